"""Staged writes into the request-state table: one kernel launch per step.

New requests are not written into the device table one tensor at a time (a dozen
small copies per request). ``RequestStateTable.add_request`` only stages them on
the CPU; once per step the staged rows are packed into three flat arrays, each
copied to the device once, and this kernel scatters them into the table. See
notebooks/02_stable_state_table.ipynb.

Packed layout (``n`` staged rows, ``L`` staged tokens in all):

* ``packed_ints`` int32 ``[n * NUM_META + L]``: per staged row ``(row, token_start,
  num_tokens, prompt_len, top_k, num_computed_tokens)``, then the token ids of all rows
  back to back (``token_start`` indexes that flat tail). ``num_computed_tokens`` is 0,
  or the length of the prefix-cache hit whose KV is already in the request's blocks.
* ``packed_floats`` f32 ``[n, NUM_FLOATS]``: the float sampling parameters in the
  order of ``FLOAT_PARAMS``.
* ``packed_seeds`` int64 ``[n]``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Lanes per iteration of the token copy: one compiled variant for every prompt length.
from mrv2.kernels.block_table import COPY_BLOCK

#: Fields per staged row at the head of ``packed_ints``.
META_FIELDS = ("row", "token_start", "num_tokens", "prompt_len", "top_k", "num_computed_tokens")
NUM_META = len(META_FIELDS)
#: The float sampling parameters, in the row order of ``RequestStateTable.float_params``.
FLOAT_PARAMS = ("temperature", "top_p", "min_p", "repetition_penalty",
                "presence_penalty", "frequency_penalty")


@triton.jit(do_not_specialize=["num_staged"])
def _apply_state_writes_kernel(
    packed_ints_ptr, packed_floats_ptr, packed_seeds_ptr,            # inputs
    token_ids_ptr, prompt_len_ptr, prefill_len_ptr, total_len_ptr,  # outputs
    num_computed_ptr, last_sampled_ptr, top_k_ptr, float_params_ptr, seed_ptr,
    num_staged,                                                      # sizes
    token_ids_stride, float_params_stride,                           # strides
    NUM_META: tl.constexpr, NUM_FLOATS: tl.constexpr, BLOCK_F: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)  # one program per staged row
    # Load this staged row's header.
    meta = packed_ints_ptr + i * NUM_META
    row = tl.load(meta + 0).to(tl.int64)
    token_start = tl.load(meta + 1)
    num_tokens = tl.load(meta + 2)
    prompt_len = tl.load(meta + 3)
    top_k = tl.load(meta + 4)
    num_computed = tl.load(meta + 5)
    # Scatter its token ids into token_ids[row, :num_tokens].
    src = packed_ints_ptr + num_staged * NUM_META + token_start
    dst = token_ids_ptr + row * token_ids_stride
    for start in range(0, num_tokens, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < num_tokens
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)
    # Per-row scalars: a fresh request has sampled nothing and computed only its
    # prefix-cache hit (0 without one).
    tl.store(prompt_len_ptr + row, prompt_len)
    tl.store(prefill_len_ptr + row, num_tokens)
    tl.store(total_len_ptr + row, num_tokens)
    tl.store(num_computed_ptr + row, num_computed)
    tl.store(last_sampled_ptr + row, -1)
    tl.store(top_k_ptr + row, top_k)
    # Float sampling params: a column of float_params [NUM_FLOATS, rows].
    f = tl.arange(0, BLOCK_F)
    fmask = f < NUM_FLOATS
    vals = tl.load(packed_floats_ptr + i * NUM_FLOATS + f, mask=fmask)
    tl.store(float_params_ptr + f * float_params_stride + row, vals, mask=fmask)
    tl.store(seed_ptr + row, tl.load(packed_seeds_ptr + i))


def apply_state_writes(packed_ints: torch.Tensor, packed_floats: torch.Tensor,
                       packed_seeds: torch.Tensor, num_staged: int, *,
                       token_ids: torch.Tensor, prompt_len: torch.Tensor,
                       prefill_len: torch.Tensor, total_len: torch.Tensor,
                       num_computed_tokens: torch.Tensor, last_sampled_token: torch.Tensor,
                       top_k: torch.Tensor, float_params: torch.Tensor,
                       seed: torch.Tensor) -> None:
    """Scatter ``num_staged`` packed rows into the state table (one launch).

    Args:
        packed_ints: int32 ``[num_staged * NUM_META + L]`` (see the module docstring).
        packed_floats: f32 ``[num_staged, NUM_FLOATS]``.
        packed_seeds: int64 ``[num_staged]``.
        num_staged: staged rows (a CPU int); 0 launches nothing.
        token_ids ... seed: the table's device tensors, written in place.
    """
    if num_staged == 0:
        return
    _apply_state_writes_kernel[(num_staged,)](
        packed_ints, packed_floats, packed_seeds,
        token_ids, prompt_len, prefill_len, total_len,
        num_computed_tokens, last_sampled_token, top_k, float_params, seed,
        num_staged,
        token_ids.stride(0), float_params.stride(0),
        NUM_META=NUM_META, NUM_FLOATS=len(FLOAT_PARAMS),
        BLOCK_F=triton.next_power_of_2(len(FLOAT_PARAMS)), BLOCK=COPY_BLOCK,
    )


def apply_state_writes_ref(staged: list[tuple],
                           token_ids: torch.Tensor, prompt_len: torch.Tensor,
                           prefill_len: torch.Tensor, total_len: torch.Tensor,
                           num_computed_tokens: torch.Tensor,
                           last_sampled_token: torch.Tensor, top_k: torch.Tensor,
                           float_params: torch.Tensor, seed: torch.Tensor) -> None:
    """Plain-torch specification of the kernel, on unpacked rows (in place).

    Args:
        staged: ``(row, token_ids, prompt_len, top_k, float_params, seed[,
            num_computed_tokens])`` per row, ``float_params`` in the order of
            ``FLOAT_PARAMS``; ``num_computed_tokens`` defaults to 0.
        token_ids ... seed: the table tensors, written in place.
    """
    for row, ids, plen, k, floats, s, *computed in staged:
        token_ids[row, :len(ids)] = torch.tensor(ids, dtype=token_ids.dtype)
        prompt_len[row], prefill_len[row], total_len[row] = plen, len(ids), len(ids)
        num_computed_tokens[row] = computed[0] if computed else 0
        last_sampled_token[row], top_k[row] = -1, k
        float_params[:, row] = torch.tensor(floats, dtype=float_params.dtype)
        seed[row] = s
