"""The host-path cuts of issue 21 (item 6) against the plain code they replace.

* ``RequestStateTable.rows_of`` gives what ``row_of`` per request gives (and names an
  unknown request);
* ``InputBuffers.req_views`` / ``token_views`` are the slices they memoise (same storage,
  offsets, shapes and strides, made in the same inference mode);
* ``Engine._check_stop``'s early return: on random requests, tokens and limits, the same
  verdicts and side effects as the plain stop checks (``_plain_check_stop``, below).
"""

import random

import pytest
import torch

from mrv2.config import SchedulerConfig
from mrv2.engine import Engine
from mrv2.input_batch import InputBuffers
from mrv2.kv_cache import KVCacheManager
from mrv2.request import Request
from mrv2.sampling_params import SamplingParams
from mrv2.scheduler import Scheduler
from mrv2.state import RequestStateTable


def test_rows_of_matches_row_of_and_names_an_unknown_request():
    table = RequestStateTable(8, 16, "cpu")
    rng = random.Random(0)
    ids = [f"r{i}" for i in range(8)]
    for req_id in ids:
        table.add_request(req_id, [1, 2], 2)
    for req_id in rng.sample(ids, 3):
        table.remove_request(req_id)
    live = [r for r in ids if r in table]
    order = rng.sample(live, len(live))
    assert table.rows_of(order) == [table.row_of(r) for r in order]
    assert table.rows_of([]) == []
    with pytest.raises(KeyError, match="'nope' has no row"):
        table.rows_of([order[0], "nope"])


def _where(t: torch.Tensor):
    """Storage, offset, shape and strides: what makes two views the same view."""
    return (t.untyped_storage().data_ptr(), t.storage_offset(), t.shape, t.stride())


@pytest.mark.parametrize("inference", [False, True])
def test_buffer_views_are_the_slices_they_memoise(inference):
    buf = InputBuffers(6, 20, "cpu")
    buf.req_views(1)  # made outside inference mode first: never handed out inside it
    with torch.inference_mode(inference):
        plain = {n: (buf.idx_mapping[:n], buf.num_scheduled_tokens[:n],
                     buf.query_start_loc[:n + 1], buf.seq_lens[:n], buf.logits_indices[:n])
                 for n in (0, 1, 6)}
        for n, expected in plain.items():
            views = buf.req_views(n)
            assert views is buf.req_views(n)  # memoised
            for v, e in zip(views, expected):
                assert _where(v) == _where(e)
                assert v.is_inference() == e.is_inference()
        for n in (0, 7, 20):
            ids, pos = buf.token_views(n)
            assert _where(ids) == _where(buf.input_ids[:n])
            assert _where(pos) == _where(buf.positions[:n])
    buf.req_views(3)[0][:] = 7  # a write through a view reaches the buffer
    assert buf.idx_mapping[:3].tolist() == [7, 7, 7]


class _Tok:
    """A tokenizer stand-in: token t is the character chr(97 + t % 26)."""

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + t % 26) for t in ids)


def _plain_check_stop(engine: Engine, req: Request, token: int) -> bool:
    """``Engine._check_stop`` without its early return (the reference)."""
    sp = req.sampling_params
    n_out = len(req.output_token_ids)
    reason = stop_reason = None
    if n_out >= sp.min_tokens and token in sp.all_stop_token_ids:
        reason = "stop"
        stop_reason = None if token not in sp.stop_token_ids else token
    elif sp.stop and engine.tokenizer is not None and n_out >= sp.min_tokens:
        text = engine.detokenize(req)
        for s in sp.stop:
            idx = text.find(s, max(0, len(req.output_text) - len(s) + 1))
            if idx >= 0:
                req.output_text = text[: idx + (len(s) if sp.include_stop_str_in_output else 0)]
                reason, stop_reason = "stop", s
                break
        else:
            req.output_text = text
    if reason is None and sp.max_tokens is not None and n_out >= sp.max_tokens:
        reason = "length"
    if reason is None and req.num_tokens >= engine.max_model_len:
        reason = "length"
    if reason is None:
        return False
    if stop_reason is None or isinstance(stop_reason, int):
        drop = reason == "stop" and not sp.include_stop_str_in_output
        req.output_text = engine.detokenize(req, drop_last=drop)
    engine.scheduler.finish_request(req.request_id, reason, stop_reason)
    return True


