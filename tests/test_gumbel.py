"""Gumbel-max sampling kernel vs its torch reference, the RNG's tails, and the sampled law."""

import math

import numpy as np
import pytest
import torch
from device_utils import on_device
from scipy import stats
from script_loader import load_script

import mrv2  # noqa: F401  (turns on the interpreter without CUDA)
from mrv2.kernels.gumbel import gumbel_noise, gumbel_sample, gumbel_sample_ref
from mrv2.kernels.gumbel_rng import (
    _log_ref,
    _mix32_ref,
    _row_keys_ref,
    gumbel_noise_ref,
    hash_words_ref,
    key_words_ref,
    words_to_gumbel_ref,
)
from mrv2.platform import DEVICE

_on_device = on_device


gumbel_noise = _on_device(gumbel_noise)
gumbel_sample = _on_device(gumbel_sample)



def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _state(num_state_rows, g, greedy_frac=0.0):
    """Random per-state-row temperature [R] and seed [R] (full int64 range)."""
    temp = torch.rand(num_state_rows, generator=g) * 1.5 + 0.25
    temp[torch.rand(num_state_rows, generator=g) < greedy_frac] = 0.0
    seed = torch.randint(-2**63, 2**63 - 1, (num_state_rows,), generator=g, dtype=torch.int64)
    return temp, seed


# --- the RNG -----------------------------------------------------------------------------

