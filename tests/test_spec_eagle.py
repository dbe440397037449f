"""The EAGLE proposer (``mrv2/spec_decode/eagle.py``) on the CPU (fp32).

The shipped head (``mrv2/assets/tiny-qwen3-shakespeare-eagle``, trained by
``scripts/train_eagle_head.py``): greedy output with EAGLE equals greedy output without
speculation token for token (tight pools: queueing, chunked prefill, preemption); seeded
sampling in ``exact`` mode equals the output without speculation; ``probabilistic`` mode
follows the target's distribution (chi-squared); the head computes what its training twin
computes; the loader's name map and the config checks fail with clear errors.
"""

import argparse
import json
import pathlib

import pytest
import test_spec_decode_e2e as e2e
import torch
from engine_checks import assert_nothing_held
from script_loader import load_script

# _tight: 4 rows, 16 tokens a step, 16 blocks of 4: queueing, chunked prefill, preemption.
from test_spec_decode_probabilistic import _assert_pairs_follow, _ids, _tight, _two_token_joint

from mrv2 import LLM, SamplingParams
from mrv2.cuda_graphs import CudaGraphManager
from mrv2.forward_context import AttentionMetadata, set_forward_context
from mrv2.models.loader import DEFAULT_MODEL_DIR
from mrv2.models.qwen3 import bind_kv_cache, kv_cache_shape
from mrv2.spec_decode.config import check_eagle_compatible
from mrv2.spec_decode.eagle_head import load_eagle_head

EAGLE = str(DEFAULT_MODEL_DIR) + "-eagle"
DRAFT = str(DEFAULT_MODEL_DIR) + "-draft"
#: The embedded model's own greedy loop after "JULIET:" (see test_spec_decode_e2e.py).
LOOP = [952, 26, 199, 47, 12, 292, 359, 850, 1, 199, 199, 952, 26]


def _eagle(k, **extra):
    return {"method": "eagle", "model": EAGLE, "num_speculative_tokens": k, **extra}


def _greedy_inputs():
    # test_spec_decode_e2e's tight workload: 7 requests, one chunked, one to max_model_len.
    return e2e._inputs(), e2e._params()


@pytest.fixture(scope="module")
def greedy_baseline():
    inputs, params = _greedy_inputs()
    return _ids(_tight().generate(inputs, params, use_tqdm=False))


@pytest.mark.parametrize("k,async_scheduling,graphs", [(1, False, False), (3, True, False),
                                                       (5, False, True)])
def test_greedy_equals_no_speculation_tight(greedy_baseline, k, async_scheduling, graphs):
    inputs, params = _greedy_inputs()
    llm = _tight(_eagle(k), async_scheduling)
    if graphs:  # the chain as the GPU replays it: padded batches, general sampling path
        llm.runner.spec.draft.chain_graphs = CudaGraphManager([1, 2, 4], emulate=True)
    got = llm.generate(inputs, params, use_tqdm=False)
    assert _ids(got) == greedy_baseline
    assert len(got[-1].outputs[0].token_ids) == 64 - 52  # ran to max_model_len
    st = llm.runner.spec.stats
    assert st.num_accepted_tokens > 0 and llm.scheduler.num_preemptions > 0
    # The head proposes at every slot except past a row's KV blocks (tight pool).
    assert st.num_draft_tokens >= 0.8 * st.num_draft_slots
    assert_nothing_held(llm)


@pytest.fixture(scope="module")
def plain():
    return LLM(dtype="float32", max_model_len=96, max_num_seqs=4)


def test_seeded_sampling_identical_with_coupled_noise(plain):
    spec = LLM(dtype="float32", max_model_len=96, max_num_seqs=4, async_scheduling=True,
               speculative_config=_eagle(3))
    prompts = [{"prompt_token_ids": p} for p in (LOOP, LOOP * 2)] + ["JULIET:\nO Romeo,"]
    sp = [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=6, ignore_eos=True,
                         logprobs=1 if s == 1 else None) for s in range(3)]
    want, got = (llm.generate(prompts, sp, use_tqdm=False) for llm in (plain, spec))
    assert _ids(got) == _ids(want)
    for px, py in zip(want[1].outputs[0].logprobs, got[1].outputs[0].logprobs):
        assert list(px) == list(py)
    assert spec.runner.spec.stats.num_accepted_tokens > 0


