"""``scripts/profile_sampler_kernels.py`` in smoke mode (CPU, tiny, no timings)."""

from __future__ import annotations

import itertools
import json

import pytest
from script_loader import load_script

from mrv2.platform import TRITON_INTERPRET


def _script():
    return load_script("profile_sampler_kernels")


@pytest.mark.skipif(not TRITON_INTERPRET, reason="the smoke run uses CPU tensors")
def test_smoke_writes_the_report_and_the_rounds_close(tmp_path):
    out = tmp_path / "k.json"
    report = _script().main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == report
    (pt,) = report["points"]
    rounds = pt["open_rows_per_round"]
    assert len(rounds) == 8 and rounds[0] <= report["shape"]["rows"]
    assert all(a >= b for a, b in itertools.pairwise(rounds)) and rounds[-1] == 0
    # top-k 20 of random logits (no ties): at most 20 survive, and the top token always
    assert 1 <= pt["kept_per_row"]["min"] and pt["kept_per_row"]["max"] <= 20