def _engine(tokenizer, max_model_len: int) -> Engine:
    class _Runner:
        spec_decode_stats = None
        timeline = None

    sched = Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64,
                                      max_model_len=max_model_len), KVCacheManager(64, 4))
    return Engine(sched, _Runner(), tokenizer, max_model_len=max_model_len)


def _random_case(rng: random.Random, stops: list):
    """A random (tokenizer or None, max_model_len, params, prompt, output) for the stop
    checks: length limits, min_tokens, stop ids (EOS = 2 unless ignore_eos), stop strings."""
    tok = _Tok() if rng.random() < 0.5 else None
    max_model_len = rng.randint(4, 30)
    max_tokens = rng.choice([None, 1, 3, 10])
    sp = SamplingParams(
        max_tokens=max_tokens, min_tokens=min(rng.choice([0, 0, 2]), max_tokens or 2),
        stop_token_ids=rng.choice([[], [3], [3, 5]]), stop=rng.choice(stops),
        include_stop_str_in_output=rng.random() < 0.3, ignore_eos=rng.random() < 0.5)
    sp.all_stop_token_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else {2})
    prompt = [1] * rng.randint(1, 3)
    output = [rng.randrange(6) for _ in range(rng.randint(1, 12))]
    return tok, max_model_len, sp, prompt, output


@pytest.mark.parametrize("seed", range(6))
def test_check_stop_early_return_changes_nothing(seed):
    rng = random.Random(seed)
    for case in range(300):
        tok, max_model_len, sp, prompt, output = _random_case(
            rng, [None, [], ["c"], ["bc", "zz"]])
        results = []
        for check in (_plain_check_stop, Engine._check_stop):
            eng = _engine(tok, max_model_len)
            req = Request(f"r{case}", prompt, sp, arrival=0)
            eng.scheduler.add_request(req)
            req.output_token_ids = list(output)
            done = check(eng, req, output[-1])
            results.append((done, req.finish_reason, req.stop_reason, req.output_text,
                            req.request_id in eng.scheduler.requests))
        assert results[0] == results[1], (case, sp, prompt, output)


@pytest.mark.parametrize("caching", [True, False])
def test_kv_fast_path_fields_follow_the_pool(caching):
    """``num_slots`` / ``next_full`` (the scheduler's skip tests) stay what they stand for
    through random allocations, caching, frees and prefix-cache resets: below them,
    ``allocate`` returns ``[]`` and ``cache_blocks`` changes nothing."""
    rng = random.Random(int(caching))
    bs = 4
    kv = KVCacheManager(40, bs, enable_caching=caching)
    reqs: dict[str, Request] = {}
    for step in range(600):
        op = rng.random()
        if op < 0.15 and len(reqs) < 6:
            req = Request(f"r{step}", [rng.randrange(3) for _ in range(rng.randint(1, 9))],
                          SamplingParams(), arrival=0)
            hits, _ = kv.get_computed_blocks(req)
            if kv.allocate(req.request_id, req.num_tokens, hits) is not None:
                req.num_computed_tokens = req.num_tokens
                kv.cache_blocks(req, req.num_tokens)
                reqs[req.request_id] = req
        elif op < 0.25 and reqs:
            kv.free(reqs.pop(rng.choice(sorted(reqs))).request_id)
        elif op < 0.27:
            kv.reset_prefix_cache()
        elif reqs:
            req = reqs[rng.choice(sorted(reqs))]
            need = req.num_tokens + 1 + rng.choice([0, 0, 3])
            if need <= kv.num_slots[req.request_id]:
                assert kv.allocate(req.request_id, need) == []
            elif kv.allocate(req.request_id, need) is None:
                continue
            req.output_token_ids.append(rng.randrange(3))
            req.num_computed_tokens = req.num_tokens
            if caching and req.num_computed_tokens < kv.next_full.get(req.request_id, 0):
                before = (dict(kv.cached_block_hash_to_block), dict(kv._num_cached))
                kv.cache_blocks(req, req.num_computed_tokens)
                assert before == (kv.cached_block_hash_to_block, kv._num_cached)
            else:
                kv.cache_blocks(req, req.num_computed_tokens)
        for req_id, blocks in kv.req_blocks.items():
            assert kv.num_slots[req_id] == len(blocks) * bs
        assert set(kv.num_slots) == set(kv.req_blocks)
        assert kv.next_full == {r: (n + 1) * bs for r, n in kv._num_cached.items()}


