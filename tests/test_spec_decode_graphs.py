"""CUDA graphs for speculating decode steps, checked on the CPU.

Graphs cannot be captured here, so two proxies: the key / padding logic of
``mrv2.cuda_graphs`` on plain integers, and ``emulate``: a runner whose manager answers
as if every graph were captured, so every step runs eagerly on the very padded shapes and
bounds a graph would replay (target: decode, speculating decode and prefill keys; draft:
the mirror at the target's key and the whole K-step chain at the padded batch size). Its
greedy tokens must equal those without graphs and without speculation. The replays on a
real GPU are in tests/test_gpu_spec_graphs.py.
"""

import random

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.cuda_graphs import (
    CudaGraphManager,
    capture_sizes,
    graph_kind,
    graph_shape,
    make_graph_manager,
    prefill_capture_sizes,
    spec_capture_sizes,
)
from mrv2.models.loader import DEFAULT_MODEL_DIR

DRAFT = str(DEFAULT_MODEL_DIR) + "-draft"
EAGLE = str(DEFAULT_MODEL_DIR) + "-eagle"
#: The embedded model's own greedy loop (tests/test_spec_decode_e2e.py): real drafts.
LOOP = [952, 26, 199, 47, 12, 292, 359, 850, 1, 199, 199, 952, 26]


def test_spec_keys_shapes_and_kinds():
    assert spec_capture_sizes([1, 2, 4, 8], 3, 16) == [(1, 4, 4), (2, 8, 4), (4, 16, 4)]
    assert spec_capture_sizes([1, 2], 0, 16) == []
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        spec_capture_sizes([1], -1, 16)
    assert graph_shape((2, 8, 4)) == (2, 8, 4) and graph_shape((4, 64)) == (4, 64, 64)
    assert [graph_kind(k) for k in (8, (4, 64), (2, 8, 4))] == ["decode", "prefill", "spec"]
    mgr = make_graph_manager(8, 32, use_graphs=True, num_speculative_tokens=3)
    assert mgr.sizes == capture_sizes(8) and mgr.spec_sizes == [(1, 4, 4), (2, 8, 4),
                                                                (4, 16, 4), (8, 32, 4)]
    assert mgr.prefill_sizes == prefill_capture_sizes(8, 32)
    keys = mgr.keys()
    assert set(keys) == {*mgr.sizes, *mgr.prefill_sizes, *mgr.spec_sizes}
    assert [graph_shape(k)[1] for k in keys] == sorted((graph_shape(k)[1] for k in keys),
                                                       reverse=True)  # pool grows once
    assert not make_graph_manager(8, 32, use_graphs=False, num_speculative_tokens=3).enabled
    assert make_graph_manager(8, 32, True, prefill_graphs=False).prefill_sizes == []


def test_graph_for_speculating_steps():
    """Decodes of <= 1 + K tokens take the speculating graph of the next size; longer
    queries a prefill graph; uniform one-token decodes the decode graph."""
    mgr = make_graph_manager(16, 64, use_graphs=True, num_speculative_tokens=3)
    assert mgr.graph_for(3, 12, 4) is None                 # nothing captured yet
    assert mgr.num_eager == {"spec": 1}
    mgr.graphs = dict.fromkeys(mgr.keys())
    assert mgr.graph_for(3, 12, 4) == (4, 16, 4)           # 3 x (1 + K): pad to 4 requests
    assert mgr.graph_for(1, 4, 4) == (1, 4, 4)
    assert mgr.graph_for(3, 6, 4) == (4, 16, 4)            # one request without drafts
    assert mgr.graph_for(5, 20, 4) == (8, 32, 4)
    assert mgr.graph_for(3, 3, 1) == 4                     # plain decodes: decode graph
    assert mgr.graph_for(2, 9, 8) == (4, 32)               # a prefill chunk: prefill graph
    assert mgr.graph_for(3, 12) == (4, 32)                 # no max_query_len: never spec
    assert mgr.graph_for(16, 64, 4) == (16, 64, 4)
    mgr.num_eager.clear()
    assert mgr.graph_for(16, 65, 5) is None                # past every graph
    assert mgr.num_eager == {"prefill": 1}
    small = make_graph_manager(4, 16, use_graphs=True, num_speculative_tokens=5)
    assert small.spec_sizes == [(1, 6, 6), (2, 12, 6)]     # 4 x 6 > the token budget
    small.graphs = dict.fromkeys(small.keys())
    assert small.graph_for(3, 18, 6) is None               # too many tokens for any graph
    assert small.num_eager == {"spec": 1}
    no_spec = make_graph_manager(4, 16, use_graphs=True)
    no_spec.graphs = dict.fromkeys(no_spec.keys())
    assert no_spec.graph_for(2, 8, 4) == (4, 16)           # without K: prefill graphs


def test_run_replays_or_emulates_and_counts():
    calls = []
    mgr = CudaGraphManager([1, 2], spec_sizes=[(1, 4, 4), (2, 8, 4)], emulate=True)
    mgr.capture(lambda key: calls.append(("prepare", key)), lambda b, key: None)
    assert calls == [] and mgr.graphs == {}                # emulate: nothing captured
    assert mgr.graph_for(2, 7, 4) == (2, 8, 4)             # ... but every key answers
    assert mgr.padded_size(1, 1) == 1
    assert mgr.run((2, 8, 4), lambda: "eager") == "eager"
    assert mgr.num_replays == {"spec": 1} and not mgr.num_eager
    real = CudaGraphManager([1, 2])
    assert real.run(2, lambda: "eager") == "eager"          # not captured: counted eager
    assert real.num_eager == {"decode": 1} and not real.num_replays


