"""RMSNorm, and the residual add fused into it: one kernel where torch launches ~8.

Written in torch, an RMSNorm is a chain of small kernels (cast to fp32, square, mean,
add eps, rsqrt, multiply, cast the weight, multiply, cast back), and every pre-norm
block adds the residual in one more. On a decode step each of them moves a few KB and
costs a launch, so a small model's step is launch-bound, not memory-bound. Here one
program loads a row once, keeps it in registers and writes it once:

* ``rms_norm(x, w)``: ``x * rsqrt(mean(x^2) + eps) * w``, computed in fp32, rounded
  once to ``x``'s dtype.
* ``fused_add_rms_norm(x, residual, w)``: the residual-stream form. It returns the new
  residual ``x + residual`` AND its norm, so a decoder layer never adds on its own:
  ``hidden, residual = fused_add_rms_norm(attn_out, residual, w)``. The sum is rounded
  to the activation dtype before it is normalised, exactly as ``x + residual`` in torch.

See notebooks/01_qwen3_and_paged_kv.ipynb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from mrv2.platform import TRITON_INTERPRET

#: Widest row a program keeps in registers (one tile, no loop over the hidden size; at
#: 16 warps that is 32 fp32 values a thread for x and as many for the residual).
MAX_HIDDEN = 16384

# NOTE: under the interpreter every call of a @triton.jit function re-patches
# triton.language (~1.5 ms, more than the rest of a norm), and tl.sum is such a function;
# the kernels call its plain Python body there (as attention.py does for its helper).
row_sum = tl.sum.rewrite() if TRITON_INTERPRET and hasattr(tl.sum, "rewrite") else tl.sum


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain torch reference of :func:`rms_norm` (the executable specification).

    Args:
        x: ``[num_tokens, hidden]`` activations.
        weight: ``[hidden]`` scale.
        eps: added to the mean square.

    Returns:
        ``[num_tokens, hidden]`` in ``x``'s dtype.
    """
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * weight.float()).to(x.dtype)


def fused_add_rms_norm_ref(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch reference of :func:`fused_add_rms_norm`.

    Args:
        x: ``[num_tokens, hidden]`` the sub-block's output.
        residual: ``[num_tokens, hidden]`` the residual stream so far (same dtype).
        weight: ``[hidden]`` scale.
        eps: added to the mean square.

    Returns:
        ``(rms_norm(x + residual), x + residual)``, both in ``x``'s dtype.
    """
    residual = x + residual                        # in the activation dtype, as unfused
    return rms_norm_ref(residual, weight, eps), residual


@triton.jit(do_not_specialize=["num_rows"])
def _rms_norm_kernel(
    x_ptr, residual_ptr, weight_ptr,                    # inputs
    out_ptr, residual_out_ptr,                          # outputs
    num_rows, hidden, eps,                              # sizes (rows are contiguous)
    HAS_RESIDUAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Each program normalises BLOCK_M whole rows (1 on the GPU, many in the interpreter).
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)        # [BLOCK_M]
    cols = tl.arange(0, BLOCK_N)                                      # [BLOCK_N]
    offs = rows[:, None] * hidden + cols[None, :]                     # [BLOCK_M, BLOCK_N]
    mask = (rows < num_rows)[:, None] & (cols < hidden)[None, :]

    # Load in the input dtype, compute in fp32.
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        # The new residual is rounded to the activation dtype, then normalised.
        s = (x + r).to(residual_out_ptr.dtype.element_ty)
        tl.store(residual_out_ptr + offs, s, mask=mask)
        x = s.to(tl.float32)

    # Mean square over the row (padding columns are 0), then scale by the weight in fp32.
    rstd = tl.math.rsqrt(row_sum(x * x, axis=1) / hidden + eps)       # [BLOCK_M]
    w = tl.load(weight_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
    y = (x * rstd[:, None]) * w[None, :]                              # [BLOCK_M, BLOCK_N]

    # Round once, at the store.
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.shape != (x.shape[1],):
        raise ValueError(f"x must be [num_tokens, hidden] and weight [hidden], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)}")
    if x.shape[1] > MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[1]} > MAX_HIDDEN ({MAX_HIDDEN})")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"residual {tuple(residual.shape)} {residual.dtype} must match "
                         f"x {tuple(x.shape)} {x.dtype}")


def _launch(x, residual, weight, eps, out, residual_out) -> None:
    # NOTE: the kernel indexes every tensor as packed [num_rows, hidden] rows (one offset
    # tensor serves all loads and stores); contiguous() is free for the model's tensors.
    x, weight = x.contiguous(), weight.contiguous()
    residual = residual.contiguous() if residual is not None else None
    num_rows, hidden = x.shape
    block_n = triton.next_power_of_2(hidden)
    if TRITON_INTERPRET:
        # NOTE: the interpreter pays per program and per op, not per element: few programs.
        block_m, num_warps = max(1, min(triton.next_power_of_2(num_rows), 16384 // block_n)), 1
    else:  # one row per program: a decode batch of 256 tokens fills the SMs
        block_m, num_warps = 1, min(max(block_n // 256, 1), 16)
    r = residual if residual is not None else x          # unused when HAS_RESIDUAL is off
    r_out = residual_out if residual_out is not None else out
    _rms_norm_kernel[(triton.cdiv(num_rows, block_m),)](
        x, r, weight,
        out, r_out,
        num_rows, hidden, eps,
        HAS_RESIDUAL=residual is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps,
    )


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of each row in one kernel (Triton): fp32 math, one rounding at the store.

    Args:
        x: ``[num_tokens, hidden]`` activations (a strided view is copied first).
        weight: ``[hidden]`` scale (any float dtype; used in fp32).
        eps: added to the mean square before the reciprocal square root.

    Returns:
        A new contiguous ``[num_tokens, hidden]`` tensor in ``x``'s dtype.
    """
    _check(x, weight, None)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] > 0:                                   # an empty batch launches nothing
        _launch(x, None, weight, eps, out, None)
    return out


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``x + residual`` and the RMSNorm of that sum, in one kernel (Triton).

    Neither input is modified (the first layer's residual may be a caller's embeddings).

    Args:
        x: ``[num_tokens, hidden]`` the attention or MLP output (views are copied first).
        residual: ``[num_tokens, hidden]`` the residual stream, same dtype.
        weight: ``[hidden]`` scale.
        eps: added to the mean square.

    Returns:
        ``(hidden_states, residual_out)``, new contiguous tensors in ``x``'s dtype:
        ``residual_out = x + residual`` (rounded to that dtype) and
        ``hidden_states = rms_norm(residual_out, weight, eps)``.
    """
    _check(x, weight, residual)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    residual_out = torch.empty_like(out)
    if x.shape[0] > 0:
        _launch(x, residual, weight, eps, out, residual_out)
    return out, residual_out
