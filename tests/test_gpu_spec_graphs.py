"""GPU: CUDA graphs of speculating decode steps (target) and of the draft model.

fp32 tokens with graphs equal those without graphs and without speculation; the graphs
really replay (the managers' counters); the draft model's graphed step loop passes
``torch.cuda.set_sync_debug_mode("error")``. The padded shapes themselves are checked on
the CPU in tests/test_spec_decode_graphs.py. About a minute on an H200.
"""

import random

import pytest
from device_utils import generate_without_sync

from mrv2 import LLM, SamplingParams
from mrv2.models.loader import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.gpu

DRAFT = str(DEFAULT_MODEL_DIR) + "-draft"
EAGLE = str(DEFAULT_MODEL_DIR) + "-eagle"
#: The embedded model's own greedy loop: real drafts for both proposers.
LOOP = [952, 26, 199, 47, 12, 292, 359, 850, 1, 199, 199, 952, 26]


def _spec(method, k, **extra):
    if method in ("draft_model", "eagle"):
        extra["model"] = DRAFT if method == "draft_model" else EAGLE
    return {"method": method, "num_speculative_tokens": k, **extra}


def _inputs(n):
    rng = random.Random(0)
    out = []
    for i in range(n):
        if i % 3 == 2:  # random prompts: their tokens depend on every attention row
            out.append([rng.randrange(1, 2048) for _ in range(5 + i % 11)])
        else:
            out.append((LOOP * 3)[i % 5: 8 + (7 * i) % 30])
    return [{"prompt_token_ids": p} for p in out]


def _params(n):
    out = []
    for i in range(n):
        if i % 4 == 1:
            out.append(SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=12,
                                      ignore_eos=True))
        elif i % 4 == 3:
            out.append(SamplingParams(temperature=0, stop_token_ids=[292], max_tokens=16))
        else:
            out.append(SamplingParams(temperature=0, max_tokens=10 + i % 7, ignore_eos=True))
    return out


def _llm(mode, spec=None, roomy=False, **kw):
    if roomy:
        sizes = {"max_model_len": 128, "max_num_seqs": 32, "max_num_batched_tokens": 256}
    else:  # tight: queueing, chunked prefill beside speculating decodes, preemption
        sizes = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 16,
                 "num_gpu_blocks_override": 16, "block_size": 4}
    return LLM(DEFAULT_MODEL_DIR, async_scheduling=True, cudagraph_mode=mode,
               speculative_config=spec, **sizes, **kw)


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_replayed(llm):
    graphs = llm.runner.cuda_graphs
    assert graphs.num_replays["spec"] > 0, graphs.num_replays
    assert graphs.num_eager["spec"] == 0 and graphs.num_eager["decode"] == 0, graphs.num_eager
    draft = llm.runner.spec.draft
    if draft is not None:
        assert draft.graphs.num_replays["spec"] > 0, draft.graphs.num_replays
        assert not draft.graphs.num_eager, draft.graphs.num_eager
        assert draft.chain_graphs.num_replays["decode"] > 0
        assert not draft.chain_graphs.num_eager, draft.chain_graphs.num_eager


@pytest.fixture(scope="module")
def baselines():
    """fp32 tokens without speculation (graphs on), tight and roomy."""
    return {roomy: _ids(_llm("FULL", roomy=roomy, dtype="float32").generate(
        _inputs(n), _params(n), use_tqdm=False)) for roomy, n in ((False, 12), (True, 24))}


@pytest.mark.parametrize("method,k,roomy", [
    ("ngram", 1, False), ("ngram", 3, False), ("draft_model", 1, False),
    ("draft_model", 3, False), ("draft_model", 3, True), ("eagle", 3, False),
    ("eagle", 3, True)])
def test_fp32_tokens_with_graphs_equal_without(baselines, method, k, roomy):
    """Greedy and seeded (exact verification), async on: graphs == eager == no speculation,
    and the speculating steps replayed their graphs (none ran eagerly)."""
    n = 24 if roomy else 12
    eager = _llm("NONE", _spec(method, k), roomy, dtype="float32")
    want = _ids(eager.generate(_inputs(n), _params(n), use_tqdm=False))
    llm = _llm("FULL", _spec(method, k), roomy, dtype="float32")
    got = _ids(llm.generate(_inputs(n), _params(n), use_tqdm=False))
    assert want == baselines[roomy]
    assert got == baselines[roomy]
    assert llm.runner.spec.stats.num_accepted_tokens > 0
    _assert_replayed(llm)
    if not roomy:
        assert llm.scheduler.num_preemptions > 0


@pytest.mark.parametrize("verification", ["exact", "probabilistic"])
def test_draft_model_graphs_run_under_sync_debug_error(verification):
    """bf16, async, graphs: the draft model's mirror and chain replays, the target's
    speculating graphs, prefill chunks beside them and preemption: no CPU-GPU sync."""
    llm = _llm("FULL", _spec("draft_model", 3, verification=verification))
    llm.generate(_inputs(4), _params(4), use_tqdm=False)  # warm-up: compile kernels
    outs = generate_without_sync(llm, _inputs(16), _params(16))
    assert all(o.finished for o in outs)
    assert llm.runner.spec.stats.num_accepted_tokens > 0
    assert llm.scheduler.num_preemptions > 0
    _assert_replayed(llm)