@pytest.mark.parametrize("seed", range(4))
def test_quick_stop_check_clears_only_what_check_stop_would(seed):
    """``Engine._stop_limits``: a token it clears (outside the stop ids, under the limit)
    is one the plain stop checks pass with no side effect; random requests, tokens and
    limits, edge cases included (stop at max_tokens, at the model's length, min_tokens,
    stop strings, ignore_eos)."""
    rng = random.Random(seed)
    cleared = 0
    for case in range(400):
        tok, max_model_len, sp, prompt, output = _random_case(rng, [None, [], ["c"]])
        eng = _engine(tok, max_model_len)
        req = Request(f"r{case}", prompt, sp, arrival=0)
        eng.scheduler.add_request(req)
        req.output_token_ids = list(output)
        limit, stop_ids = eng._stop_limits(req)
        assert req.stop_limits == (limit, stop_ids)
        if len(output) < limit and output[-1] not in stop_ids:
            cleared += 1
            assert not _plain_check_stop(eng, req, output[-1])
            assert (req.finish_reason, req.output_text) == (None, "")
            assert req.request_id in eng.scheduler.requests
    assert cleared > 50


def test_unapplied_ids_after_a_failure_inside_apply(monkeypatch):
    """A failure partway through ``_apply`` leaves in ``_unapplied`` exactly the sampling
    ids not reached yet (what the fault reset undoes), and none after a clean pass."""
    import mrv2.engine as engine_mod
    from mrv2.async_output import StepOutput
    from mrv2.scheduler import SchedulerOutput

    eng = _engine(None, 64)
    ids = [f"r{i}" for i in range(4)]
    for req_id in ids:
        req = Request(req_id, [1, 2], SamplingParams(max_tokens=50), arrival=0)
        eng.scheduler.add_request(req)
        req.num_output_placeholders = 1
    sched = SchedulerOutput(sampling_req_ids={"r0", "r2", "r3", "gone"})
    out = StepOutput(ids, [[4], [4], [4], [4]], num_draft_tokens=[0, 0, 0, 0])

    def observe(req, *args, **kwargs):
        if req.request_id == "r2":
            raise RuntimeError("injected")

    monkeypatch.setattr(engine_mod, "observe_spec_output", observe)
    with pytest.raises(RuntimeError, match="injected"):
        eng._apply(sched, out)
    assert eng._unapplied == {"r3", "gone"}
    monkeypatch.setattr(engine_mod, "observe_spec_output", lambda *a, **k: None)
    eng._apply(SchedulerOutput(sampling_req_ids={"r3", "gone"}), StepOutput(
        ["r3"], [[5]], num_draft_tokens=[0]))
    assert eng._unapplied == {"gone"}
    got = {r: eng.scheduler.requests[r].output_token_ids for r in ids}
    assert got == {"r0": [4], "r1": [], "r2": [], "r3": [5]}
