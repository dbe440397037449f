"""The register-resident fused decode GEMMs (Gluon, 3-64 rows) against the torch references.

Gluon has no interpreter, so on the CPU the kernel is compiled for sm_90 (PTX, no GPU) and
the PTX is checked for the property the kernel exists for: every weight load of a program is
a 16-byte ``ld.global.v4`` issued before ``griddepcontrol.wait``, and the products are
``mma.sync``. The numbers are checked on the GPU: bf16 at the Qwen3-0.6B shapes and ragged
ones against ``skinny_fused``'s references and ``small_m_fused``'s kernel, the in-place add,
and a two-layer chain in a CUDA graph with PDL equal to the eager chain.
"""

import os
import re

import pytest
import torch
from device_utils import (
    check_chain_in_a_cuda_graph,
    check_qwen3_shape_fused_gemms,
    check_ragged_fused_gemms,
)

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels import small_m_fused, small_m_resident, small_m_staged
from mrv2.kernels.small_m_fused import (
    small_m_linear_add,
)
from mrv2.platform import HAS_CUDA, TRITON_INTERPRET


def test_chunks_split_k_into_power_of_two_chunks():
    assert small_m_resident.chunks(1024) == (1024, 1)
    assert small_m_resident.chunks(2048) == (1024, 2)
    assert small_m_resident.chunks(3072) == (1024, 3)
    assert small_m_resident.chunks(1536) == (512, 3)
    assert small_m_resident.chunks(96) == (32, 3)
    assert small_m_resident.chunks(5120) is None          # 5 chunks of 1024: more than 4
    assert small_m_resident.chunks(300) is None           # 75 chunks of 4


def test_launch_keeps_a_warp_slice_of_32_keys():
    assert small_m_resident.launch("add", 3072) == small_m_resident.LAUNCH["add"]
    # K = 96 is chunks of 32: one warp; K = 64 one chunk of 64: two warps.
    assert small_m_resident.launch("norm", 96)[1] == 1
    assert small_m_resident.launch("norm", 64)[1] == 2
    w = torch.zeros(64, 48)
    assert small_m_resident.chunks(48) == (16, 3)
    assert not small_m_resident.fits(torch.zeros(4, 48), w, 48)  # chunks under 32 keys


def test_fits_only_cuda_half_types_and_whole_chunks():
    x = torch.zeros(4, 1024)
    w = torch.zeros(64, 1024)
    assert not small_m_resident.fits(x, w, 1024)                      # CPU, fp32
    assert not small_m_resident.fits(x.bfloat16(), w.bfloat16(), 1024)  # CPU


def test_on_by_default_on_the_gpu_never_in_the_interpreter():
    on = os.environ.get("MRV2_RESIDENT_GEMM", "1") == "1" and not TRITON_INTERPRET
    assert small_m_resident.ENABLED is on
    assert not small_m_resident.takes(torch.zeros(4, 8, dtype=torch.bfloat16))  # CPU


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="the routing reads a CUDA tensor's device")
def test_gpu_the_model_routes_17_to_32_rows_here_only_where_it_takes_them(monkeypatch):
    monkeypatch.setattr(small_m_fused, "ENABLED", True)
    monkeypatch.setattr(small_m_resident, "ENABLED", True)
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    assert small_m_resident.takes(torch.zeros(4, 8, **bf))
    assert small_m_fused.use_small_m_fused(torch.zeros(small_m_resident.MODEL_MAX_M, 8, **bf))
    assert not small_m_fused.use_small_m_fused(
        torch.zeros(small_m_resident.MODEL_MAX_M + 1, 8, **bf))
    assert not small_m_fused.use_small_m_fused(torch.zeros(17, 8, device="cuda"))  # fp32
    monkeypatch.setattr(small_m_resident, "ENABLED", False)
    assert small_m_fused.use_small_m_fused(torch.zeros(16, 8, **bf))
    assert not small_m_fused.use_small_m_fused(torch.zeros(17, 8, **bf))           # cuBLAS's


# --- the compiled kernel (CPU: sm_90 PTX) -------------------------------------------------

