"""scripts/train_tiny_qwen3.py --smoke: trains in seconds and writes a loadable HF folder."""

import json
import pathlib
import random

import torch
from script_loader import load_script

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def load_train_script():
    return load_script("train_tiny_qwen3")


def data_file(tmp_path) -> pathlib.Path:
    if SHAKESPEARE.is_file():
        return SHAKESPEARE
    rng = random.Random(0)  # a small stand-in text with the same shape
    words = ["the", "king", "my", "lord", "and", "thou", "art", "not", "what", "I", "shall",
             "love", "good", "sir", "now", "come", "hence"]
    speakers = ["ROMEO:", "JULIET:", "First Citizen:", "MENENIUS:"]
    lines = []
    for _ in range(1500):
        lines += [rng.choice(speakers)] + [" ".join(rng.choices(words, k=9)).capitalize() + "."
                                          for _ in range(rng.randint(1, 4))] + [""]
    path = tmp_path / "tiny.txt"
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def test_train_script_smoke(tmp_path):
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    out = tmp_path / "model"
    data = data_file(tmp_path)
    argv = ["--smoke", "--device", "cpu", "--out", str(out), "--data", str(data)]
    stats = load_train_script().main(argv)

    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md", "training_log.json"} <= names
    assert not any(n.endswith((".bin", ".pt", ".pth")) for n in names)

    tok = AutoTokenizer.from_pretrained(out)
    assert tok.eos_token == "<|endoftext|>"
    text = "ROMEO:\nWhat, ho!  café 世界\n\tx"
    ids = tok.encode(text)
    assert tok.decode(ids) == text

    model = Qwen3ForCausalLM.from_pretrained(out)
    assert model.dtype == torch.bfloat16
    assert model.config.vocab_size == len(tok)
    assert model.config.eos_token_id == tok.eos_token_id
    assert model.config.tie_word_embeddings
    assert model.config.rope_parameters["rope_theta"] == 1e6
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 1e6
    assert sum(p.numel() for p in model.parameters()) == stats["params"]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits
    assert logits.shape == (1, len(ids), len(tok)) and torch.isfinite(logits.float()).all()

    card = (out / "README.md").read_text()
    assert f"{stats['final_val_loss']:.4f}" in card and "nats/token" in card
    assert "--smoke" in card
    log = json.loads((out / "training_log.json").read_text())
    assert log["stats"]["final_val_loss"] == stats["final_val_loss"]
    assert any("val_loss" in e for e in log["log"]) and any("train_loss" in e for e in log["log"])


TARGET = ROOT / "mrv2" / "assets" / "tiny-qwen3-shakespeare"


def test_train_script_distill_smoke(tmp_path, monkeypatch):
    """--teacher: the loss and the KL to the teacher go down; agreement is logged, in [0, 1]."""
    from transformers import Qwen3ForCausalLM

    out = tmp_path / "draft"
    argv = ["--smoke", "--device", "cpu", "--out", str(out), "--data", str(data_file(tmp_path)),
            "--preset", "draft", "--teacher", str(TARGET), "--teacher-generated", "0.5",
            "--lr", "3e-3"]  # --smoke: 8 steps, an evaluation every 4
    stats = load_train_script().main(argv)

    log = json.loads((out / "training_log.json").read_text())
    evals = [e for e in log["log"] if "val_agreement" in e]
    losses = [e["train_loss"] for e in log["log"] if "train_loss" in e]
    assert len(evals) == 2 and len(losses) == 4
    assert losses[-1] < losses[0]
    assert evals[-1]["val_kl"] < evals[0]["val_kl"]
    for e in evals:
        assert 0.0 <= e["val_agreement"] <= 1.0 and 0.0 <= e["val_gen_agreement"] <= 1.0
        assert e["val_kl"] >= 0.0 and e["val_loss"] > 0.0
    s = log["stats"]
    assert s == stats and s["teacher"] == str(TARGET)
    assert 0.0 <= s["final_val_agreement"] <= 1.0 and s["pool_sequences"] == 8
    best = max(evals, key=lambda e: (e["val_agreement"], -e["val_kl"]))
    assert s["best_step"] == best["step"]
    assert log["samples"] and log["n_new"] == 24  # what --card-only rebuilds the card from

    # The draft shares the teacher's vocabulary (--tokenizer defaults to the teacher's).
    draft = Qwen3ForCausalLM.from_pretrained(out)
    assert draft.config.vocab_size == 2048
    assert (out / "tokenizer.json").read_text() == (TARGET / "tokenizer.json").read_text()
    card = (out / "README.md").read_text()
    assert "## Distillation" in card and "KL(teacher || student)" in card
    assert f"{s['final_val_agreement']:.4f}" in card and "best validation agreement" in card
    assert "Acceptance, measured by mrv2" not in card  # --smoke: not measured

    # --card-only: the acceptance section (mrv2's measurement stubbed: it is slow on the CPU).
    import sys

    acc = {"max_tokens": 32, "prompts": ["ROMEO:", "LOOP"], "device": "the CPU",
           "baseline_steps": 64,
           "k3": {"num_spec_steps": 20, "accepted_per_position": [16, 10, 6],
                  "mean_accepted_length": 2.6, "acceptance_rate": 0.5333, "steps": 25,
                  "same_tokens": True}}
    calls = []
    monkeypatch.setattr(sys.modules["distill_draft"], "measure_acceptance",
                        lambda draft, target: calls.append((draft, target)) or acc)
    assert load_train_script().main(["--card-only", "--out", str(out)]) == stats
    assert calls == [(out, TARGET)]
    card = (out / "README.md").read_text()
    assert "## Distillation" in card and "## Acceptance, measured by mrv2" in card
    assert "| 3 | 2.60 | 0.53 | 0.80 0.50 0.30 | 25 | yes |" in card
    assert json.loads((out / "training_log.json").read_text())["acceptance"] == acc


