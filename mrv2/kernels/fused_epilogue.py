"""The epilogue the fused decode GEMMs share: the unfused path's roundings, then the store.

``skinny_fused``, ``skinny_stream``, ``small_m_fused`` and ``persistent_layer`` compute a
product in fp32 and must hold afterwards exactly what the unfused layers would have written
(each GEMM output rounded to the activation dtype, SiLU's result rounded, their product
rounded), then add the residual in place or store. One copy of that, here.
"""

from __future__ import annotations

import triton
import triton.language as tl

from mrv2.platform import interpreter_body


@triton.jit
def round_product(acc, acc_up, DT: tl.constexpr, GATE_UP: tl.constexpr):
    # The fp32 product(s) -> what the unfused path holds: the GEMM output rounded to DT,
    # then (gate_up) silu(g) rounded and its product with the rounded u rounded. fp32 out.
    y = acc.to(DT).to(tl.float32)
    if GATE_UP:
        s = (y / (1.0 + tl.exp(-y))).to(DT).to(tl.float32)                  # silu(g)
        y = (s * acc_up.to(DT).to(tl.float32)).to(DT).to(tl.float32)
    return y


@triton.jit
def store_output(y, out_ptr, residual_ptr, m, n, mask, stride_rm, stride_om,
                 ADD_RESIDUAL: tl.constexpr):
    # Store the fp32 [BM, BN] tile y in out's dtype, plus the residual first when asked.
    if ADD_RESIDUAL:
        # NOTE: in place is race-free: a program reads and writes only its own elements.
        r = tl.load(residual_ptr + m[:, None] * stride_rm + n[None, :], mask=mask, other=0.0)
        y = y + r.to(tl.float32)
    tl.store(out_ptr + m[:, None] * stride_om + n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=mask)


# NOTE: the interpreter re-patches triton.language at every jit-helper call: plain bodies.
_round_product_body = interpreter_body(round_product)
_store_body = interpreter_body(store_output)
