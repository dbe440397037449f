"""small_m_fused's split-K (each tile's K cut into ranges; the tile's last program sums the
fp32 partials in split order and runs the epilogue) against the torch references.

Under the interpreter in fp32: the three kernel kinds at 2 / 4 / 8 splits with ragged N,
several row blocks, bias on/off and the in-place add; the split launch deterministic and
its tile counters back at zero after every launch; the PDL path (prefetched first tile of
each range) bitwise the plain one; the rule and the argument checks; the embedded model's
greedy tokens with the split on vs off. bf16 at the Qwen3-0.6B shapes, and a CUDA graph
replayed twice, on the GPU.
"""

import pytest
import torch
from device_utils import qwen3_layer_weights
from test_skinny_fused import TOL, _inputs  # the fused kernels' inputs and tolerance
from test_small_m_fused import _llm_tokens, _own_kernel  # noqa: F401 (autouse fixture)

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2 import LLM
from mrv2.kernels import pdl, small_m_fused, split_k
from mrv2.kernels.skinny_fused import (
    skinny_linear_add_ref,
    skinny_norm_gate_up_silu_ref,
    skinny_norm_linear_ref,
)
from mrv2.kernels.small_m_fused import (
    small_m_linear_add,
    small_m_norm_gate_up_silu,
    small_m_norm_linear,
    split_k_for,
)
from mrv2.platform import DEVICE, HAS_CUDA, TRITON_INTERPRET

# (M, N, K, bias): ragged N at block_n 16, one and two row blocks at block_m 16, 0 rows.
CASES = [(3, 40, 256, False), (17, 24, 512, True), (5, 64, 1024, True), (0, 24, 256, True)]


def _counters_zero():
    for _, counts, _ in split_k._BUFFERS.values():
        assert int(counts.abs().sum()) == 0          # every tile's last program reset its own


def _cfg(split):
    return {"block_m": 16, "block_n": 16, "block_k": 32, "split_k": split}


@pytest.mark.parametrize("M,N,K,bias", CASES)
@pytest.mark.parametrize("split", [2, 4, 8])
def test_each_kind_matches_reference(M, N, K, bias, split):
    x, nw, w, b = _inputs(M, N, K, bias, seed=M * 100 + N + K + split)
    torch.testing.assert_close(small_m_norm_linear(x, nw, 1e-6, w, b, config=_cfg(split)),
                               skinny_norm_linear_ref(x, nw, 1e-6, w, b), **TOL)
    residual = torch.randn(M, N, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    r = residual.clone()
    assert small_m_linear_add(x, w, r, b, config=_cfg(split)) is r
    torch.testing.assert_close(r, skinny_linear_add_ref(x, w, residual.clone(), b), **TOL)
    x2, nw2, w2, b2 = _inputs(M, N, K, bias, seed=M + N + K + split, rows=2)
    torch.testing.assert_close(small_m_norm_gate_up_silu(x2, nw2, 1e-5, w2, b2,
                                                         config=_cfg(split)),
                               skinny_norm_gate_up_silu_ref(x2, nw2, 1e-5, w2, b2), **TOL)
    _counters_zero()


def test_split_is_deterministic_and_close_to_unsplit():
    x, nw, w, b = _inputs(9, 40, 512, True, seed=11, rows=2)
    one = small_m_norm_gate_up_silu(x, nw, 1e-6, w, b, config=_cfg(1))
    first = small_m_norm_gate_up_silu(x, nw, 1e-6, w, b, config=_cfg(4))
    again = small_m_norm_gate_up_silu(x, nw, 1e-6, w, b, config=_cfg(4))
    assert torch.equal(first, again)
    torch.testing.assert_close(first, one, **TOL)
    _counters_zero()


@pytest.mark.skipif(not TRITON_INTERPRET, reason="the interpreter's PDL path (no gdc calls)")
def test_pdl_path_equals_the_plain_path(monkeypatch):
    # With PDL each program prefetches the first tile of ITS range and peels that step.
    x, nw, w, b = _inputs(17, 24, 512, True, seed=4, rows=2)
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(pdl, "use_pdl", lambda device, on=on: on)
        r = torch.zeros(17, 48, device=DEVICE)
        outs[on] = (small_m_norm_linear(x, nw, 1e-6, w, b, config=_cfg(4)),
                    small_m_norm_gate_up_silu(x, nw, 1e-6, w, b, config=_cfg(4)),
                    small_m_linear_add(x, w, r, b, config=_cfg(4)))
    for a, c in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a, c)


