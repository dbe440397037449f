"""Chapter 07's checker: the kernel that keeps a step's sampled tokens on the device.

Under async scheduling step N+1 is planned and launched before anyone has seen step N's
tokens: the scheduler counts a placeholder, and the runner finds the real token on the device,
because right after sampling a kernel appends it to its state row (``token_ids[row,
total_len]``), where step N+1's ``prepare_inputs`` reads its decode input. The learner writes
that kernel (the package's is ``post_update``); it is compared with ``post_update_ref`` on the
cases a first attempt gets wrong: a partial prefill chunk (its sample is dropped), the last
chunk of a prompt (kept), a row with no room left, padding slots past ``num_reqs`` (their rows
must not be touched), more requests than ``BLOCK`` and an empty batch. See
notebooks/07_async_streams.ipynb.
"""

from __future__ import annotations

import numpy as np
import torch
import triton

from mrv2.exercises.checks import ExerciseFailed, _first_diff, _raised, _require_kernel
from mrv2.kernels.input_prep import post_update_ref

BLOCK = 4
_FIELDS = ("token_ids", "num_computed_tokens", "total_len", "last_sampled_token")


def _table(rng: np.random.Generator, rows: int, max_model_len: int) -> dict:
    """A state table mid-run: every row has known tokens, some already computed."""
    total = rng.integers(1, max_model_len, size=rows)                    # [R] known tokens
    computed = np.array([rng.integers(0, t) for t in total])              # [R] < total
    token_ids = rng.integers(1, 50, size=(rows, max_model_len))
    token_ids[np.arange(max_model_len)[None, :] >= total[:, None]] = 0    # past total_len: 0
    return {"token_ids": token_ids.astype(np.int32), "num_computed_tokens": computed.astype(
        np.int32), "total_len": total.astype(np.int32),
        "last_sampled_token": np.full(rows, -1, dtype=np.int32)}


