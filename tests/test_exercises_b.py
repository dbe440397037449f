"""The build-it-yourself exercises of chapters 08-12: solutions pass, wrong answers fail.

For each of ``check_graph_padding`` (08), ``check_accept_kernel`` (09),
``check_decode_roofline`` (10), ``check_tp_shard`` (11) and ``check_serve_stats`` (12): the
chapter's solution (notebooks/solutions/NN_*.py) passes, the learner copy's skeleton fails
with NotImplementedError, and plausible wrong answers fail with a message naming the case
or the output that is wrong.
"""

from __future__ import annotations

import json
import runpy
from pathlib import Path

import numpy as np
import pytest
import torch

from mrv2.exercises import (
    ExerciseFailed,
    check_accept_kernel,
    check_decode_roofline,
    check_graph_padding,
    check_serve_stats,
    check_tp_shard,
)

ROOT = Path(__file__).resolve().parent.parent
CHAPTERS = {"08_model_state_and_cuda_graphs": "pad_for_graph",
            "09_speculative_decoding": "accept_kernel",
            "10_full_runner_qwen3_and_benchmarks": "decode_step_roofline",
            "11_tensor_parallel": "rank_slice", "12_serving": "serve_stats"}


def _solution(stem: str):
    """The solution's function (its definitions run, its check call left out)."""
    source = (ROOT / "notebooks" / "solutions" / f"{stem}.py").read_text()
    ns: dict = {}
    exec(compile(source.replace("\ncheck_", "\n_ = check_"), stem, "exec"), ns)  # noqa: S102
    return ns[CHAPTERS[stem]]


@pytest.mark.parametrize("stem", CHAPTERS)
def test_solution_passes_and_skeleton_fails(stem, capsys):
    runpy.run_path(str(ROOT / "notebooks" / "solutions" / f"{stem}.py"), run_name="__solution__")
    assert "cases pass" in capsys.readouterr().out
    nb = json.loads((ROOT / "notebooks" / "clean" / f"{stem}.ipynb").read_text())
    cells = ["".join(c["source"]) for c in nb["cells"]
             if c["cell_type"] == "code" and "# your code here" in "".join(c["source"])]
    assert len(cells) == 1, stem
    with pytest.raises(ExerciseFailed, match="NotImplementedError"):
        exec(compile(cells[0], f"<{stem} skeleton>", "exec"), {"__name__": "__cell__"})  # noqa: S102


def test_wrong_graph_padding_fails():
    right = _solution("08_model_state_and_cuda_graphs")

    def largest_size(sizes, n, seq_lens, slots):        # always the largest graph
        out = right(sizes, n, seq_lens, slots)
        return out if out is None else right([sizes[-1]], n, seq_lens, slots)

    def slots_padded_with_zero(*args):                  # padding would overwrite slot 0
        out = right(*args)
        return out if out is None else (*out[:3], np.where(out[3] < 0, 0, out[3]))

    def qsl_keeps_growing(*args):                        # padding slots get a 1-token query
        out = right(*args)
        return out if out is None else (out[0], np.arange(out[0] + 1), *out[2:])

    def graphs_any_batch(sizes, n, seq_lens, slots):    # a prefill chunk is not a decode batch
        return right(sizes, np.ones_like(n), seq_lens, slots[:len(n)])

    for wrong, match in [(largest_size, "size is 8, expected 1"),
                         (slots_padded_with_zero, "slot_mapping"),
                         (qsl_keeps_growing, "query_start_loc"),
                         (graphs_any_batch, "prefill chunk.*runs eagerly")]:
        with pytest.raises(ExerciseFailed, match=match):
            check_graph_padding(wrong)
    with pytest.raises(TypeError, match="fn must be a function"):
        check_graph_padding(None)


