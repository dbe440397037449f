"""The fused decode GEMMs (norm prologue, residual / SiLU * up epilogue) against their torch
references, and the model's fused decode path against its unfused path.

Under the interpreter in fp32: ragged shapes (N not a multiple of the column block, K not a
multiple of the K step), 0..2 rows, bias on/off, launch overrides, the in-place add; then
the embedded Qwen3 and the stories260K Llama with the fused decode path forced on vs off.
bf16 at the Qwen3-0.6B shapes on the GPU.
"""

import json
import sys
from pathlib import Path

import pytest
import torch
import transformers

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2 import LLM, SamplingParams
from mrv2.forward_context import AttentionMetadata, set_forward_context
from mrv2.kernels import persistent_layer, skinny_fused, small_m_fused
from mrv2.kernels.activation import silu_and_mul
from mrv2.kernels.layernorm import rms_norm
from mrv2.kernels.skinny_fused import (
    skinny_linear_add,
    skinny_linear_add_ref,
    skinny_norm_gate_up_silu,
    skinny_norm_gate_up_silu_ref,
    skinny_norm_linear,
    skinny_norm_linear_ref,
)
from mrv2.kernels.skinny_gemm import MAX_M, skinny_linear
from mrv2.models import qwen3
from mrv2.models.loader import DEFAULT_MODEL_DIR, load_model
from mrv2.platform import DEVICE, HAS_CUDA, TRITON_INTERPRET

ROOT = Path(__file__).resolve().parents[1]
TOL = {"rtol": 1e-5, "atol": 1e-4}
OVERRIDES = ({}, {"block_n": 16, "block_k": 64}, {"block_n": 8, "block_k": 128})


