"""Draft verification: kernels vs references, exact == non-speculative sampling, and
chi-squared checks that probabilistic verification samples the target distribution."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy import stats

from mrv2.kernels.gumbel import gumbel_noise_ref, gumbel_sample, gumbel_sample_ref
from mrv2.kernels.input_prep import prepare_inputs
from mrv2.kernels.top_k_top_p import apply_top_k_top_p_min_p, apply_top_k_top_p_min_p_ref
from mrv2.platform import TRITON_INTERPRET
from mrv2.spec_decode.draft_slots import spec_post_update, write_draft_slots
from mrv2.spec_decode.ngram import ngram_propose
from mrv2.spec_decode.verify import (
    exact_verify,
    exact_verify_ref,
    probabilistic_verify,
    probabilistic_verify_ref,
)

# NOTE: CPU tensors throughout (the interpreter's); on a GPU machine the launches reject them
# (job D). The GPU twins of the kernel-vs-reference checks are in test_gpu_spec_kernels.py.
pytestmark = pytest.mark.skipif(not TRITON_INTERPRET, reason="CPU tensors: the interpreter only")


class _State:
    """The state table's sampling columns (``[R]`` each)."""

    def __init__(self, temperature, top_k=None, top_p=None, min_p=None, seed=None):
        r = temperature.shape[0]
        self.temperature = temperature.to(torch.float32)
        self.top_k = torch.full((r,), -1, dtype=torch.int32) if top_k is None else top_k
        self.top_p = torch.ones(r) if top_p is None else top_p
        self.min_p = torch.zeros(r) if min_p is None else min_p
        self.seed = torch.arange(r, dtype=torch.int64) * 7919 + 3 if seed is None else seed

    def cols(self):
        return self.temperature, self.top_k, self.top_p, self.min_p, self.seed


def _mixed_state():
    # Row 0 greedy; rows 1-3 sampled with top-k / top-p / min-p; row 4 plain T = 1.3.
    return _State(torch.tensor([0.0, 0.7, 1.0, 1.5, 1.3]),
                  torch.tensor([-1, 5, -1, 8, -1], dtype=torch.int32),
                  torch.tensor([1.0, 0.9, 0.8, 1.0, 1.0]),
                  torch.tensor([0.0, 0.0, 0.05, 0.0, 0.0]))


def _assert_same(got, ref):
    for name in ("output_token_ids", "num_output_tokens", "num_accepted", "sampled"):
        assert torch.equal(getattr(got, name).long(), getattr(ref, name).long()), name


# --- exact ---------------------------------------------------------------------------------

@pytest.mark.parametrize("num_reqs, k, vocab", [(8, 3, 20), (1, 1, 16), (6, 4, 5000)])
def test_exact_vs_reference_and_edge_slots(num_reqs, k, vocab):
    gen = torch.Generator().manual_seed(num_reqs * 100 + k)
    st = _mixed_state()
    logits = torch.randn(num_reqs * (k + 1), vocab, generator=gen) * 2
    idx = torch.randint(0, 5, (num_reqs,), generator=gen, dtype=torch.int32)
    idx[0] = 1
    base = torch.randint(0, 500, (num_reqs,), generator=gen)
    # The target's own samples (from the reference) decide which drafts must be accepted.
    rep_idx = idx.long().repeat_interleave(k + 1)                            # [B * (K + 1)]
    rep_pos = (base[:, None] + 1 + torch.arange(k + 1)).reshape(-1)
    own = gumbel_sample_ref(apply_top_k_top_p_min_p_ref(logits, rep_idx, *st.cols()[:4]),
                            rep_idx, st.temperature, st.seed, rep_pos).view(num_reqs, k + 1)
    drafts = torch.randint(0, vocab, (num_reqs, k), generator=gen, dtype=torch.int32)
    drafts[0] = own[0, :k]                                   # slot 0: all accepted + bonus
    if num_reqs > 1:
        drafts[1] = own[1, :k]
        drafts[1, 0] = (own[1, 0] + 1) % vocab               # slot 1: first rejected
    if num_reqs > 2:
        drafts[2] = -1                                       # slot 2: no proposal
    if num_reqs > 3:
        drafts[3] = own[3, :k]
        drafts[3, 1:] = -1                                   # slot 3: one draft, accepted
    got = exact_verify(logits.clone(), drafts, idx, base, st)
    ref = exact_verify_ref(logits, drafts, idx, base, *st.cols())
    _assert_same(got, ref)
    out, num_acc = got.output_token_ids, got.num_accepted
    assert int(num_acc[0]) == k and out[0].tolist() == own[0].tolist()
    if num_reqs > 3:
        assert num_acc[1:4].tolist() == [0, 0, 1]
        assert out[1].tolist() == [int(own[1, 0])] + [-1] * k
        assert out[2].tolist() == [int(own[2, 0])] + [-1] * k   # the plain decode's sample
        assert out[3, :2].tolist() == own[3, :2].tolist()


