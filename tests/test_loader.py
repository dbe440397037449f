"""load_model / resolve_model_path: folders, shards, hub ids, dummy weights, broken checkpoints."""

import json

import huggingface_hub
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from mrv2.models import loader
from mrv2.models.loader import load_model, resolve_model_path


def tiny_config(**kw):
    args = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8,
            "max_position_embeddings": 64, "tie_word_embeddings": True}
    args.update(kw)
    return transformers.Qwen3Config(**args)


@pytest.fixture
def saved(tmp_path):
    """A tiny HF Qwen3 saved as safetensors: (folder, hf model)."""
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(tiny_config()).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path, hf


def edit_checkpoint(folder, fn):
    """Rewrite model.safetensors with ``fn(dict of tensors)``."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def assert_same_weights(model, hf):
    ref = hf.state_dict()
    for name, t in model.state_dict().items():
        torch.testing.assert_close(t, ref[name], atol=0, rtol=0, msg=name)


def test_load_local_folder_exact_weights(saved):
    folder, hf = saved
    model, cfg = load_model(str(folder), dtype="float32", device="cpu")
    assert cfg.model_type == "qwen3" and not model.training
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.model.rotary_emb.cos_sin_cache.dtype == torch.float32
    assert_same_weights(model, hf)


def test_sharded_checkpoint(tmp_path):
    torch.manual_seed(0)
    hf = transformers.Qwen3ForCausalLM(tiny_config(tie_word_embeddings=False)).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(loader.weight_files(tmp_path)) > 1
    model, _ = load_model(tmp_path, dtype="float32", device="cpu")
    assert_same_weights(model, hf)


def test_ignored_tensors(saved):
    """Rotary ``inv_freq`` buffers and the duplicate ``lm_head.weight`` of tied weights."""
    folder, hf = saved

    def add(t):
        t["model.rotary_emb.inv_freq"] = torch.ones(4)
        t["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
        t["lm_head.weight"] = t["model.embed_tokens.weight"].clone()
    edit_checkpoint(folder, add)
    model, _ = load_model(folder, dtype="float32", device="cpu")
    assert_same_weights(model, hf)


def test_missing_folder():
    with pytest.raises(FileNotFoundError, match="does_not_exist"):
        load_model("/nonexistent/does_not_exist", dtype="float32", device="cpu")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model_path("./no/such/folder")


def test_folder_without_config(tmp_path):
    with pytest.raises(FileNotFoundError, match="config.json"):
        resolve_model_path(tmp_path)


def test_default_model_dir(tmp_path, monkeypatch, saved):
    monkeypatch.setattr(loader, "DEFAULT_MODEL_DIR", tmp_path / "absent")
    with pytest.raises(FileNotFoundError, match="embedded default"):
        resolve_model_path(None)
    folder, hf = saved
    monkeypatch.setattr(loader, "DEFAULT_MODEL_DIR", folder)
    model, _ = load_model(None, dtype="float32", device="cpu")
    assert_same_weights(model, hf)


def test_hub_id_download_and_offline(saved, monkeypatch):
    folder, hf = saved
    calls = []

    def fake_download(repo_id, allow_patterns=None, **kw):
        calls.append((repo_id, allow_patterns))
        return str(folder)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_download)
    model, _ = load_model("Org/tiny-model", dtype="float32", device="cpu")
    assert_same_weights(model, hf)
    assert calls[0][0] == "Org/tiny-model"
    assert "*.safetensors" in calls[0][1] and not any("bin" in p for p in calls[0][1])

    def offline(repo_id, **kw):
        raise ConnectionError("Name or service not known")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(FileNotFoundError, match="unreachable.*local folder"):
        resolve_model_path("Org/tiny-model")


def test_missing_tensor(saved):
    folder, _ = saved
    edit_checkpoint(folder, lambda t: t.pop("model.layers.1.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(folder, dtype="float32", device="cpu")


def test_unexpected_tensor(saved):
    folder, _ = saved
    edit_checkpoint(folder, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.ones(3)}))
    with pytest.raises(ValueError, match=r"unexpected tensor 'model\.layers\.0\.mlp\.extra\.weight'"):
        load_model(folder, dtype="float32", device="cpu")


def test_shape_mismatch(saved):
    folder, _ = saved
    edit_checkpoint(folder, lambda t: t.update({"model.layers.0.mlp.up_proj.weight":
                                                torch.ones(47, 32)}))
    with pytest.raises(ValueError, match=r"up_proj\.weight.*\(47, 32\).*\(48, 32\)"):
        load_model(folder, dtype="float32", device="cpu")


def test_unsupported_architecture(tmp_path):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2).save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*Qwen3ForCausalLM.*LlamaForCausalLM"):
        load_model(tmp_path, dtype="float32", device="cpu")


def test_only_pickled_checkpoint(saved):
    folder, _ = saved
    (folder / "model.safetensors").unlink()
    (folder / "pytorch_model.bin").write_bytes(b"not unpickled")
    with pytest.raises(ValueError, match="never unpickles"):
        load_model(folder, dtype="float32", device="cpu")


def test_no_weights_at_all(saved):
    folder, _ = saved
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_model(folder, dtype="float32", device="cpu")


def test_bad_load_format(saved):
    with pytest.raises(ValueError, match="load_format"):
        load_model(saved[0], dtype="float32", device="cpu", load_format="pickle")


def test_dummy_weights(tmp_path):
    config = tiny_config(tie_word_embeddings=False, initializer_range=0.02)
    config.save_pretrained(tmp_path)  # config only: no weight file
    model, cfg = load_model(tmp_path, dtype="float32", device="cpu", load_format="dummy", seed=3)
    hf_shapes = {k: v.shape for k, v in transformers.Qwen3ForCausalLM(config).state_dict().items()}
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    assert shapes == {k: hf_shapes[k] for k in shapes} and set(shapes) <= set(hf_shapes)
    assert "lm_head.weight" in shapes
    norms = [p for n, p in model.named_parameters() if "norm" in n]
    assert norms and all(bool((p == 1).all()) for p in norms)
    q = model.model.layers[0].self_attn.q_proj.weight
    assert 0.01 < q.std().item() < 0.03
    again, _ = load_model(None, dtype="float32", device="cpu", load_format="dummy",
                          hf_config=cfg, seed=3)
    other, _ = load_model(None, dtype="float32", device="cpu", load_format="dummy",
                          hf_config=cfg, seed=4)
    assert torch.equal(again.model.layers[1].mlp.down_proj.weight,
                       model.model.layers[1].mlp.down_proj.weight)
    assert not torch.equal(other.model.layers[1].mlp.down_proj.weight,
                           model.model.layers[1].mlp.down_proj.weight)