def _inputs():
    # Random prompts: their continuations depend on every attended token (the loops
    # would survive a wrong attention row); LOOP ones give the drafts to accept.
    rng = random.Random(0)
    ids = [[rng.randrange(1, 2048) for _ in range(n)] for n in (15, 9)]   # 15: one chunk
    ids = [ids[0], LOOP, LOOP * 3, ids[1]]
    return [{"prompt_token_ids": p} for p in ids]


def _params():
    return ([SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (10, 8)]
            + [SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=8,
                              ignore_eos=True),
               SamplingParams(temperature=0, stop_token_ids=[292], max_tokens=10)])


def _spec(method, k, verification="exact"):
    spec = {"method": method, "num_speculative_tokens": k, "verification": verification}
    if method in ("draft_model", "eagle"):
        spec["model"] = DRAFT if method == "draft_model" else EAGLE
    return spec


def _tight(spec=None, emulate=False):
    # 4 rows, 16 tokens a step, 16 blocks of 4: queueing, chunked prefill, preemption.
    llm = LLM(DEFAULT_MODEL_DIR, dtype="float32", max_model_len=64, max_num_seqs=4,
              max_num_batched_tokens=16, num_gpu_blocks_override=16, block_size=4,
              async_scheduling=True, speculative_config=spec)
    if emulate:
        r = llm.runner
        r.cuda_graphs = make_graph_manager(
            r.max_num_reqs, r.max_num_tokens, use_graphs=True,
            num_speculative_tokens=0 if r.spec is None else r.spec.k, emulate=True)
        r.capture_cuda_graphs(progress=False)
    return llm


@pytest.fixture(scope="module")
def baseline():
    return _ids(_tight().generate(_inputs(), _params(), use_tqdm=False))


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _check_replayed(llm):
    graphs = llm.runner.cuda_graphs
    assert graphs.num_replays["spec"] > 0 and graphs.num_eager["spec"] == 0
    assert llm.runner.spec.stats.num_accepted_tokens > 0
    assert llm.scheduler.num_preemptions > 0
    draft = llm.runner.spec.draft
    if draft is not None:
        assert draft.graphs.num_replays["spec"] > 0 and not draft.graphs.num_eager
        assert draft.chain_graphs.num_replays["decode"] > 0
        assert not draft.chain_graphs.num_eager


cpu_only = pytest.mark.skipif(torch.cuda.is_available(),
                              reason="the CPU proxy (GPU: tests/test_gpu_spec_graphs.py)")


@cpu_only
def test_draft_model_padded_graph_shapes_same_tokens_and_drafts(baseline):
    """fp32, async, K = 3: every step on its graph's padded shapes and bounds (target and
    draft) gives the tokens without graphs and without speculation, and the very drafts
    of the eager proposer (the same acceptance counts: draft bugs never change tokens)."""
    eager = _tight(_spec("draft_model", 3))
    want = _ids(eager.generate(_inputs(), _params(), use_tqdm=False))
    llm = _tight(_spec("draft_model", 3), emulate=True)
    got = _ids(llm.generate(_inputs(), _params(), use_tqdm=False))
    assert want == baseline and got == baseline
    assert llm.runner.spec.stats.as_dict() == eager.runner.spec.stats.as_dict()
    _check_replayed(llm)


@cpu_only
def test_probabilistic_draft_model_padded_graph_shapes(baseline):
    """K = 1, the draft's kept q written from the chain (padding slots: the scratch row):
    the greedy rows keep their tokens (the seeded row samples differently under
    probabilistic verification). n-gram needs only the target's graphs, exercised above."""
    llm = _tight(_spec("draft_model", 1, "probabilistic"), emulate=True)
    got = _ids(llm.generate(_inputs(), _params(), use_tqdm=False))
    greedy = [p.temperature == 0 for p in _params()]
    assert [g for g, m in zip(got, greedy) if m] == [b for b, m in zip(baseline, greedy) if m]
    _check_replayed(llm)


@cpu_only
@pytest.mark.parametrize("k", [1, 3])
def test_eagle_mirror_and_chain_on_padded_graph_shapes(baseline, k):
    """EAGLE, async: the mirror at the target's (padded) key, reading the hidden states
    of the padded target pass, and the chain at the padded batch size give the tokens
    without speculation and the very drafts of the eager proposer (same acceptance)."""
    eager = _tight(_spec("eagle", k))
    want = _ids(eager.generate(_inputs(), _params(), use_tqdm=False))
    llm = _tight(_spec("eagle", k), emulate=True)
    got = _ids(llm.generate(_inputs(), _params(), use_tqdm=False))
    assert want == baseline and got == baseline
    assert llm.runner.spec.stats.as_dict() == eager.runner.spec.stats.as_dict()
    draft = llm.runner.spec.draft
    assert draft.graphs.num_replays["spec"] > 0 and not draft.graphs.num_eager
    # The chain holds draft 1's sampling too, so K = 1 replays a chain graph as well.
    assert draft.chain_graphs.num_replays["decode"] > 0
    assert not draft.chain_graphs.num_eager
    graphs = llm.runner.cuda_graphs
    assert graphs.num_replays["spec"] > 0 and graphs.num_eager["spec"] == 0
    assert llm.scheduler.num_preemptions > 0
