"""Per-head q/k RMSNorm and rotary position embedding, q and k in one launch.

Between the q/k/v projections and attention, Qwen3 normalises every head of q and k
(RMSNorm over ``head_dim``, the "q/k-norm") and then rotates it by its token's position
(RoPE, rotate-half / GPT-NeoX layout). In torch that is two norms of ~8 kernels and two
rotations of ~9 (gather cos/sin, split, four products, two sums, concatenate, cast).
Every one of them is elementwise or a reduction over one head, so one program can do it
all for one token: load each head of q and k once, normalise, rotate, store once.

A head is a row of ``head_dim`` values split in two halves ``x1, x2``; with
``cos, sin = cos_sin_cache[position]`` (``head_dim / 2`` each, fp32)::

    out = concat(x1 * cos - x2 * sin, x2 * cos + x1 * sin)

Llama and Qwen2 have no q/k-norm: pass no weights and only the rotation runs.
See notebooks/01_qwen3_and_paged_kv.ipynb.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mrv2.kernels import pdl
from mrv2.kernels.kv_cache import _check as _check_kv
from mrv2.kernels.layernorm import rms_norm_ref, row_sum
from mrv2.kernels.pdl import GDC_CALLS
from mrv2.platform import TRITON_INTERPRET, interpreter_body


def build_cos_sin_cache(head_dim: int, max_position: int, theta: float,
                        device: torch.device | str | None = None) -> torch.Tensor:
    """The fp32 ``[max_position, head_dim]`` table RoPE reads: ``cos`` | ``sin`` halves.

    Args:
        head_dim: rotated size (the whole head, even).
        max_position: positions ``0 .. max_position - 1`` get a row.
        theta: the RoPE base; pair ``i`` turns at frequency ``theta ** (-2i / head_dim)``.
        device: where the table lives.
    """
    half = torch.arange(0, head_dim, 2, dtype=torch.float, device=device)       # [D/2]
    inv_freq = 1.0 / (theta ** (half / head_dim))                               # [D/2]
    t = torch.arange(max_position, dtype=torch.float, device=device)            # [P]
    freqs = t[:, None] * inv_freq[None, :]                                      # [P, D/2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)                        # [P, D]


def rope_ref(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of ``x [T, H, D]`` by ``positions [T]``: fp32 math, ``x``'s dtype out."""
    cos, sin = cos_sin_cache[positions].chunk(2, dim=-1)              # [T, D/2] each
    cos, sin = cos[:, None, :], sin[:, None, :]                       # [T, 1, D/2]
    x1, x2 = x.float().chunk(2, dim=-1)                               # [T, H, D/2] each
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def qk_norm_rope_ref(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                     cos_sin_cache: torch.Tensor, q_weight: torch.Tensor | None = None,
                     k_weight: torch.Tensor | None = None, eps: float = 1e-6,
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain torch reference of :func:`qk_norm_rope` (the executable specification).

    Args: as :func:`qk_norm_rope`.

    Returns:
        ``(q_out [T, H_q, D], k_out [T, H_kv, D])`` in the dtypes of ``q`` and ``k``.
    """
    outs = []
    for x, w in ((q, q_weight), (k, k_weight)):
        if w is not None:  # per head: a [T, H, D] tensor is [T * H] rows of D
            x = rms_norm_ref(x.reshape(-1, x.shape[-1]), w, eps).view(x.shape)
        outs.append(rope_ref(x, positions, cos_sin_cache))
    return outs[0], outs[1]


@triton.jit
def _qk_norm(x1, x2, w_ptr, c, c_ok, eps, HALF: tl.constexpr, USE_NORM: tl.constexpr,
             DT: tl.constexpr):
    # [R, BH] fp32 halves of R heads -> RMS-normed over the whole head (weight in fp32),
    # rounded to DT as the unfused norm writes them, back in fp32; unchanged without USE_NORM.
    if USE_NORM:
        rstd = tl.math.rsqrt(row_sum(x1 * x1 + x2 * x2, axis=1) / (2 * HALF) + eps)  # [R]
        w1 = tl.load(w_ptr + c, mask=c_ok, other=0.0).to(tl.float32)             # [BH]
        w2 = tl.load(w_ptr + HALF + c, mask=c_ok, other=0.0).to(tl.float32)
        x1 = ((x1 * rstd[:, None]) * w1[None, :]).to(DT).to(tl.float32)
        x2 = ((x2 * rstd[:, None]) * w2[None, :]).to(DT).to(tl.float32)
    return x1, x2


@triton.jit
def _rotate(x1, x2, cos, sin, DT: tl.constexpr):
    # Rotate-half RoPE of [R, BH] fp32 halves by cos, sin ([1, BH] or [R, BH]), rounded to
    # DT (as qk_norm_rope stores them).
    return (x1 * cos - x2 * sin).to(DT), (x2 * cos + x1 * sin).to(DT)


@triton.jit
def _norm_rope(x1, x2, w_ptr, c, c_ok, cos, sin, eps, HALF: tl.constexpr,
               USE_NORM: tl.constexpr, DT: tl.constexpr):
    # Both at once, for a caller that has its angles already (decode_attention's q and k).
    x1, x2 = _qk_norm_body(x1, x2, w_ptr, c, c_ok, eps, HALF, USE_NORM, DT)
    return _rotate_body(x1, x2, cos, sin, DT)


@triton.jit
def _cache_rows(slot_mapping_ptr, tok, r, row_ok, c, stride_cb, stride_co,
                NUM_HEADS: tl.constexpr, HALF: tl.constexpr, PAGE_SIZE: tl.constexpr):
    # Where rows (token, head) of a tile go in a paged cache [.., blocks, PAGE, H, 2 HALF]
    # (heads and dims packed): offsets [BLOCK_R, BLOCK_HALF] and the rows to write
    # (slot -1: a padding token, nothing written).
    slot = tl.load(slot_mapping_ptr + tok, mask=row_ok, other=-1)             # [BLOCK_R]
    ok = row_ok & (slot >= 0)
    slot = tl.where(ok, slot, 0).to(tl.int64)
    base = (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_co \
        + (r % NUM_HEADS) * (2 * HALF)
    return base[:, None] + c[None, :], ok


@triton.jit
def _norm_rope_heads(x_ptr, out_ptr, w_ptr, positions_ptr, cos_sin_ptr, pid,
                     num_tokens, eps, stride_xt, stride_cp,
                     slot_mapping_ptr, stride_cb, stride_co,
                     NUM_HEADS: tl.constexpr, HALF: tl.constexpr, USE_NORM: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr,
                     TO_CACHE: tl.constexpr, PAGE_SIZE: tl.constexpr):
    # One [BLOCK_R, BLOCK_HALF] tile: its rows are the heads of BLOCK_T tokens, its columns
    # half a head, so x1 and x2 below are the two halves RoPE pairs up.
    r = tl.arange(0, BLOCK_R)                                           # [BLOCK_R]
    tok = pid * BLOCK_T + r // NUM_HEADS
    row_ok = (r < BLOCK_T * NUM_HEADS) & (tok < num_tokens)
    c = tl.arange(0, BLOCK_HALF)                                        # [BLOCK_HALF]
    mask = row_ok[:, None] & (c < HALF)[None, :]                        # [BLOCK_R, BLOCK_HALF]

    # Load both halves of every head (heads and dims are packed within a token).
    src = x_ptr + (tok * stride_xt + (r % NUM_HEADS) * (2 * HALF))[:, None] + c[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)

    # q/k-norm, rounded to the input dtype as the unfused norm's output is before RoPE
    # reads it.
    # NOTE: not _norm_rope (angles first): cos and sin live across the norm's reduction
    # took the USE_NORM kernel from 40 to 48 / 55 (WRITE_KV) registers (Triton 3.6, sm_90).
    dt = x_ptr.dtype.element_ty
    x1, x2 = _qk_norm_body(x1, x2, w_ptr, c, c < HALF, eps, HALF, USE_NORM, dt)

    # The angles: cos and sin are the two halves of the token's cache row.
    if BLOCK_T == 1:  # GPU: one token, one row of angles broadcast over its heads
        cs = cos_sin_ptr + tl.load(positions_ptr + pid) * stride_cp + c[None, :]  # [1, BH]
        cs_mask = (c < HALF)[None, :]
    else:             # interpreter: each row gathers its own token's angles
        pos = tl.load(positions_ptr + tok, mask=row_ok, other=0)        # [BLOCK_R]
        cs = cos_sin_ptr + pos[:, None] * stride_cp + c[None, :]        # [BLOCK_R, BLOCK_HALF]
        cs_mask = mask
    cos = tl.load(cs, mask=cs_mask, other=0.0)
    sin = tl.load(cs + HALF, mask=cs_mask, other=0.0)

    # Rotate, round to the input dtype (as the unfused output is), and store: into the
    # contiguous output (row (token, head) is row r of this tile), or into the token's
    # slot of the paged KV cache, in the cache's dtype.
    y1, y2 = _rotate_body(x1, x2, cos, sin, dt)
    if TO_CACHE:
        off, ok = _cache_rows_body(slot_mapping_ptr, tok, r, row_ok, c, stride_cb, stride_co,
                                   NUM_HEADS, HALF, PAGE_SIZE)
        keep = ok[:, None] & (c < HALF)[None, :]
        tl.store(out_ptr + off, y1.to(out_ptr.dtype.element_ty), mask=keep)
        tl.store(out_ptr + off + HALF, y2.to(out_ptr.dtype.element_ty), mask=keep)
    else:
        dst = out_ptr + (pid * (BLOCK_T * NUM_HEADS) + r)[:, None] * (2 * HALF) + c[None, :]
        tl.store(dst, y1.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF, y2.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _copy_v_heads(v_ptr, cache_ptr, slot_mapping_ptr, pid, num_tokens, stride_vt,
                  stride_cb, stride_co,
                  NUM_HEADS: tl.constexpr, HALF: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_HALF: tl.constexpr, PAGE_SIZE: tl.constexpr):
    # The values of BLOCK_T tokens into their cache slots (the tile layout of the k pass).
    r = tl.arange(0, BLOCK_R)                                           # [BLOCK_R]
    tok = pid * BLOCK_T + r // NUM_HEADS
    row_ok = (r < BLOCK_T * NUM_HEADS) & (tok < num_tokens)
    c = tl.arange(0, BLOCK_HALF)                                        # [BLOCK_HALF]
    src = v_ptr + (tok * stride_vt + (r % NUM_HEADS) * (2 * HALF))[:, None] + c[None, :]
    off, ok = _cache_rows_body(slot_mapping_ptr, tok, r, row_ok, c, stride_cb, stride_co,
                               NUM_HEADS, HALF, PAGE_SIZE)
    keep = ok[:, None] & (c < HALF)[None, :]
    dt = cache_ptr.dtype.element_ty
    tl.store(cache_ptr + off, tl.load(src, mask=keep, other=0.0).to(dt), mask=keep)
    tl.store(cache_ptr + off + HALF, tl.load(src + HALF, mask=keep, other=0.0).to(dt),
             mask=keep)


# NOTE: under the interpreter every call of a @triton.jit helper re-patches triton.language
# (~1.5 ms a call); the kernel calls the helper's plain Python body there (see attention.py).
_qk_norm_body = interpreter_body(_qk_norm)
_rotate_body = interpreter_body(_rotate)
_norm_rope_body = interpreter_body(_norm_rope)
_cache_rows_body = interpreter_body(_cache_rows)
_norm_rope_heads_body = interpreter_body(_norm_rope_heads)
_copy_v_heads_body = interpreter_body(_copy_v_heads)


@triton.jit(do_not_specialize=["num_tokens"])
def _qk_norm_rope_kernel(
    q_ptr, k_ptr, q_weight_ptr, k_weight_ptr, positions_ptr, cos_sin_ptr,   # inputs
    v_ptr, slot_mapping_ptr,                                                # (WRITE_KV)
    q_out_ptr, k_out_ptr,                          # outputs (WRITE_KV: k_out = kv_cache)
    num_tokens, eps,                                                        # sizes
    stride_qt, stride_kt, stride_cp, stride_vt,                             # strides
    stride_ckv, stride_cb, stride_co,                                       # (WRITE_KV)
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HALF: tl.constexpr,
    USE_NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_RQ: tl.constexpr,
    BLOCK_RK: tl.constexpr, BLOCK_HALF: tl.constexpr,
    WRITE_KV: tl.constexpr, PAGE_SIZE: tl.constexpr, PDL: tl.constexpr = False,
):
    # One program, BLOCK_T tokens: first all their q heads, then all their k heads (with
    # WRITE_KV straight into their KV-cache slots, then their v heads beside them).
    # NOTE: with PDL every input may come from the kernel before: wait first, then let the
    # next kernel launch (mrv2/kernels/pdl.py); every program, before any early return.
    if PDL and GDC_CALLS:
        gdc_wait()
        gdc_launch_dependents()
    pid = tl.program_id(0)
    _norm_rope_heads_body(q_ptr, q_out_ptr, q_weight_ptr, positions_ptr, cos_sin_ptr, pid,
                          num_tokens, eps, stride_qt, stride_cp,
                          slot_mapping_ptr, stride_cb, stride_co,
                          NUM_Q_HEADS, HALF, USE_NORM, BLOCK_T, BLOCK_RQ, BLOCK_HALF,
                          False, PAGE_SIZE)
    _norm_rope_heads_body(k_ptr, k_out_ptr, k_weight_ptr, positions_ptr, cos_sin_ptr, pid,
                          num_tokens, eps, stride_kt, stride_cp,
                          slot_mapping_ptr, stride_cb, stride_co,
                          NUM_KV_HEADS, HALF, USE_NORM, BLOCK_T, BLOCK_RK, BLOCK_HALF,
                          WRITE_KV, PAGE_SIZE)
    if WRITE_KV:
        _copy_v_heads_body(v_ptr, k_out_ptr + stride_ckv, slot_mapping_ptr, pid, num_tokens,
                           stride_vt, stride_cb, stride_co,
                           NUM_KV_HEADS, HALF, BLOCK_T, BLOCK_RK, BLOCK_HALF, PAGE_SIZE)


def _check(q, k, positions, cos_sin_cache, q_weight, k_weight) -> None:
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must be [T, H_q, D] "
                         "and [T, H_kv, D]")
    d = q.shape[2]
    if d % 2 or cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != d:
        raise ValueError(f"head_dim {d} must be even and cos_sin_cache [max_position, {d}], "
                         f"got {tuple(cos_sin_cache.shape)}")
    if positions.shape != (q.shape[0],):
        raise ValueError(f"positions must be [{q.shape[0]}], got {tuple(positions.shape)}")
    if (q_weight is None) != (k_weight is None) or \
            (q_weight is not None and (q_weight.shape != (d,) or k_weight.shape != (d,))):
        raise ValueError(f"q_weight and k_weight must both be [{d}] or both None")


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    # The kernel needs heads and dims packed within a token; a token stride is free.
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, q_weight: torch.Tensor | None = None,
                 k_weight: torch.Tensor | None = None, eps: float = 1e-6, *,
                 v: torch.Tensor | None = None, kv_cache: torch.Tensor | None = None,
                 slot_mapping: torch.Tensor | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-head RMSNorm (optional) then RoPE of q and k, in one kernel launch (Triton).

    With ``kv_cache`` the same launch also does ``write_kv_cache``'s work: the rotated
    keys go straight into their slots of the paged cache (no ``k_out``), the values beside
    them; the KV write's own launch disappears.

    Args:
        q: ``[T, H_q, D]`` queries; any token stride (e.g. a view of a fused projection),
            heads and dims packed (otherwise copied first).
        k: ``[T, H_kv, D]`` keys, same rules.
        positions: ``[T]`` integer absolute positions, ``0 <= p < max_position``
            (not checked on the device: no host sync).
        cos_sin_cache: ``[max_position, D]`` fp32, ``cos`` in the first half, ``sin`` in
            the second (``Qwen3RotaryEmbedding.cos_sin_cache``).
        q_weight: ``[D]`` q-norm weight, or ``None`` for no q/k-norm (Llama, Qwen2).
        k_weight: ``[D]`` k-norm weight; ``None`` exactly when ``q_weight`` is.
        eps: the norms' epsilon.
        v: ``[T, H_kv, D]`` values (with ``kv_cache``), same rules as ``k``.
        kv_cache: ``[2, num_blocks, block_size, H_kv, D]`` contiguous, written in place at
            ``slot_mapping`` (as ``mrv2.kernels.kv_cache.write_kv_cache``).
        slot_mapping: ``[T]`` int64 cache slot per token; -1: padding, not written.

    Returns:
        ``(q_out, k_out)``: new contiguous tensors shaped and typed as ``q`` and ``k``;
        with ``kv_cache``, ``(q_out, None)``.
    """
    _check(q, k, positions, cos_sin_cache, q_weight, k_weight)
    write_kv = kv_cache is not None
    if write_kv:
        if v is None or slot_mapping is None:
            raise ValueError("kv_cache needs v and slot_mapping")
        _check_kv(k, v, kv_cache, slot_mapping)
        if not kv_cache.is_contiguous():
            raise ValueError("kv_cache must be contiguous to be written by qk_norm_rope")
        v = _rows_contiguous(v)
    q, k = _rows_contiguous(q), _rows_contiguous(k)
    cos_sin_cache = cos_sin_cache.contiguous()          # a no-op for the model's buffer
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = kv_cache if write_kv else torch.empty(k.shape, dtype=k.dtype, device=k.device)
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads = k.shape[1]
    if num_tokens == 0:                                  # an empty batch launches nothing
        return q_out, None if write_kv else k_out
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    if TRITON_INTERPRET:
        # NOTE: the interpreter pays per program and per op: many tokens per program.
        per_token = triton.next_power_of_2(num_q_heads) * block_half
        block_t, num_warps = max(1, min(num_tokens, 16384 // per_token)), 1
    else:  # one token per program: its q heads, then its k heads, as [heads, D / 2] tiles
        block_t = 1
        num_warps = min(max(triton.next_power_of_2(num_q_heads) * block_half // 256, 1), 8)
    use_norm = q_weight is not None
    cache_strides = kv_cache.stride()[:3] if write_kv else (0, 0, 0)   # kv, block, offset
    use_pdl = pdl.use_pdl(q.device)
    _qk_norm_rope_kernel[(triton.cdiv(num_tokens, block_t),)](
        q, k, q_weight if use_norm else q, k_weight if use_norm else k, positions,
        cos_sin_cache,
        v if write_kv else k, slot_mapping if write_kv else positions,
        q_out, k_out,
        num_tokens, eps,
        q.stride(0), k.stride(0), cos_sin_cache.stride(0), v.stride(0) if write_kv else 0,
        *cache_strides,
        NUM_Q_HEADS=num_q_heads, NUM_KV_HEADS=num_kv_heads, HALF=half, USE_NORM=use_norm,
        BLOCK_T=block_t, BLOCK_RQ=triton.next_power_of_2(block_t * num_q_heads),
        BLOCK_RK=triton.next_power_of_2(block_t * num_kv_heads), BLOCK_HALF=block_half,
        WRITE_KV=write_kv, PAGE_SIZE=kv_cache.shape[2] if write_kv else 1, PDL=use_pdl,
        num_warps=num_warps, **pdl.launch_kwargs(use_pdl),
    )
    return q_out, None if write_kv else k_out