@pytest.mark.slow
def test_probabilistic_first_two_tokens_follow_the_targets_distribution(plain):
    """As test_spec_decode_probabilistic's chi-squared test, with EAGLE drafts (K = 2), on a
    2-token prompt ("JULIET:") and 60 trials to keep it small."""
    temp, top_k, n, start = 1.0, 3, 60, [952, 26]
    joint = _two_token_joint(plain, start, top_k, temp)
    llm = LLM(dtype="float32", max_model_len=32, max_num_seqs=n,
              speculative_config=_eagle(2, verification="probabilistic"))
    sp = [SamplingParams(temperature=temp, top_k=top_k, seed=s, max_tokens=3, ignore_eos=True)
          for s in range(n)]
    outs = llm.generate([{"prompt_token_ids": start}] * n, sp, use_tqdm=False)
    assert llm.runner.spec.stats.num_accepted_tokens > 0
    _assert_pairs_follow([tuple(o.outputs[0].token_ids[:2]) for o in outs], joint)


# -- the head: its numerics, its checkpoint layout ---------------------------------------

def _twin_module():
    return load_script("train_eagle_head")


def test_head_equals_its_training_twin_over_a_paged_cache():
    """mrv2's head (paged KV, block boundary crossed, scattered blocks) == the script's."""
    from safetensors.torch import load_file

    head, cfg = load_eagle_head(EAGLE, torch.float32, torch.device("cpu"))
    c = argparse.Namespace(hidden_size=cfg.hidden_size, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64,
                           intermediate_size=cfg.intermediate_size, rms_norm_eps=1e-6,
                           rope_theta=1e6)
    twin = _twin_module().EagleHead(c)
    twin.load_state_dict({k: v.float() for k, v in
                          load_file(f"{EAGLE}/model.safetensors").items()})
    gen = torch.Generator().manual_seed(0)
    n, bs = 10, 4
    emb, feat = (torch.randn(n, cfg.hidden_size, generator=gen) for _ in range(2))
    with torch.no_grad():
        want = twin(emb[None], feat[None])[0]                               # [n, H]
    bind_kv_cache(head, [torch.zeros(kv_cache_shape(cfg, 8, bs))])
    block_table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32)
    pos = torch.arange(n, dtype=torch.int32)
    slots = block_table[0, pos // bs].long() * bs + pos % bs
    md = AttentionMetadata(torch.tensor([0, n], dtype=torch.int32),
                           torch.tensor([n], dtype=torch.int32), block_table, slots, n, n)
    with torch.no_grad(), set_forward_context(md):
        got = head(emb, feat, pos)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def _copy_head(tmp_path, rename=None, drop=(), add=None, config=None):
    """A copy of the shipped head with renamed / dropped / added tensors or config keys."""
    from safetensors.torch import load_file, save_file

    out = tmp_path / "head"
    out.mkdir()
    tensors = load_file(f"{EAGLE}/model.safetensors")
    tensors = {(rename(k) if rename else k): v for k, v in tensors.items() if k not in drop}
    tensors.update(add or {})
    save_file(tensors, str(out / "model.safetensors"))
    cfg = json.loads(pathlib.Path(EAGLE, "config.json").read_text())
    cfg.update(config or {})
    (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_loader_name_map(tmp_path):
    ref, _ = load_eagle_head(EAGLE, torch.float32, torch.device("cpu"))
    # vLLM-style "model." prefixes, a layer-0 input norm (dropped, as EAGLE-1 skips it)
    # and an fc bias (original EAGLE-1 heads have one).
    h = ref.fc.weight.shape[0]
    path = _copy_head(tmp_path, rename=lambda k: "model." + k,
                      add={"model.layers.0.input_layernorm.weight": torch.ones(h),
                           "fc.bias": torch.full((h,), 0.5)})
    head, _ = load_eagle_head(path, torch.float32, torch.device("cpu"))
    torch.testing.assert_close(head.layers[0].mlp.down_proj.weight,
                               ref.layers[0].mlp.down_proj.weight)
    assert head.fc.bias is not None and float(head.fc.bias[0].detach()) == 0.5
    assert isinstance(head.layers[0].input_layernorm, torch.nn.Identity)
    assert head.embed_tokens is None and head.lm_head is None  # the target's are shared


@pytest.mark.parametrize("kind,match", [
    ("missing", "missing tensor"), ("unexpected", "unexpected tensor"),
    ("shape", "has shape"), ("eagle3", "EAGLE-3"),
])
def test_loader_errors(tmp_path, kind, match):
    kw = {"missing": {"drop": ("fc.weight",)},
          "unexpected": {"add": {"layers.0.foo.weight": torch.zeros(2)}},
          "shape": {"add": {"fc.weight": torch.zeros(3, 3)}},
          "eagle3": {"add": {"midlayer.hidden_norm.weight": torch.zeros(4)}}}[kind]
    with pytest.raises(ValueError, match=match):
        load_eagle_head(_copy_head(tmp_path, **kw), torch.float32, torch.device("cpu"))


def test_config_checks(tmp_path):
    target = {"hidden_size": 256, "vocab_size": 2048}
    head = {"hidden_size": 256, "vocab_size": 2048, "num_hidden_layers": 1,
            "max_position_embeddings": 1024}
    check_eagle_compatible(target, head, max_model_len=512)
    for bad, match in (({"hidden_size": 128}, "hidden_size"), ({"vocab_size": 1000}, "vocab"),
                       ({"num_hidden_layers": 0}, "num_hidden_layers"),
                       ({"architectures": ["Eagle3LlamaForCausalLM"]}, "EAGLE-3"),
                       ({"max_position_embeddings": 256}, "max_position_embeddings")):
        with pytest.raises(ValueError, match=match):
            check_eagle_compatible(target, {**head, **bad}, max_model_len=512)


@pytest.mark.parametrize("cfg,match", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "EAGLE head"),
    ({"method": "eagle", "model": "/nonexistent/head", "num_speculative_tokens": 2}, "model"),
    ({"method": "eagle", "model": EAGLE, "num_speculative_tokens": 2,
      "prompt_lookup_max": 3}, "only for method 'ngram'"),
    ({"method": "eagle", "model": DRAFT, "num_speculative_tokens": 2}, "hidden_size"),
])
def test_bad_eagle_config_fails_at_construction(cfg, match):
    with pytest.raises(ValueError, match=match):
        LLM(max_model_len=32, max_num_seqs=2, speculative_config=cfg)



