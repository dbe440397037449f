"""scripts/train_tiny_qwen3.py --smoke: trains in seconds and writes a loadable HF folder."""

import importlib.util
import json
import pathlib
import random

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared" / "data" / "tinyshakespeare.txt"


def load_script():
    path = ROOT / "scripts" / "train_tiny_qwen3.py"
    spec = importlib.util.spec_from_file_location("train_tiny_qwen3", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


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
    stats = load_script().main(argv)

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