def test_exact_empty_batch_and_bad_inputs():
    st = _mixed_state()
    got = exact_verify(torch.zeros(0, 16), torch.zeros(0, 2, dtype=torch.int32),
                       torch.zeros(0, dtype=torch.int32), torch.zeros(0, dtype=torch.int64), st)
    assert got.output_token_ids.shape == (0, 3) and got.num_accepted.shape == (0,)
    with pytest.raises(ValueError, match="logits"):
        exact_verify(torch.zeros(5, 16), torch.zeros(2, 2, dtype=torch.int32),
                     torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), st)
    with pytest.raises(ValueError, match="draft_token_ids"):
        exact_verify(torch.zeros(6, 16), torch.zeros(2, 2, dtype=torch.int64),
                     torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int64), st)


def _sample_plain(logits, idx, st, pos):
    """The non-speculative sampler: mask, then Gumbel-max at the sampled position."""
    logits = apply_top_k_top_p_min_p(logits.clone(), idx, st.temperature, st.top_k, st.top_p,
                                     st.min_p)
    return gumbel_sample(logits, idx, st.temperature, st.seed, pos)


@pytest.mark.parametrize("k", [1, 3])
def test_exact_equals_sequential_sampling(k):
    """Token for token what the plain sampler returns, through the runner's device path."""
    # A bigram "model" (next-token logits depend on the previous token) over 8 tokens, so
    # sequences repeat and the n-gram proposer has something to propose.
    vocab, steps, prompt_len = 8, 12, 6
    gen = torch.Generator().manual_seed(k)
    table = torch.randn(vocab, vocab, generator=gen) * 2.5                    # [prev, next]
    # Greedy; T = 0.8 with top-k, top-p and min-p at once; two plain temperatures.
    # NOTE: one filtered row only: the mask kernel is the slow part under the interpreter.
    st = _State(torch.tensor([0.0, 0.8, 1.0, 1.5]),
                torch.tensor([-1, 5, -1, -1], dtype=torch.int32),
                torch.tensor([1.0, 0.9, 1.0, 1.0]), torch.tensor([0.0, 0.05, 0.0, 0.0]))
    rows = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
    prompts = torch.randint(0, vocab, (4, prompt_len), generator=gen, dtype=torch.int32)
    # Sequential: one token per step at position len(seq).
    seqs = prompts.clone()
    for _ in range(steps):
        pos = torch.full((4,), seqs.shape[1], dtype=torch.int64)
        nxt = _sample_plain(table[seqs[:, -1].long()], rows, st, pos)
        seqs = torch.cat([seqs, nxt[:, None].to(torch.int32)], 1)
    # Speculative, on the device state the runner will use: n-gram drafts (slot 0 gets the
    # oracle's, so it runs all-accepted steps) -> draft slots -> prepare_inputs (1 + K query
    # tokens) -> the bigram's logits -> exact_verify -> spec_post_update.
    width = prompt_len + steps + k + 2
    table_state = SimpleNamespace(
        token_ids=torch.zeros(4, width, dtype=torch.int32),
        total_len=torch.full((4,), prompt_len, dtype=torch.int32),
        num_computed_tokens=torch.full((4,), prompt_len - 1, dtype=torch.int32),
        last_sampled_token=torch.full((4,), -1, dtype=torch.int32),
        draft_token_ids=torch.full((4, k), -1, dtype=torch.int32))
    table_state.token_ids[:, :prompt_len] = prompts
    buf = {name: torch.zeros(4 * (k + 1) + 1, dtype=torch.int32) for name in
           ("query_start_loc", "seq_lens", "input_ids", "positions", "logits_indices")}
    accepted_any = 0
    while int(table_state.total_len.min()) < prompt_len + steps:
        idx = rows[table_state.total_len < prompt_len + steps]   # the unfinished rows
        num_reqs = idx.shape[0]
        drafts, _ = ngram_propose(idx, table_state.token_ids, table_state.total_len, k, 1, 2)
        if int(idx[0]) == 0:
            at = int(table_state.total_len[0])
            oracle = seqs[0, at:at + k]
            drafts[0, :oracle.numel()] = oracle
        write_draft_slots(drafts, idx, num_reqs, table_state)
        n_sched = torch.full((num_reqs,), k + 1, dtype=torch.int32)
        prepare_inputs(idx, n_sched, num_reqs, num_reqs * (k + 1), table_state, **buf)
        input_ids = buf["input_ids"][:num_reqs * (k + 1)].long()          # [B * (1 + K)]
        base_positions = buf["positions"][buf["query_start_loc"][:num_reqs].long()]
        res = exact_verify(table[input_ids], drafts, idx, base_positions, st)
        accepted_any += int(res.num_accepted.sum())
        spec_post_update(idx, n_sched, torch.full((num_reqs,), k, dtype=torch.int32),
                         res.output_token_ids, res.num_output_tokens, num_reqs, table_state)
    token_ids = table_state.token_ids
    assert accepted_any > 0
    assert torch.equal(token_ids[:, :prompt_len + steps], seqs)