@pytest.mark.slow
def test_wrong_accept_kernels_fail():
    import triton
    import triton.language as tl

    @triton.jit
    def ignores_k_b(draft_ptr, idx_mapping_ptr, target_ptr, num_spec_ptr, out_ptr, num_acc_ptr,
                    K, draft_stride, BLOCK_K1: tl.constexpr):
        b = tl.program_id(0)
        j = tl.arange(0, BLOCK_K1)
        row = tl.load(idx_mapping_ptr + b).to(tl.int64)
        d = tl.load(draft_ptr + row * draft_stride + j, mask=j < K, other=-1)   # all K drafts
        t = tl.load(target_ptr + b * (K + 1) + j, mask=j <= K, other=-1)
        a = tl.min(tl.where((j < K) & (d == t) & (d >= 0), BLOCK_K1, j), axis=0)
        tl.store(out_ptr + b * (K + 1) + j, tl.where(j < a, d, tl.where(j == a, t, -1)),
                 mask=j <= K)
        tl.store(num_acc_ptr + b, a)

    @triton.jit
    def batch_slot_as_row(draft_ptr, idx_mapping_ptr, target_ptr, num_spec_ptr, out_ptr,
                          num_acc_ptr, K, draft_stride, BLOCK_K1: tl.constexpr):
        b = tl.program_id(0)                                    # forgets idx_mapping
        j = tl.arange(0, BLOCK_K1)
        k_b = tl.load(num_spec_ptr + b)
        d = tl.load(draft_ptr + b * draft_stride + j, mask=j < k_b, other=-1)
        t = tl.load(target_ptr + b * (K + 1) + j, mask=j <= K, other=-1)
        a = tl.min(tl.where((j < k_b) & (d == t) & (d >= 0), BLOCK_K1, j), axis=0)
        tl.store(out_ptr + b * (K + 1) + j, tl.where(j < a, d, tl.where(j == a, t, -1)),
                 mask=j <= K)
        tl.store(num_acc_ptr + b, a)

    @triton.jit
    def no_target_token(draft_ptr, idx_mapping_ptr, target_ptr, num_spec_ptr, out_ptr,
                        num_acc_ptr, K, draft_stride, BLOCK_K1: tl.constexpr):
        b = tl.program_id(0)
        j = tl.arange(0, BLOCK_K1)
        row = tl.load(idx_mapping_ptr + b).to(tl.int64)
        k_b = tl.load(num_spec_ptr + b)
        d = tl.load(draft_ptr + row * draft_stride + j, mask=j < k_b, other=-1)
        t = tl.load(target_ptr + b * (K + 1) + j, mask=j <= K, other=-1)
        a = tl.min(tl.where((j < k_b) & (d == t) & (d >= 0), BLOCK_K1, j), axis=0)
        tl.store(out_ptr + b * (K + 1) + j, tl.where(j < a, d, -1), mask=j <= K)  # no bonus
        tl.store(num_acc_ptr + b, a)

    for wrong, match in [(ignores_k_b, "K_b = 0.*out"), (batch_slot_as_row, "idx_mapping"),
                         (no_target_token, "bonus token.*out\\[3\\]")]:
        with pytest.raises(ExerciseFailed, match=match):
            check_accept_kernel(wrong)
    with pytest.raises(TypeError, match="@triton.jit"):
        check_accept_kernel(print)


def test_wrong_rooflines_fail():
    right = _solution("10_full_runner_qwen3_and_benchmarks")

    def lm_head_always(cfg, nbytes, batch, context, bw):     # counts a tied lm_head twice
        return right({**cfg, "tie_word_embeddings": False}, nbytes, batch, context, bw)

    def k_only(cfg, nbytes, batch, context, bw):             # forgets the V half of the cache
        w, kv, _ = right(cfg, nbytes, batch, context, bw)
        return w, kv / 2, (w + kv / 2) / (bw * 1e9) * 1e3

    def no_gqa(cfg, nbytes, batch, context, bw):             # as many KV heads as query heads
        return right({**cfg, "num_key_value_heads": cfg["num_attention_heads"]}, nbytes, batch,
                     context, bw)

    def seconds(cfg, nbytes, batch, context, bw):            # step time in s, not ms
        w, kv, ms = right(cfg, nbytes, batch, context, bw)
        return w, kv, ms / 1e3

    for wrong, match in [(lm_head_always, "0.6B.*weight_bytes"), (k_only, "kv_bytes"),
                         (no_gqa, "0.6B.*weight_bytes"), (seconds, "step_ms")]:
        with pytest.raises(ExerciseFailed, match=match):
            check_decode_roofline(wrong)
    with pytest.raises(ExerciseFailed, match="return \\(weight_bytes"):
        check_decode_roofline(lambda *a: 1.0)


