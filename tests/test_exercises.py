"""The book's exercises: learner copies in sync, solutions pass, wrong answers fail.

The checkers (``mrv2.exercises``) must tell a right answer from a wrong one: every solution
in notebooks/solutions/ passes its checker, the learner copy's skeleton (``# your code
here``) fails it, and so do a few plausible wrong answers, each with a message naming the
output that is wrong.
"""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from mrv2.exercises import (
    ExerciseFailed,
    check_gumbel_argmax_kernel,
    check_prepare_inputs,
    check_slot_mapping_kernel,
)

ROOT = Path(__file__).resolve().parent.parent
SOLUTIONS = sorted((ROOT / "notebooks" / "solutions").glob("*.py"))


def test_learner_copies_are_in_sync():
    proc = subprocess.run([sys.executable, "scripts/make_clean_notebooks.py", "--check"],
                          cwd=ROOT, capture_output=True, text=True, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr +
                                  "\nrun: python scripts/make_clean_notebooks.py")


def test_learner_copies_hold_no_outputs_and_no_solutions():
    for path in sorted((ROOT / "notebooks" / "clean").glob("*.ipynb")):
        nb = json.loads(path.read_text())
        for cell in nb["cells"]:
            src = "".join(cell["source"])
            assert "BEGIN SOLUTION" not in src, path.name
            assert "solution" not in cell["metadata"].get("tags", []), path.name
            assert not cell.get("outputs"), path.name
        assert "widgets" not in nb["metadata"], path.name


def test_the_kernel_chapters_have_an_exercise():
    assert {p.stem for p in SOLUTIONS} >= {"03_gather_block_tables", "04_triton_input_prep",
                                           "05_gumbel_sampling"}


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_solution_passes_its_checker(path, capsys):
    runpy.run_path(str(path), run_name="__solution__")
    assert "cases pass" in capsys.readouterr().out


def _exercise_cells(path: Path) -> list[str]:
    nb = json.loads(path.read_text())
    return ["".join(c["source"]) for c in nb["cells"]
            if c["cell_type"] == "code" and "# your code here" in "".join(c["source"])]


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.stem)
def test_skeleton_fails_its_checker(path):
    cells = _exercise_cells(ROOT / "notebooks" / "clean" / (path.stem + ".ipynb"))
    assert cells, f"no skeleton cell in the learner copy of {path.stem}"
    for code in cells:
        with pytest.raises(ExerciseFailed, match="NotImplementedError"):
            # running the learner's cell is the point of the test
            exec(compile(code, f"<{path.stem} skeleton>", "exec"),  # noqa: S102
                 {"__name__": "__cell__"})


def _solution_namespace(stem: str) -> dict:
    ns: dict = {}
    source = (ROOT / "notebooks" / "solutions" / f"{stem}.py").read_text()
    # the solution's definitions, without its check call
    exec(compile(source.replace("\ncheck_", "\n_ = check_"), stem, "exec"), ns)  # noqa: S102
    return ns


def test_wrong_prepare_inputs_fail_with_the_field_named():
    right = _solution_namespace("04_triton_input_prep")["prepare_inputs_np"]

    def positions_from_zero(*args):  # forgets num_computed_tokens
        qsl, seq_lens, ids, pos, li = right(*args)
        n = int(qsl[-1])
        starts = np.repeat(qsl[:-1], np.diff(qsl))
        pos = pos.copy()
        pos[:n] = np.arange(n) - starts
        return qsl, seq_lens, ids, pos, li

    def padding_not_zeroed(*args):  # padding slots keep a stale length
        qsl, seq_lens, ids, pos, li = right(*args)
        return qsl, np.where(seq_lens == 0, 1, seq_lens), ids, pos, li

    def first_token_logits(*args):  # samples from the first token instead of the last
        qsl, seq_lens, ids, pos, li = right(*args)
        return qsl, seq_lens, ids, pos, np.where(np.diff(qsl) > 0, qsl[:-1], li)

    for wrong, field in [(positions_from_zero, "positions"), (padding_not_zeroed, "seq_lens"),
                         (first_token_logits, "logits_indices")]:
        with pytest.raises(ExerciseFailed, match=field):
            check_prepare_inputs(wrong)
    with pytest.raises(ExerciseFailed, match="return the 5 arrays"):
        check_prepare_inputs(lambda *a: None)
    with pytest.raises(TypeError, match="fn must be a function"):
        check_prepare_inputs("not a function")