# --- probabilistic: kernel vs reference ------------------------------------------------------

@pytest.mark.parametrize("with_q", [False, True])
@pytest.mark.parametrize("num_reqs, k, vocab, block_v", [(9, 3, 24, None), (1, 1, 16, None),
                                                         (4, 2, 300, 64)])
def test_probabilistic_vs_reference(with_q, num_reqs, k, vocab, block_v):
    gen = torch.Generator().manual_seed(num_reqs + 7 * k + with_q)
    st = _mixed_state()
    logits = torch.randn(num_reqs * (k + 1), vocab, generator=gen) * 2
    idx = torch.randint(0, 5, (num_reqs,), generator=gen, dtype=torch.int32)
    base = torch.randint(0, 500, (num_reqs,), generator=gen)
    drafts = torch.randint(0, 4, (num_reqs, k), generator=gen, dtype=torch.int32)  # likely tokens
    drafts[-1, -1] = -1
    q = torch.softmax(torch.randn(num_reqs * k, vocab, generator=gen), 1) if with_q else None
    got = probabilistic_verify(logits.clone(), drafts, idx, base, st, q, block_v=block_v)
    ref = probabilistic_verify_ref(logits, drafts, idx, base, *st.cols(), draft_probs=q)
    _assert_same(got, ref)


def test_probabilistic_greedy_rows_equal_exact():
    gen = torch.Generator().manual_seed(5)
    st = _State(torch.zeros(3))
    logits = torch.randn(6 * 4, 12, generator=gen)
    argmax = logits.argmax(1).view(6, 4).to(torch.int32)
    drafts = argmax[:, :3].clone()
    drafts[1, 0], drafts[2, 2], drafts[3] = (drafts[1, 0] + 1) % 12, -1, -1
    idx, base = torch.tensor([0, 1, 2, 0, 1, 2], dtype=torch.int32), torch.arange(6) * 10
    p = probabilistic_verify(logits.clone(), drafts, idx, base, st)
    e = exact_verify(logits.clone(), drafts, idx, base, st)
    assert torch.equal(p.output_token_ids, e.output_token_ids)
    assert p.num_accepted.tolist() == [3, 0, 2, 0, 3, 3]


def test_probabilistic_empty_batch_and_bad_q():
    st = _mixed_state()
    got = probabilistic_verify(torch.zeros(0, 16), torch.zeros(0, 2, dtype=torch.int32),
                               torch.zeros(0, dtype=torch.int32), torch.zeros(0), st)
    assert got.output_token_ids.shape == (0, 3)
    with pytest.raises(ValueError, match="draft_probs"):
        probabilistic_verify(torch.zeros(6, 16), torch.zeros(2, 2, dtype=torch.int32),
                             torch.zeros(2, dtype=torch.int32), torch.zeros(2), st,
                             torch.zeros(6, 16))


# --- probabilistic: the output distribution ---------------------------------------------------

def _filtered_probs_np(logits: np.ndarray, temp: float, top_k: int, top_p: float) -> np.ndarray:
    """softmax(logits / T) after top-k and top-p, in float64 (an independent re-derivation)."""
    s = logits.astype(np.float64) / temp
    order = np.argsort(-s, kind="stable")
    keep = np.zeros(s.size, dtype=bool)
    p_sorted = np.exp(s[order] - s.max())
    p_sorted /= p_sorted.sum()
    mass_before = np.cumsum(p_sorted) - p_sorted
    ranks = np.arange(s.size)
    keep[order] = ((ranks < top_k) if top_k > 0 else True) & ((mass_before < top_p) | (ranks == 0))
    p = np.where(keep, np.exp(s - s.max()), 0.0)
    return p / p.sum()


