"""Automatic prefix caching: the block pool's hash chain, ref counts, LRU eviction and
longest-prefix lookup (no model), then end to end: greedy and seeded outputs identical
with caching on and off (fp32, CPU) for shared prefixes, full hits, ``n > 1``,
preemption and eviction in a tight pool, chunked prefill, async on/off, both runners;
``num_cached_tokens`` reported; ``prompt_logprobs`` unchanged (those requests skip the
lookup); every block's ref count back to 0 and the pool whole at the end.
"""

import random

import pytest
from device_utils import generate_without_sync
from hypothesis import given, settings
from hypothesis import strategies as st

from mrv2 import LLM, SamplingParams
from mrv2.kv_cache import KVCacheManager
from mrv2.models.loader import DEFAULT_MODEL_DIR
from mrv2.request import Request


def _req(rid, tokens, **sp) -> Request:
    return Request(str(rid), tokens, SamplingParams(**sp), 0)


def _chain(tokens, bs, extra=()) -> list[int]:
    """The hash chain re-derived: block i's hash covers every token of blocks 0..i."""
    out, parent = [], 0
    for i in range(len(tokens) // bs):
        parent = hash((parent, tuple(tokens[i * bs:(i + 1) * bs]), extra))
        out.append(parent)
    return out


def _admit(kv, req, num_tokens=None):
    """Admission as the scheduler does it: lookup, allocate, cache what the step fills."""
    hits, num_hit = kv.get_computed_blocks(req)
    total = req.num_tokens if num_tokens is None else num_tokens
    assert kv.allocate(req.request_id, total, hits) is not None
    kv.cache_blocks(req, total)
    return num_hit


def _assert_pool_whole(kv):
    assert kv.num_free_blocks == kv.num_blocks and all(c == 0 for c in kv.ref_cnt)
    assert not kv.req_blocks


# -- the pool, no model ---------------------------------------------------------------


def test_hash_chain_covers_the_whole_prefix_and_extra_keys():
    kv = KVCacheManager(16, 4)
    a, b = _req("a", list(range(10))), _req("b", [99] + list(range(1, 10)))
    assert kv.block_hashes(a, 2) == _chain(list(range(10)), 4)
    # b differs in block 0 only; its block 1 has a's tokens but another parent.
    assert kv.block_hashes(b, 2)[1] != kv.block_hashes(a, 2)[1]
    salted = KVCacheManager(16, 4, extra_keys=lambda req: ("lora", 7))
    c = _req("c", list(range(10)))
    assert salted.block_hashes(c, 2) == _chain(list(range(10)), 4, ("lora", 7))
    assert salted.block_hashes(c, 2) != kv.block_hashes(a, 2)
    # Output tokens extend the chain across the prompt/output boundary, hashed once each.
    a.output_token_ids += [10, 11]
    assert kv.block_hashes(a, 3) == _chain(list(range(12)), 4)


def test_longest_prefix_lookup_and_full_hits():
    kv = KVCacheManager(32, 4)
    first = _req("p", list(range(13)))                      # 3 full blocks + 1 token
    _admit(kv, first)
    assert kv.num_cached_blocks == 3
    # Shares 2 full blocks, diverges inside the 3rd.
    assert kv.get_computed_blocks(_req("q", list(range(10)) + [50, 51, 52]))[1] == 8
    # The very same prompt: 12 tokens hit, the 13th is recomputed.
    assert kv.get_computed_blocks(_req("r", list(range(13))))[1] == 12
    # Block aligned (12 tokens, all cached): the last block is recomputed.
    hits, n = kv.get_computed_blocks(_req("s", list(range(12))))
    assert n == 8 and hits == kv.get_blocks("p")[:2]
    # One token, or prompt_logprobs: no lookup.
    assert kv.get_computed_blocks(_req("t", [0]))[1] == 0
    assert kv.get_computed_blocks(_req("u", list(range(13)), prompt_logprobs=1))[1] == 0
    off = KVCacheManager(32, 4, enable_caching=False)
    _admit(off, _req("p", list(range(13))))
    assert off.num_cached_blocks == 0
    assert off.get_computed_blocks(_req("r", list(range(13))))[1] == 0


def test_shared_blocks_are_ref_counted_and_survive_their_holders():
    kv = KVCacheManager(8, 4)
    a, b = _req("a", list(range(9))), _req("b", list(range(9)))
    assert _admit(kv, a) == 0 and _admit(kv, b) == 8
    shared = kv.get_blocks("a")[:2]
    assert kv.get_blocks("b")[:2] == shared and [kv.ref_cnt[x] for x in shared] == [2, 2]
    kv.free("a")
    assert [kv.ref_cnt[x] for x in shared] == [1, 1] and not set(shared) & set(kv.free_queue)
    kv.free("b")
    _assert_pool_whole(kv)
    assert kv.num_cached_blocks == 2                       # free, but still hittable
    assert _admit(kv, _req("c", list(range(9)))) == 8


def test_eviction_takes_uncached_blocks_first_then_the_least_recently_freed():
    kv = KVCacheManager(6, 2)
    _admit(kv, _req("old", [1, 2, 3, 4]))                  # 2 cached blocks
    _admit(kv, _req("new", [5, 6, 7, 8]))                  # 2 cached blocks
    _admit(kv, _req("odd", [9]))                           # 1 block, never full
    old, new = kv.get_blocks("old"), kv.get_blocks("new")
    for r in ("old", "new", "odd"):
        kv.free(r)
    assert kv.num_cached_blocks == 4
    first = kv.allocate("x", 4)                            # odd's block + the unused one
    assert sorted(first) == [4, 5] and kv.num_evictions == 0 and kv.num_cached_blocks == 4
    # Next: old's blocks (freed first), its last block before its first.
    assert kv.allocate("y", 2) == [old[1]] and kv.num_evictions == 1
    assert kv.get_computed_blocks(_req("o", [1, 2, 3, 4, 0]))[1] == 2  # old's 1st still hits
    assert kv.allocate("z", 2) == [old[0]]
    assert kv.get_computed_blocks(_req("o2", [1, 2, 3, 4, 0]))[1] == 0
    assert kv.get_computed_blocks(_req("n", [5, 6, 7, 8, 0]))[1] == 4
    assert kv.num_evictions == 2 and kv.num_cached_blocks == 2 and new == [2, 3]


def test_a_hit_on_free_blocks_counts_against_the_pool_and_fails_cleanly():
    kv = KVCacheManager(3, 2)
    _admit(kv, _req("a", [1, 2, 3, 4, 5]))                 # 3 blocks: 2 cached
    kv.free("a")
    b = _req("b", [1, 2, 3, 4, 6, 7, 8, 9])                # hits 2, needs 2 more: 4 > 3
    hits, n = kv.get_computed_blocks(b)
    assert n == 4 and kv.allocate("b", 8, hits) is None
    _assert_pool_whole(kv)
    assert kv.num_cached_blocks == 2                       # nothing evicted by the failure
    assert kv.allocate("b", 6, hits) == [kv.get_blocks("b")[2]]


def test_tokens_in_flight_are_not_cached_until_known():
    """Async scheduling computes a placeholder's KV before the CPU knows the token:
    the block holding it is cached only once the token is known."""
    kv = KVCacheManager(8, 2)
    r = _req("r", [1, 2, 3])
    _admit(kv, r)                                          # 3 computed: 1 full block
    kv.allocate("r", 4)
    kv.cache_blocks(r, 4)                                  # the 4th token is in flight
    assert kv.num_cached_blocks == 1
    r.output_token_ids.append(4)                           # the engine learns it
    kv.cache_blocks(r, 4)
    assert kv.num_cached_blocks == 2
    assert kv.get_computed_blocks(_req("s", [1, 2, 3, 4, 5]))[1] == 4


def test_reset_prefix_cache_forgets_hashes():
    kv = KVCacheManager(8, 2)
    _admit(kv, _req("a", [1, 2, 3, 4, 5]))
    kv.free("a")
    assert kv.reset_prefix_cache() == 2 and kv.num_cached_blocks == 0
    assert all(h is None for h in kv.block_hash)
    assert kv.get_computed_blocks(_req("b", [1, 2, 3, 4, 5]))[1] == 0


@settings(max_examples=120, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["add", "step", "step", "free", "readmit"]),
                              st.integers(0, 2**31)), max_size=50),
       bs=st.sampled_from([1, 2, 4]), num_blocks=st.integers(3, 24))
