"""Verification of draft tokens on the device: ``exact`` and ``probabilistic``, no CPU sync.

A speculating request b schedules 1 + K tokens: its last known token at position
``p_b`` (``base_positions[b]``) and K drafts. Row j of its ``K + 1`` logits rows
(``logits[b * (K + 1) + j]``) follows the token at position ``p_b + j``: it is the
distribution of the token at absolute position ``p_b + j + 1``.

- ``exact``: the target samples every row exactly as the non-speculative sampler would
  (top-k / top-p / min-p mask, then Gumbel-max with the stateless (seed, position,
  vocab id) noise of ``kernels/gumbel.py``; greedy rows take the argmax). Drafts are
  accepted while they equal those samples; the output is the accepted drafts then the
  target's sample at the first mismatch (or the bonus sample after K accepted). So a
  seeded request returns, token for token, what it returns without speculation.
- ``probabilistic`` (Leviathan et al. 2023, Chen et al. 2023): draft x at row j is
  accepted with probability ``min(1, p(x) / q(x))``, p the filtered target
  distribution, q the draft's (``draft_probs``, or a point mass at x for n-gram
  drafts); the first rejected row samples from ``max(p - q, 0)`` (normalised), the row
  after K accepted drafts from p. The acceptance uniform and the residual's Gumbel
  noise come from streams 1 and 2 of the same stateless hash (stream 0 is the noise
  the target and a coupled draft model sample with), so verification never reuses the
  noise that drew the drafts (vLLM once did, and its outputs were biased).

Every row is verified in parallel; a small ``_accept_kernel`` then finds, per request,
the first row that is not accepted and writes ``output_token_ids [B, K + 1]`` (-1
padded), ``num_output_tokens`` and ``num_accepted``. Everything is read through
``idx_mapping``. See notebooks/09_speculative_decoding.ipynb.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from mrv2.kernels.gumbel import gumbel_sample, gumbel_sample_ref
from mrv2.kernels.gumbel_noise import (
    GREEDY_TEMPERATURE,
    _hash_words,
    _launch_options,
    _log_ref,
    _logf,
    _mix32,
    _mix32_ref,
    _row_keys,
    _row_keys_ref,
    _words_to_gumbel,
    key_words_ref,
    words_to_gumbel_ref,
)
from mrv2.kernels.top_k_top_p import apply_top_k_top_p_min_p, apply_top_k_top_p_min_p_ref
from mrv2.platform import TRITON_INTERPRET

#: Stream salts: stream s >= 1 keys are (mix(k1 ^ S1[s]), mix(k2 ^ S2[s])) of stream 0's keys.
STREAM_ACCEPT, STREAM_RESIDUAL = 1, 2
_SALT = {1: (0x632BE5AB, 0xD1B54A33), 2: (0x2545F491, 0x94D049BB)}
_FLT_MIN_F = 2.0 ** -126
_GREEDY_T: tl.constexpr = tl.constexpr(GREEDY_TEMPERATURE)
_FLT_MIN: tl.constexpr = tl.constexpr(_FLT_MIN_F)
_INT32_MAX: tl.constexpr = tl.constexpr(2**31 - 1)
_A1: tl.constexpr = tl.constexpr(_SALT[1][0])
_A2: tl.constexpr = tl.constexpr(_SALT[1][1])
_R1: tl.constexpr = tl.constexpr(_SALT[2][0])
_R2: tl.constexpr = tl.constexpr(_SALT[2][1])
_TWO_M23: tl.constexpr = tl.constexpr(2.0 ** -23)


class VerifyOutput(NamedTuple):
    output_token_ids: torch.Tensor   # [B, K + 1] int32, -1 padded
    num_output_tokens: torch.Tensor  # [B] int32, num_accepted + 1
    num_accepted: torch.Tensor       # [B] int32
    sampled: torch.Tensor            # [B * (K + 1)] int64: each row's own sample


# --- the verification RNG streams (torch reference) -----------------------------------

def _stream_keys_ref(seed: torch.Tensor, pos: torch.Tensor, stream: int):
    k1, k2 = _row_keys_ref(seed, pos)
    s1, s2 = _SALT[stream]
    return _mix32_ref(k1 ^ s1), _mix32_ref(k2 ^ s2)


def accept_uniform_ref(seed: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """Stream 1: the acceptance uniform of each row, ``(2k + 1) / 2**24`` in (0, 1).

    Args:
        seed, pos: ``[N]`` int64 (pos: the absolute position the row samples).

    Returns:
        ``[N]`` float32, bit-identical to the kernel's.
    """
    hi, _ = key_words_ref(*_stream_keys_ref(seed, pos, STREAM_ACCEPT), 1)
    return ((hi[:, 0] >> 9).to(torch.float32) + 0.5) * 2.0 ** -23


def residual_noise_ref(seed: torch.Tensor, pos: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Stream 2: the Gumbel noise ``[N, V]`` of the residual / bonus sample."""
    keys = _stream_keys_ref(seed, pos, STREAM_RESIDUAL)
    return words_to_gumbel_ref(*key_words_ref(*keys, vocab_size))


