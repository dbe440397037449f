"""SwiGLU's gate: ``silu(gate) * up`` in one kernel instead of two.

The MLP of Qwen3/Llama is ``down_proj(silu(gate_proj(x)) * up_proj(x))``. Between the
matrix products torch launches a SiLU kernel and a product kernel, and writes and
re-reads a ``[num_tokens, intermediate_size]`` tensor in between (the widest activation
of the layer). One elementwise program loads ``gate`` and ``up`` once and writes the
product once. Like torch, SiLU's result is rounded to the activation dtype before the
product, so fp32 results equal the unfused ones. See notebooks/01_qwen3_and_paged_kv.ipynb.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mrv2.platform import TRITON_INTERPRET


def silu_and_mul_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """Plain torch reference of :func:`silu_and_mul` (the executable specification).

    Args:
        gate: ``[num_tokens, intermediate]`` output of ``gate_proj``.
        up: ``[num_tokens, intermediate]`` output of ``up_proj``, same dtype.

    Returns:
        ``silu(gate) * up``, ``[num_tokens, intermediate]`` in the input dtype.
    """
    return F.silu(gate) * up


@triton.jit(do_not_specialize=["num_rows"])
def _silu_and_mul_kernel(
    gate_ptr, up_ptr,                             # inputs
    out_ptr,                                      # output (contiguous)
    num_rows, width,                              # sizes
    stride_gm, stride_gn, stride_um, stride_un,   # strides of gate, up
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # A [BLOCK_M, BLOCK_N] tile of the [num_rows, width] output.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)          # [BLOCK_M]
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)          # [BLOCK_N]
    mask = (rows < num_rows)[:, None] & (cols < width)[None, :]         # [BLOCK_M, BLOCK_N]

    # Load in the input dtype, compute in fp32.
    g = tl.load(gate_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn,
                mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + rows[:, None] * stride_um + cols[None, :] * stride_un,
                mask=mask, other=0.0).to(tl.float32)

    # silu(g) = g * sigmoid(g), rounded to the activation dtype as F.silu's output is.
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + rows[:, None] * width + cols[None, :],
             (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one kernel (Triton): fp32 math, input dtype in and out.

    Args:
        gate: ``[num_tokens, intermediate]`` output of ``gate_proj``, any strides.
        up: ``[num_tokens, intermediate]`` output of ``up_proj``, same shape and dtype.

    Returns:
        A new contiguous ``[num_tokens, intermediate]`` tensor in the input dtype.
    """
    if gate.dim() != 2 or gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} "
                         f"{up.dtype} must be the same [num_tokens, intermediate] and dtype")
    num_rows, width = gate.shape
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if num_rows == 0 or width == 0:                      # nothing to do: launch nothing
        return out
    if TRITON_INTERPRET:
        # NOTE: the interpreter pays per program and per op: one big tile, few programs.
        block_n = triton.next_power_of_2(width)
        block_m, num_warps = max(1, min(triton.next_power_of_2(num_rows), 32768 // block_n)), 1
    else:  # one row per program, split into 1024-wide column blocks (8 elems per thread)
        block_m, block_n, num_warps = 1, min(1024, triton.next_power_of_2(width)), 4
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(width, block_n))
    _silu_and_mul_kernel[grid](
        gate, up,
        out,
        num_rows, width,
        *gate.stride(), *up.stride(),
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return out
