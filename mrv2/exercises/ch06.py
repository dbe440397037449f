"""Chapter 06's checker: a Triton kernel for the sampled token's logprob and rank.

One program per row walks the vocabulary in blocks of ``BLOCK_V`` with an online max /
sum-exp (the log-sum-exp, never a ``[N, V]`` log-softmax) and counts the logits strictly
above the sampled token's. It is compared with ``compute_topk_logprobs_ref`` (the full
``log_softmax``) on the cases a first attempt gets wrong: a vocabulary smaller than one block
and one not a multiple of the block, the sampled token being the most likely, ties, ``-inf``
logits, all-negative and very large logits (no max subtracted: ``exp`` overflows). See
notebooks/06_logprobs.ipynb.
"""

from __future__ import annotations

import numpy as np
import torch

from mrv2.exercises.checks import ExerciseFailed, _first_diff, _raised, _require_kernel
from mrv2.kernels.logprobs import compute_topk_logprobs_ref

_ATOL = 1e-4
BLOCK_V = 64


def _logprob_cases(gen: torch.Generator) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """(name, logits [N, V], sampled [N]) of check_sampled_logprobs_kernel."""
    def logits(n, v, scale=3.0):
        return torch.randn(n, v, generator=gen) * scale

    def tokens(n, v):
        return torch.randint(0, v, (n,), generator=gen)

    small = logits(2, 40)
    top = logits(3, 150)
    ties = torch.tensor([[1.0, 5.0, 5.0, 2.0, 5.0, 0.0] * 20])         # [1, 120] many ties
    ninf = logits(2, 100)
    ninf[:, 1::3] = float("-inf")                                      # banned tokens
    negative = logits(2, 130) - 1000.0                                 # lanes read as 0 win
    large = logits(2, 200) + 200.0                                     # exp(200) overflows fp32
    return [
        ("one row, V smaller than one block (masking)", small[:1], tokens(1, 40)),
        ("V several blocks, not a multiple of BLOCK_V", logits(3, 3 * BLOCK_V + 17),
         tokens(3, 3 * BLOCK_V + 17)),
        ("the sampled token is the most likely (rank 1)", top, top.argmax(1)),
        ("ties share the best rank", ties, torch.tensor([2])),
        ("-inf logits (banned tokens) count for nothing", ninf,
         torch.tensor([0, 2])),
        ("all logits very negative", negative, tokens(2, 130)),
        ("very large logits (subtract the max)", large, tokens(2, 200)),
        ("random batch", logits(6, 500), tokens(6, 500)),
    ]


def check_sampled_logprobs_kernel(kernel, seed: int = 0) -> None:
    """Check a Triton kernel of sampled-token logprobs and ranks against the package.

    The kernel is launched as ``kernel[(N,)](logits, sampled, logprobs, ranks, V,
    logits.stride(0), BLOCK_V=64)``: program ``n`` reads row ``n`` of the fp32 ``logits``
    ``[N, V]`` in blocks of ``BLOCK_V`` (``V`` is any size: loop and mask), and stores
    ``logprobs[n] = logits[n, t] - logsumexp(logits[n])`` (float32) and ``ranks[n] = 1 +
    #{v : logits[n, v] > logits[n, t]}`` (int64) with ``t = sampled[n]`` (int64). The
    reference is ``mrv2.kernels.logprobs.compute_topk_logprobs_ref(logits, 0, sampled)``.

    Args:
        kernel: a ``@triton.jit`` function with that signature.
        seed: the random cases' seed.

    Prints how many cases passed (all of them) and returns None, so that a notebook cell
    ending in the check shows only that line.

    Raises:
        TypeError: ``kernel`` is not a Triton kernel.
        ExerciseFailed: on the first case with a wrong rank or a logprob off by more than
            1e-4 (or when the launch raises).
    """
    _require_kernel(kernel)
    cases = _logprob_cases(torch.Generator().manual_seed(seed))
    for name, logits, sampled in cases:
        n, v = logits.shape
        _, want_lp, want_rank = compute_topk_logprobs_ref(logits, 0, sampled)   # [N, 1], [N]
        logprobs = torch.full((n,), float("nan"))
        ranks = torch.full((n,), -1, dtype=torch.int64)
        try:  # the interpreter computes in numpy: its inf/NaN warnings would only repeat ours
            with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
                kernel[(n,)](logits, sampled, logprobs, ranks, v, logits.stride(0),
                             BLOCK_V=BLOCK_V)
        except Exception as e:  # the learner's bug, reported with its case
            raise _raised(name, e, "the launch") from e
        shown = f"N={n}, V={v}, BLOCK_V={BLOCK_V}, sampled={sampled.tolist()}"
        msg = _first_diff("ranks", ranks.numpy(), want_rank.numpy(), name, shown)
        if msg:
            raise ExerciseFailed(msg)
        got, want = logprobs.numpy(), want_lp[:, 0].numpy()
        bad = np.flatnonzero(~(np.abs(got - want) <= _ATOL))          # NaN counts as wrong
        if bad.size:
            i = int(bad[0])
            raise ExerciseFailed(
                f"case {name!r}: logprobs[{i}] is {got[i]:.6g}, expected {want[i]:.6g} "
                f"({bad.size} rows off by more than {_ATOL})\n  got:      "
                f"{np.round(got, 4).tolist()}\n  expected: {np.round(want, 4).tolist()}"
                f"\n  inputs: {shown}")
    print(f"check_sampled_logprobs_kernel: all {len(cases)} cases pass")
