"""scripts/train_eagle_head.py on the CPU (--smoke sizes): the target's own continuations in
the batches, --init fine-tuning, --unroll 3, and the checkpoint mrv2 then loads."""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
from script_loader import load_script

import mrv2  # noqa: F401  (before transformers: Triton's interpreter mode)
from mrv2.spec_decode.eagle_head import load_eagle_head

ROOT = pathlib.Path(__file__).resolve().parents[1]
EAGLE = ROOT / "mrv2/assets/tiny-qwen3-shakespeare-eagle"


def _script():
    return load_script("train_eagle_head")


def test_smoke_fine_tunes_on_the_targets_continuations(tmp_path, shared_data):
    out = tmp_path / "head"
    stats = _script().main(["--smoke", "--data", str(shared_data / "tinyshakespeare.txt"),
                            "--teacher-generated", "0.5", "--unroll", "3", "--labels",
                            "target", "--init", str(EAGLE), "--threads", "1",
                            "--out", str(out)])
    log = json.loads((out / "training_log.json").read_text())
    assert log["args"]["select"] == "chain"       # auto: chain top-1 with generated rows
    assert stats["pool_sequences"] == 8 and stats["gen_val_sequences"] == 4
    assert log["log"][0]["step"] == 0             # the --init head, evaluated before training
    assert all(len(e["gen_chain_top1"]) == 3 for e in log["log"] if "val_ce" in e)
    assert len(stats["best_gen_chain_top1"]) == 3 and stats["steps_run"] == 6
    head, cfg = load_eagle_head(out, torch.float32, torch.device("cpu"))
    assert cfg.intermediate_size == 768 and head.fc.weight.shape == (256, 512)


def test_bad_options_fail_clearly(tmp_path, shared_data):
    mod = _script()
    with pytest.raises(ValueError, match="--init .*no config.json"):
        mod.main(["--smoke", "--data", str(shared_data / "tinyshakespeare.txt"),
                  "--init", str(tmp_path), "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit):
        mod.parse_args(["--teacher-generated", "1.5"])