def _chi2_p(tokens: np.ndarray, probs: np.ndarray) -> float:
    """Chi-squared p-value of ``tokens`` against ``probs``; impossible tokens must not appear."""
    counts = np.bincount(tokens, minlength=probs.size).astype(np.float64)
    assert counts[probs == 0].sum() == 0, "a token outside the target's support was returned"
    exp = probs * tokens.size
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    if (~big & (probs > 0)).any():                                  # pool the small bins
        obs_b.append(counts[~big].sum())
        exp_b.append(exp[~big].sum())
    return stats.chisquare(obs_b, np.array(exp_b) * sum(obs_b) / sum(exp_b)).pvalue


def _setup(k, temp, top_k, top_p, num_trials, seed):
    vocab = 16
    gen = torch.Generator().manual_seed(seed)
    base = torch.randn(k + 1, vocab, generator=gen) * 1.5                       # [K + 1, V]
    one = _State(torch.full((k + 1,), temp), torch.full((k + 1,), top_k, dtype=torch.int32),
                 torch.full((k + 1,), top_p))
    masked = apply_top_k_top_p_min_p(base.clone(), torch.arange(k + 1, dtype=torch.int32),
                                     *one.cols()[:4])
    target = np.stack([_filtered_probs_np(base[j].numpy(), temp, top_k, top_p)
                       for j in range(k + 1)])                                    # [K + 1, V]
    st = _State(torch.full((num_trials,), temp), seed=torch.arange(num_trials) * 104729 + seed)
    return gen, base, masked, target, st


def _draw_drafts(q, st, k, base_pos):
    """Drafts x ~ q by Gumbel-max with stream 0 at (seed, position): a coupled draft model."""
    n = q.shape[0] // k
    rows = torch.arange(n, dtype=torch.int32).repeat_interleave(k)
    pos = (base_pos[:, None] + 1 + torch.arange(k)).reshape(-1)
    x = gumbel_sample(torch.log(q), rows, torch.ones(n), st.seed, pos)
    return x.view(n, k).to(torch.int32)


def _check_positions(res, target, k, min_count=300):
    out = res.output_token_ids.numpy()
    n_out = res.num_output_tokens.numpy()
    tested = []
    for j in range(k + 1):
        reached = out[n_out > j, j]
        if reached.size >= min_count:
            tested.append(_chi2_p(reached, target[j]))
    return tested


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("temp, top_k, top_p", [(0.5, -1, 1.0), (1.0, 10, 1.0), (2.0, 12, 0.85)])
def test_probabilistic_matches_target_distribution(k, temp, top_k, top_p):
    n = 3000                                           # trials per draft kind
    gen, base, masked, target, st = _setup(k, temp, top_k, top_p, 3 * n, seed=11 * k)
    logits = masked.repeat(3 * n, 1)                   # [3n * (K + 1), V]: trials share logits
    base_pos = torch.randint(0, 1000, (3 * n,), generator=gen)
    # Close draft: the target's (unfiltered) softmax, slightly perturbed.
    close = torch.softmax(base[:k] / temp + 0.3 * torch.randn(k, 16, generator=gen), 1)
    # Adversarial: all of q on 4 tokens the target finds unlikely (one may be filtered out).
    narrow = torch.zeros(k, 16)
    for j in range(k):
        low = np.argsort(target[j])
        picks = list(low[target[j][low] > 0][:3]) + [int(low[0])]
        narrow[j, picks] += torch.tensor([0.4, 0.3, 0.2, 0.1])
    q = torch.cat([close.repeat(n, 1), narrow.repeat(n, 1)])                    # [2n * K, V]
    drafts = _draw_drafts(q, st, k, base_pos[:2 * n])
    idx = torch.arange(3 * n, dtype=torch.int32)
    res = probabilistic_verify(logits[:2 * n * (k + 1)].clone(), drafts, idx[:2 * n],
                               base_pos[:2 * n], st, q, needs_top_k_top_p=False)
    # Point-mass (n-gram) drafts: arbitrary tokens, here uniform over 3 of them.
    pm = torch.randint(0, 3, (n, k), generator=gen, dtype=torch.int32)
    res_pm = probabilistic_verify(logits[2 * n * (k + 1):].clone(), pm, idx[2 * n:],
                                  base_pos[2 * n:], st, None, needs_top_k_top_p=False)
    for part in (slice(0, n), slice(n, 2 * n)):
        sub = type(res)(*(t[part] for t in res[:3]), res.sampled)
        pvals = _check_positions(sub, target, k)
        assert pvals and min(pvals) > 1e-3, pvals
    pvals = _check_positions(res_pm, target, k)
    assert pvals and min(pvals) > 1e-3, pvals


