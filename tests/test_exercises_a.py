"""The build-it-yourself exercises of chapters 01, 02, 06 and 07: wrong answers fail, named.

tests/test_exercises.py runs every solution in notebooks/solutions/ through its checker and
every learner-copy skeleton against it (both must hold for these chapters too: the first test
below makes sure they are there to run). Here each checker meets plausible wrong answers, and
must fail each one with a message that names the case and the output that is wrong.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mrv2.exercises import (
    ExerciseFailed,
    check_paged_decode_attention,
    check_post_update_kernel,
    check_sampled_logprobs_kernel,
    check_state_rows,
)

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = ("01_qwen3_and_paged_kv", "02_stable_state_table", "06_logprobs", "07_async_streams")


def _solution(stem: str) -> dict:
    ns: dict = {}
    source = (ROOT / "notebooks" / "solutions" / f"{stem}.py").read_text()
    # the solution's definitions, without its check call
    exec(compile(source.replace("\ncheck_", "\n_ = check_"), stem, "exec"), ns)  # noqa: S102
    return ns


def test_these_chapters_have_an_exercise_with_a_skeleton():
    for stem in CHAPTERS:
        assert (ROOT / "notebooks" / "solutions" / f"{stem}.py").is_file(), stem
        clean = (ROOT / "notebooks" / "clean" / f"{stem}.ipynb").read_text()
        assert "# your code here" in clean and "BEGIN SOLUTION" not in clean, stem


# --- chapter 01: paged decode attention in numpy ---------------------------------------------

def test_wrong_paged_decode_attention_fails_with_the_case_named():
    right = _solution("01_qwen3_and_paged_kv")["paged_decode_attention"]

    def whole_blocks(q, kv_cache, block_table, seq_lens, scale):  # no cut at seq_len
        bs = kv_cache.shape[2]
        return right(q, kv_cache, block_table, -(-seq_lens // bs) * bs, scale)

    def heads_modulo(q, kv_cache, block_table, seq_lens, scale):  # query head h -> h % H_kv
        h, h_kv = q.shape[1], kv_cache.shape[3]
        order = [g * h_kv + k for k in range(h_kv) for g in range(h // h_kv)]   # h % H_kv
        out = right(q[:, order], kv_cache, block_table, seq_lens, scale)
        res = np.empty_like(out)
        res[:, order] = out
        return res

    def no_scale(q, kv_cache, block_table, seq_lens, scale):
        return right(q, kv_cache, block_table, seq_lens, 1.0)

    def padding_not_skipped(q, kv_cache, block_table, seq_lens, scale):
        if (seq_lens == 0).any():
            np.max(np.zeros(0))                     # what the softmax of no key raises
        return right(q, kv_cache, block_table, seq_lens, scale)

    for wrong, message in [
            (whole_blocks, r"case 'one cached token \(seq_len 1\)': out\[0, 0\] differs"),
            (heads_modulo, r"case 'one cached token \(seq_len 1\)': out\[0, 1\] differs"),
            (no_scale, "case 'a sequence ending on a block boundary': out"),
            (padding_not_skipped, "case 'a padding slot.*raised ValueError")]:
        with pytest.raises(ExerciseFailed, match=message):
            check_paged_decode_attention(wrong)
    with pytest.raises(ExerciseFailed, match="out has shape"):
        check_paged_decode_attention(lambda q, *a: q[:, :1])
    with pytest.raises(TypeError, match="fn must be a function"):
        check_paged_decode_attention(None)


# --- chapter 02: the CPU half of the state table ---------------------------------------------

def test_wrong_state_rows_fail_with_the_row_named():
    right = _solution("02_stable_state_table")["StableRows"]

    class OldestFreedFirst(right):  # a queue, not a stack: reuses the oldest free row
        def __init__(self, n):
            super().__init__(n)
            self.free_rows.reverse()

        def add_request(self, req_id):
            if not self.free_rows:
                raise RuntimeError("full")
            self.row_of[req_id] = self.free_rows.pop(0)
            return self.row_of[req_id]

    class Condensing(right):  # V1: rows stay dense, the last row moves into the hole
        def add_request(self, req_id):
            if not self.free_rows:
                raise RuntimeError("full")
            self.free_rows.pop()
            self.row_of[req_id] = len(self.row_of)
            return self.row_of[req_id]

        def remove_request(self, req_id):
            row = self.row_of.pop(req_id)
            self.free_rows.append(row)
            for r, at in self.row_of.items():
                if at == len(self.row_of):
                    self.row_of[r] = row
            return row

    class RowOrder(right):  # forgets the batch order
        def idx_mapping(self, req_ids):
            return np.sort(super().idx_mapping(req_ids))

    class NeverFull(right):  # hands out a row past the table
        def add_request(self, req_id):
            if not self.free_rows:
                self.row_of[req_id] = len(self.row_of)
                return self.row_of[req_id]
            return super().add_request(req_id)

    for wrong, message in [
            (OldestFreedFirst, (r"'a freed row is reused first', step 1: add_request\('d'\) "
                               "returned row 3, expected 1")),
            (Condensing, r"'a freed row is reused first', step 1: add_request\('d'\) returned row 2"),
            (RowOrder, "'two freed rows: the last freed is reused first, step 2': idx_mapping"),
            (NeverFull, "'a full table'.*must raise")]:
        with pytest.raises(ExerciseFailed, match=message):
            check_state_rows(wrong)
    with pytest.raises(TypeError, match="cls must be a class"):
        check_state_rows("StableRows")


# --- chapter 06: the sampled token's logprob and rank ----------------------------------------

@pytest.mark.slow
def test_wrong_logprob_kernels_fail_with_the_output_named():
    import triton
    import triton.language as tl

    @triton.jit
    def zero_padding(logits_ptr, sampled_ptr, logprobs_ptr, ranks_ptr, V, stride,
                     BLOCK_V: tl.constexpr):
        n = tl.program_id(0)
        x_tok = tl.load(logits_ptr + n * stride + tl.load(sampled_ptr + n))
        m, s, count = -3.0e38, 0.0, 0
        for start in range(0, V, BLOCK_V):
            v = start + tl.arange(0, BLOCK_V)
            x = tl.load(logits_ptr + n * stride + v, mask=v < V, other=0.0)   # 0, not -inf
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
            count += tl.sum((x > x_tok).to(tl.int32), axis=0)
        tl.store(logprobs_ptr + n, x_tok - (m + tl.log(s)))
        tl.store(ranks_ptr + n, (count + 1).to(tl.int64))

    @triton.jit
    def no_max(logits_ptr, sampled_ptr, logprobs_ptr, ranks_ptr, V, stride,
               BLOCK_V: tl.constexpr):
        n = tl.program_id(0)
        x_tok = tl.load(logits_ptr + n * stride + tl.load(sampled_ptr + n))
        s, count = 0.0, 0
        for start in range(0, V, BLOCK_V):
            v = start + tl.arange(0, BLOCK_V)
            x = tl.load(logits_ptr + n * stride + v, mask=v < V, other=float("-inf"))
            s += tl.sum(tl.exp(x), axis=0)                                 # underflows to 0
            count += tl.sum((x > x_tok).to(tl.int32), axis=0)
        tl.store(logprobs_ptr + n, x_tok - tl.log(s))
        tl.store(ranks_ptr + n, (count + 1).to(tl.int64))

    @triton.jit
    def ties_worst_rank(logits_ptr, sampled_ptr, logprobs_ptr, ranks_ptr, V, stride,
                        BLOCK_V: tl.constexpr):
        n = tl.program_id(0)
        x_tok = tl.load(logits_ptr + n * stride + tl.load(sampled_ptr + n))
        m, s, count = -3.0e38, 0.0, 0
        for start in range(0, V, BLOCK_V):
            v = start + tl.arange(0, BLOCK_V)
            x = tl.load(logits_ptr + n * stride + v, mask=v < V, other=float("-inf"))
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            m = m_new
            count += tl.sum((x >= x_tok).to(tl.int32), axis=0)            # vLLM's >=
        tl.store(logprobs_ptr + n, x_tok - (m + tl.log(s)))
        tl.store(ranks_ptr + n, count.to(tl.int64))

    for wrong, message in [
            (zero_padding, "case 'one row, V smaller than one block"),
            (no_max, "case 'all logits very negative': logprobs"),
            (ties_worst_rank, r"case 'ties share the best rank': ranks\[0\] is 60, expected 1")]:
        with pytest.raises(ExerciseFailed, match=message):
            check_sampled_logprobs_kernel(wrong)
    with pytest.raises(TypeError, match="@triton.jit"):
        check_sampled_logprobs_kernel(print)


# --- chapter 07: the sampled token stays on the device ---------------------------------------

@pytest.mark.slow
def test_wrong_post_update_kernels_fail_with_the_tensor_named():
    import triton
    import triton.language as tl

    @triton.jit
    def keeps_partial_chunks(idx_mapping_ptr, num_scheduled_ptr, sampled_ptr, token_ids_ptr,
                             num_computed_ptr, total_len_ptr, last_sampled_ptr, num_reqs,
                             max_model_len, token_ids_stride, BLOCK: tl.constexpr):
        b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = b < num_reqs
        row = tl.load(idx_mapping_ptr + b, mask=mask, other=0)
        n = tl.load(num_scheduled_ptr + b, mask=mask, other=0)
        sampled = tl.load(sampled_ptr + b, mask=mask, other=0).to(tl.int32)
        computed = tl.load(num_computed_ptr + row, mask=mask, other=0) + n
        total = tl.load(total_len_ptr + row, mask=mask, other=0)
        tl.store(num_computed_ptr + row, computed, mask=mask)
        keep = mask & (total < max_model_len)                      # every sample appended
        tl.store(token_ids_ptr + row * token_ids_stride + total, sampled, mask=keep)
        tl.store(total_len_ptr + row, total + 1, mask=keep)
        tl.store(last_sampled_ptr + row, sampled, mask=keep)

    @triton.jit
    def compares_before_adding(idx_mapping_ptr, num_scheduled_ptr, sampled_ptr, token_ids_ptr,
                               num_computed_ptr, total_len_ptr, last_sampled_ptr, num_reqs,
                               max_model_len, token_ids_stride, BLOCK: tl.constexpr):
        b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = b < num_reqs
        row = tl.load(idx_mapping_ptr + b, mask=mask, other=0)
        n = tl.load(num_scheduled_ptr + b, mask=mask, other=0)
        sampled = tl.load(sampled_ptr + b, mask=mask, other=0).to(tl.int32)
        before = tl.load(num_computed_ptr + row, mask=mask, other=0)
        total = tl.load(total_len_ptr + row, mask=mask, other=0)
        tl.store(num_computed_ptr + row, before + n, mask=mask)
        keep = mask & (before >= total) & (total < max_model_len)  # the count before the step
        tl.store(token_ids_ptr + row * token_ids_stride + total, sampled, mask=keep)
        tl.store(total_len_ptr + row, total + 1, mask=keep)
        tl.store(last_sampled_ptr + row, sampled, mask=keep)

    @triton.jit
    def no_mask(idx_mapping_ptr, num_scheduled_ptr, sampled_ptr, token_ids_ptr,
                num_computed_ptr, total_len_ptr, last_sampled_ptr, num_reqs,
                max_model_len, token_ids_stride, BLOCK: tl.constexpr):
        b = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)            # padding slots too
        row = tl.load(idx_mapping_ptr + b)
        computed = tl.load(num_computed_ptr + row) + tl.load(num_scheduled_ptr + b)
        total = tl.load(total_len_ptr + row)
        sampled = tl.load(sampled_ptr + b).to(tl.int32)
        tl.store(num_computed_ptr + row, computed)
        keep = (computed >= total) & (total < max_model_len)
        tl.store(token_ids_ptr + row * token_ids_stride + total, sampled, mask=keep)
        tl.store(total_len_ptr + row, total + 1, mask=keep)
        tl.store(last_sampled_ptr + row, sampled, mask=keep)

    for wrong, message in [
            (keeps_partial_chunks, ("case 'a partial prefill chunk: its sample is dropped': "
                                   "token_ids")),
            (compares_before_adding, "case 'decodes': token_ids"),
            (no_mask, r"(?s)case 'decodes'.*row 0 is in no real slot of this step: a padding")]:
        with pytest.raises(ExerciseFailed, match=message):
            check_post_update_kernel(wrong)
    with pytest.raises(TypeError, match="@triton.jit"):
        check_post_update_kernel(lambda: None)
