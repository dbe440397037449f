"""Programmatic dependent launch (mrv2.kernels.pdl) in the fused decode GEMMs.

On the CPU: the switch is off under the interpreter whatever ``MRV2_PDL`` says, and the PDL
path of ``_skinny_fused_kernel`` (the prefetched first weight tile, the peeled first K step,
the prefetched bias; the ``gdc_*`` calls themselves compile only for the GPU) gives bitwise
the PDL-off result and matches the torch references. On the GPU (H200): a chain of fused
decode layers captured in a CUDA graph gives bitwise the same outputs with PDL on as off,
and ``LLM`` greedy decoding gives the same tokens with PDL (the default) as with ``MRV2_PDL=0``.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from test_skinny_fused import TOL, _inputs  # the fused kernels' inputs and tolerance

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels import pdl, skinny_fused
from mrv2.kernels.skinny_fused import (
    skinny_linear_add,
    skinny_linear_add_ref,
    skinny_norm_gate_up_silu,
    skinny_norm_gate_up_silu_ref,
    skinny_norm_linear,
    skinny_norm_linear_ref,
)
from mrv2.platform import DEVICE, HAS_CUDA, TRITON_INTERPRET, env_switch

ROOT = Path(__file__).resolve().parents[1]


def test_switch_reads_the_env_and_is_off_under_the_interpreter():
    for env in ({}, {"MRV2_PDL": "1"}):                 # on by default
        assert pdl.pdl_switch(env, interpret=False)
        assert not pdl.pdl_switch(env, interpret=True)
    assert not pdl.pdl_switch({"MRV2_PDL": "0"}, interpret=False)
    for bad in ("true", "", "on"):
        with pytest.raises(ValueError, match="MRV2_PDL must be 0"):
            pdl.pdl_switch({"MRV2_PDL": bad}, interpret=False)
    if TRITON_INTERPRET:
        assert pdl.PDL_ENABLED is False and not pdl.GDC_CALLS


def test_env_switch_defaults_and_rejects_typos():
    # the one reader of mrv2's 0/1 switches (MRV2_PDL, MRV2_SMALL_M_FUSED, ...)
    assert env_switch("MRV2_X", True, {}) and not env_switch("MRV2_X", False, {})
    assert env_switch("MRV2_X", False, {"MRV2_X": "1"})
    assert not env_switch("MRV2_X", True, {"MRV2_X": "0"})
    with pytest.raises(ValueError, match=r"MRV2_X must be 0 \(off\) or 1 \(on; unset: on\)"):
        env_switch("MRV2_X", True, {"MRV2_X": "yes"})


def test_use_pdl_never_on_the_cpu(monkeypatch):
    monkeypatch.setattr(pdl, "PDL_ENABLED", True)
    assert not pdl.use_pdl(torch.device("cpu"))
    monkeypatch.setattr(pdl, "PDL_ENABLED", False)
    assert not pdl.use_pdl(torch.device("cpu"))


class _Spy:
    """Wraps the kernel to record each launch's ``PDL`` constexpr."""

    def __init__(self, kernel):
        self.kernel, self.pdl = kernel, []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.pdl.append(kwargs["PDL"])
            return launch(*args, **kwargs)
        return run


# (M, N, K, bias, launch overrides): one K step, a ragged last K step, several steps
CASES = [(1, 40, 96, False, {}), (2, 24, 200, True, {"block_n": 16, "block_k": 64}),
         (2, 17, 64, True, {"block_n": 8, "block_k": 128}), (1, 12, 300, True, {"block_k": 128}),
         (0, 24, 64, True, {})]


@pytest.mark.skipif(not TRITON_INTERPRET, reason="the interpreter's PDL path (no gdc calls)")
@pytest.mark.parametrize("M,N,K,bias,kw", CASES)
def test_pdl_path_equals_plain_path_in_the_interpreter(M, N, K, bias, kw, monkeypatch):
    x, nw, w, b = _inputs(M, N, K, bias, seed=M * 100 + N + K)
    _, _, wgu, bgu = _inputs(M, N, K, bias, seed=M * 100 + N + K + 1, rows=2)
    residual = torch.randn(M, N, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    spy = _Spy(skinny_fused._skinny_fused_kernel)
    monkeypatch.setattr(skinny_fused, "_skinny_fused_kernel", spy)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "use_pdl", lambda device, on=on: on)
        outs[on] = (skinny_norm_linear(x, nw, 1e-6, w, b, **kw),
                    skinny_linear_add(x, w, residual.clone(), b, **kw),
                    skinny_norm_gate_up_silu(x, nw, 1e-6, wgu, bgu, **kw))
    assert spy.pdl == ([False] * 3 + [True] * 3 if M else [])    # M = 0 launches nothing
    for plain, pdl_out in zip(outs[False], outs[True], strict=True):
        assert torch.equal(plain, pdl_out)
    refs = (skinny_norm_linear_ref(x, nw, 1e-6, w, b),
            skinny_linear_add_ref(x, w, residual.clone(), b),
            skinny_norm_gate_up_silu_ref(x, nw, 1e-6, wgu, bgu))
    for out, ref in zip(outs[True], refs, strict=True):
        torch.testing.assert_close(out, ref, **TOL)


