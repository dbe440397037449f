"""Chapter 02's checker: the CPU half of the stable state table against ``RequestStateTable``.

The learner writes who owns which row: a free list that hands out row 0 first and reuses the
last freed row first, rows that never move while their request lives, and the step's
``idx_mapping`` (batch slot -> row) in the scheduler's batch order. Each case is a trace of
steps, replayed on the learner's class and on ``mrv2.state.RequestStateTable``; the checker
compares every row handed out or given back, and every ``idx_mapping``. See
notebooks/02_stable_state_table.ipynb.
"""

from __future__ import annotations

import numpy as np

from mrv2.exercises.checks import ExerciseFailed, _first_diff
from mrv2.state import RequestStateTable

#: A step: (requests that finish, requests admitted, the batch order of the step).
Step = tuple[list[str], list[str], list[str]]


def _random_trace(rng: np.random.Generator, num_rows: int, num_steps: int) -> list[Step]:
    live: list[str] = []
    steps, n = [], 0
    for _ in range(num_steps):
        finished = [r for r in live if rng.random() < 0.3]
        live = [r for r in live if r not in finished]
        new = [f"r{n + i}" for i in range(min(num_rows - len(live), int(rng.integers(0, 3))))]
        n += len(new)
        live += new
        steps.append((finished, new, [live[i] for i in rng.permutation(len(live))]))
    return steps


def _state_cases(rng: np.random.Generator) -> list[tuple[str, int, list[Step]]]:
    """(name, max_num_reqs, trace) of check_state_rows."""
    cases = [
        ("the first rows are handed out in order", 4, [([], ["a", "b", "c"], ["a", "b", "c"])]),
        ("a freed row is reused first", 4, [([], ["a", "b", "c"], ["a", "b", "c"]),
                                            (["b"], ["d"], ["a", "d", "c"])]),
        ("two freed rows: the last freed is reused first", 4,
         [([], ["a", "b", "c", "d"], ["a", "b", "c", "d"]), (["a", "c"], [], ["b", "d"]),
          ([], ["e", "f"], ["f", "e", "b", "d"])]),
        ("a live request keeps its row while others leave", 3,
         [([], ["a", "b", "c"], ["a", "b", "c"]), (["a"], [], ["c", "b"]),
          (["b"], [], ["c"]), ([], ["d", "e"], ["c", "e", "d"])]),
        ("batch order is not row order", 4, [([], ["a", "b", "c", "d"], ["d", "b", "a", "c"])]),
        ("an empty step (empty batch)", 2, [([], ["a"], ["a"]), (["a"], [], [])]),
        ("a row freed and taken again in one step", 2,
         [([], ["a"], ["a"]), ([], ["b"], ["a", "b"]), (["b"], ["c"], ["c", "a"])]),
    ]
    for k in range(3):
        cases.append((f"random trace {k}", 4, _random_trace(rng, 4, 12)))
    return cases


def _call(name: str, what: str, fn, *args):
    try:
        return fn(*args)
    except Exception as e:  # the learner's bug, reported with its case
        raise ExerciseFailed(f"case {name!r}: {what} raised {type(e).__name__}: {e}") from e


def check_state_rows(cls, seed: int = 0) -> None:
    """Check a class that hands out stable rows against ``mrv2.state.RequestStateTable``.

    Args:
        cls: ``cls(max_num_reqs)`` builds an empty table with methods ``add_request(req_id)
            -> row`` (a free row; the last freed first, row 0 first in a fresh table),
            ``remove_request(req_id) -> row`` (gives the row back) and
            ``idx_mapping(req_ids) -> np.ndarray`` (int32 ``[len(req_ids)]``, the row of
            each request, in that batch order). Adding to a full table must raise.
        seed: the random traces' seed.

    Prints how many cases passed (all of them) and returns None, so that a notebook cell
    ending in the check shows only that line.

    Raises:
        TypeError: ``cls`` is not callable.
        ExerciseFailed: on the first step where a row or ``idx_mapping`` differs (or the
            learner's code raises).
    """
    if not callable(cls):
        raise TypeError(f"cls must be a class, got {type(cls).__name__}")
    cases = _state_cases(np.random.default_rng(seed))
    for name, num_rows, trace in cases:
        ref = RequestStateTable(num_rows, max_model_len=4, device="cpu")
        mine = _call(name, f"{getattr(cls, '__name__', 'cls')}({num_rows})", cls, num_rows)
        for step, (finished, new, batch) in enumerate(trace):
            where = f"case {name!r}, step {step}"
            for req in finished:
                got = _call(name, f"remove_request({req!r})", mine.remove_request, req)
                want = ref.remove_request(req)
                if got != want:
                    raise ExerciseFailed(f"{where}: remove_request({req!r}) returned row {got}, "
                                         f"expected {want}\n  trace so far: {trace[:step + 1]}")
            for req in new:
                got = _call(name, f"add_request({req!r})", mine.add_request, req)
                want = ref.add_request(req, [1], prompt_len=1)
                if got != want:
                    raise ExerciseFailed(f"{where}: add_request({req!r}) returned row {got}, "
                                         f"expected {want} (rows by owner: {ref.req_ids})"
                                         f"\n  trace so far: {trace[:step + 1]}")
            got = _call(name, f"idx_mapping({batch})", mine.idx_mapping, list(batch))
            want = np.array([ref.row_of(r) for r in batch], dtype=np.int32)   # [B]
            msg = _first_diff("idx_mapping", got, want, f"{name}, step {step}",
                              f"batch {batch}, rows by owner {ref.req_ids}")
            if msg:
                raise ExerciseFailed(msg)
    mine = _call("a full table", f"{getattr(cls, '__name__', 'cls')}(2)", cls, 2)
    for req in ("a", "b"):
        _call("a full table", f"add_request({req!r})", mine.add_request, req)
    refused, row = False, None
    try:
        row = mine.add_request("c")
    except Exception:  # noqa: BLE001  (any exception: the table refused the request)
        refused = True
    if not refused:
        raise ExerciseFailed(f"case 'a full table': add_request('c') on a table of 2 rows, both "
                             f"in use, returned {row!r}; it must raise (RequestStateTable raises "
                             "RuntimeError)")
    print(f"check_state_rows: all {len(cases) + 1} cases pass")
