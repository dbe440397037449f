"""Decode attention with q/k-norm, RoPE and the KV-cache write folded in: one kernel for two.

A decode layer at batch 1 is ~7.5 kernels after the GEMM fusions (``skinny_fused.py``), and
each costs a few microseconds whatever it computes: at 211 kernels a step the step is ~0.9
ms where its bytes take 0.29 (H200, PDL on). Two of a layer's kernels only prepare the third:
``qk_norm_rope`` normalises and rotates q and k and writes k and v into the paged cache, then
``paged_attention`` reads them back. Here one program per (request, KV head, split):

1. loads its GQA group's raw q heads from the qkv projection, applies q-norm and RoPE in
   registers (the halves RoPE pairs up are kept as two tiles: ``q1 @ K1^T + q2 @ K2^T``);
2. walks the cached keys before the new token, with the online softmax of ``attention.py``;
3. the program whose key range holds the new token's position normalises and rotates its
   k, writes k and v into the token's cache slot, and adds the token's score from registers
   (no program reads that slot in this launch; the next step's do).

Only decode steps (one query token per request, ``max_query_len == 1``); prefills, chunks and
speculative steps keep the two kernels. The launch (split count, key tile, warps) is the
decode table's, and the split merge is ``attention.py``'s. Numerics follow the unfused
path: the normed and rotated q/k rounded to the activation dtype, k and v stored in the
cache's, P rounded to V's dtype before P @ V. The new token's score and P V term are fp32
sums of the same rounded values where the unfused path uses ``tl.dot``: not bitwise equal.

On by default since job AB (session 7, H200, ``bench latency``: TPOT off / on at batch 1, 4,
8, 16, 32: 0.894 / 0.902, 1.311 / 1.290, 1.293 / 1.241, 1.412 / 1.324, 1.502 / 1.425 ms; 28
launches a step fewer); ``MRV2_FUSED_ROPE_ATTENTION=0`` turns it off; only for decode steps
of at most ``MAX_TOKENS`` = 32 tokens (at batch 256 it lost, job D). Serve's warm-up
(``Runner.precompile_attention``) also compiles its decode launches
(``attention_warmup.precompile_decode_rope``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from mrv2.forward_context import AttentionMetadata
from mrv2.kernels import attention, pdl
from mrv2.kernels.attention_tile import _LOG2E, prefetch_keys_l2_body
from mrv2.kernels.decode_attention_tile import (
    _attend_key_tile_body,
    _load_key_tile_body,
    _new_token_kv_body,
    _norm_rope_body,
    _request_range_body,
    _token_meta_body,
)
from mrv2.kernels.kv_cache import write_kv_cache
from mrv2.kernels.layernorm import row_sum
from mrv2.kernels.pdl import GDC_CALLS
from mrv2.kernels.rotary import qk_norm_rope_ref
from mrv2.platform import TRITON_INTERPRET, env_switch

#: On a GPU unless ``MRV2_FUSED_ROPE_ATTENTION=0``; never under the interpreter (tests set it).
ENABLED: bool = (not TRITON_INTERPRET and torch.cuda.is_available()
                 and env_switch("MRV2_FUSED_ROPE_ATTENTION", True))


#: Fold the split merge into the attention kernel (the last split of a token's KV head merges
#: them all; no merge launch). OFF unless ``MRV2_FOLD_SPLIT_MERGE=1``: its GPU tests pass
#: (session 9, job B) but it is slower (TPOT b4 1.030 -> 1.217 ms, b1 unchanged, one job):
#: the atomics and the last split's extra pass cost more than the launch. NOTE: merging in
#: the consumer lost too (7845af1, reverted: each o_proj program merged the parts of its x):
#: TPOT b1 0.90 -> 1.00 ms, b2 1.02 -> 1.18 (``bench_latency_merge-in-o-proj-*_job14B.json``).
FOLD_MERGE: bool = env_switch("MRV2_FOLD_SPLIT_MERGE", False)

#: Load each program's first cached key tile BEFORE the PDL wait, for steps of at most
#: ``PREFETCH_MAX_REQS`` requests (``MRV2_ATTENTION_PREFETCH=0`` turns it off): the lesson of
#: ``skinny_stream`` (a program's bytes in flight while the kernel before it ends) applied
#: to attention, whose cached keys no kernel of the current step writes. At batch 1 and
#: short contexts each split is one tile, so all its keys are in flight. H200, ``bench
#: latency``, fresh processes taking turns (job 16A): TPOT off / on b1 0.836 / 0.717 ms, b2
#: 0.920 / 0.881, b8 1.096 / 1.062, b32 1.405 / 1.444 (two tiles a program, the first held in
#: registers through the wait). The bound (job 18F): up to 8 / 16 / 32 requests, TPOT b16
#: 1.196 / 1.127 / 1.124 ms, b24 1.355 / 1.346 / 1.378, b32 1.406 / 1.420 / 1.454: 16.
PREFETCH: bool = env_switch("MRV2_ATTENTION_PREFETCH", True)
PREFETCH_MAX_REQS = 32   # 16 until qkv was staged to 32 rows (small_m_staged.KIND_MAX_M)

#: With ``MRV2_ATTENTION_PREFETCH_L2=1`` (opt-in), steps of at least ``PREFETCH_L2_MIN_REQS``
#: requests bring every cached row a program reads into L2 before the wait (``attention_tile.
#: prefetch_keys_l2``; no register holds them, where ``PREFETCH``'s lost at 17-32). It did not
#: pay (H100, job 25X: TPOT b24 / b32 1.378 / 1.504 -> 1.398 / 1.501 ms; b4 0.903 -> 0.991 from
#: 1 request). PTX only.
PREFETCH_L2: bool = env_switch("MRV2_ATTENTION_PREFETCH_L2", False)
PREFETCH_L2_MIN_REQS = 17


def prefetch_l2(num_reqs: int) -> bool:
    """Whether a launch of ``num_reqs`` requests prefetches its keys into L2 (host ints)."""
    return PREFETCH_L2 and not TRITON_INTERPRET and num_reqs >= PREFETCH_L2_MIN_REQS


#: The most decode tokens a step sends here. NOTE: at batch 256 it lost (job D, standard
#: workload: 24,907 tok/s with it, 25,244 without; ``bench decode`` b256 GPU 3.07 ms a step),
#: while it won at 4-32 (job AB): larger batches keep the two kernels.
MAX_TOKENS = 32


#: One request (batch 1): at most 32 splits of 64-key tiles, whatever the decode table says.
#: In-model TPOT (session 8, H200, max_model_len 4352, one job; the table's choice there is 16
#: splits of 128 keys): 1.038 -> 0.920 ms at a 128-token prompt, 1.063 -> 1.032 at 3,968; at
#: max_model_len 256 (``bench latency``) both give 4 splits of 64 (the cap below). The table
#: was swept one kernel at a time; in the model, with PDL, more and shorter splits win at b1
#: (16 x 16 keys won at short contexts, 1.67 ms at long ones: 64 keys is the compromise).
ONE_REQUEST_LAUNCH = {"num_splits": 32, "block_n": 64}


#: Short contexts (``max_seq_len`` below ``SHORT_CONTEXT``: the table's 128 and 256 rows),
#: by request count ``(lo, hi)``: more, shorter splits than the table's (swept one kernel at
#: a time: 1 split of 64-128 keys). In the model, with PDL, they won (H200, Qwen3-0.6B shape,
#: ``bench latency`` at max_model_len 256 through ``scripts/bench_with.py --decode-launch``,
#: table / this, two rounds in one job, 15A): batch 8 1.144 / 1.099 and 1.144 / 1.098 ms,
#: batch 24 1.384 / 1.356 and 1.379 / 1.335, batch 32 1.422 / 1.407 and 1.421 / 1.404. Batch
#: 16 gained nothing (2 or 4 splits: 1.195, 1.191 vs 1.190-1.205, job 15B), so 16 keeps the
#: table's; 5-7 and 9-15 (and 17-23, 25-31) take their measured neighbour's rule unmeasured.
SHORT_CONTEXT = 512
SHORT_CONTEXT_LAUNCH: dict[tuple[int, int], dict] = {
    (5, 15): {"num_splits": 4, "block_n": 64}, (17, 32): {"num_splits": 2, "block_n": 64}}


def pick_config(num_reqs: int, num_kv_heads: int, group_pad: int, max_query_len: int,
                max_seq_len: int, block_d: int = 128) -> dict:
    """This kernel's launch: ``attention._pick_config``'s decode choice, except on the GPU
    one request takes ``ONE_REQUEST_LAUNCH`` and short contexts ``SHORT_CONTEXT_LAUNCH``
    (splits capped at the key tiles of ``max_seq_len``). Host ints only (graph-safe); the
    serve warm-up walks it too."""
    cfg = attention._pick_config(num_reqs, num_kv_heads, group_pad, max_query_len,
                                 max_seq_len, block_d)
    if attention.TRITON_INTERPRET:
        return cfg
    launch = ONE_REQUEST_LAUNCH if num_reqs == 1 else None
    if max_seq_len < SHORT_CONTEXT:
        launch = next((v for (lo, hi), v in SHORT_CONTEXT_LAUNCH.items()
                       if lo <= num_reqs <= hi), launch)
    if launch is not None:
        tiles = triton.cdiv(max(max_seq_len, 1), launch["block_n"])
        attention.override_launch(cfg, {**launch, "num_splits": min(launch["num_splits"], tiles)})
    if max_query_len == 1:  # a partition rule of this batch wins over both (its own rows)
        attention.partition_launch(cfg, num_reqs, max_seq_len)
    return cfg


def use_fused_rope_attention(qkv: torch.Tensor, md: AttentionMetadata) -> bool:
    """Whether a step takes this kernel: on, a decode step of at most ``MAX_TOKENS`` tokens,
    qkv on the GPU (or interpreted). Host ints only: graph- and sync-safe."""
    return (ENABLED and md.max_query_len == 1 and qkv.shape[0] <= MAX_TOKENS
            and (qkv.is_cuda or TRITON_INTERPRET))


def decode_rope_attention_ref(qkv, positions, cos_sin_cache, q_weight, k_weight, eps,
                              kv_cache, md, scale, num_heads, num_kv_heads):
    """Reference of :func:`decode_rope_attention`: ``qk_norm_rope_ref``, ``write_kv_cache``,
    then ``paged_attention_ref`` (the two kernels it replaces, in torch). Writes the cache.

    Returns:
        ``[T, H, D]`` attention output in qkv's dtype.
    """
    T = qkv.shape[0]
    d = kv_cache.shape[-1]
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q, k = qk_norm_rope_ref(q.reshape(T, num_heads, d), k.reshape(T, num_kv_heads, d),
                            positions, cos_sin_cache, q_weight, k_weight, eps)
    write_kv_cache(k, v.reshape(T, num_kv_heads, d), kv_cache, md.slot_mapping)
    return attention.paged_attention_ref(q, kv_cache, md, scale)


@triton.jit
def _decode_rope_attention_kernel(
    qkv_ptr, q_w_ptr, k_w_ptr, positions_ptr, cos_sin_ptr, slot_mapping_ptr,  # inputs
    block_table_ptr, query_start_loc_ptr, seq_lens_ptr,
    kv_cache_ptr, out_ptr, part_acc_ptr, part_ml_ptr, counter_ptr,            # outputs
    qk_scale, eps,                                                            # sizes
    stride_xt, stride_cp, stride_ckv, stride_cb, stride_co, stride_ch, stride_bt,  # strides
    stride_ot, stride_oh, stride_pt, stride_ph, stride_ps, stride_mt, stride_mh, stride_ms,
    NUM_Q_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, GROUP: tl.constexpr,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, USE_NORM: tl.constexpr,
    PAGE_SIZE: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, DOT_PRECISION: tl.constexpr, PDL: tl.constexpr = False,
    FOLD_MERGE: tl.constexpr = False, BLOCK_S: tl.constexpr = 1,
    PREFETCH: tl.constexpr = False, PART_TILES: tl.constexpr = 0,
    PREFETCH_L2: tl.constexpr = False, LINE: tl.constexpr = 64, LINES: tl.constexpr = 2,
    EARLY_META: tl.constexpr = False,
):
    # Program = (request, KV head x split of the keys). Request b decodes token t.
    b = tl.program_id(0)
    kh = tl.program_id(1) // NUM_SPLITS
    split = tl.program_id(1) % NUM_SPLITS
    dt = qkv_ptr.dtype.element_ty
    c = tl.arange(0, BLOCK_HALF)                                        # [BH] half a head
    c_ok = c < HALF
    if PREFETCH or PREFETCH_L2 or EARLY_META:
        t, q_len, seq_len, lo, hi, kv_hi = _request_range_body(
            query_start_loc_ptr, seq_lens_ptr, split, NUM_SPLITS, BLOCK_N, ".cg", PART_TILES)
    if EARLY_META:  # the token's angles and slot too (attention.EARLY_META): step metadata
        cos, sin, slot = _token_meta_body(positions_ptr, cos_sin_ptr, slot_mapping_ptr, t,
                                          q_len > 0, stride_cp, c, c_ok, HALF, ".cg")
    if PREFETCH:
        # The step's metadata and the first cached key tile BEFORE the wait. None of it comes
        # from the kernel right before this one (qkv): the metadata from the input prep at
        # the step's start, the cached keys from earlier steps (this launch writes only the
        # new token's slot, which it does not read). Every kernel up to the one before that
        # has completed once this one runs (the one before passed its own wait first, or
        # was launched without PDL), so L2 holds their writes. NOTE: ".cg" loads, through
        # L2 only: an SM's L1 could still hold a line of the previous step's metadata.
        # NOTE: a padding row (no token) masks every key.
        k1_0, k2_0, v1_0, v2_0, n_ok_0 = _load_key_tile_body(
            lo, tl.where(q_len > 0, kv_hi, 0), b, kv_cache_ptr, block_table_ptr, kh, c, c_ok,
            stride_ckv, stride_cb, stride_co, stride_ch, stride_bt, HALF, PAGE_SIZE, BLOCK_N,
            ".cg")
    if PREFETCH_L2:
        # The rest of the range's cached rows into L2 (all of it without PREFETCH): bytes in
        # flight while the qkv GEMM ends, no register holding them through the wait.
        prefetch_keys_l2_body(
            lo + BLOCK_N if PREFETCH else lo, tl.where(q_len > 0, kv_hi, 0), b, kv_cache_ptr,
            block_table_ptr, kh, stride_ckv, stride_cb, stride_co, stride_ch, stride_bt,
            PAGE_SIZE, BLOCK_N, LINE, LINES)
    # NOTE: with PDL the kernel before wrote qkv (and, without PREFETCH, may have written any
    # input): wait, then let the next kernel launch (mrv2/kernels/pdl.py); every program,
    # before any early return.
    if PDL and GDC_CALLS:
        gdc_wait()
        gdc_launch_dependents()
    if not (PREFETCH or PREFETCH_L2 or EARLY_META):
        t, q_len, seq_len, lo, hi, kv_hi = _request_range_body(
            query_start_loc_ptr, seq_lens_ptr, split, NUM_SPLITS, BLOCK_N, "", PART_TILES)
    if q_len <= 0:  # graph padding: no token
        return
    new_pos = seq_len - 1                               # the new token's key index
    has_new = (new_pos >= lo) & (new_pos < hi)          # this program adds it (step 3)
    if not EARLY_META:
        cos, sin, slot = _token_meta_body(positions_ptr, cos_sin_ptr, slot_mapping_ptr, t,
                                          q_len > 0, stride_cp, c, c_ok, HALF, "")

    # 1. The group's q heads (rows), normed and rotated, as the two halves RoPE pairs.
    m = tl.arange(0, BLOCK_M)                                           # [BM]
    row_ok = m < GROUP
    head = kh * GROUP + m
    q_ptrs = qkv_ptr + t * stride_xt + head[:, None] * (2 * HALF) + c[None, :]
    q_mask = row_ok[:, None] & c_ok[None, :]                            # [BM, BH]
    q1, q2 = _norm_rope_body(tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32),
                             tl.load(q_ptrs + HALF, mask=q_mask, other=0.0).to(tl.float32),
                             q_w_ptr, c, c_ok, cos, sin, eps, HALF, USE_NORM, dt)
    kv_dt = kv_cache_ptr.dtype.element_ty
    q1, q2 = q1.to(kv_dt), q2.to(kv_dt)                                 # tl.dot: one dtype
    if EARLY_META:  # the new token's raw k and v in flight beside q's, not after the loop
        # NOTE: k_1 .. v_2, not k1 .. v2: the key loop below reuses those names
        k_1, k_2, v_1, v_2 = _new_token_kv_body(qkv_ptr, t, kh, stride_xt, c, has_new,
                                                NUM_Q_HEADS, NUM_KV_HEADS, HALF)

    # 2. The cached keys of this split's range, below the new token.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_M, BLOCK_HALF], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_M, BLOCK_HALF], dtype=tl.float32)
    first = lo
    if PREFETCH:
        if lo < kv_hi:
            acc1, acc2, m_i, l_i = _attend_key_tile_body(
                acc1, acc2, m_i, l_i, q1, q2, k1_0, k2_0, v1_0, v2_0, n_ok_0, qk_scale,
                DOT_PRECISION)
        first = lo + BLOCK_N
    for start in range(first, kv_hi, BLOCK_N):
        k1, k2, v1, v2, n_ok = _load_key_tile_body(
            start, kv_hi, b, kv_cache_ptr, block_table_ptr, kh, c, c_ok, stride_ckv, stride_cb,
            stride_co, stride_ch, stride_bt, HALF, PAGE_SIZE, BLOCK_N, "")
        acc1, acc2, m_i, l_i = _attend_key_tile_body(
            acc1, acc2, m_i, l_i, q1, q2, k1, k2, v1, v2, n_ok, qk_scale, DOT_PRECISION)

    # 3. The new token, in the program whose range holds it: k-norm + RoPE, the cache
    # write, and its score and value straight from registers.
    if has_new:
        if not EARLY_META:
            k_1, k_2, v_1, v_2 = _new_token_kv_body(qkv_ptr, t, kh, stride_xt, c, has_new,
                                                    NUM_Q_HEADS, NUM_KV_HEADS, HALF)
        k1, k2 = _norm_rope_body(k_1.to(tl.float32), k_2.to(tl.float32), k_w_ptr, c, c_ok,
                                 cos, sin, eps, HALF, USE_NORM, dt)
        k1, k2, v1, v2 = k1.to(kv_dt), k2.to(kv_dt), v_1.to(kv_dt), v_2.to(kv_dt)  # [1, BH]
        if slot >= 0:
            dst = (kv_cache_ptr + (slot // PAGE_SIZE) * stride_cb + (slot % PAGE_SIZE) * stride_co
                   + kh * stride_ch + c[None, :])
            tl.store(dst, k1, mask=c_ok[None, :])
            tl.store(dst + HALF, k2, mask=c_ok[None, :])
            tl.store(dst + stride_ckv, v1, mask=c_ok[None, :])
            tl.store(dst + stride_ckv + HALF, v2, mask=c_ok[None, :])
        s_new = (row_sum(q1.to(tl.float32) * k1.to(tl.float32), axis=1)
                 + row_sum(q2.to(tl.float32) * k2.to(tl.float32), axis=1)) * qk_scale  # [BM]
        m_new = tl.maximum(m_i, s_new)
        alpha = tl.exp2(m_i - m_new)
        p_new = tl.exp2(s_new - m_new)                                  # [BM]
        l_i = l_i * alpha + p_new
        p_r = p_new.to(kv_dt).to(tl.float32)[:, None]                   # as P @ V rounds P
        acc1 = acc1 * alpha[:, None] + p_r * v1.to(tl.float32)
        acc2 = acc2 * alpha[:, None] + p_r * v2.to(tl.float32)
        m_i = m_new

    odt = out_ptr.dtype.element_ty
    o_ptrs = out_ptr + t * stride_ot + head[:, None] * stride_oh + c[None, :]
    if NUM_SPLITS == 1:
        inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
        tl.store(o_ptrs, (acc1 * inv[:, None]).to(odt), mask=q_mask)
        tl.store(o_ptrs + HALF, (acc2 * inv[:, None]).to(odt), mask=q_mask)
    else:  # this split's unnormalised sums and (max, sum), for the merge
        p_ptrs = part_acc_ptr + t * stride_pt + head[:, None] * stride_ph + split * stride_ps \
            + c[None, :]
        tl.store(p_ptrs, acc1, mask=q_mask)
        tl.store(p_ptrs + HALF, acc2, mask=q_mask)
        ml_ptr = part_ml_ptr + t * stride_mt + head * stride_mh + split * stride_ms
        tl.store(ml_ptr, m_i, mask=row_ok)
        tl.store(ml_ptr + 1, l_i, mask=row_ok)
        if FOLD_MERGE:
            # The merge folded in: the last of the (token, KV head)'s NUM_SPLITS programs to
            # count itself in merges every split (no merge kernel). NOTE: the barrier puts
            # every thread's partial stores before thread 0's acq_rel atomic (release); the
            # last program's loads come after its acquire (Triton broadcasts the count
            # through shared memory behind a barrier) and bypass L1 (.cg): another program
            # wrote them. The last program sets the counter back to 0 for the next launch.
            tl.debug_barrier()
            cnt_ptr = counter_ptr + t * NUM_KV_HEADS + kh
            if tl.atomic_add(cnt_ptr, 1, sem="acq_rel", scope="gpu") == NUM_SPLITS - 1:
                sp = tl.arange(0, BLOCK_S)                                  # [BS]
                ml_all = part_ml_ptr + t * stride_mt + head[:, None] * stride_mh \
                    + sp[None, :] * stride_ms                               # [BM, BS]
                ml_ok = row_ok[:, None] & (sp < NUM_SPLITS)[None, :]
                m_s = tl.load(ml_all, mask=ml_ok, other=-1.0e30, cache_modifier=".cg")
                l_s = tl.load(ml_all + 1, mask=ml_ok, other=0.0, cache_modifier=".cg")
                m_tot = tl.max(m_s, 1)                                      # [BM]
                l_tot = tl.sum(l_s * tl.exp2(m_s - m_tot[:, None]), 1)      # [BM]
                o1 = tl.zeros([BLOCK_M, BLOCK_HALF], dtype=tl.float32)
                o2 = tl.zeros([BLOCK_M, BLOCK_HALF], dtype=tl.float32)
                for j in range(NUM_SPLITS):
                    w = tl.exp2(tl.load(part_ml_ptr + t * stride_mt + head * stride_mh
                                        + j * stride_ms, mask=row_ok, other=-1.0e30,
                                        cache_modifier=".cg") - m_tot)[:, None]  # [BM, 1]
                    a_ptrs = part_acc_ptr + t * stride_pt + head[:, None] * stride_ph \
                        + j * stride_ps + c[None, :]
                    o1 += tl.load(a_ptrs, mask=q_mask, other=0.0, cache_modifier=".cg") * w
                    o2 += tl.load(a_ptrs + HALF, mask=q_mask, other=0.0,
                                  cache_modifier=".cg") * w
                inv = 1.0 / tl.where(l_tot > 0, l_tot, 1.0)
                tl.store(o_ptrs, (o1 * inv[:, None]).to(odt), mask=q_mask)
                tl.store(o_ptrs + HALF, (o2 * inv[:, None]).to(odt), mask=q_mask)
                tl.store(cnt_ptr, 0)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _merge_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of at least ``n`` counters (one per token x KV head) that every
    folded launch leaves zeroed again. Allocated outside CUDA-graph capture only: a buffer
    from a graph's private pool would go with the graph (capture runs warm-ups first)."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("decode_rope_attention's merge counters must be allocated "
                               "before CUDA-graph capture: run the launch once eagerly first")
        buf = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


def decode_rope_attention(qkv: torch.Tensor, positions: torch.Tensor,
                          cos_sin_cache: torch.Tensor, q_weight: torch.Tensor | None,
                          k_weight: torch.Tensor | None, eps: float, kv_cache: torch.Tensor,
                          md: AttentionMetadata, scale: float, num_heads: int,
                          num_kv_heads: int, out: torch.Tensor | None = None, *,
                          config: dict | None = None) -> torch.Tensor:
    """q/k-norm + RoPE + KV write + attention of a decode step, in one kernel (Triton).

    Args:
        qkv: ``[T, (H + 2 H_kv) D]`` the qkv projection's output (raw q, k, v), last dim
            contiguous; one token per request (``md.max_query_len == 1``).
        positions: ``[T]`` the tokens' positions (the RoPE angles' rows).
        cos_sin_cache: ``[max_position, D]`` fp32 (``Qwen3RotaryEmbedding.cos_sin_cache``).
        q_weight, k_weight: ``[D]`` q/k-norm weights, or both ``None`` (Llama, Qwen2).
        eps: the norms' epsilon.
        kv_cache: ``[2, num_blocks, block_size, H_kv, D]`` contiguous: the tokens' k and v
            are written at ``md.slot_mapping``.
        md: the step's attention metadata; scale: softmax scale.
        num_heads, num_kv_heads: H and H_kv.
        out: optional ``[T, H, D]`` output; config: launch overrides (``num_splits``,
            ``block_n``, ``num_warps``, ``num_stages``).

    Returns:
        ``out`` (new when not given): rows of padding tokens are left as they were.
    """
    T, width = qkv.shape
    d = kv_cache.shape[-1]
    if md.max_query_len != 1:
        raise ValueError(f"decode_rope_attention is for decode steps (max_query_len 1), got "
                         f"max_query_len {md.max_query_len}")
    if width != (num_heads + 2 * num_kv_heads) * d or qkv.stride(1) != 1 or d % 2 \
            or num_heads % num_kv_heads or kv_cache.shape[3] != num_kv_heads:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not fit {num_heads} q heads, "
                         f"{num_kv_heads} KV heads of the cache {tuple(kv_cache.shape)}")
    if (q_weight is None) != (k_weight is None) or not kv_cache.is_contiguous():
        raise ValueError("q_weight and k_weight must both be given or both None, and "
                         "kv_cache contiguous")
    out = torch.empty(T, num_heads, d, dtype=qkv.dtype, device=qkv.device) if out is None \
        else out
    num_reqs = md.num_reqs
    if T == 0 or num_reqs == 0:
        return out
    group = num_heads // num_kv_heads
    block_half = max(16, triton.next_power_of_2(d // 2))
    cfg = pick_config(num_reqs, num_kv_heads, triton.next_power_of_2(group), 1, md.max_seq_len,
                      2 * block_half)
    cfg = attention.override_launch(cfg, config or {})
    splits = cfg["num_splits"]
    part_acc, part_ml = attention.split_buffers(out, splits)
    use_norm = q_weight is not None
    fp32 = qkv.dtype == torch.float32 or kv_cache.dtype == torch.float32
    use_pdl = pdl.use_pdl(qkv.device)
    cos_sin_cache = cos_sin_cache.contiguous()
    opts = ({} if TRITON_INTERPRET else {"num_warps": cfg["num_warps"],
                                          "num_stages": cfg["num_stages"]})
    fold = FOLD_MERGE and splits > 1
    counters = _merge_counters(qkv.device, T * num_kv_heads) if fold else md.seq_lens
    _decode_rope_attention_kernel[(num_reqs, num_kv_heads * splits)](
        qkv, q_weight if use_norm else qkv, k_weight if use_norm else qkv, positions,
        cos_sin_cache, md.slot_mapping, md.block_table, md.query_start_loc, md.seq_lens,
        kv_cache, out, part_acc, part_ml, counters,
        scale * _LOG2E, float(eps),
        qkv.stride(0), cos_sin_cache.stride(0), *kv_cache.stride()[:4],
        md.block_table.stride(0), out.stride(0), out.stride(1),
        *part_acc.stride()[:3], *part_ml.stride()[:3],
        NUM_Q_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group, HALF=d // 2,
        BLOCK_HALF=block_half, USE_NORM=use_norm, PAGE_SIZE=kv_cache.shape[2],
        NUM_SPLITS=splits, BLOCK_M=max(16, triton.next_power_of_2(group)),
        BLOCK_N=cfg["block_n"], DOT_PRECISION="ieee" if fp32 else "tf32", PDL=use_pdl,
        FOLD_MERGE=fold, BLOCK_S=triton.next_power_of_2(splits),
        PREFETCH=PREFETCH and num_reqs <= PREFETCH_MAX_REQS,
        PART_TILES=cfg["part_tiles"], PREFETCH_L2=prefetch_l2(num_reqs),
        EARLY_META=attention.early_meta(num_reqs, decode=True),
        LINE=128 // kv_cache.element_size(), LINES=triton.cdiv(d * kv_cache.element_size(), 128),
        **opts, **pdl.launch_kwargs(use_pdl))
    if splits > 1 and not fold:
        attention.merge_splits(part_acc, part_ml, md, out, use_pdl)
    return out
