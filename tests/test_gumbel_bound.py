"""The Gumbel sampler's one-word bound: g <= -log(E_lb(hi)), and both kernel paths.

The kernel scores every logit with an upper bound from the first hash word only, computes
the exact score of the best-bounded logit, and falls back to every exact score only when
another logit's bound comes within a slack of it. These tests check the bound on the RNG's
extreme words, and that both paths (the fast one and the fallback) return the reference's
ids, with one row per program so that each row takes its own path.
"""

import pytest
import torch
from device_utils import on_device

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels.gumbel import gumbel_sample, gumbel_sample_ref
from mrv2.kernels.gumbel_rng import (
    GREEDY_TEMPERATURE,
    gumbel_noise_ref,
    hash_words_ref,
    words_to_gumbel_ref,
)

gumbel_sample = on_device(gumbel_sample)


def _bound(hi: torch.Tensor) -> torch.Tensor:
    """The kernel's per-logit bound on g, in float64 (exact logs): -log(E_lb), E_lb the larger
    of 1 - u_up (floored at 2**-66) and -log(u_up) - 1e-5, u_up = (top 23 bits of hi + 1) /
    2**23."""
    u_up = ((hi >> 9) + 1).to(torch.float64) * 2.0 ** -23
    e_small = (1.0 - u_up).clamp(min=2.0 ** -66)
    return -torch.maximum(e_small, -u_up.log() - 1e-5).log()