def test_launch_kwargs_only_when_compiling():
    assert pdl.launch_kwargs(False) == {}
    assert pdl.launch_kwargs(True) == ({} if TRITON_INTERPRET else {"launch_pdl": True})


class _SpyAll:
    """Records the ``PDL`` constexpr of every launch of the kernels it wraps."""

    def __init__(self, monkeypatch, *mod_names):
        self.pdl = []
        for mod, name in mod_names:
            kernel = getattr(mod, name)
            monkeypatch.setattr(mod, name, self._wrap(kernel, name))

    def _wrap(self, kernel, name):
        spy = self

        class Wrapped:
            def __getitem__(self, grid):
                launch = kernel[grid]

                def run(*args, **kwargs):
                    spy.pdl.append((name, kwargs["PDL"]))
                    return launch(*args, **kwargs)
                return run
        return Wrapped()


def test_rope_and_attention_pass_the_pdl_flag(monkeypatch):
    """qk_norm_rope, paged_attention and its split merge take ``PDL`` from ``use_pdl`` and
    give the same result either way (their PDL path is only the wait at the start, which the
    interpreter skips)."""
    from test_kernels_attention import make_batch

    from mrv2.kernels import attention, rotary
    spy = _SpyAll(monkeypatch, (rotary, "_qk_norm_rope_kernel"),
                  (attention, "_paged_attention_kernel"), (attention, "_merge_splits_kernel"))
    q, kv_cache, md = make_batch([(30, 1), (7, 1)], 4, 2, 16, seed=3)
    g = torch.Generator().manual_seed(1)
    k = torch.randn(2, 2, 16, generator=g).to(DEVICE)
    cache = rotary.build_cos_sin_cache(16, 64, 10000.0).to(DEVICE)
    positions = torch.tensor([30, 7], device=DEVICE)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "use_pdl", lambda device, on=on: on)
        outs[on] = (*rotary.qk_norm_rope(q, k, positions, cache),
                    attention.paged_attention(q, kv_cache, md, 0.25, num_splits=2))
    assert [f for _, f in spy.pdl] == [False] * 3 + [True] * 3
    assert {n for n, _ in spy.pdl} == {"_qk_norm_rope_kernel", "_paged_attention_kernel",
                                       "_merge_splits_kernel"}
    for a, b in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a, b)
    torch.testing.assert_close(outs[True][2], attention.paged_attention_ref(q, kv_cache, md, 0.25),
                               **TOL)