def test_bench_compares_every_method_in_one_job():
    """``--speculative ngram,draft_model,eagle``: one row per method beside plain v2."""
    from mrv2.bench import spec as spec_bench
    from mrv2.bench import suite
    from mrv2.bench.cli import _spec_list
    from mrv2.bench.llm_runs import ModelSpec

    cfg = suite.BenchConfig(kind="latency", runners=["v2"],
                            speculative=_spec_list("ngram, draft_model,eagle"))
    variants = suite.spec_variants(cfg, ModelSpec(None))
    assert [v[0] for v in variants] == ["", "-ngram", "-draft_model", "-eagle"]
    assert variants[3][1] == {"method": "eagle", "num_speculative_tokens": 3,
                              "model": str(spec_bench.EMBEDDED_EAGLE_DIR)}
    labels = ["v2", "v2-ngram", "v2-draft_model", "v2-eagle"]
    assert sorted(spec_bench.spec_pairs(labels, variants)) == sorted(
        [("v2-ngram", "v2"), ("v2-draft_model", "v2"), ("v2-eagle", "v2")])
    with pytest.raises(ValueError, match="needs --eagle-model"):
        suite.spec_variants(suite.BenchConfig(kind="latency", runners=["v2"],
                                              speculative="eagle"), ModelSpec("/some/model"))
    with pytest.raises(ValueError, match="comma list"):
        suite.BenchConfig(kind="latency", runners=["v2"], speculative="eagle,medusa")
    with pytest.raises(argparse.ArgumentTypeError, match="comma list"):
        _spec_list("ngram,ngram")