def test_reusing_the_draft_noise_is_detected():
    # The same trials verified twice: with independent streams (unbiased) and with the
    # draft's own stream-0 noise reused for the uniform and the residual (biased).
    k, n, temp = 1, 20000, 1.0
    gen, base, masked, target, st = _setup(k, temp, -1, 1.0, n, seed=3)
    base_pos = torch.randint(0, 1000, (n,), generator=gen)
    q = torch.softmax(base[:k] / temp + 0.8 * torch.randn(k, 16, generator=gen), 1).repeat(n, 1)
    drafts = _draw_drafts(q, st, k, base_pos)
    logits = masked.repeat(n, 1)
    idx = torch.arange(n, dtype=torch.int32)
    honest = probabilistic_verify(logits.clone(), drafts, idx, base_pos, st, q,
                                  needs_top_k_top_p=False)
    assert min(_check_positions(honest, target, k)) > 1e-3
    # Stream 0 at the verification rows' (seed, position): row j of trial b is position
    # base_pos[b] + j + 1, the very noise that drew draft j.
    rep_pos = (base_pos[:, None] + 1 + torch.arange(k + 1)).reshape(-1)
    g0 = gumbel_noise_ref(st.seed.repeat_interleave(k + 1), rep_pos, 16)       # [n(K+1), V]
    x = torch.cat([drafts.long(), torch.zeros(n, 1, dtype=torch.long)], 1).reshape(-1)
    u_reused = torch.exp(-torch.exp(-g0.gather(1, x[:, None])[:, 0]))          # the draft's uniform
    biased = probabilistic_verify_ref(logits, drafts, idx, base_pos, *st.cols(), draft_probs=q,
                                      uniforms=u_reused, residual_noise=g0)
    assert _chi2_p(biased.output_token_ids[:, 0].numpy(), target[0]) < 1e-6


@pytest.mark.parametrize("with_q", [False, True])
def test_minus_one_draft_is_no_draft_a_plain_sample_of_p(with_q):
    # The runner's prefill / plain-decode rows (K_b = 0: every draft -1) and a request whose
    # second draft is -1 after an always-accepted first one: the output at a -1 position is
    # a plain sample of p there, whatever q holds (here q puts all its mass on the token p
    # likes best: a q that was read would move mass off it).
    k, n, temp = 2, 4000, 1.0
    gen, _, masked, target, st = _setup(k, temp, 12, 1.0, 2 * n, seed=21)
    base_pos = torch.randint(0, 1000, (2 * n,), generator=gen)
    drafts = torch.full((2 * n, k), -1, dtype=torch.int32)
    sure = torch.full((k + 1, 16), -1e4)                     # row 0: one token only, p = 1
    sure[0, 5] = 0.0
    logits = torch.cat([masked.repeat(n, 1), torch.cat([sure[:1], masked[1:]]).repeat(n, 1)])
    drafts[n:, 0] = 5
    q = None
    if with_q:
        q = torch.zeros(2 * n * k, 16)
        q[torch.arange(2 * n * k), torch.from_numpy(target.argmax(1)[:k]).repeat(2 * n)] = 1.0
        q[n * k::k] = torch.eye(16)[5]                       # the real draft: x = 5, q(x) = 1
    idx = torch.arange(2 * n, dtype=torch.int32)
    res = probabilistic_verify(logits.clone(), drafts, idx, base_pos, st, q,
                               needs_top_k_top_p=False)
    ref = probabilistic_verify_ref(logits, drafts, idx, base_pos, *st.cols(), draft_probs=q)
    _assert_same(res, ref)
    plain = type(res)(*(t[:n] for t in res[:3]), res.sampled)
    assert plain.num_output_tokens.eq(1).all()               # nothing to accept: one token
    assert min(_check_positions(plain, target, k)) > 1e-3
    after = type(res)(*(t[n:] for t in res[:3]), res.sampled)
    assert after.num_output_tokens.eq(2).all()               # x = 5 accepted, then -1: stop
    assert after.output_token_ids[:, 0].eq(5).all()
    assert _chi2_p(after.output_token_ids[:, 1].numpy(), target[1]) > 1e-3