def _inputs(M, N, K, bias, seed, rows=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(M, K, generator=g) * 3.0
    nw = torch.randn(K, generator=g)
    w = torch.randn(rows * N, K, generator=g) * 0.2
    b = torch.randn(rows * N, generator=g) if bias else None
    return [t.to(DEVICE) if t is not None else None for t in (x, nw, w, b)]


@pytest.fixture(autouse=True)
def _per_gemm_path(monkeypatch):
    """These tests are about the per-GEMM fused layers: the persistent one-launch tail
    (opt-in, ``MRV2_PERSISTENT_DECODE=1``; tests/test_persistent_layer.py) stays off here
    whatever the environment says."""
    monkeypatch.setattr(persistent_layer, "ENABLED", False)


CASES = [(1, 40, 96, False), (2, 24, 200, True), (2, 17, 64, True), (1, 64, 300, False),
         (0, 24, 64, True)]


@pytest.mark.parametrize("M,N,K,bias", CASES)
def test_norm_linear_matches_reference(M, N, K, bias):
    x, nw, w, b = _inputs(M, N, K, bias, seed=M * 100 + N + K)
    ref = skinny_norm_linear_ref(x, nw, 1e-6, w, b)
    for kw in OVERRIDES:
        out = skinny_norm_linear(x, nw, 1e-6, w, b, **kw)
        assert out.shape == (M, N) and out.dtype == x.dtype
        torch.testing.assert_close(out, ref, **TOL)


@pytest.mark.parametrize("M,N,K,bias", CASES)
def test_linear_add_matches_reference_in_place(M, N, K, bias):
    x, _, w, b = _inputs(M, N, K, bias, seed=M * 100 + N + K + 1)
    residual = torch.randn(M, N, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    ref = skinny_linear_add_ref(x, w, residual.clone(), b)
    assert torch.equal(ref, residual + torch.nn.functional.linear(x, w, b))  # the spec
    for kw in OVERRIDES:
        r = residual.clone()
        out = skinny_linear_add(x, w, r, b, **kw)
        assert out is r                                       # written in place, returned
        torch.testing.assert_close(r, ref, **TOL)


def test_linear_add_into_a_row_strided_view():
    # residual as the first N columns of a wider buffer: only those columns change.
    x, _, w, b = _inputs(2, 20, 72, True, seed=9)
    buf = torch.randn(2, 32, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    before = buf.clone()
    skinny_linear_add(x, w, buf[:, :20], b)
    torch.testing.assert_close(buf[:, :20], skinny_linear_add_ref(x, w, before[:, :20], b), **TOL)
    assert torch.equal(buf[:, 20:], before[:, 20:])


@pytest.mark.parametrize("M,N,K,bias", CASES)
def test_norm_gate_up_silu_matches_reference(M, N, K, bias):
    x, nw, w, b = _inputs(M, N, K, bias, seed=M * 100 + N + K + 2, rows=2)
    ref = skinny_norm_gate_up_silu_ref(x, nw, 1e-5, w, b)
    assert ref.shape == (M, N)
    for kw in OVERRIDES:
        out = skinny_norm_gate_up_silu(x, nw, 1e-5, w, b, **kw)
        assert out.shape == (M, N) and out.dtype == x.dtype
        torch.testing.assert_close(out, ref, **TOL)


def test_references_are_the_unfused_chain():
    # The specification, spelled with the model's unfused kernels' own references.
    x, nw, w, b = _inputs(2, 12, 48, True, seed=3, rows=2)
    normed = x / x.pow(2).mean(-1, keepdim=True).add(1e-6).sqrt() * nw
    gu = normed @ w.T + b
    torch.testing.assert_close(skinny_norm_linear_ref(x, nw, 1e-6, w, b), gu, **TOL)
    g, u = gu[:, :12], gu[:, 12:]
    torch.testing.assert_close(skinny_norm_gate_up_silu_ref(x, nw, 1e-6, w, b),
                               g * torch.sigmoid(g) * u, **TOL)


def test_bad_input_raises_before_work():
    x, nw, w, b = _inputs(2, 16, 32, True, seed=4, rows=2)
    with pytest.raises(ValueError, match="at most"):
        skinny_norm_linear(torch.randn(MAX_M + 1, 32, device=DEVICE), nw, 1e-6, w)
    with pytest.raises(ValueError, match=r"\[M, K\]"):
        skinny_norm_linear(torch.randn(2, 31, device=DEVICE), nw, 1e-6, w)
    with pytest.raises(ValueError, match="contiguous"):
        skinny_norm_linear(torch.randn(32, 2, device=DEVICE).t(), nw, 1e-6, w)
    with pytest.raises(ValueError, match="norm_weight"):
        skinny_norm_linear(x, nw[:16], 1e-6, w)
    with pytest.raises(ValueError, match="bias"):
        skinny_norm_linear(x, nw, 1e-6, w, b[:5])
    with pytest.raises(ValueError, match="even"):
        skinny_norm_gate_up_silu(x, nw, 1e-6, w[:31])
    with pytest.raises(ValueError, match="K > 0"):
        skinny_norm_linear(torch.randn(2, 0, device=DEVICE), nw[:0], 1e-6, w[:, :0])
    res = torch.zeros(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="residual"):
        skinny_linear_add(x, w, res[:, :31])
    with pytest.raises(ValueError, match="residual"):
        skinny_linear_add(x, w, torch.zeros(2, 32, device=DEVICE, dtype=torch.float64))
    square = torch.randn(32, 32, device=DEVICE)
    with pytest.raises(ValueError, match="share memory"):
        skinny_linear_add(res, square, res)                    # x IS the residual: a race


# --------------------------------------------------------------- in the model

def _decode_logits(model, config, ids, positions, fused, monkeypatch):
    """A prefill of 4 tokens per request (unfused: T > 2), then a 1-token decode of each
    request (fused or not); returns the decode step's logits [num_reqs, vocab]."""
    calls = []
    orig = qwen3.Qwen3DecoderLayer.forward_decode
    monkeypatch.setattr(qwen3.Qwen3DecoderLayer, "forward_decode",
                        lambda self, *a: calls.append(1) or orig(self, *a))
    n = len(ids)
    with torch.device(DEVICE), torch.no_grad():
        qwen3.bind_kv_cache(model, [torch.zeros(qwen3.kv_cache_shape(config, 4, 16))
                                    for _ in range(config.num_hidden_layers)])
        block_table = torch.arange(n, dtype=torch.int32)[:, None]              # [n, 1]
        prefill = AttentionMetadata(torch.arange(0, 4 * n + 1, 4, dtype=torch.int32),
                                    torch.full((n,), 4, dtype=torch.int32), block_table,
                                    torch.cat([torch.arange(4) + 16 * b for b in range(n)]),
                                    4, 4)
        monkeypatch.setattr(skinny_fused, "ENABLED", fused)
        monkeypatch.setattr(small_m_fused, "ENABLED", False)   # NOTE: on a GPU the 4-row
        # prefill would take small_m_fused's forward_decode (on by default there)
        with set_forward_context(prefill):
            model(torch.tensor([t for _ in range(n) for t in (5, 7, 11, 13)]),
                  torch.arange(4).repeat(n))
        decode = AttentionMetadata(torch.arange(n + 1, dtype=torch.int32),
                                   torch.full((n,), positions + 1, dtype=torch.int32),
                                   block_table, torch.arange(n) * 16 + positions, 1, 5)
        with set_forward_context(decode):
            logits = model.compute_logits(model(torch.tensor(ids),
                                                torch.full((n,), positions)))
    # NOTE: 1-2 rows with the persistent path on take forward_decode_persistent instead
    per_gemm = fused and not (persistent_layer.ENABLED and n <= persistent_layer.MAX_M)
    assert len(calls) == (config.num_hidden_layers if per_gemm else 0)
    return logits


@pytest.mark.parametrize("which", ["embedded", "stories260K", "qwen2_bias"])
def test_model_fused_decode_equals_unfused(which, monkeypatch, shared_data):
    if which == "embedded":
        model, config = load_model(DEFAULT_MODEL_DIR, dtype="float32")
    elif which == "stories260K":
        model, config = load_model(shared_data / "stories260K" / "hf-llama", dtype="float32")
    else:  # biases on q/k/v (Qwen2), on o_proj and the MLP: every bias path matters
        config = transformers.LlamaConfig(
            vocab_size=300, hidden_size=48, intermediate_size=72, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
            max_position_embeddings=64, attention_bias=True, mlp_bias=True)
        model = qwen3.Qwen3ForCausalLM(config).to(DEVICE).eval()
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(0)) * 0.5)
    for ids in ([3], [3, 9]):                                  # 1 and 2 decode rows
        on = _decode_logits(model, config, ids, 4, True, monkeypatch)
        off = _decode_logits(model, config, ids, 4, False, monkeypatch)
        torch.testing.assert_close(on, off, rtol=1e-5, atol=1e-5)


def test_inputs_embeds_are_never_written(monkeypatch):
    model, config = load_model(DEFAULT_MODEL_DIR, dtype="float32")
    monkeypatch.setattr(skinny_fused, "ENABLED", True)
    embeds = model.get_input_embeddings(torch.tensor([3, 9], device=DEVICE))
    before = embeds.clone()
    with torch.device(DEVICE), torch.no_grad():
        qwen3.bind_kv_cache(model, [torch.zeros(qwen3.kv_cache_shape(config, 2, 16))
                                    for _ in range(config.num_hidden_layers)])
        md = AttentionMetadata(torch.tensor([0, 1, 2], dtype=torch.int32),
                               torch.ones(2, dtype=torch.int32),
                               torch.arange(2, dtype=torch.int32)[:, None],
                               torch.tensor([0, 16]), 1, 1)
        with set_forward_context(md):
            model(None, torch.zeros(2, dtype=torch.long), inputs_embeds=embeds)
    assert torch.equal(embeds, before)


def test_swapped_modules_keep_the_unfused_path(monkeypatch):
    """Tensor parallelism swaps o_proj/down_proj for all-reducing modules: no fusion then."""
    from mrv2.distributed.layers import RowParallelLinear
    model, config = load_model(DEFAULT_MODEL_DIR, dtype="float32")
    layer = model.model.layers[1]
    assert layer.can_fuse_decode()
    o = layer.self_attn.o_proj
    # NOTE: on the model's device (a GPU run would otherwise mix a CPU weight in)
    layer.self_attn.o_proj = RowParallelLinear(o.in_features, o.out_features,
                                               bias=False).to(o.weight.device)
    assert not layer.can_fuse_decode()
    monkeypatch.setattr(skinny_fused, "ENABLED", True)
    calls = []
    monkeypatch.setattr(qwen3.Qwen3DecoderLayer, "forward_decode",
                        lambda self, *a: calls.append(1))
    with torch.device(DEVICE), torch.no_grad():
        qwen3.bind_kv_cache(model, [torch.zeros(qwen3.kv_cache_shape(config, 1, 16))
                                    for _ in range(config.num_hidden_layers)])
        md = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32),
                               torch.ones(1, dtype=torch.int32),
                               torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]), 1, 1)
        layer.self_attn.o_proj.weight.copy_(o.weight)
        with set_forward_context(md):
            model(torch.tensor([3]), torch.zeros(1, dtype=torch.long))
    assert not calls