# --- kernels ------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["num_reqs", "num_spec"])
def _accept_kernel(
    draft_ptr, sampled_ptr, accepted_ptr,                       # inputs
    out_ptr, num_out_ptr, num_acc_ptr,                          # outputs
    num_reqs, num_spec,                                         # sizes
    draft_stride, out_stride,                                   # strides
    EXACT: tl.constexpr, BLOCK_B: tl.constexpr, BLOCK_K1: tl.constexpr,
):
    # Load the [BLOCK_B, K + 1] drafts and row samples of BLOCK_B requests.
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)                     # [BB]
    j = tl.arange(0, BLOCK_K1)                                                 # [K1]
    b_mask = b < num_reqs
    in_draft = b_mask[:, None] & (j < num_spec)[None, :]
    in_out = b_mask[:, None] & (j <= num_spec)[None, :]
    row = b[:, None].to(tl.int64) * (num_spec + 1) + j[None, :]                # [BB, K1]
    d = tl.load(draft_ptr + b[:, None].to(tl.int64) * draft_stride + j[None, :],
                mask=in_draft, other=-1)
    t = tl.load(sampled_ptr + row, mask=in_out, other=-1).to(tl.int32)
    # A row is accepted when its draft equals the target's sample (exact) or passed the test.
    if EXACT:
        ok = in_draft & (d == t) & (d >= 0)
    else:
        ok = in_draft & (tl.load(accepted_ptr + row, mask=in_draft, other=0) != 0)
    # The first row not accepted (at most K: the bonus row) takes the row's own sample.
    a = tl.min(tl.where(ok, BLOCK_K1, j[None, :]), axis=1)                    # [BB]
    out = tl.where(j[None, :] < a[:, None], d, tl.where(j[None, :] == a[:, None], t, -1))
    tl.store(out_ptr + b[:, None].to(tl.int64) * out_stride + j[None, :], out, mask=in_out)
    tl.store(num_out_ptr + b, a + 1, mask=b_mask)
    tl.store(num_acc_ptr + b, a, mask=b_mask)