def test_bound_holds_on_extreme_and_random_words():
    # ~hi = 0, 1, 2, ... (w -> 0, the top of g), around the series switch at 2**28,
    # and near 2**32 (u -> 0); every lo extreme with each.
    hi_c = torch.tensor([0, 1, 2, 3, 255, 2**24 - 1, 2**24, 2**28 - 1, 2**28, 2**28 + 1,
                         2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64)
    lo = torch.tensor([0, 1, 2**31, 2**32 - 2, 2**32 - 1], dtype=torch.int64)
    hi = (hi_c[:, None] ^ 0xFFFFFFFF).expand(-1, lo.numel()).reshape(-1)
    lo = lo.repeat(hi_c.numel())
    g = torch.Generator().manual_seed(0)
    hi = torch.cat([hi, torch.randint(0, 2**32, (200_000,), generator=g)])
    lo = torch.cat([lo, torch.randint(0, 2**32, (200_000,), generator=g)])
    gum = words_to_gumbel_ref(hi, lo).double()
    # the kernel's slack is 1e-4 + 2**-18 * (|best| + 92): the bound alone needs far less
    assert (gum <= _bound(hi) + 2e-5).all()
    # and it is tight: at the top of g within log(1 + 1 / j) + 1e-3, j = ~hi >> 9 the
    # distance of hi's top 23 bits from all ones (1 - u_up = j / 2**23 while 1 - u < (j + 1)
    # / 2**23), and elsewhere within 3e-3 (the 1e-5 margin on E ~ 0.01, the 9 low bits of hi
    # u_up drops). j = 0 (u_up = 1, one logit in 2**23) takes the floor: its bound wins its
    # block, so that logit gets its exact score (the fallback tests below cover the paths).
    hi_c = (hi ^ 0xFFFFFFFF).double()
    j = (hi ^ 0xFFFFFFFF) >> 9
    top = (j >= 1) & (hi_c < 2**20)
    assert top.sum() > 10
    assert ((_bound(hi) - gum)[top] <= torch.log1p(1 / j[top].double()) + 1e-3).all()
    assert (_bound(hi)[j == 0] >= 45.0).all() and (j == 0).sum() >= 10
    rest = (hi_c >= 2**20) & (hi >= 2**24)           # below u ~ 2**-8 g never wins
    assert ((_bound(hi) - gum)[rest] <= 3e-3).all()
    # the one-word bound of before (E >= ~hi / 2**32 only) was loose by ~0.42 on average
    assert (_bound(hi) - gum)[rest].mean() < 1e-3


def _fallback_rows_ref(logits, idx_mapping, temperature, seed, pos, block_v):
    """Which rows take the kernel's fallback (a torch mirror of its decision, float64 bound)."""
    req = idx_mapping.long()
    temp = temperature[req]
    hi, _ = hash_words_ref(seed[req], pos, logits.shape[1])
    safe_t = torch.where(temp < GREEDY_TEMPERATURE, 1.0, temp).double()
    ub = logits.double() / safe_t[:, None] + _bound(hi)
    noise = words_to_gumbel_ref(*hash_words_ref(seed[req], pos, logits.shape[1]))
    score = logits / safe_t.float()[:, None] + noise
    out = torch.zeros(logits.shape[0], dtype=torch.bool)
    for start in range(0, logits.shape[1], block_v):
        blk_ub, blk_s = ub[:, start:start + block_v], score[:, start:start + block_v]
        star = blk_ub.argmax(dim=1, keepdim=True)
        best = blk_s.gather(1, star).double()
        slack = 1e-4 + (best.abs() + 92.0) * 2.0 ** -18
        out |= (blk_ub >= best - slack).sum(dim=1) > 1
    return out & (temp >= GREEDY_TEMPERATURE)


def test_fast_path_and_fallback_both_equal_the_reference():
    g = torch.Generator().manual_seed(11)
    num_rows, vocab, block_v = 48, 700, 256                    # 3 blocks, the last one partial
    logits = torch.randn(num_rows, vocab, generator=g) * 2
    logits[0:8] = 0.0                                          # flat rows: the top noise wins
    logits[8:16, :50] = 7.0                                    # 50-way ties at the top
    logits[16:24] *= 40.0                                      # peaked rows
    logits[24:28, 300:] = float("-inf")                        # whole masked blocks
    logits[28:30, 10] = 1e4                                    # one far-ahead token
    temp = torch.rand(num_rows, generator=g) * 1.5 + 0.2
    temp[30:34] = 0.0                                          # greedy rows
    temp[34:38] = 2e-5                                         # barely sampled: big |x / T|
    temp[38:42] = 1e3                                          # very flat
    seed = torch.randint(0, 2**62, (num_rows,), generator=g)
    pos = torch.randint(0, 10_000, (num_rows,), generator=g)
    idx = torch.arange(num_rows, dtype=torch.int32)
    fallback = _fallback_rows_ref(logits, idx, temp, seed, pos, block_v)
    assert fallback.any() and (~fallback).sum() > num_rows // 2   # both paths are exercised
    # NOTE: bound=True: the interpreter skips the bound on small tiles by default.
    out = gumbel_sample(logits, idx, temp, seed, pos, block_v=block_v, block_b=1, bound=True)
    assert torch.equal(out, gumbel_sample_ref(logits, idx, temp, seed, pos))
    # the same rows, several per program (any fallback in a tile takes the whole tile)
    out4 = gumbel_sample(logits, idx, temp, seed, pos, block_v=block_v, block_b=4, bound=True)
    assert torch.equal(out4, out)
    # and every logit's exact score, without the bound (the interpreter's small tiles)
    assert torch.equal(gumbel_sample(logits, idx, temp, seed, pos, block_v=block_v,
                                     bound=False), out)


def test_sub_chunks_of_a_block_equal_the_reference():
    """A program walks its block ``sub_v`` logits at a time (the GPU default: 1024 of 4096):
    the running (max, argmax), the runner-up bound and the fallback across sub-chunks give
    the reference's ids, ties across sub-chunks to the lowest id, all-greedy tiles too."""
    g = torch.Generator().manual_seed(13)
    num_rows, vocab, block_v = 24, 700, 256
    logits = torch.randn(num_rows, vocab, generator=g) * 2
    logits[0:4] = 0.0                                          # flat rows
    logits[4:8, 60:70] = 6.0                                   # ties spanning sub-chunks
    logits[4:8, 200:210] = 6.0
    logits[8:10, 256:] = float("-inf")                         # whole masked blocks
    logits[10:12, :] = float("-inf")
    logits[10:12, 511] = 1.0                                   # the last id of a block
    logits[12:14, 3] = 1e4
    temp = torch.rand(num_rows, generator=g) * 1.5 + 0.2
    temp[14:17] = 0.0                                          # greedy rows
    seed = torch.randint(0, 2**62, (num_rows,), generator=g)
    pos = torch.randint(0, 10_000, (num_rows,), generator=g)
    idx = torch.randperm(num_rows, generator=g).to(torch.int32)
    ref = gumbel_sample_ref(logits, idx, temp, seed, pos)
    for sub_v in (32, 128):
        for block_b, bound in ((1, True), (4, True), (2, False)):
            out = gumbel_sample(logits, idx, temp, seed, pos, block_v=block_v, block_b=block_b,
                                sub_v=sub_v, bound=bound)
            assert torch.equal(out, ref), (sub_v, block_b, bound)
    # The best bound in sub-chunk 1 while the exact winner sits in sub-chunk 0: the earlier
    # best must stay the runner-up bound when the later sub-chunk takes over.
    f_seed, f_pos = torch.tensor([77]), torch.tensor([5])
    hi, _ = hash_words_ref(f_seed, f_pos, 256)
    noise = gumbel_noise_ref(f_seed, f_pos, 256)[0].double()
    gap = _bound(hi[0]) - noise                      # bound - exact noise, >= 0
    a = int(gap[:128].argmin())                      # tight bound, in sub-chunk 0
    b = 128 + int(gap[128:].argmax())                # loose bound, in sub-chunk 1
    delta = float(gap[b] - gap[a]) / 2
    assert delta > 1e-4                              # well above fp32's ulp at 10
    trap = torch.full((1, 256), float("-inf"))
    trap[0, a] = float(10.0 + delta - noise[a])      # exact: 10 + delta (the winner)
    trap[0, b] = float(10.0 - noise[b])              # exact: 10, bound: 10 + 2 * delta + ...
    one = torch.zeros(1, dtype=torch.int32)
    out = gumbel_sample(trap, one, torch.ones(1), f_seed, f_pos, block_v=256, block_b=1,
                        sub_v=128, bound=True)
    assert int(out[0]) == a == int(gumbel_sample_ref(trap, one, torch.ones(1), f_seed, f_pos)[0])
    greedy = torch.zeros(num_rows)                             # the all-greedy branch
    out = gumbel_sample(logits, idx, greedy, seed, pos, block_v=block_v, sub_v=32)
    assert torch.equal(out, gumbel_sample_ref(logits, idx, greedy, seed, pos))
    for bad in (24, 512, 8):
        with pytest.raises(ValueError, match="sub_v"):
            gumbel_sample(logits, idx, temp, seed, pos, block_v=block_v, sub_v=bad)


def test_one_block_and_one_row():
    g = torch.Generator().manual_seed(12)
    logits = torch.randn(1, 100, generator=g)
    temp, seed = torch.tensor([0.7]), torch.tensor([5], dtype=torch.int64)
    pos, idx = torch.tensor([3]), torch.zeros(1, dtype=torch.int32)
    for bound in (True, False):
        out = gumbel_sample(logits, idx, temp, seed, pos, block_v=128, block_b=1,  # SINGLE_BLOCK
                            bound=bound)
        assert torch.equal(out, gumbel_sample_ref(logits, idx, temp, seed, pos))


def _same_lane_trap(f_seed, f_pos, sub_v, winner_first):
    """Logits [1, 4 * sub_v] whose exact winner a and a loose-bound decoy b sit in the same
    lane (b = a +- sub_v: one column of the per-lane state): the decoy has the best bound,
    so the winner's bound is that lane's runner-up and must force the exact pass."""
    vocab = 4 * sub_v
    hi, _ = hash_words_ref(f_seed, f_pos, vocab)
    noise = gumbel_noise_ref(f_seed, f_pos, vocab)[0].double()
    gap = _bound(hi[0]) - noise                                       # bound - exact, >= 0
    lanes = torch.arange(sub_v)
    d = gap[lanes + sub_v] - gap[lanes] if winner_first else gap[lanes] - gap[lanes + sub_v]
    lane = int(d.argmax())
    a, b = (lane, lane + sub_v) if winner_first else (lane + sub_v, lane)
    delta = float(d[lane]) / 2
    assert delta > 1e-4                              # well above fp32's ulp at 10
    trap = torch.full((1, vocab), float("-inf"))
    trap[0, a] = float(10.0 + delta - noise[a])                       # exact: 10 + delta
    trap[0, b] = float(10.0 - noise[b])                               # exact: 10; bound higher
    return trap, a


@pytest.mark.parametrize("winner_first", [True, False])
def test_runner_up_in_the_winning_lane(winner_first):
    f_seed, f_pos, sub_v = torch.tensor([91]), torch.tensor([4]), 32
    trap, a = _same_lane_trap(f_seed, f_pos, sub_v, winner_first)
    one = torch.zeros(1, dtype=torch.int32)
    out = gumbel_sample(trap, one, torch.ones(1), f_seed, f_pos, block_v=trap.shape[1],
                        block_b=1, sub_v=sub_v, bound=True)
    assert int(out[0]) == a == int(gumbel_sample_ref(trap, one, torch.ones(1), f_seed, f_pos)[0])


def test_per_lane_edge_cases_equal_the_reference():
    """The bound path with a many-chunk walk: one row, V smaller than sub_v, V not a
    multiple of the block, all -inf rows, greedy ties in one lane and across lanes."""
    g = torch.Generator().manual_seed(21)
    one = torch.zeros(1, dtype=torch.int32)
    for vocab in (20, 100, 1000):                                    # < sub_v, partial, 8 blocks
        logits = torch.randn(1, vocab, generator=g) * 3
        for t in (0.0, 0.8):
            temp = torch.tensor([t])
            out = gumbel_sample(logits, one, temp, torch.tensor([3]), torch.tensor([9]),
                                block_v=128, block_b=1, sub_v=32, bound=True)
            assert torch.equal(out, gumbel_sample_ref(logits, one, temp, torch.tensor([3]),
                                                      torch.tensor([9])))
    num_rows, vocab = 8, 300
    logits = torch.randn(num_rows, vocab, generator=g)
    logits[0] = float("-inf")                                         # all -inf, sampled
    logits[1] = float("-inf")                                         # all -inf, greedy
    logits[2, [69, 37, 40, 101]] = 9.0                                # greedy ties: lane 5 x 3
    logits[3, [140, 12]] = 9.0                                        # a later lane first
    temp = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.5, 1.0, 1e3, 0.0])
    seed = torch.randint(0, 2**62, (num_rows,), generator=g)
    pos = torch.randint(0, 10_000, (num_rows,), generator=g)
    idx = torch.arange(num_rows, dtype=torch.int32)
    ref = gumbel_sample_ref(logits, idx, temp, seed, pos)
    assert ref[:4].tolist() == [0, 0, 37, 12]                         # by hand
    for block_b in (1, 8):
        out = gumbel_sample(logits, idx, temp, seed, pos, block_v=128, block_b=block_b,
                            sub_v=32, bound=True)
        assert torch.equal(out, ref), block_b