def test_noise_kernel_equals_reference_bit_for_bit():
    g = _gen(0)
    seed = torch.randint(-2**63, 2**63 - 1, (37,), generator=g, dtype=torch.int64)
    pos = torch.randint(0, 2**40, (37,), generator=g, dtype=torch.int64)  # beyond 32 bits too
    pos[:3] = torch.tensor([0, 1, 2**31])
    noise = gumbel_noise(seed, pos, 3001, block_v=1024, block_b=16)  # V not a multiple of 1024
    ref = gumbel_noise_ref(seed, pos, 3001)
    assert torch.equal(noise.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(gumbel_noise(seed[:0], pos[:0], 10), torch.empty(0, 10))


def test_noise_is_a_function_of_seed_position_and_vocab_id_only():
    seed = torch.tensor([5, 5, 6, 5], dtype=torch.int64)
    pos = torch.tensor([9, 10, 9, 9], dtype=torch.int64)
    noise = gumbel_noise_ref(seed, pos, 64)
    assert torch.equal(noise[0], noise[3])
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    # the first 16 ids do not depend on the vocab size
    assert torch.equal(gumbel_noise_ref(seed, pos, 16), noise[:, :16])


def test_log_is_within_one_ulp():
    g = _gen(1)
    x = torch.exp(torch.rand(200_000, generator=g) * 100 - 60)  # 1e-26 .. 1e17
    got = _log_ref(x).double()
    want = torch.log(x.double())
    ulp = torch.from_numpy(np.spacing(np.abs(want.float().numpy()))).double()
    assert ((got - want).abs() / ulp).max() <= 1.0


def test_words_to_gumbel_is_accurate_in_both_tails():
    # Words at every scale: u (and 1 - u) from 2**-64 to 1/2, against float64 maths.
    g = _gen(2)
    n = 20_000
    shift = torch.randint(0, 64, (n,), generator=g)
    k = (torch.randint(0, 2**62, (n,), generator=g) >> shift.clamp(max=62))  # log-uniform-ish
    hi, lo = (k >> 32) & 0xFFFFFFFF, k & 0xFFFFFFFF
    flip = torch.rand(n, generator=g) < 0.5  # half near u = 0, half near u = 1
    hi = torch.where(flip, hi ^ 0xFFFFFFFF, hi)
    lo = torch.where(flip, lo ^ 0xFFFFFFFF, lo)
    got = words_to_gumbel_ref(hi, lo).double()
    u = (hi.double() * 2.0**32 + lo.double() + 0.5) / 2.0**64
    w = ((hi ^ 0xFFFFFFFF).double() * 2.0**32 + (lo ^ 0xFFFFFFFF).double() + 0.5) / 2.0**64
    e = torch.where(u < 0.5, -torch.log(u), -torch.log1p(-w))
    want = -torch.log(e)
    assert torch.allclose(got, want, rtol=3e-6, atol=3e-6)
    # the extremes: no -inf / inf, and the top reaches ~45 (a 24-bit uniform stops at 16.6)
    top = words_to_gumbel_ref(torch.tensor([0xFFFFFFFF]), torch.tensor([0xFFFFFFFF]))
    bottom = words_to_gumbel_ref(torch.tensor([0]), torch.tensor([0]))
    assert 44.9 < top.item() < 45.2 and -3.9 < bottom.item() < -3.7


def test_empirical_tails_match_the_gumbel_cdf():
    """1e6 kernel draws: counts beyond extreme quantiles vs the Gumbel CDF (binomial z < 5)."""
    seed = torch.arange(250, dtype=torch.int64) * 7919 + 11
    pos = torch.arange(250, dtype=torch.int64)
    noise = gumbel_noise(seed, pos, 4000).flatten().double()  # [1e6]
    n = noise.numel()
    for x in (-2.5, -2.0, -1.0, 0.0, 2.0, 5.0, 8.0, 10.0, 12.0):
        p_below = math.exp(-math.exp(-x))
        observed = (noise > x).sum().item() if x > 0 else (noise <= x).sum().item()
        p = 1 - p_below if x > 0 else p_below
        z = (observed - n * p) / math.sqrt(n * p * (1 - p))
        assert abs(z) < 5, (x, observed, n * p)
    assert abs(noise.mean().item() - 0.5772157) < 0.01
    assert abs(noise.std().item() - math.pi / math.sqrt(6)) < 0.01
    assert stats.kstest(noise.numpy(), stats.gumbel_r.cdf).pvalue > 1e-3
    # The top draws are all distinct (no quantisation of the right tail).
    assert torch.unique(noise.topk(200).values).numel() == 200


def test_hash_words_look_uniform():
    hi, lo = hash_words_ref(torch.arange(64, dtype=torch.int64), torch.zeros(64, dtype=torch.int64), 1024)
    for word in (hi, lo):
        counts = torch.bincount((word >> 28).flatten(), minlength=16).numpy()  # top 4 bits
        assert stats.chisquare(counts).pvalue > 1e-3
        bits = ((word[..., None] >> torch.arange(32)) & 1).double().mean(dim=(0, 1))
        assert (bits - 0.5).abs().max() < 0.01


_PHI, _V_QWEN = 0x9E3779B1, 151_936


def _weyl(v: np.ndarray) -> np.ndarray:
    """x = v * 0x9E3779B1 mod 2**32, the hash's input per vocab id (uint32)."""
    return (v.astype(np.uint64) * _PHI & 0xFFFFFFFF).astype(np.uint32)


def test_weyl_inputs_of_a_vocabulary_differ_in_at_least_four_bits():
    """The docstring's reason one finaliser round suffices: no two of the first 151,936 ids
    have inputs x within 3 bits of each other (so no weak small differential of the hash)."""
    import itertools

    x = _weyl(np.arange(_V_QWEN))
    inv = np.uint32(pow(_PHI, -1, 2**32))
    deltas = np.array([sum(1 << b for b in c) for w in (1, 2, 3)
                       for c in itertools.combinations(range(32), w)], dtype=np.uint32)
    for i in range(0, deltas.size, 64):
        other = (x[None, :] ^ deltas[i:i + 64, None]) * inv            # the id with x ^ d
        assert not (other < _V_QWEN).any()


def test_hash_words_top_bits_are_uniform_over_a_full_vocabulary():
    seed = torch.tensor([0, 1, -5, 2**62 + 3], dtype=torch.int64)
    pos = torch.tensor([0, 0, 77, 2**33], dtype=torch.int64)
    hi, lo = hash_words_ref(seed, pos, _V_QWEN)                          # [4, V] each
    for word in (hi, lo):
        for r in range(4):                                             # per row: 256 bins
            counts = torch.bincount(word[r] >> 24, minlength=256).numpy()
            assert stats.chisquare(counts).pvalue > 1e-4
        low = torch.bincount((word & 0xFF).flatten(), minlength=256).numpy()  # low bits too
        assert stats.chisquare(low).pvalue > 1e-4


def test_hi_and_lo_are_independent():
    """hi = mix(x ^ k1), lo = mix(x ^ k2): across a row, their top bits form an independent
    16 x 16 table and their correlation is at noise level; so do hi of ids v and v + 1."""
    seed = torch.arange(6, dtype=torch.int64) * 1_000_003
    pos = torch.arange(6, dtype=torch.int64) * 17
    hi, lo = hash_words_ref(seed, pos, 65_536)                           # [6, V]
    for a, b in ((hi, lo), (hi[:, :-1], hi[:, 1:]), (lo[:, :-1], lo[:, 1:])):
        for r in range(6):
            table = torch.zeros(16, 16, dtype=torch.int64)
            table.index_put_(((a[r] >> 28), (b[r] >> 28)), torch.ones_like(a[r]), accumulate=True)
            assert stats.chi2_contingency(table.numpy()).pvalue > 1e-4
            ua, ub = (a[r].double() + 0.5) / 2**32 - 0.5, (b[r].double() + 0.5) / 2**32 - 0.5
            z = (ua * ub).mean() * 12 * math.sqrt(a.shape[1])           # ~N(0, 1)
            assert abs(z) < 5


def test_closest_vocab_ids_are_uncorrelated_across_rows():
    """The pairs of ids whose inputs x are closest (4 bits apart) see the same xor
    difference in every row: over 4,096 (seed, position) rows their hi words must still
    be uncorrelated (a chi-squared of the pairs' z-scores)."""
    import itertools

    x = _weyl(np.arange(_V_QWEN))
    inv = np.uint32(pow(_PHI, -1, 2**32))
    pairs = []
    for c in itertools.combinations(range(32), 4):
        other = (x ^ np.uint32(sum(1 << b for b in c))) * inv
        a = np.nonzero((other < _V_QWEN) & (other > np.arange(_V_QWEN)))[0]
        pairs += list(zip(a.tolist(), other[a].tolist()))
        if len(pairs) >= 300:
            break
    a, b = (torch.tensor([p[i] for p in pairs[:300]]) for i in (0, 1))
    rows = 4096
    k1, k2 = _row_keys_ref(torch.full((rows,), 31337), torch.arange(rows))  # [rows] each
    # the words at those ids only (the whole [4096, V] would be 5 GB): hash_words_ref's
    # key_words_ref on an id subset, checked against it on the first ids
    ids = torch.cat([a, b])
    x = torch.from_numpy(_weyl(ids.numpy()).astype(np.int64))[None, :]
    hi, lo = _mix32_ref(x ^ k1[:, None]), _mix32_ref(x ^ k2[:, None])     # [rows, 600]
    first = key_words_ref(k1[:4], k2[:4], int(ids.max()) + 1)
    assert torch.equal(first[0][:, ids], hi[:4]) and torch.equal(first[1][:, ids], lo[:4])
    for w in (hi, lo):
        ua = (w[:, :300].double() + 0.5) / 2**32 - 0.5                    # [rows, pairs]
        ub = (w[:, 300:].double() + 0.5) / 2**32 - 0.5
        z = (ua * ub).mean(0) * 12 * math.sqrt(rows)                    # [pairs] ~N(0, 1)
        assert stats.chi2.sf(float((z ** 2).sum()), z.numel()) > 1e-4
        assert z.abs().max() < 5.5


# --- sampling vs the reference ----------------------------------------------------------

@pytest.mark.parametrize("num_rows, vocab, block_v, block_b, greedy_frac", [
    (1, 1000, 1024, None, 0.0),      # B = 1, V < BLOCK_V
    (7, 3000, 1024, 4, 0.3),         # V not a multiple of BLOCK_V, several row tiles
    (33, 2048, 512, 8, 0.5),         # V a multiple, greedy rows mixed in
    (5, 100, 1024, None, 1.0),       # all greedy
])
@pytest.mark.parametrize("bound", [None, True, False])
def test_sample_equals_reference(num_rows, vocab, block_v, block_b, greedy_frac, bound):
    g = _gen(num_rows)
    num_state_rows = num_rows + 9
    temp, seed = _state(num_state_rows, g, greedy_frac)
    idx_mapping = torch.randperm(num_state_rows, generator=g)[:num_rows].to(torch.int32)
    logits = torch.randn(num_rows, vocab, generator=g) * 2
    pos = torch.randint(0, 5000, (num_rows,), generator=g)
    out = gumbel_sample(logits, idx_mapping, temp, seed, pos, block_v=block_v, block_b=block_b,
                        bound=bound)
    assert out.dtype == torch.int64
    assert torch.equal(out, gumbel_sample_ref(logits, idx_mapping, temp, seed, pos))
    greedy = temp[idx_mapping.long()] == 0
    assert torch.equal(out[greedy], logits[greedy].argmax(-1))
    # `out=` is written and returned
    buf = torch.full((num_rows,), -1, dtype=torch.int64)
    assert gumbel_sample(logits, idx_mapping, temp, seed, pos, buf, block_v=block_v) is buf
    assert torch.equal(buf, out)


def test_empty_batch():
    temp, seed = _state(4, _gen(3))
    out = gumbel_sample(torch.empty(0, 50), torch.empty(0, dtype=torch.int32), temp, seed,
                        torch.empty(0, dtype=torch.int64))
    assert out.shape == (0,) and out.dtype == torch.int64


def test_masked_tokens_are_never_drawn():
    g = _gen(4)
    num_rows, vocab = 64, 700
    logits = torch.full((num_rows, vocab), float("-inf"))
    only = torch.randint(0, vocab, (num_rows,), generator=g)
    logits[torch.arange(num_rows), only] = torch.randn(num_rows, generator=g) * 50
    temp = torch.tensor([0.0, 0.5, 1.0, 100.0]).repeat(16)
    seed = torch.randint(0, 2**62, (num_rows,), generator=g)
    pos = torch.arange(num_rows)
    idx = torch.arange(num_rows, dtype=torch.int32)
    # all -inf but one (the survivor in the middle, first, or last block)
    assert torch.equal(gumbel_sample(logits, idx, temp, seed, pos, block_v=256), only)
    # half the vocab masked, a very flat distribution at T = 100: never a masked id
    logits = torch.randn(num_rows, vocab, generator=g)
    logits[:, ::2] = float("-inf")
    out = gumbel_sample(logits, idx, temp, seed, pos, block_v=256)
    assert (out % 2 == 1).all()


def test_ties_go_to_the_lowest_index():
    logits = torch.zeros(3, 2500)
    logits[0, [7, 1500, 2400]] = 3.0   # the tie spans three blocks
    logits[1, [2047, 2048]] = 1.0      # across a block edge
    logits[2] = float("-inf")          # everything masked: report id 0
    temp = torch.zeros(3)
    idx = torch.arange(3, dtype=torch.int32)
    seed = torch.zeros(3, dtype=torch.int64)
    out = gumbel_sample(logits, idx, temp, seed, torch.zeros(3, dtype=torch.int64), block_v=1024)
    assert out.tolist() == [7, 2047, 0]


def test_batch_invariance():
    """A row samples the same token alone, at another slot of a batch of 64, through another
    state row, with padding rows around it."""
    g = _gen(5)
    vocab, num_state_rows = 1500, 80
    temp, seed = _state(num_state_rows, g)
    logits = torch.randn(64, vocab, generator=g) * 3
    pos = torch.randint(0, 4096, (64,), generator=g)
    idx = torch.randperm(num_state_rows, generator=g)[:64].to(torch.int32)
    batch = gumbel_sample(logits, idx, temp, seed, pos)
    for b in (0, 17, 63):
        alone = gumbel_sample(logits[b:b + 1], idx[b:b + 1], temp, seed, pos[b:b + 1])
        assert alone.item() == batch[b].item()
    # the same request moved to slot 5 of a padded batch, its state in another row
    r = int(idx[17])
    temp2, seed2 = temp.clone(), seed.clone()
    temp2[3], seed2[3] = temp[r], seed[r]
    idx2 = torch.zeros(9, dtype=torch.int32)  # padding rows point at row 0
    idx2[5] = 3
    logits2 = torch.randn(9, vocab, generator=g)
    logits2[5] = logits[17]
    pos2 = torch.zeros(9, dtype=torch.int64)
    pos2[5] = pos[17]
    moved = gumbel_sample(logits2, idx2, temp2, seed2, pos2, block_v=512, block_b=2)
    assert moved[5].item() == batch[17].item()


def test_other_seeds_or_positions_sample_other_tokens():
    vocab = 1000
    logits = torch.zeros(1, vocab).expand(32, vocab).contiguous()  # uniform
    idx = torch.arange(32, dtype=torch.int32)
    temp = torch.ones(32)
    same = torch.full((32,), 123, dtype=torch.int64)
    by_seed = gumbel_sample(logits, idx, temp, torch.arange(32), torch.zeros(32, dtype=torch.int64))
    by_pos = gumbel_sample(logits, idx, temp, same, torch.arange(32))
    assert by_seed.unique().numel() > 25 and by_pos.unique().numel() > 25
    repeat = gumbel_sample(logits, idx, temp, same, torch.full((32,), 7))
    assert repeat.unique().numel() == 1


# --- the sampled law ---------------------------------------------------------------------

def _chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Chi-squared p-value, pooling the tokens expected < 5 times into one bin."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # fold a too-small pool into the smallest big bin
        i = np.argmin(exp[:-1])
        obs[i] += obs[-1]
        exp[i] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    return stats.chisquare(obs, exp * obs.sum() / exp.sum()).pvalue


@pytest.mark.parametrize("vocab, block_v", [(50, 64), (200, 64)])  # V < block; V % block != 0
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_chi_squared_against_softmax(vocab, block_v, temperature):
    num = 12_000
    g = _gen(vocab)
    row = torch.randn(vocab, generator=g) * 1.5
    logits = row.expand(num, vocab).contiguous()                          # [N, V]
    idx = torch.zeros(num, dtype=torch.int32)
    temp = torch.tensor([temperature])
    seed = torch.tensor([vocab * 1000 + int(temperature * 10)], dtype=torch.int64)
    pos = torch.arange(num, dtype=torch.int64)                            # one request, N steps
    out = gumbel_sample(logits, idx, temp, seed, pos, block_v=block_v)
    counts = np.bincount(out.numpy(), minlength=vocab)
    probs = torch.softmax(row.double() / temperature, -1).numpy()
    assert _chi2_pvalue(counts, probs) > 1e-3
    # and the test can tell: a slightly wrong temperature is rejected
    wrong = torch.softmax(row.double() / (temperature * 1.25), -1).numpy()
    assert _chi2_pvalue(counts, wrong) < 1e-6


# --- the GPU -----------------------------------------------------------------------------

@pytest.mark.gpu
def test_gpu_bf16_logits_match_reference():
    g = _gen(6)
    num_rows, vocab, num_state_rows = 64, 151_936, 100
    temp, seed = _state(num_state_rows, g, greedy_frac=0.25)
    idx = torch.randperm(num_state_rows, generator=g)[:num_rows].to(torch.int32)
    logits = (torch.randn(num_rows, vocab, generator=g) * 3).to(torch.bfloat16)
    pos = torch.randint(0, 8192, (num_rows,), generator=g)
    args = [t.to(DEVICE) for t in (logits, idx, temp, seed, pos)]
    out = gumbel_sample(*args)
    assert torch.equal(out.cpu(), gumbel_sample_ref(logits, idx, temp, seed, pos))
    assert torch.equal(out, gumbel_sample_ref(*args).cpu())
    noise = gumbel_noise(args[3][:8], args[4][:8], vocab)
    assert torch.equal(noise.cpu(), gumbel_noise_ref(seed[:8], pos[:8], vocab))


def test_bench_script_smoke(tmp_path):

    bench = load_script("bench_sampler")
    report = bench.main(["--smoke", "--out", str(tmp_path / "s.json")])
    # One fp32 case and one with top-k/top-p; bf16 cases too on a GPU.
    assert (tmp_path / "s.json").exists()
    assert len(report["results"]) == (4 if torch.cuda.is_available() else 2)
    assert all(r["triton_us"] > 0 and r["torch_us"] > 0 for r in report["results"])