@pytest.mark.skipif(not TRITON_INTERPRET, reason="the smoke run uses CPU tensors: the interpreter only")
def test_bench_smoke_with_pdl(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import bench_skinny_fused
    finally:
        sys.path.pop(0)
    from mrv2.kernels import skinny_stream
    before = pdl.PDL_ENABLED, skinny_stream.ENABLED
    bench_skinny_fused.main(["--smoke", "--pdl", "--layers", "1", "--out", str(tmp_path / "f.json")])
    assert (pdl.PDL_ENABLED, skinny_stream.ENABLED) == before      # restored after the runners
    rows = json.loads((tmp_path / "f.json").read_text())["chain"]
    # (the smoke run also takes the stream runners: tests/test_skinny_fused.py checks them)
    assert {r["runner"] for r in rows} == {"unfused", "fused", "fused_pdl", "stream", "stream_pdl"}
    assert all(r["equal_to_fused"] for r in rows if r["runner"] == "fused_pdl")


# --------------------------------------------------------------- GPU (H200)

def _needs_hopper():
    if not HAS_CUDA or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs an sm_90+ GPU")


def _chain_in_graph(M, layers=4):
    """``layers`` fused decode layers at the Qwen3-0.6B shapes (bf16), each kernel reading
    the previous kernel's output (o_proj takes qkv's first 2048 columns), captured in one
    CUDA graph and replayed twice; returns every output of the last replay."""
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    g = torch.Generator(device="cuda").manual_seed(M)
    ws = [{"ln1": 1 + 0.1 * torch.randn(1024, generator=g, **kw),
           "qkv": torch.randn(4096, 1024, generator=g, **kw) * 0.05,
           "o": torch.randn(1024, 2048, generator=g, **kw) * 0.05,
           "ln2": 1 + 0.1 * torch.randn(1024, generator=g, **kw),
           "gate_up": torch.randn(6144, 1024, generator=g, **kw) * 0.05,
           "down": torch.randn(1024, 3072, generator=g, **kw) * 0.05} for _ in range(layers)]
    h0 = torch.randn(M, 1024, generator=g, **kw)
    h = h0.clone()

    def run():
        outs = []
        for w in ws:
            qkv = skinny_norm_linear(h, w["ln1"], 1e-6, w["qkv"])          # [M, 4096]
            skinny_linear_add(qkv[:, :2048], w["o"], h)                     # h += o(qkv)
            act = skinny_norm_gate_up_silu(h, w["ln2"], 1e-6, w["gate_up"])  # [M, 3072]
            skinny_linear_add(act, w["down"], h)
            outs += [qkv, act]
        return outs

    run()                                                                   # compile
    h.copy_(h0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = run()
    for _ in range(2):
        h.copy_(h0)
        graph.replay()
    torch.cuda.synchronize()
    return [o.clone() for o in outs] + [h.clone()]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs the GPU")
@pytest.mark.parametrize("M", [1, 2])
def test_gpu_pdl_chain_in_cuda_graph_bitwise_equal(M, monkeypatch):
    _needs_hopper()
    monkeypatch.setattr(pdl, "PDL_ENABLED", False)
    off = _chain_in_graph(M)
    monkeypatch.setattr(pdl, "PDL_ENABLED", True)
    assert pdl.use_pdl(torch.device("cuda"))
    on = _chain_in_graph(M)
    for i, (a, b) in enumerate(zip(off, on, strict=True)):
        assert torch.equal(a, b), (i, (a.float() - b.float()).abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs the GPU")
def test_gpu_model_decode_logits_bitwise_with_pdl(monkeypatch):
    """Qwen3-0.6B shape (4 layers, dummy bf16), eager: a prefill then a 1- and a 2-token
    decode step, every decode kernel (fused GEMMs, q/k-norm + RoPE + KV write, attention and
    its merge) launched with PDL vs without: bitwise equal logits."""
    _needs_hopper()
    from test_skinny_fused import _decode_logits, _qwen3_0_6b
    model, config = _qwen3_0_6b(4)
    for ids in ([3], [3, 9]):
        monkeypatch.setattr(pdl, "PDL_ENABLED", False)
        off = _decode_logits(model, config, ids, 4, True, monkeypatch)
        monkeypatch.setattr(pdl, "PDL_ENABLED", True)
        on = _decode_logits(model, config, ids, 4, True, monkeypatch)
        assert torch.equal(on, off), (on.float() - off.float()).abs().max().item()


_GENERATE = """
import json, sys
from mrv2 import LLM, SamplingParams
from mrv2.kernels import pdl
llm = LLM(max_model_len=128, max_num_seqs=2, dtype="bfloat16")
params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24)
tokens = [[o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
          for prompts in (["ROMEO:"], ["ROMEO:", "JULIET:\\nO Romeo,"])]
print(json.dumps({"pdl": pdl.PDL_ENABLED, "tokens": tokens}))
"""


def _generate(pdl_env: str) -> dict:
    env = {**os.environ, "MRV2_PDL": pdl_env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _GENERATE], env=env, capture_output=True,
                          check=False, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs the GPU")
def test_gpu_llm_greedy_same_tokens_with_pdl():
    """The embedded model, bf16, CUDA graphs on (the default): one prompt (M = 1), then two
    decoding side by side (M = 2), 24 greedy tokens each, MRV2_PDL=1 vs 0."""
    _needs_hopper()
    off, on = _generate("0"), _generate("1")
    assert off["pdl"] is False and on["pdl"] is True
    assert on["tokens"] == off["tokens"]