def _post_cases(rng: np.random.Generator) -> list[tuple[str, dict, dict]]:
    """(name, state table, step) of check_post_update_kernel."""
    L = 12

    def case(total, computed, rows, counts, b_pad=None):
        t = _table(rng, 6, L)
        for r, (tot, comp) in enumerate(zip(total, computed)):
            t["total_len"][r], t["num_computed_tokens"][r] = tot, comp
            t["token_ids"][r, tot:] = 0
        n = len(rows)
        # NOTE: whole blocks of slots, as a padded batch has: a kernel that forgets the mask
        # reads padding slots (row 0), never memory past the tensors.
        b_pad = -(-max(n if b_pad is None else b_pad, 1) // BLOCK) * BLOCK
        idx = np.zeros(b_pad, dtype=np.int32)       # NOTE: padding slots point at row 0
        idx[:n] = rows
        sched = np.ones(b_pad, dtype=np.int32)      # NOTE: padding counts are don't-care
        sched[:n] = counts
        step = {"idx_mapping": idx, "num_scheduled_tokens": sched,
                "sampled": rng.integers(100, 200, size=b_pad).astype(np.int64), "num_reqs": n}
        return t, step

    tot, comp = [5, 9, 3, 7, 11, 2], [4, 2, 2, 6, 10, 1]   # rows 0, 2, 3, 4, 5: one token left
    cases = [
        ("decodes", *case(tot, comp, [2, 3, 5], [1, 1, 1])),
        ("a partial prefill chunk: its sample is dropped", *case(tot, comp, [1], [3])),
        ("the last chunk of a prompt: its sample is kept", *case(tot, comp, [1], [7])),
        ("a row with no room left (total_len == max_model_len)",
         *case([5, 9, L, 7, 11, 2], [4, 2, L - 1, 6, 10, 1], [2, 3], [1, 1])),
        ("padding slots past num_reqs (their rows untouched)", *case(tot, comp, [3, 4], [1, 1],
                                                                   b_pad=4)),
        ("more requests than BLOCK", *case(tot, comp, [5, 4, 3, 2, 0, 1], [1, 1, 1, 1, 1, 7])),
        ("empty batch", *case(tot, comp, [], [], b_pad=2)),
    ]
    for k in range(3):
        total = rng.integers(1, L + 1, size=6)                            # L: a full row
        computed = [int(rng.integers(0, t)) for t in total]
        n = int(rng.integers(1, 7))
        rows = rng.permutation(6)[:n]
        counts = [int(rng.integers(1, total[r] - computed[r] + 1)) for r in rows]  # chunk or rest
        cases.append((f"random batch {k}", *case(total, computed, rows, counts,
                                                 n + int(rng.integers(0, 3)))))
    return cases


def check_post_update_kernel(kernel, seed: int = 0) -> None:
    """Check a Triton ``post_update`` kernel against ``mrv2.kernels.input_prep.post_update_ref``.

    The kernel is launched as ``kernel[(cdiv(num_reqs, BLOCK),)](idx_mapping,
    num_scheduled_tokens, sampled, token_ids, num_computed_tokens, total_len,
    last_sampled_token, num_reqs, max_model_len, token_ids.stride(0), BLOCK=4)``: program
    ``p`` handles batch slots ``p * BLOCK + arange(BLOCK)`` below ``num_reqs`` (slots past it
    are padding and point at row 0). For slot ``b`` with ``row = idx_mapping[b]``:
    ``num_computed_tokens[row] += num_scheduled_tokens[b]``; then, only if that reaches
    ``total_len[row]`` (the step computed every known token: not a partial prefill chunk)
    and ``total_len[row] < max_model_len`` (room left), ``token_ids[row, total_len[row]] =
    sampled[b]``, ``total_len[row] += 1`` and ``last_sampled_token[row] = sampled[b]``. All
    state tensors are int32 ``[R]`` (``token_ids`` ``[R, max_model_len]``); ``sampled`` is
    int64 ``[B_pad]``.

    Args:
        kernel: a ``@triton.jit`` function with that signature.
        seed: the random cases' seed.

    Prints how many cases passed (all of them) and returns None, so that a notebook cell
    ending in the check shows only that line.

    Raises:
        TypeError: ``kernel`` is not a Triton kernel.
        ExerciseFailed: on the first case where a state tensor differs (or the launch raises).
    """
    _require_kernel(kernel)
    cases = _post_cases(np.random.default_rng(seed))
    for name, table, step in cases:
        mine = {k: torch.from_numpy(v.copy()) for k, v in table.items()}
        want = {k: torch.from_numpy(v.copy()) for k, v in table.items()}
        s = {k: torch.from_numpy(v) for k, v in step.items() if k != "num_reqs"}
        n = step["num_reqs"]
        post_update_ref(s["idx_mapping"], s["num_scheduled_tokens"], s["sampled"], n,
                        *(want[k] for k in _FIELDS))
        try:
            kernel[(triton.cdiv(n, BLOCK),)](
                s["idx_mapping"], s["num_scheduled_tokens"], s["sampled"],
                *(mine[k] for k in _FIELDS), n, mine["token_ids"].shape[1],
                mine["token_ids"].stride(0), BLOCK=BLOCK)
        except Exception as e:  # the learner's bug, reported with its case
            raise _raised(name, e, "the launch") from e
        shown = (f"num_reqs={n}, {({k: v.tolist() for k, v in step.items() if k != 'num_reqs'})}"
                 f", before: total_len={table['total_len'].tolist()}, num_computed_tokens="
                 f"{table['num_computed_tokens'].tolist()}, max_model_len="
                 f"{table['token_ids'].shape[1]}")
        batch_rows = set(step["idx_mapping"][:n].tolist())
        for field in _FIELDS:
            got, exp = mine[field].numpy(), want[field].numpy()
            msg = _first_diff(field, got, exp, name, shown)
            if msg:
                rows = np.flatnonzero((got != exp).reshape(got.shape[0], -1).any(axis=1))
                stray = [int(r) for r in rows if int(r) not in batch_rows]
                if stray:
                    msg += (f"\n  row {stray[0]} is in no real slot of this step: a padding slot "
                            f"(past num_reqs={n}) wrote it")
                raise ExerciseFailed(msg)
    print(f"check_post_update_kernel: all {len(cases)} cases pass")