def test_pool_invariants_over_random_workloads(ops, bs, num_blocks):
    """Random admissions (3-token vocabulary: many hits), steps, frees and re-admissions.

    A shadow KV cache records, for each block a request writes, the token prefix its KV
    stands for. After every operation: no block both free and held; ref counts = holders;
    every cached block's hash = the re-derived chain hash of that prefix; every full
    computed block a request holds carries exactly that request's prefix.
    """
    kv = KVCacheManager(num_blocks, bs)
    live, gone, n = {}, [], 0               # live: req_id -> (Request, computed)
    written: dict[int, tuple] = {}          # block -> the token prefix its KV stands for

    def run(req, start, end):
        toks, blocks = req.all_token_ids, kv.get_blocks(req.request_id)
        for p in range(start, end):
            if p % bs == bs - 1:
                written[blocks[p // bs]] = tuple(toks[:p + 1])
        kv.cache_blocks(req, end)
        live[req.request_id] = (req, end)

    def admit(req, rng):
        hits, num_hit = kv.get_computed_blocks(req)
        assert num_hit % bs == 0 and num_hit < req.num_tokens
        end = rng.randint(num_hit + 1, req.num_tokens)
        free_before = kv.num_free_blocks
        new = kv.allocate(req.request_id, end, hits)
        if new is None:
            assert kv.num_free_blocks == free_before and req.request_id not in kv.req_blocks
            return False
        for b in new:
            written.pop(b, None)
        run(req, num_hit, end)
        return True

    for op, seed in ops:
        rng = random.Random(seed)
        if op == "add":
            req = _req(n, [rng.randrange(3) for _ in range(rng.randint(1, 12))])
            n += 1
            if not admit(req, rng):
                gone.append(req)
        elif op == "readmit" and gone:
            req = gone.pop(rng.randrange(len(gone)))
            if not admit(req, rng):
                gone.append(req)
        elif op == "step" and live:
            req, done = live[rng.choice(sorted(live))]
            if done == req.num_tokens:
                req.output_token_ids.append(rng.randrange(3))   # "sampled"
            end = rng.randint(done + 1, req.num_tokens)
            new = kv.allocate(req.request_id, end)
            if new is not None:
                for b in new:
                    written.pop(b, None)
                run(req, done, end)
        elif op == "free" and live:
            req, _ = live.pop(rng.choice(sorted(live)))
            kv.free(req.request_id)
            gone.append(req)                                    # preempted: may come back
        # Invariants.
        held = [b for blocks in kv.req_blocks.values() for b in blocks]
        assert not set(held) & set(kv.free_queue)
        assert len(set(held)) + kv.num_free_blocks == num_blocks
        assert all(kv.ref_cnt[b] == held.count(b) for b in range(num_blocks))
        for h, b in kv.cached_block_hash_to_block.items():
            assert kv.block_hash[b] == h and _chain(list(written[b]), bs)[-1] == h
        for req, done in live.values():
            toks, blocks = req.all_token_ids, kv.get_blocks(req.request_id)
            for i in range(done // bs):
                assert written[blocks[i]] == tuple(toks[:(i + 1) * bs])
    for rid in list(live):
        kv.free(rid)
    _assert_pool_whole(kv)


# -- end to end (fp32, CPU) -------------------------------------------------------------


def _llm(caching, async_scheduling=False, runner="v2", **kw):
    # Tight: 4 rows, 16 tokens a step, 10 blocks of 4: queueing, chunked prefill, preemption.
    base = {"dtype": "float32", "max_model_len": 40, "max_num_seqs": 4,
            "max_num_batched_tokens": 16, "num_gpu_blocks_override": 10, "block_size": 4}
    return LLM(DEFAULT_MODEL_DIR, enable_prefix_caching=caching, runner=runner,
               async_scheduling=async_scheduling, **{**base, **kw})


def _workload(seed=0):
    """Shared prefixes (two families), block-aligned full repeats, greedy and seeded."""
    rng = random.Random(seed)
    fams = [[rng.randrange(1, 2000) for _ in range(n)] for n in (13, 8)]
    prompts, params = [], []
    for i in range(8):
        fam = fams[i % 2]
        tail = [] if i in (2, 3) else [rng.randrange(1, 2000) for _ in range(rng.randrange(1, 6))]
        prompts.append({"prompt_token_ids": fam + tail})       # i = 3: exactly 2 blocks
        params.append(SamplingParams(temperature=0, max_tokens=7, ignore_eos=True) if i % 3
                      else SamplingParams(temperature=0.8, seed=i, max_tokens=6, ignore_eos=True))
    return prompts, params


def _ids(outs):
    return [[c.token_ids for c in o.outputs] for o in outs]


@pytest.fixture(scope="module")
def reference():
    prompts, params = _workload()
    llm = _llm(False)
    return _ids(llm.generate(prompts, params, use_tqdm=False))


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_outputs_identical_with_caching_under_preemption_and_eviction(reference,
                                                                      async_scheduling):
    prompts, params = _workload()
    llm = _llm(True, async_scheduling)
    kv = llm.kv_manager
    first = llm.generate(prompts, params, use_tqdm=False)
    assert _ids(first) == reference
    assert any(o.num_cached_tokens > 0 for o in first)
    again = llm.generate(prompts, params, use_tqdm=False)      # the cache is warm now
    assert _ids(again) == reference
    assert llm.scheduler.num_preemptions > 0 and kv.num_evictions > 0 and kv.num_hits > 0
    for o, p in zip(again, prompts):
        n = len(p["prompt_token_ids"])
        assert o.num_cached_tokens % 4 == 0 and o.num_cached_tokens <= n - 1
    _assert_pool_whole(kv)


def test_full_hits_chunked_prefill_and_num_cached_tokens():
    """Roomy pool (no eviction): a repeated prompt hits all but its last token's block;
    a long prompt hit while chunked (budget 16) still matches."""
    rng = random.Random(1)
    p = [rng.randrange(1, 2000) for _ in range(40)]
    prompts = [{"prompt_token_ids": p}, {"prompt_token_ids": p[:37]},
               {"prompt_token_ids": p + [5]}]
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    ref = _ids(_llm(False, max_model_len=64, num_gpu_blocks_override=64).generate(prompts, sp, use_tqdm=False))
    llm = _llm(True, max_model_len=64, num_gpu_blocks_override=64)
    assert _ids(llm.generate(prompts[:1], sp, use_tqdm=False)) == ref[:1]
    outs = llm.generate(prompts, sp, use_tqdm=False)
    assert _ids(outs) == ref
    # 40 = 10 full blocks: 9 hit (the last recomputed); 37: 9 blocks; 41: all 10.
    assert [o.num_cached_tokens for o in outs] == [36, 36, 40]
    _assert_pool_whole(llm.kv_manager)


def test_n_children_share_the_prompt_blocks():
    rng = random.Random(2)
    prompt = {"prompt_token_ids": [rng.randrange(1, 2000) for _ in range(19)]}
    sp = SamplingParams(n=3, temperature=0.9, seed=5, max_tokens=5, ignore_eos=True)
    ref = _ids(_llm(False).generate([prompt], sp, use_tqdm=False))
    llm = _llm(True)
    kv = llm.kv_manager
    outs = llm.generate([prompt], sp, use_tqdm=False)
    assert _ids(outs) == ref and len(set(map(tuple, ref[0]))) > 1
    # Child 1's first chunk (16 of 19 tokens) filled 4 blocks; children 2 and 3 hit them.
    assert kv.num_hits == 8
    _assert_pool_whole(kv)


def test_prompt_logprobs_skip_the_lookup_and_stay_identical():
    rng = random.Random(3)
    p = [rng.randrange(1, 2000) for _ in range(21)]
    greedy = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    with_lp = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    ref = _llm(False).generate([{"prompt_token_ids": p}], with_lp, use_tqdm=False)[0]
    llm = _llm(True)
    llm.generate([{"prompt_token_ids": p}], greedy, use_tqdm=False)     # p is cached now
    out = llm.generate([{"prompt_token_ids": p}], with_lp, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0 and out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert len(out.prompt_logprobs) == len(p) and out.prompt_logprobs[0] is None
    for got, want in zip(out.prompt_logprobs[1:], ref.prompt_logprobs[1:]):
        assert got.keys() == want.keys()
        for t in got:
            assert got[t].logprob == pytest.approx(want[t].logprob, abs=1e-5)
            assert got[t].rank == want[t].rank
    # A request without prompt_logprobs still hits afterwards.
    assert llm.generate([{"prompt_token_ids": p}], greedy,
                        use_tqdm=False)[0].num_cached_tokens == 20
    _assert_pool_whole(llm.kv_manager)


@pytest.mark.slow
def test_v1_baseline_runner_with_caching():
    prompts, params = _workload()   # (V1 samples seeded requests with its own generators)
    reference = _ids(_llm(False, runner="v1").generate(prompts, params, use_tqdm=False))
    llm = _llm(True, runner="v1")
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == reference
    assert _ids(llm.generate(prompts, params, use_tqdm=False)) == reference
    assert llm.kv_manager.num_hits > 0
    _assert_pool_whole(llm.kv_manager)


def test_enable_prefix_caching_argument():
    assert _llm(True).kv_manager.enable_caching
    assert not _llm(False).kv_manager.enable_caching
    assert LLM(max_model_len=32, max_num_seqs=2).kv_manager.enable_caching  # on by default


# -- GPU (run by the lead): CUDA graphs + async + caching, no sync -----------------------


@pytest.mark.gpu
def test_gpu_caching_under_graphs_async_and_sync_debug():
    """fp32 on the GPU (token identity across schedules), CUDA graphs and async on: the
    same outputs with caching on and off, and no sync in the loop while hits happen."""

    prompts, params = _workload(4)
    outs = {}
    for on in (False, True):
        llm = LLM(DEFAULT_MODEL_DIR, dtype="float32", max_model_len=40, max_num_seqs=4,
                  max_num_batched_tokens=16, num_gpu_blocks_override=10, block_size=4,
                  async_scheduling=True, enable_prefix_caching=on)
        assert llm.runner.cuda_graphs.graphs
        llm.generate(prompts, params, use_tqdm=False)             # warm-up; fills the cache
        outs[on] = _ids(generate_without_sync(llm, prompts, params))
        assert (llm.kv_manager.num_hits > 0) == on
        _assert_pool_whole(llm.kv_manager)
    assert outs[True] == outs[False]