@pytest.mark.slow
def test_wrong_gumbel_kernels_fail():
    import triton
    import triton.language as tl

    @triton.jit
    def no_temperature(logits_ptr, noise_ptr, temperature_ptr, out_ptr, V, stride,
                       BLOCK_V: tl.constexpr):
        b = tl.program_id(0)
        v = tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + b * stride + v, mask=v < V, other=float("-inf"))
        g = tl.load(noise_ptr + b * V + v, mask=v < V, other=0.0)
        tl.store(out_ptr + b, tl.argmax(x + g, axis=0).to(tl.int64))   # ignores T and greedy

    @triton.jit
    def padding_wins(logits_ptr, noise_ptr, temperature_ptr, out_ptr, V, stride,
                     BLOCK_V: tl.constexpr):
        b = tl.program_id(0)
        v = tl.arange(0, BLOCK_V)
        x = tl.load(logits_ptr + b * stride + v, mask=v < V, other=0.0)   # 0, not -inf
        t = tl.load(temperature_ptr + b)
        g = tl.load(noise_ptr + b * V + v, mask=v < V, other=0.0)
        val = tl.where(t < 1e-5, x, x / tl.where(t < 1e-5, 1.0, t) + g)
        tl.store(out_ptr + b, tl.argmax(val, axis=0).to(tl.int64))

    for wrong, case in [(no_temperature, "greedy rows|V not a power"),
                        (padding_wins, "all logits negative")]:
        with pytest.raises(ExerciseFailed, match=case):
            check_gumbel_argmax_kernel(wrong)
    with pytest.raises(TypeError, match="@triton.jit"):
        check_gumbel_argmax_kernel(lambda: None)


@pytest.mark.slow
def test_wrong_slot_mapping_kernels_fail():
    import triton
    import triton.language as tl

    @triton.jit
    def no_loop(idx_mapping_ptr, query_start_loc_ptr, positions_ptr, block_table_ptr,
                out_ptr, table_stride, block_size, BLOCK: tl.constexpr):
        b = tl.program_id(0)
        row = tl.load(idx_mapping_ptr + b)
        start = tl.load(query_start_loc_ptr + b)
        end = tl.load(query_start_loc_ptr + b + 1)
        t = start + tl.arange(0, BLOCK)                       # only the first BLOCK tokens
        mask = t < end
        pos = tl.load(positions_ptr + t, mask=mask, other=0)
        block = tl.load(block_table_ptr + row * table_stride + pos // block_size, mask=mask)
        tl.store(out_ptr + t, block.to(tl.int64) * block_size + pos % block_size, mask=mask)

    @triton.jit
    def batch_slot_as_row(idx_mapping_ptr, query_start_loc_ptr, positions_ptr,
                          block_table_ptr, out_ptr, table_stride, block_size,
                          BLOCK: tl.constexpr):
        b = tl.program_id(0)                                  # forgets idx_mapping
        start = tl.load(query_start_loc_ptr + b)
        end = tl.load(query_start_loc_ptr + b + 1)
        for i in range(start, end, BLOCK):
            t = i + tl.arange(0, BLOCK)
            mask = t < end
            pos = tl.load(positions_ptr + t, mask=mask, other=0)
            block = tl.load(block_table_ptr + b * table_stride + pos // block_size, mask=mask)
            tl.store(out_ptr + t, block.to(tl.int64) * block_size + pos % block_size, mask=mask)

    for wrong, case in [(no_loop, "more tokens than BLOCK"), (batch_slot_as_row, "decode")]:
        with pytest.raises(ExerciseFailed, match=case):
            check_slot_mapping_kernel(wrong)
    with pytest.raises(TypeError, match="@triton.jit"):
        check_slot_mapping_kernel(print)