def test_rule_keeps_the_grid_within_the_target():
    target = split_k.SPLIT_TARGET_PROGRAMS
    assert target == 264
    assert split_k_for(64, 2048) == 4 and split_k_for(64, 3072) == 4   # o_proj, down
    assert split_k_for(128, 1024) == 2                                   # qkv
    assert split_k_for(192, 1024) == 1                                   # 384 > 264
    assert split_k_for(3, 96) == 1                                       # 96 / 2 not x64
    assert split_k_for(1, 1 << 16) == split_k.MAX_SPLIT_K
    for tiles in (1, 5, 64, 100, 133, 264):
        for K in (64, 192, 1024, 3072):
            s = split_k_for(tiles, K)
            assert s == 1 or (tiles * s <= target and K % (s * 64) == 0)


def test_split_launch_fits_its_range_and_the_shared_memory():
    from mrv2.kernels.small_m_gemm import _SMEM_BYTES, _launch, _smem_bytes
    for M, N, K, w_tiles in [(32, 1024, 2048, 1), (32, 1024, 3072, 1), (4, 4096, 1024, 1),
                             (32, 3072, 1024, 2), (16, 40, 192, 1)]:
        cfg = _launch(M, N, K)
        tiles = -(-N // cfg["block_n"])
        split = max(2, split_k_for(tiles, K))
        k_per = K // split
        new = split_k.split_launch(cfg, tiles * split, k_per, 2, w_tiles)
        bk, stages = new["block_k"], new["num_stages"]
        assert k_per % bk == 0 and (bk <= 64 or 2 * bk <= k_per)     # two steps to pipeline
        assert 2 <= stages <= max(2, k_per // bk)
        per_sm = -(-tiles * split // split_k.NUM_SMS)
        assert (_smem_bytes(cfg["block_m"], cfg["block_n"] * w_tiles, bk, stages)
                <= _SMEM_BYTES // per_sm or bk == 64)
        assert {k: v for k, v in new.items() if k not in ("block_k", "num_stages")} == \
            {k: v for k, v in cfg.items() if k not in ("block_k", "num_stages")}


def test_switch_on_takes_the_rule(monkeypatch):
    monkeypatch.setattr(small_m_fused, "SPLIT_K", True)
    launched = []
    orig = small_m_fused._split_buffers
    monkeypatch.setattr(small_m_fused, "_split_buffers",
                        lambda *a: launched.append(a) or orig(*a))
    x, nw, w, b = _inputs(4, 40, 1024, True, seed=2)
    out = small_m_norm_linear(x, nw, 1e-6, w, b)             # 3 tiles: the most splits
    assert launched and launched[0][2] == 3                  # (device, numel, tiles)
    torch.testing.assert_close(out, skinny_norm_linear_ref(x, nw, 1e-6, w, b), **TOL)
    monkeypatch.setattr(small_m_fused, "SPLIT_K", False)
    launched.clear()
    small_m_norm_linear(x, nw, 1e-6, w, b)
    assert not launched


def test_rule_beyond_64_rows_matches_reference(monkeypatch):
    # 130 rows take the 64 x 64 tiles (LARGE_M_LAUNCH), re-planned for the rule's split.
    monkeypatch.setattr(small_m_fused, "SPLIT_K", True)
    splits = []
    orig = small_m_fused.split_k_for
    monkeypatch.setattr(small_m_fused, "split_k_for", lambda *a: splits.append(orig(*a)) or splits[-1])
    x, nw, w, b = _inputs(130, 40, 1024, True, seed=8, rows=2)
    torch.testing.assert_close(small_m_norm_gate_up_silu(x, nw, 1e-6, w, b),
                               skinny_norm_gate_up_silu_ref(x, nw, 1e-6, w, b), **TOL)
    x2, _, w2, b2 = _inputs(130, 40, 1024, True, seed=9)
    residual = torch.randn(130, 40, generator=torch.Generator().manual_seed(2)).to(x.device)
    r = residual.clone()
    small_m_linear_add(x2, w2, r, b2)
    torch.testing.assert_close(r, skinny_linear_add_ref(x2, w2, residual.clone(), b2), **TOL)
    assert splits == [8, 8]                                  # 3 tiles: the most splits
    _counters_zero()


def test_buffers_grow_and_keep_the_old_ones(monkeypatch):
    monkeypatch.setattr(split_k, "_BUFFERS", {})
    dev = torch.device(DEVICE)
    p1, c1 = split_k.split_buffers(dev, 100, 10)
    assert p1.numel() >= 100 and c1.numel() >= 10 and int(c1.sum()) == 0
    assert split_k.split_buffers(dev, 50, 5)[0] is p1        # reused when it fits
    p2, _ = split_k.split_buffers(dev, 10 * p1.numel(), 10)
    assert p2.numel() >= 10 * p1.numel()
    assert split_k._BUFFERS[dev][2][0][0] is p1          # kept for old graphs


def test_bad_split_raises_before_work():
    x, nw, w, _ = _inputs(4, 32, 256, False, seed=3)
    with pytest.raises(ValueError, match="split_k must be 1, 2, 4 or 8"):
        small_m_norm_linear(x, nw, 1e-6, w, config=_cfg(3))
    with pytest.raises(ValueError, match="dividing K = 256"):
        small_m_norm_linear(x, nw, 1e-6, w, config={"split_k": 4, "block_k": 128})


def test_llm_greedy_split_on_equals_off(monkeypatch):
    """End to end, fp32: the embedded model's small-M decodes split (the rule) vs not."""
    llm = LLM(max_model_len=64, max_num_seqs=4, dtype="float32", enforce_eager=True)
    prompts = ["ROMEO:", "JULIET:\nO Romeo,", "First Citizen:", "KING HENRY:"]
    off, _ = _llm_tokens(llm, prompts, monkeypatch, True)
    monkeypatch.setattr(small_m_fused, "SPLIT_K", True)
    splits = []
    orig = small_m_fused.split_k_for
    monkeypatch.setattr(small_m_fused, "split_k_for",
                        lambda *a: splits.append(orig(*a)) or splits[-1])
    on, _ = _llm_tokens(llm, prompts, monkeypatch, True)
    assert max(splits) > 1                                   # the split really ran
    assert on == off


@pytest.mark.skipif(not HAS_CUDA, reason="bf16 and CUDA graphs need the GPU")
@pytest.mark.parametrize("M", [4, 32, 128])
def test_gpu_bf16_split_in_a_cuda_graph(M, monkeypatch):
    """Qwen3-0.6B shapes, bf16, the rule's splits: close to the references, and a captured
    graph replayed twice gives the eager result bitwise (the counters reset themselves)."""
    monkeypatch.setattr(small_m_fused, "SPLIT_K", True)
    kw = {"device": "cuda", "dtype": torch.bfloat16}
    g = torch.Generator(device="cuda").manual_seed(M)
    nw, qkv, o, gate_up, down = qwen3_layer_weights(g, **kw)
    h0 = torch.randn(M, 1024, generator=g, **kw)
    tol = {"rtol": 2e-2, "atol": 2e-2}
    q = small_m_norm_linear(h0, nw, 1e-6, qkv)
    torch.testing.assert_close(q, skinny_norm_linear_ref(h0, nw, 1e-6, qkv), **tol)
    act = small_m_norm_gate_up_silu(h0, nw, 1e-6, gate_up)
    torch.testing.assert_close(act, skinny_norm_gate_up_silu_ref(h0, nw, 1e-6, gate_up), **tol)
    torch.testing.assert_close(small_m_linear_add(act, down, h0.clone()),
                               skinny_linear_add_ref(act, down, h0.clone()), **tol)

    def chain(h):
        q = small_m_norm_linear(h, nw, 1e-6, qkv)
        small_m_linear_add(q[:, :2048], o, h)
        small_m_linear_add(small_m_norm_gate_up_silu(h, nw, 1e-6, gate_up), down, h)
        return h

    h = chain(h0.clone())
    eager = h.clone()
    h.copy_(h0)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(h)
    for _ in range(2):
        h.copy_(h0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h, eager)
    _counters_zero()


@pytest.mark.skipif(not TRITON_INTERPRET, reason="the smoke run uses CPU tensors: the interpreter only")
def test_bench_chain_smoke_with_the_split(tmp_path, monkeypatch):
    import json
    import pathlib
    import sys
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "scripts"))
    try:
        import bench_skinny_fused
    finally:
        sys.path.pop(0)
    # NOTE: the smoke sizes (K = 32 / 64 / 96) are below the rule's 128: force two splits.
    splits = []
    monkeypatch.setattr(small_m_fused, "split_k_for", lambda tiles, K: splits.append(K) or 2)
    bench_skinny_fused.main(["--smoke", "--layers", "1", "--rows", "4", "--split-k",
                             "--out", str(tmp_path / "f.json")])
    rows = {r["runner"]: r for r in json.loads((tmp_path / "f.json").read_text())["chain"]}
    assert {"unfused", "fused", "split", "split_pdl"} <= set(rows) and splits
    assert rows["split"]["max_abs_diff_vs_fused"] < 1e-4
    assert rows["split_pdl"]["max_abs_diff_vs_fused"] < 1e-4
