"""``logit_bias``, ``allowed_token_ids`` and ``min_tokens``: per-row logit edits on the device.

Each is a per-request rule that V1 applied by looping over the batch on the CPU.
Here every state-table row stores its rule in fixed-size device arrays, written once
at admission (staged: two host->device copies and two indexed copies per step; a request
without rules writes nothing, or only zeroes the 4 header ints a previous owner left),
and one Triton kernel applies all three to the ``[B, V]`` logits through
``idx_mapping``. ``min_tokens`` needs the number of tokens a row has generated: the
state table already holds it on the device as ``total_len - prompt_len`` (also for a
re-admitted preempted request, whose prefill is prompt + earlier output).

Row layout of ``ints`` (int32 ``[R, NUM_META + max_logit_bias + max_stop_ids + W]``,
``W = ceil(V / 32)``): ``(num_bias, min_tokens, num_stop, has_allowed)``, then the
bias token ids, the stop token ids, and the allowed-token bitmask (bit ``v % 32`` of
word ``v // 32``). ``bias_values`` f32 ``[R, max_logit_bias]`` holds the biases.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from mrv2.state import to_device_async

NUM_META = 4  # num_bias, min_tokens, num_stop, has_allowed


@triton.jit
def _logit_bias_kernel(
    logits_ptr, idx_mapping_ptr, ints_ptr, bias_values_ptr,   # inputs (logits in place)
    total_len_ptr, prompt_len_ptr,
    vocab_size,                                               # sizes
    logits_stride, ints_stride, bias_values_stride,           # strides
    BIAS_OFF: tl.constexpr, STOP_OFF: tl.constexpr, ALLOWED_OFF: tl.constexpr,
    BLOCK_V: tl.constexpr, BLOCK_I: tl.constexpr,
):
    b = tl.program_id(0)       # batch slot
    vb = tl.program_id(1)      # vocab block
    row = tl.load(idx_mapping_ptr + b).to(tl.int64)
    base = ints_ptr + row * ints_stride
    num_bias = tl.load(base + 0)
    min_tokens = tl.load(base + 1)
    num_stop = tl.load(base + 2)
    has_allowed = tl.load(base + 3)
    num_output = tl.load(total_len_ptr + row) - tl.load(prompt_len_ptr + row)
    num_ban = tl.where(num_output < min_tokens, num_stop, 0)
    v0 = vb * BLOCK_V
    logits_row = logits_ptr + b * logits_stride
    # Stage 1: allowed_token_ids: every token whose bit is clear becomes -inf.
    if has_allowed != 0:
        v = v0 + tl.arange(0, BLOCK_V)
        ok = v < vocab_size
        words = tl.load(base + ALLOWED_OFF + (v >> 5), mask=ok, other=0)
        allowed = ((words >> (v & 31)) & 1) != 0
        x = tl.load(logits_row + v, mask=ok, other=0.0)
        tl.store(logits_row + v, tl.where(allowed, x, float("-inf")).to(x.dtype), mask=ok)
    # NOTE: stage 2 rereads logits other threads of this program may just have stored.
    tl.debug_barrier()
    # Stage 2: logit_bias: the (unique) ids that fall in this vocab block.
    for j0 in range(0, num_bias, BLOCK_I):
        j = j0 + tl.arange(0, BLOCK_I)
        ids = tl.load(base + BIAS_OFF + j, mask=j < num_bias, other=-1)
        inb = (ids >= v0) & (ids < v0 + BLOCK_V) & (ids < vocab_size)
        vals = tl.load(bias_values_ptr + row * bias_values_stride + j, mask=inb, other=0.0)
        x = tl.load(logits_row + ids, mask=inb, other=0.0)
        tl.store(logits_row + ids, (x.to(tl.float32) + vals).to(x.dtype), mask=inb)
    tl.debug_barrier()
    # Stage 3: min_tokens: ban the stop ids while too few tokens were generated.
    for j0 in range(0, num_ban, BLOCK_I):
        j = j0 + tl.arange(0, BLOCK_I)
        ids = tl.load(base + STOP_OFF + j, mask=j < num_ban, other=-1)
        inb = (ids >= v0) & (ids < v0 + BLOCK_V) & (ids < vocab_size)
        x = tl.load(logits_row + ids, mask=inb, other=0.0)
        tl.store(logits_row + ids, tl.full([BLOCK_I], float("-inf"), tl.float32).to(x.dtype),
                 mask=inb)


class LogitBiasState:
    """Per-row ``logit_bias`` / ``allowed_token_ids`` / ``min_tokens`` rules on the device.

    Args:
        max_num_reqs: rows (the state table's ``max_num_reqs``).
        vocab_size: V.
        device: where the arrays live.
        max_logit_bias: most ``logit_bias`` entries per request (OpenAI allows 300).
        max_stop_ids: most stop token ids (EOS included) per request.

    Attributes:
        ints: int32 ``[R, NUM_META + max_logit_bias + max_stop_ids + W]`` (module docstring).
        bias_values: f32 ``[R, max_logit_bias]``.
        row_active: numpy bool ``[R]`` (CPU): the row has any rule; lets the runner skip
            the launch for a batch without one, without reading the device.
    """

    def __init__(self, max_num_reqs: int, vocab_size: int, device: torch.device | str,
                 max_logit_bias: int = 300, max_stop_ids: int = 64):
        if min(max_num_reqs, vocab_size, max_logit_bias, max_stop_ids) <= 0:
            raise ValueError("max_num_reqs, vocab_size, max_logit_bias and max_stop_ids must be "
                             f"positive, got {max_num_reqs}, {vocab_size}, {max_logit_bias}, "
                             f"{max_stop_ids}")
        self.max_num_reqs, self.vocab_size = max_num_reqs, vocab_size
        self.max_logit_bias, self.max_stop_ids = max_logit_bias, max_stop_ids
        self.device = torch.device(device)
        self.bias_off = NUM_META
        self.stop_off = self.bias_off + max_logit_bias
        self.allowed_off = self.stop_off + max_stop_ids
        width = self.allowed_off + (vocab_size + 31) // 32
        self.ints = torch.zeros(max_num_reqs, width, dtype=torch.int32, device=self.device)
        self.bias_values = torch.zeros(max_num_reqs, max_logit_bias, dtype=torch.float32,
                                       device=self.device)
        self.row_active = np.zeros(max_num_reqs, dtype=bool)
        # Rows whose device header may be non-zero (a previous owner had rules).
        self._dirty = np.zeros(max_num_reqs, dtype=bool)
        # row -> (ints, floats) of a row with rules, or None: zero the row's header only.
        self._staged: dict[int, tuple[np.ndarray, np.ndarray] | None] = {}

    @property
    def has_staged_writes(self) -> bool:
        return bool(self._staged)

    def any_active(self, rows) -> bool:
        """Whether any of ``rows`` (CPU ints) has a rule: else ``apply`` can be skipped."""
        return bool(self.row_active[rows].any())

    def _ids(self, row: int, ids, what: str) -> np.ndarray:
        arr = np.asarray(list(ids), dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"row {row}: {what} holds a token id outside [0, {self.vocab_size})")
        return arr

    def add_request(self, row: int, sampling_params) -> None:
        """Stage a row's rules from its ``SamplingParams`` (applied next step).

        Uses ``logit_bias``, ``allowed_token_ids``, ``min_tokens`` and
        ``all_stop_token_ids`` (stop ids + EOS unless ``ignore_eos``, set by the engine).
        """
        if not 0 <= row < self.max_num_reqs:
            raise ValueError(f"row {row} is outside [0, {self.max_num_reqs})")
        sp = sampling_params
        bias = dict(sp.logit_bias or {})
        bias_ids = self._ids(row, bias.keys(), "logit_bias")
        stop = self._ids(row, sorted(sp.all_stop_token_ids) if sp.min_tokens else (),
                         "all_stop_token_ids")
        if bias_ids.size > self.max_logit_bias:
            raise ValueError(f"row {row}: {bias_ids.size} logit_bias entries, more than "
                             f"max_logit_bias={self.max_logit_bias}")
        if stop.size > self.max_stop_ids:
            raise ValueError(f"row {row}: {stop.size} stop token ids, more than "
                             f"max_stop_ids={self.max_stop_ids}")
        allowed = (None if sp.allowed_token_ids is None
                   else self._ids(row, sp.allowed_token_ids, "allowed_token_ids"))
        self.row_active[row] = bool(bias_ids.size or stop.size or allowed is not None)
        if not self.row_active[row]:
            # NOTE: the kernel reads only the 4 header ints of a row without rules (a
            # 20 KB row per request was copied before): zero them if a previous owner
            # left rules there; otherwise there is nothing to write.
            if self._dirty[row]:
                self._staged[row] = None
            else:
                self._staged.pop(row, None)
            return
        ints = np.zeros(self.ints.shape[1], dtype=np.int32)
        floats = np.zeros(self.max_logit_bias, dtype=np.float32)
        ints[:NUM_META] = (bias_ids.size, sp.min_tokens, stop.size, allowed is not None)
        ints[self.bias_off:self.bias_off + bias_ids.size] = bias_ids
        floats[:bias_ids.size] = [float(bias[int(t)]) for t in bias_ids]
        ints[self.stop_off:self.stop_off + stop.size] = stop
        if allowed is not None:
            bits = np.zeros(self.ints.shape[1] - self.allowed_off, dtype=np.uint32)
            np.bitwise_or.at(bits, allowed >> 5, (np.uint32(1) << (allowed & 31).astype(np.uint32)))
            ints[self.allowed_off:] = bits.view(np.int32)
        self._staged[row] = (ints, floats)

    def remove_request(self, row: int) -> None:
        """Free ``row``; its device contents are overwritten by the next owner's write."""
        self._staged.pop(row, None)  # NOTE: added and removed within one step: never written
        self.row_active[row] = False

    def apply_staged_writes(self) -> None:
        """Write the staged rows with rules (three host->device copies, two indexed copies)
        and zero the headers to clear (one copy, one fill); no sync."""
        if not self._staged:
            return
        rows = sorted(r for r, w in self._staged.items() if w is not None)
        clear = sorted(r for r, w in self._staged.items() if w is None)
        if rows:
            packed_ints = np.stack([self._staged[r][0] for r in rows])      # [n, width]
            packed_floats = np.stack([self._staged[r][1] for r in rows])    # [n, max_logit_bias]
            rows_dev = to_device_async(np.asarray(rows, dtype=np.int64), self.device)
            self.ints.index_copy_(0, rows_dev, to_device_async(packed_ints, self.device))
            self.bias_values.index_copy_(0, rows_dev, to_device_async(packed_floats, self.device))
            self._dirty[rows] = True
        if clear:
            clear_dev = to_device_async(np.asarray(clear, dtype=np.int64), self.device)
            self.ints[:, :NUM_META].index_fill_(0, clear_dev, 0)            # a view: in place
            self._dirty[clear] = False
        self._staged.clear()

    def apply(self, logits: torch.Tensor, idx_mapping: torch.Tensor, state) -> torch.Tensor:
        """Apply allowed ids, then biases, then the min_tokens ban, in place (one launch).

        Args:
            logits: ``[B, V]`` (last dim contiguous), modified in place.
            idx_mapping: int32 ``[>= B]`` batch slot -> state row.
            state: the ``RequestStateTable`` (reads ``total_len``, ``prompt_len``).

        Returns:
            ``logits``. Rows without rules are read for 4 ints and left untouched.
        """
        num_reqs, vocab_size = logits.shape
        if num_reqs == 0:
            return logits
        block = min(4096, triton.next_power_of_2(max(vocab_size, 16)))
        _logit_bias_kernel[(num_reqs, triton.cdiv(vocab_size, block))](
            logits, idx_mapping, self.ints, self.bias_values, state.total_len, state.prompt_len,
            vocab_size, logits.stride(0), self.ints.stride(0), self.bias_values.stride(0),
            BIAS_OFF=self.bias_off, STOP_OFF=self.stop_off, ALLOWED_OFF=self.allowed_off,
            BLOCK_V=block, BLOCK_I=64)
        return logits


def apply_logit_bias_ref(logits: torch.Tensor, rows: list[int], params: dict,
                         num_output: dict[int, int]) -> torch.Tensor:
    """Plain-torch specification (a new tensor; loops; CPU ints).

    Args:
        logits: ``[B, V]``.
        rows: the state row of each batch slot.
        params: row -> its ``SamplingParams``.
        num_output: row -> tokens it has generated so far.
    """
    out = logits.clone()
    for b, row in enumerate(rows):
        sp = params[row]
        if sp.allowed_token_ids is not None:
            keep = torch.zeros(logits.shape[1], dtype=torch.bool, device=logits.device)
            keep[list(sp.allowed_token_ids)] = True
            out[b] = out[b].masked_fill(~keep, float("-inf"))
        for t, bias in (sp.logit_bias or {}).items():
            out[b, t] += bias
        if num_output[row] < sp.min_tokens:
            for t in sp.all_stop_token_ids:
                out[b, t] = float("-inf")
    return out