def test_llm_greedy_fused_decode_on_equals_off(monkeypatch):
    """End to end: 2 prompts decoding side by side (T = 2), fused path on vs off."""
    # NOTE: eager: a replayed CUDA graph runs no Python, so the spy would see no call.
    llm = LLM(max_model_len=64, max_num_seqs=2, dtype="float32", enforce_eager=True)
    prompts = ["ROMEO:", "JULIET:\nO Romeo,"]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=6)
    calls = []
    orig = qwen3.Qwen3DecoderLayer.forward_decode
    monkeypatch.setattr(qwen3.Qwen3DecoderLayer, "forward_decode",
                        lambda self, *a: calls.append(1) or orig(self, *a))
    monkeypatch.setattr(skinny_fused, "ENABLED", False)  # NOTE: on a GPU it is on by default
    # NOTE: and so is small_m_fused, whose 3-16-token forwards (these prompts' prefills)
    # take forward_decode too: off, so the spy counts the 1-2-row path only
    monkeypatch.setattr(small_m_fused, "ENABLED", False)
    off = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert not calls
    monkeypatch.setattr(skinny_fused, "ENABLED", True)
    on = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert calls                                               # the fused path ran
    assert on == off


def test_draft_model_speculation_through_the_fused_decode_path(monkeypatch):
    """A draft model drafts 1-2 rows at a time, so on a GPU its forwards take the fused
    path while the target's verify (K + 1 tokens a row) does not: greedy with speculation
    must still equal greedy without (the same check tests/test_gpu_spec_*.py make)."""
    prompts = ["ROMEO:", "JULIET:\nO Romeo,"]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=8)
    kw = {"max_model_len": 64, "max_num_seqs": 2, "dtype": "float32", "enforce_eager": True}
    monkeypatch.setattr(skinny_fused, "ENABLED", False)
    want = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]
    calls = []
    orig = qwen3.Qwen3DecoderLayer.forward_decode
    monkeypatch.setattr(qwen3.Qwen3DecoderLayer, "forward_decode",
                        lambda self, *a: calls.append(1) or orig(self, *a))
    monkeypatch.setattr(skinny_fused, "ENABLED", True)
    spec = {"method": "draft_model", "model": str(DEFAULT_MODEL_DIR) + "-draft",
            "num_speculative_tokens": 2}
    llm = LLM(**kw, speculative_config=spec)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert calls and got == want
    assert llm.runner.spec.stats.num_accepted_tokens > 0