@triton.jit(do_not_specialize=["num_rows", "num_spec", "vocab_size"])
def _probabilistic_kernel(
    logits_ptr, draft_probs_ptr, draft_ptr, idx_mapping_ptr, base_pos_ptr,    # inputs
    temperature_ptr, seed_ptr,
    accepted_ptr, sampled_ptr,                                                # outputs
    num_rows, num_spec, vocab_size,                                           # sizes
    logits_stride, q_stride, draft_stride,                                    # strides
    HAS_Q: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_V: tl.constexpr,
):
    # Stage 1: per-row knobs. Row i is position j of request b; it samples position p_b + j + 1.
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)                 # [BR]
    r_mask = rows < num_rows
    b = rows // (num_spec + 1)
    j = rows % (num_spec + 1)
    req = tl.load(idx_mapping_ptr + b, mask=r_mask, other=0).to(tl.int64)
    temp = tl.load(temperature_ptr + req, mask=r_mask, other=1.0)
    greedy = temp < _GREEDY_T
    safe_t = tl.where(greedy, 1.0, temp)
    seed = tl.load(seed_ptr + req, mask=r_mask, other=0).to(tl.int64)
    pos = tl.load(base_pos_ptr + b, mask=r_mask, other=0).to(tl.int64) + j + 1
    is_draft = r_mask & (j < num_spec)
    x = tl.load(draft_ptr + b.to(tl.int64) * draft_stride + j, mask=is_draft, other=-1)
    is_draft = is_draft & (x >= 0)
    row_ptr = logits_ptr + rows[:, None].to(tl.int64) * logits_stride         # [BR, 1]
    q_row = rows - b                      # = b * K + j, the draft-probs row
    cols0 = tl.arange(0, BLOCK_V)
    # Stage 2: max (and argmax, lowest id) of s = logits / T; then Z = sum(exp(s - m)).
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    amax = tl.zeros([BLOCK_R], dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + cols0
        mask = r_mask[:, None] & (cols < vocab_size)[None, :]
        s = tl.math.div_rn(tl.load(row_ptr + cols[None, :], mask=mask,
                                   other=float("-inf")).to(tl.float32),
                           safe_t[:, None])                                  # [BR, BV]
        bm = tl.max(s, axis=1)
        bi = tl.min(tl.where(s == bm[:, None], cols[None, :], _INT32_MAX), axis=1)
        amax = tl.where(bm > m, bi, amax)
        m = tl.maximum(m, bm)
    # NOTE: a padding row (or a row of -inf) would give -inf - -inf = nan: shift by 0 there.
    m = tl.where(m > float("-inf"), m, 0.0)
    z = tl.zeros([BLOCK_R], dtype=tl.float32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + cols0
        mask = r_mask[:, None] & (cols < vocab_size)[None, :]
        s = tl.math.div_rn(tl.load(row_ptr + cols[None, :], mask=mask,
                                   other=float("-inf")).to(tl.float32),
                           safe_t[:, None])
        z += tl.sum(tl.exp(s - m[:, None]), axis=1)
    z = tl.where(z > 0.0, z, 1.0)
    # Stage 3: sample argmax(log r + g) (r = max(p - q, 0), g from stream 2), and
    # argmax(log p + g) for a row whose residual is empty.
    k1, k2 = _row_keys(seed, pos)
    k1r = _mix32(k1 ^ _R1)
    k2r = _mix32(k2 ^ _R2)
    best_r = tl.full([BLOCK_R], float("-inf"), tl.float32)
    best_p = tl.full([BLOCK_R], float("-inf"), tl.float32)
    idx_r = tl.zeros([BLOCK_R], dtype=tl.int32)
    idx_p = tl.zeros([BLOCK_R], dtype=tl.int32)
    for start in range(0, vocab_size, BLOCK_V):
        cols = start + cols0
        mask = r_mask[:, None] & (cols < vocab_size)[None, :]
        s = tl.math.div_rn(tl.load(row_ptr + cols[None, :], mask=mask,
                                   other=float("-inf")).to(tl.float32),
                           safe_t[:, None])
        p = tl.where(greedy[:, None], (cols[None, :] == amax[:, None]).to(tl.float32),
                     tl.math.div_rn(tl.exp(s - m[:, None]), z[:, None]))     # [BR, BV]
        if HAS_Q:
            q = tl.load(draft_probs_ptr + q_row[:, None].to(tl.int64) * q_stride + cols[None, :],
                        mask=is_draft[:, None] & mask, other=0.0)
        else:
            q = (cols[None, :] == x[:, None]).to(tl.float32)
        r = tl.maximum(p - q, 0.0)
        hi, lo = _hash_words(k1r[:, None], k2r[:, None], cols[None, :])
        g = _words_to_gumbel(hi, lo)
        # NOTE: _logf is exact for normal floats only; a residual below 2**-126 counts as 0.
        val_r = tl.where(r >= _FLT_MIN, _logf(tl.maximum(r, _FLT_MIN)) + g, float("-inf"))
        val_p = tl.where(p >= _FLT_MIN, _logf(tl.maximum(p, _FLT_MIN)) + g, float("-inf"))
        bm_r = tl.max(val_r, axis=1)
        bi_r = tl.min(tl.where(val_r == bm_r[:, None], cols[None, :], _INT32_MAX), axis=1)
        idx_r = tl.where(bm_r > best_r, bi_r, idx_r)
        best_r = tl.maximum(best_r, bm_r)
        bm_p = tl.max(val_p, axis=1)
        bi_p = tl.min(tl.where(val_p == bm_p[:, None], cols[None, :], _INT32_MAX), axis=1)
        idx_p = tl.where(bm_p > best_p, bi_p, idx_p)
        best_p = tl.maximum(best_p, bm_p)
    sample = tl.where(best_r > float("-inf"), idx_r, idx_p)
    # Stage 4: the acceptance test u * q(x) < p(x), u from stream 1.
    xs = tl.maximum(x, 0)
    s_x = tl.math.div_rn(tl.load(logits_ptr + rows.to(tl.int64) * logits_stride + xs,
                                 mask=is_draft, other=float("-inf")).to(tl.float32), safe_t)
    p_x = tl.where(greedy, (xs == amax).to(tl.float32), tl.math.div_rn(tl.exp(s_x - m), z))
    if HAS_Q:
        q_x = tl.load(draft_probs_ptr + q_row.to(tl.int64) * q_stride + xs, mask=is_draft,
                      other=1.0)
    else:
        q_x = tl.full([BLOCK_R], 1.0, tl.float32)
    hi_a, _ = _hash_words(_mix32(k1 ^ _A1), _mix32(k2 ^ _A2), tl.zeros([BLOCK_R], tl.int32))
    u = ((hi_a >> 9).to(tl.float32) + 0.5) * _TWO_M23
    accepted = is_draft & (u * q_x < p_x)
    tl.store(accepted_ptr + rows, accepted.to(tl.int32), mask=r_mask)
    tl.store(sampled_ptr + rows, sample.to(tl.int64), mask=r_mask)


# --- launchers --------------------------------------------------------------------------------

def _check(logits: torch.Tensor, draft_token_ids: torch.Tensor, idx_mapping: torch.Tensor,
           base_positions: torch.Tensor) -> tuple[int, int]:
    if draft_token_ids.dim() != 2 or draft_token_ids.dtype != torch.int32:
        raise ValueError("draft_token_ids must be an int32 [B, K] tensor, got "
                         f"{draft_token_ids.dtype} {tuple(draft_token_ids.shape)}")
    num_reqs, k = draft_token_ids.shape
    if k < 1:
        raise ValueError("draft_token_ids must have K >= 1 columns")
    if logits.dim() != 2 or logits.shape[0] != num_reqs * (k + 1):
        raise ValueError(f"logits must be [B * (K + 1), V] = [{num_reqs * (k + 1)}, V], "
                         f"got {tuple(logits.shape)}")
    if idx_mapping.shape[0] != num_reqs or base_positions.shape[0] != num_reqs:
        raise ValueError(f"idx_mapping and base_positions need {num_reqs} entries, got "
                         f"{idx_mapping.shape[0]} and {base_positions.shape[0]}")
    return num_reqs, k


def _accept(draft_token_ids, sampled, accepted, exact: bool) -> VerifyOutput:
    num_reqs, k = draft_token_ids.shape
    dev = draft_token_ids.device
    out = torch.empty(num_reqs, k + 1, dtype=torch.int32, device=dev)
    num_out = torch.empty(num_reqs, dtype=torch.int32, device=dev)
    num_acc = torch.empty(num_reqs, dtype=torch.int32, device=dev)
    if num_reqs:
        block_b = 256 if TRITON_INTERPRET else 32
        _accept_kernel[(triton.cdiv(num_reqs, block_b),)](
            draft_token_ids, sampled, sampled if accepted is None else accepted,
            out, num_out, num_acc, num_reqs, k, draft_token_ids.stride(0), out.stride(0),
            EXACT=exact, BLOCK_B=block_b, BLOCK_K1=triton.next_power_of_2(k + 1))
    return VerifyOutput(out, num_out, num_acc, sampled)


def exact_accept(draft_token_ids: torch.Tensor, target_token_ids: torch.Tensor,
                 num_spec_tokens: torch.Tensor) -> VerifyOutput:
    """``exact`` acceptance of drafts against target samples the caller already drew.

    The runner samples every logits row with its ``Sampler`` (logit rules, logprobs and
    the stateless Gumbel noise included), then calls this: a draft is accepted while it
    equals the target's sample at its position. One launch, no sync.

    Args:
        draft_token_ids: int32 ``[B, K]`` drafts (-1: none, never accepted).
        target_token_ids: ``[B, K + 1]`` the target's sample at each position.
        num_spec_tokens: int32 ``[B]`` K_b <= K, the drafts slot ``b`` really verified
            (drafts past it are ignored; 0 for a slot that did not speculate).

    Returns:
        ``VerifyOutput`` (``sampled`` is ``target_token_ids`` flattened).
    """
    k = draft_token_ids.shape[1]
    j = torch.arange(k, device=draft_token_ids.device)                      # [K]
    drafts = torch.where(j[None, :] < num_spec_tokens[:, None],
                         draft_token_ids.to(torch.int32), -1)               # [B, K]
    sampled = target_token_ids.to(torch.int64).contiguous().view(-1)       # [B * (K + 1)]
    return _accept(drafts, sampled, None, exact=True)


def exact_verify(logits: torch.Tensor, draft_token_ids: torch.Tensor, idx_mapping: torch.Tensor,
                 base_positions: torch.Tensor, state, *,
                 needs_top_k_top_p: bool = True) -> VerifyOutput:
    """Accept drafts while they equal the target's own stateless Gumbel sample (no sync).

    Args:
        logits: ``[B * (K + 1), V]`` float32 target logits after the logit rules; row
            ``b * (K + 1) + j`` samples position ``base_positions[b] + j + 1``. Masked in
            place by top-k / top-p / min-p, as in the sampler.
        draft_token_ids: int32 ``[B, K]``, -1 = no draft (never accepted).
        idx_mapping: int32 ``[B]`` batch slot -> state row.
        base_positions: ``[B]`` position of each request's last known token (its first
            query token; ``seq_lens - (1 + K)`` in a 1 + K verification step).
        state: has ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed`` ``[R]``.
        needs_top_k_top_p: some row uses a filter (a CPU flag, as the sampler's).

    Returns:
        ``VerifyOutput``.
    """
    num_reqs, k = _check(logits, draft_token_ids, idx_mapping, base_positions)
    # NOTE: expand + contiguous, not repeat_interleave (nothing here may wait for the
    # device), and not reshape: with B == 1 it returns a stride-0 view the kernels misread.
    rep_idx = idx_mapping[:, None].expand(-1, k + 1).contiguous().view(-1)   # [B * (K + 1)]
    rep_pos = (base_positions.to(torch.int64)[:, None] + 1
               + torch.arange(k + 1, device=logits.device)).reshape(-1)       # [B * (K + 1)]
    if needs_top_k_top_p and num_reqs:
        apply_top_k_top_p_min_p(logits, rep_idx, state.temperature, state.top_k,
                                state.top_p, state.min_p)
    sampled = gumbel_sample(logits, rep_idx, state.temperature, state.seed, rep_pos)
    return _accept(draft_token_ids, sampled, None, exact=True)


def probabilistic_verify(logits: torch.Tensor, draft_token_ids: torch.Tensor,
                         idx_mapping: torch.Tensor, base_positions: torch.Tensor, state,
                         draft_probs: torch.Tensor | None = None, *,
                         needs_top_k_top_p: bool = True, block_v: int | None = None
                         ) -> VerifyOutput:
    """Leviathan / Chen rejection sampling with noise independent of the drafts' (no sync).

    Args:
        logits, draft_token_ids, idx_mapping, base_positions, state, needs_top_k_top_p:
            as for ``exact_verify``; p is ``softmax`` of the masked ``logits / T``
            (greedy rows: a point mass at the argmax).
        draft_probs: ``[B * K, V]`` float32 draft distribution q of each draft row, or
            ``None``: q is a point mass at the draft (n-gram).
        block_v: vocabulary block override.

    Returns:
        ``VerifyOutput`` (``sampled``: each row's residual / bonus sample).
    """
    num_reqs, k = _check(logits, draft_token_ids, idx_mapping, base_positions)
    num_rows, vocab_size = logits.shape
    if draft_probs is not None and tuple(draft_probs.shape) != (num_reqs * k, vocab_size):
        raise ValueError(f"draft_probs must be [B * K, V] = [{num_reqs * k}, {vocab_size}], "
                         f"got {tuple(draft_probs.shape)}")
    dev = logits.device
    sampled = torch.empty(num_rows, dtype=torch.int64, device=dev)
    accepted = torch.empty(num_rows, dtype=torch.int32, device=dev)
    if num_reqs:
        rep_idx = idx_mapping[:, None].expand(-1, k + 1).contiguous().view(-1)  # [B * (K + 1)]
        if needs_top_k_top_p:
            apply_top_k_top_p_min_p(logits, rep_idx, state.temperature, state.top_k,
                                    state.top_p, state.min_p)
        if block_v is None:
            block_v = min(4096 if TRITON_INTERPRET else 1024,
                          triton.next_power_of_2(max(vocab_size, 16)))
        # NOTE: the interpreter pays per program: many rows per program there (as gumbel.py).
        block_r = (min(max(1, 262144 // block_v), triton.next_power_of_2(num_rows))
                   if TRITON_INTERPRET else 1)
        q = logits if draft_probs is None else draft_probs
        _probabilistic_kernel[(triton.cdiv(num_rows, block_r),)](
            logits, q, draft_token_ids, idx_mapping, base_positions, state.temperature,
            state.seed, accepted, sampled, num_rows, k, vocab_size,
            logits.stride(0), q.stride(0), draft_token_ids.stride(0),
            HAS_Q=draft_probs is not None, BLOCK_R=block_r, BLOCK_V=block_v,
            **_launch_options())
    return _accept(draft_token_ids, sampled, accepted, exact=False)


# --- references ------------------------------------------------------------------------------

def accept_ref(draft_token_ids: torch.Tensor, sampled: torch.Tensor,
               accepted: torch.Tensor | None = None) -> VerifyOutput:
    """Plain-Python ``_accept_kernel``: ``accepted`` None means exact (draft == sample)."""
    num_reqs, k = draft_token_ids.shape
    out = torch.full((num_reqs, k + 1), -1, dtype=torch.int32)
    num_acc = torch.zeros(num_reqs, dtype=torch.int32)
    t = sampled.reshape(num_reqs, k + 1)
    for b in range(num_reqs):
        a = 0
        while a < k and draft_token_ids[b, a] >= 0 and (
                bool(accepted.reshape(num_reqs, k + 1)[b, a]) if accepted is not None
                else int(draft_token_ids[b, a]) == int(t[b, a])):
            a += 1
        out[b, :a] = draft_token_ids[b, :a]
        out[b, a] = int(t[b, a])
        num_acc[b] = a
    return VerifyOutput(out, num_acc + 1, num_acc, sampled)


def _expand(idx_mapping, base_positions, k):
    rep_idx = idx_mapping.to(torch.int64).repeat_interleave(k + 1)            # [B * (K + 1)]
    rep_pos = (base_positions.to(torch.int64)[:, None] + 1 + torch.arange(k + 1)).reshape(-1)
    return rep_idx, rep_pos


def exact_verify_ref(logits, draft_token_ids, idx_mapping, base_positions, temperature,
                     top_k, top_p, min_p, seed) -> VerifyOutput:
    """The torch reference of ``exact_verify`` (state columns passed one by one)."""
    k = draft_token_ids.shape[1]
    rep_idx, rep_pos = _expand(idx_mapping, base_positions, k)
    masked = apply_top_k_top_p_min_p_ref(logits, rep_idx, temperature, top_k, top_p, min_p)
    sampled = gumbel_sample_ref(masked, rep_idx, temperature, seed, rep_pos)
    return accept_ref(draft_token_ids, sampled)


def target_probs_ref(logits, rep_idx, temperature, top_k, top_p, min_p) -> torch.Tensor:
    """p of every row: softmax of the masked ``logits / T``; greedy rows one-hot (``[N, V]``)."""
    masked = apply_top_k_top_p_min_p_ref(logits, rep_idx, temperature, top_k, top_p, min_p)
    temp = temperature[rep_idx]
    greedy = temp < GREEDY_TEMPERATURE
    s = masked.to(torch.float32) / torch.where(greedy, 1.0, temp)[:, None]   # [N, V]
    m = s.max(dim=1, keepdim=True).values
    e = torch.exp(s - m)
    p = e / e.sum(dim=1, keepdim=True)
    one_hot = torch.nn.functional.one_hot(s.argmax(dim=1), s.shape[1]).to(torch.float32)
    return torch.where(greedy[:, None], one_hot, p)


def probabilistic_verify_ref(logits, draft_token_ids, idx_mapping, base_positions,
                             temperature, top_k, top_p, min_p, seed, draft_probs=None, *,
                             uniforms=None, residual_noise=None) -> VerifyOutput:
    """The torch reference of ``probabilistic_verify``.

    ``uniforms [B * (K + 1)]`` and ``residual_noise [B * (K + 1), V]`` replace streams 1
    and 2 when given (tests use this to build the biased, noise-reusing variant).
    """
    num_reqs, k = draft_token_ids.shape
    vocab_size = logits.shape[1]
    rep_idx, rep_pos = _expand(idx_mapping, base_positions, k)
    p = target_probs_ref(logits, rep_idx, temperature, top_k, top_p, min_p)   # [N, V]
    x = torch.cat([draft_token_ids.to(torch.int64),
                   torch.full((num_reqs, 1), -1, dtype=torch.int64)], 1).reshape(-1)  # [N]
    has_x = x >= 0
    if draft_probs is None:
        q = torch.nn.functional.one_hot(x.clamp(min=0), vocab_size).to(torch.float32)
    else:
        q = torch.zeros_like(p)
        q.view(num_reqs, k + 1, vocab_size)[:, :k] = draft_probs.view(num_reqs, k, vocab_size)
    q = torch.where(has_x[:, None], q, 0.0)
    seeds = seed[rep_idx]
    g = residual_noise if residual_noise is not None else residual_noise_ref(
        seeds, rep_pos, vocab_size)
    u = uniforms if uniforms is not None else accept_uniform_ref(seeds, rep_pos)

    def log_or_ninf(v):
        return torch.where(v >= _FLT_MIN_F, _log_ref(v.clamp(min=_FLT_MIN_F)), float("-inf"))

    val_r = log_or_ninf((p - q).clamp(min=0.0)) + g
    val_p = log_or_ninf(p) + g
    best_r = val_r.max(dim=1)
    sampled = torch.where(best_r.values > float("-inf"), best_r.indices, val_p.argmax(dim=1))
    xs = x.clamp(min=0)[:, None]
    p_x, q_x = p.gather(1, xs)[:, 0], torch.where(has_x, q.gather(1, xs)[:, 0], 1.0)
    accepted = has_x & (u * q_x < p_x)
    return accept_ref(draft_token_ids, sampled, accepted)