@pytest.mark.parametrize("N,K,kind", [
    (4096, 1024, "norm"),        # input norm + qkv
    (1024, 2048, "add"),         # o_proj + residual add
    (3072, 1024, "gate_up"),     # post-attention norm + gate_up + SiLU * up
    (1024, 3072, "add"),         # down + residual add (three K chunks)
])
def test_sm90_ptx_loads_every_weight_before_the_wait(N, K, kind):
    ptx, block_n, warps = small_m_resident.sm90_ptx(16, N, K, kind)
    norm, gate_up = kind != "add", kind == "gate_up"
    assert ptx.count("griddepcontrol.wait") == 1
    before, after = ptx.split("griddepcontrol.wait")
    # A thread's share of the program's weights, 8 bf16 (16 bytes) a load.
    weights = block_n * K * (2 if gate_up else 1) // (32 * warps)
    v4 = r"ld\.global(?:\.[a-z0-9_]+)*\.v4\.b32"
    assert len(re.findall(v4, before)) == weights // 8
    # ... and after it only the activations' (a thread's share of x, 16 rows x K) and, with
    # the norm, the norm weight's: a thread holds 2 of the 16 rows, so half as many K columns
    # (Triton 3.9), or one load per x load where the compiler does not share the broadcast
    # between the two rows (Triton 3.6, the GPU machine's).
    x_loads = 16 * K // (32 * warps) // 8
    loads_after = len(re.findall(v4, after))
    assert x_loads + (x_loads // 2 if norm else 0) <= loads_after <= x_loads * (2 if norm else 1)
    # The products: m16n8k16 per 16 keys of a warp's slice, per 8 columns (x 2 for gate_up).
    mmas = (K // warps // 16) * (block_n // 8) * (2 if gate_up else 1)
    assert after.count("mma.sync.aligned.m16n8k16") == mmas
    assert "mma.sync" not in before


def test_sm90_ptx_compiles_after_an_interpreted_kernel_with_a_cold_cache(tmp_path, monkeypatch):
    """The interpreter's patched language stays for the process; sm90_ptx must compile past it
    (it failed once an interpreted kernel had run and the cache held no copy)."""
    import triton

    if not TRITON_INTERPRET:
        pytest.skip("the interpreter's patch is what this is about")
    x = torch.randn(3, 64)
    small_m_linear_add(x, torch.randn(8, 64), torch.zeros(3, 8))     # an interpreted launch
    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))      # nothing cached
    ptx, _, _ = small_m_resident.sm90_ptx(16, 1024, 2048, "add")
    assert "griddepcontrol.wait" in ptx
    torch.testing.assert_close(small_m_linear_add(x, torch.eye(8, 64), torch.zeros(3, 8)),
                               x[:, :8])                               # ... and the interpreter again


# --- the GPU ------------------------------------------------------------------------------

@pytest.fixture(autouse=True)
def _not_staged(monkeypatch):
    """This file checks the resident kernel: small_m_staged (on by default, up to 16 rows)
    would take its calls; tests/test_small_m_staged.py checks that one."""
    monkeypatch.setattr(small_m_staged, "ENABLED", False)


def _resident_on(monkeypatch):
    monkeypatch.setattr(small_m_resident, "ENABLED", True)


def _block_m(monkeypatch, block_m):
    # Every launch at block_m rows a pass, BLOCK_N 8 (registers: see LAUNCH).
    for name in ("LAUNCH", "LAUNCH_OVER_16"):
        table = {kind: (8, warps, block_m)
                 for kind, (_, warps, _) in getattr(small_m_resident, name).items()}
        monkeypatch.setattr(small_m_resident, name, table)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="Gluon kernels need the GPU")
@pytest.mark.parametrize("M", [3, 4, 16, 17, 32, 33, 64])
@pytest.mark.parametrize("launches", ["default", "block_m_32", "candidates"])
def test_gpu_bf16_qwen3_shapes_match_the_references(M, launches, monkeypatch):
    """Each op at the Qwen3-0.6B shapes within bf16 rounding of the torch reference and of
    small_m_fused's own kernel (the same roundings, another summation order): at the
    default launches, with every op taking 32 rows a pass (rows past M masked), and at
    ``LAUNCH_CANDIDATES`` (launches the sweep found, tested here, not the default)."""
    if launches == "block_m_32":
        _block_m(monkeypatch, 32)
    if launches == "candidates":
        for (name, kind), launch in small_m_resident.LAUNCH_CANDIDATES.items():
            monkeypatch.setitem(getattr(small_m_resident, name), kind, launch)
    check_qwen3_shape_fused_gemms(
        M, lambda on: monkeypatch.setattr(small_m_resident, "ENABLED", on))


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="Gluon kernels need the GPU")
@pytest.mark.parametrize("M,N,K,bias,block_m", [
    (5, 40, 96, True, 16), (3, 1000, 512, False, 16), (20, 24, 1536, True, 16),
    (64, 8, 64, True, 16), (20, 24, 1536, True, 32), (33, 40, 96, False, 32)])
def test_gpu_ragged_shapes_bias_and_a_strided_residual(M, N, K, bias, block_m, monkeypatch):
    """N not a multiple of the column block (wrapped loads, masked stores), K of 3 chunks,
    bias, rows past one block (of 16 or 32); the add into a row-strided view of a wider
    buffer."""
    _resident_on(monkeypatch)
    if block_m == 32:
        _block_m(monkeypatch, block_m)
    check_ragged_fused_gemms(M, N, K, bias)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="CUDA graphs need the GPU")
@pytest.mark.parametrize("M", [4, 32])
def test_gpu_chain_in_a_cuda_graph_equals_eager(M, monkeypatch):
    """Two layers at the Qwen3-0.6B shapes, bf16, PDL as the GPU does it: the graph's replay
    bitwise the eager chain, and within bf16 rounding of small_m_fused's chain."""
    # Both chains round at the same places and sum in another order (see the helper).
    check_chain_in_a_cuda_graph(
        M, lambda on: monkeypatch.setattr(small_m_resident, "ENABLED", on))
    assert small_m_fused.MAX_M >= small_m_resident.MAX_M


@pytest.mark.skipif(HAS_CUDA, reason="the CPU's answer")
def test_chain_bench_says_it_needs_a_gpu():
    from script_loader import load_script
    bench = load_script("bench_resident_chain")
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        bench.main(["--rows", "4"])


@pytest.mark.skipif(HAS_CUDA, reason="the CPU's answer")
def test_kernel_probe_says_it_needs_a_gpu():
    from script_loader import load_script
    probe = load_script("probe_resident_kernels")
    assert set(probe.OPS) == {"qkv", "o_proj", "gate_up", "down"}
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe.main(["--rows", "16"])