@pytest.mark.skipif(not TRITON_INTERPRET, reason="the smoke run uses CPU tensors: the interpreter only")
def test_bench_smoke(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_skinny_fused
    finally:
        sys.path.pop(0)
    bench_skinny_fused.main(["--smoke", "--layers", "2", "--out", str(tmp_path / "f.json")])
    saved = json.loads((tmp_path / "f.json").read_text())
    assert {r["runner"] for r in saved["chain"]} == {"unfused", "fused", "stream", "stream_pdl"}
    assert all(r["max_abs_diff_vs_unfused"] < 1e-3 for r in saved["chain"]
               if r["runner"] != "unfused")
    assert all(r["max_abs_diff_vs_fused"] < 1e-3 for r in saved["chain"]
               if r["runner"].startswith("stream"))
    assert {r["kind"] for r in saved["stream_sweep"]} == {"default", "norm", "add", "gate_up"}
    # small_m_fused's launch sweep: one override per op, each run and matching the default
    launches = saved["launch_sweep"]
    assert {r["op"] for r in launches} == {"default", "norm_linear", "linear_add",
                                           "norm_gate_up_silu"}
    assert all(isinstance(r["max_abs_diff_vs_default"], float)
               and r["max_abs_diff_vs_default"] < 1e-3 for r in launches)


# --------------------------------------------------------------- bf16 (GPU only)

@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="bf16 needs the GPU")
@pytest.mark.parametrize("M", [1, 2])
def test_gpu_bf16_qwen3_shapes_vs_unfused(M):
    """Each fused kernel vs the unfused bf16 chain (rms_norm -> skinny_linear -> add /
    silu_and_mul) at the Qwen3-0.6B shapes: within 2x the unfused chain's own error."""
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    g = torch.Generator(device="cuda").manual_seed(M)
    h = torch.randn(M, 1024, generator=g, **kw)
    nw = 1 + 0.1 * torch.randn(1024, generator=g, **kw)
    wqkv = torch.randn(4096, 1024, generator=g, **kw) * 0.05
    wgu = torch.randn(6144, 1024, generator=g, **kw) * 0.05
    wd = torch.randn(1024, 3072, generator=g, **kw) * 0.05
    act = torch.randn(M, 3072, generator=g, **kw)

    def check(fused, unfused, exact):
        err_f = (fused.float() - exact).abs().max().item()
        err_u = (unfused.float() - exact).abs().max().item()
        assert err_f <= 2 * err_u + 1e-2, (err_f, err_u)

    exact32 = skinny_norm_linear_ref(h.float(), nw.float(), 1e-6, wqkv.float())
    check(skinny_norm_linear(h, nw, 1e-6, wqkv), skinny_linear(rms_norm(h, nw, 1e-6), wqkv),
          exact32)
    exact32 = skinny_norm_gate_up_silu_ref(h.float(), nw.float(), 1e-6, wgu.float())
    gate, up = skinny_linear(rms_norm(h, nw, 1e-6), wgu).chunk(2, -1)
    check(skinny_norm_gate_up_silu(h, nw, 1e-6, wgu), silu_and_mul(gate, up), exact32)
    exact32 = h.float() + act.float() @ wd.float().T
    unfused = h + skinny_linear(act, wd)
    r = h.clone()
    assert skinny_linear_add(act, wd, r) is r
    check(r, unfused, exact32)