def test_train_script_teacher_errors(tmp_path):
    """A teacher with another vocabulary, or no model at all: a clear ValueError, no training."""
    import pytest

    mod = load_train_script()
    data = data_file(tmp_path)
    other = tmp_path / "other-tok"  # a tokenizer of another vocabulary
    mod.train_tokenizer(data.read_text(encoding="utf-8")[:20_000], 300).save_pretrained(other)
    out = tmp_path / "draft"
    base = ["--smoke", "--device", "cpu", "--out", str(out), "--data", str(data)]
    with pytest.raises(ValueError, match="--teacher .*tokenizer differs"):
        mod.main(base + ["--teacher", str(TARGET), "--tokenizer", str(other)])
    with pytest.raises(ValueError, match="--teacher .*not a Hugging Face model folder"):
        mod.main(base + ["--teacher", str(tmp_path / "missing"), "--tokenizer", str(other)])
    assert not (out / "model.safetensors").exists()
    with pytest.raises(ValueError, match="--out .*no training_log.json"):
        mod.main(["--card-only", "--out", str(tmp_path)])
    (tmp_path / "training_log.json").write_text(json.dumps({"args": {"teacher": None}}))
    with pytest.raises(ValueError, match="--card-only needs a --teacher run"):
        mod.main(["--card-only", "--out", str(tmp_path)])


def test_train_script_init_fine_tunes_from_a_checkpoint(tmp_path):
    """--init starts from a checkpoint's weights (step 0 equals it), and refuses one of
    another architecture or a folder without a model, before any training."""
    import pytest
    from transformers import Qwen3ForCausalLM

    mod = load_train_script()
    data = data_file(tmp_path)
    first = tmp_path / "first"
    base = ["--smoke", "--device", "cpu", "--data", str(data)]
    mod.main(base + ["--out", str(first)])
    src = Qwen3ForCausalLM.from_pretrained(first, dtype=torch.float32)
    fresh = Qwen3ForCausalLM._from_config(src.config)
    mod._distill().init_from(fresh, str(first))
    for (name, a), b in zip(fresh.state_dict().items(), src.state_dict().values()):
        assert torch.equal(a, b), name
    second = tmp_path / "second"
    stats = mod.main(base + ["--out", str(second), "--tokenizer", str(first),
                             "--init", str(first)])
    assert stats["params"] == sum(p.numel() for p in src.parameters())
    assert json.loads((second / "training_log.json").read_text())["args"]["init"] == str(first)
    with pytest.raises(ValueError, match="--init .*does not fit"):
        mod.main(base + ["--out", str(tmp_path / "y"), "--tokenizer", str(first),
                         "--init", str(TARGET)])
    with pytest.raises(ValueError, match="--init .*no config.json"):
        mod.main(base + ["--out", str(tmp_path / "z"), "--tokenizer", str(first),
                         "--init", str(tmp_path / "missing")])