def test_wrong_tp_shards_fail():
    right = _solution("11_tensor_parallel")

    def kv_not_replicated(name, full, cfg, tp, rank):        # rank r takes KV head r, always
        if name.endswith(("k_proj.weight", "v_proj.weight")) and cfg.num_key_value_heads < tp:
            return full[rank * cfg.head_dim:(rank + 1) * cfg.head_dim].clone()
        return right(name, full, cfg, tp, rank)

    def rows_everywhere(name, full, cfg, tp, rank):          # o_proj / down_proj split like q
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            n = full.shape[0] // tp
            return full[rank * n:(rank + 1) * n].clone()
        return right(name, full, cfg, tp, rank)

    def bias_split(name, full, cfg, tp, rank):               # the row-parallel bias split too
        if name.endswith("o_proj.bias"):
            n = full.shape[0] // tp
            return full[rank * n:(rank + 1) * n].clone()
        return right(name, full, cfg, tp, rank)

    def no_vocab_padding(name, full, cfg, tp, rank):         # the last shard comes up short
        if "embed_tokens" in name or "lm_head" in name:
            n = -(-cfg.vocab_size // tp)
            return full[rank * n:(rank + 1) * n].clone()
        return right(name, full, cfg, tp, rank)

    for wrong, match in [(kv_not_replicated, "replicated"), (rows_everywhere, "row-parallel"),
                         (bias_split, "o_proj bias"), (no_vocab_padding, "zero padding")]:
        with pytest.raises(ExerciseFailed, match=match):
            check_tp_shard(wrong)


def test_tp_shard_checker_recombines_the_mlp():
    right = _solution("11_tensor_parallel")

    def swapped_ranks(name, full, cfg, tp, rank):            # pieces fine alone, never together
        if "mlp.down_proj" in name and tp == 2 and full.shape == (16, 24):
            return right(name, full, cfg, tp, 1 - rank)
        return right(name, full, cfg, tp, rank)

    with pytest.raises(ExerciseFailed, match="recombine"):
        from mrv2.exercises import ch11_12
        ch11_12._mlp_recombines(swapped_ranks, torch.Generator().manual_seed(0))


def test_wrong_serve_stats_fail():
    right = _solution("12_serving")

    def per_token(recs):                                     # TPOT over tokens, not tokens - 1
        out = right(recs)
        fixed = [{**r, "tokens": r["tokens"] + 1} for r in recs]
        out["tpot_ms"] = right(fixed)["tpot_ms"]
        return out

    def itl_from_start(recs):                                # the first gap is the TTFT
        out = right(recs)
        out["itl_ms"] = right([{**r, "chunks": [r["start"], *r["chunks"]]} if r["chunks"] else r
                               for r in recs])["itl_ms"]
        return out

    def keeps_failures(recs):                                # a failed request is counted
        return right([{**r, "error": None} for r in recs])

    def in_seconds(recs):
        out = right(recs)
        return {k: {s: (v if v is None else v / 1e3) for s, v in d.items()}
                for k, d in out.items()}

    for wrong, match in [(per_token, "tpot_ms"), (itl_from_start, "itl_ms"),
                         (keeps_failures, "failed request"), (in_seconds, "ttft_ms")]:
        with pytest.raises(ExerciseFailed, match=match):
            check_serve_stats(wrong)
    with pytest.raises(ExerciseFailed, match="return a dict"):
        check_serve_stats(lambda recs: None)