def _qwen3_0_6b(layers):
    """The Qwen3-0.6B shape with ``layers`` layers and dummy bf16 weights on the GPU."""
    from test_gpu_qwen3 import qwen3_0_6b_config_dir
    cfg = transformers.AutoConfig.from_pretrained(qwen3_0_6b_config_dir())
    cfg.num_hidden_layers = layers
    return load_model(None, dtype="bfloat16", device="cuda", load_format="dummy", hf_config=cfg)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="bf16 needs the GPU")
def test_gpu_bf16_model_fused_decode_vs_unfused(monkeypatch):
    """Qwen3-0.6B shape (4 layers), bf16: decode logits fused on vs off agree to bf16 noise
    (printed: whether they are bitwise equal), and greedy picks the same token."""
    model, config = _qwen3_0_6b(4)
    for ids in ([3], [3, 9]):
        on = _decode_logits(model, config, ids, 4, True, monkeypatch).float()
        off = _decode_logits(model, config, ids, 4, False, monkeypatch).float()
        rel = ((on - off).pow(2).mean().sqrt() / off.pow(2).mean().sqrt()).item()
        print(f"M={len(ids)}: bitwise equal {torch.equal(on, off)}, relative RMS diff {rel:.2e}")
        assert rel < 2e-2
        assert torch.equal(on.argmax(-1), off.argmax(-1))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs the GPU")
def test_gpu_fused_decode_kernels_per_layer(monkeypatch):
    """A 1-token forward launches at most 7 kernels a layer (+ embedding and final norm)."""
    from torch.profiler import ProfilerActivity, profile
    model, config = _qwen3_0_6b(4)
    _decode_logits(model, config, [3], 4, True, monkeypatch)         # compile + warm up
    md = AttentionMetadata(torch.tensor([0, 1], dtype=torch.int32, device="cuda"),
                           torch.tensor([5], dtype=torch.int32, device="cuda"),
                           torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
                           torch.tensor([4], device="cuda"), 1, 5)
    ids, positions = torch.tensor([3], device="cuda"), torch.tensor([4], device="cuda")
    with set_forward_context(md), torch.no_grad():
        model(ids, positions)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            model(ids, positions)
            torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    print(len(kernels), "kernels:", sorted(set(kernels)))
    assert len(kernels) <= 7 * config.num_hidden_layers + 2
