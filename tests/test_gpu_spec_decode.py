"""GPU: the speculating step loop (n-gram, draft model, EAGLE) never synchronises, and its
fp32 tokens equal those without it."""

import pytest
import torch
from device_utils import generate_without_sync

pytestmark = pytest.mark.gpu

from mrv2 import LLM, SamplingParams
from mrv2.models.loader import DEFAULT_MODEL_DIR

#: The embedded model's own greedy loop (see tests/test_spec_decode_e2e.py): real drafts.
LOOP = [952, 26, 199, 47, 12, 292, 359, 850, 1, 199, 199, 952, 26]


DRAFT = str(DEFAULT_MODEL_DIR) + "-draft"
EAGLE = str(DEFAULT_MODEL_DIR) + "-eagle"


def _spec(k, method="ngram", **extra):
    if method in ("draft_model", "eagle"):
        extra["model"] = DRAFT if method == "draft_model" else EAGLE
    return {"method": method, "num_speculative_tokens": k, **extra}


def _inputs(n):
    return [{"prompt_token_ids": (LOOP * 3)[: 5 + (7 * i) % 30]} for i in range(n)]


def _params(n):
    out = []
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        elif kind == 1:
            out.append(SamplingParams(temperature=0.8, top_p=0.9, seed=i, max_tokens=10,
                                      ignore_eos=True))
        elif kind == 2:
            out.append(SamplingParams(temperature=0, logprobs=2, max_tokens=9, ignore_eos=True))
        else:
            out.append(SamplingParams(temperature=0, stop_token_ids=[292], max_tokens=15))
    return out


def _tight(**kw):
    return LLM(DEFAULT_MODEL_DIR, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
               num_gpu_blocks_override=16, block_size=4, **kw)


@pytest.mark.parametrize("verification", ["exact", "probabilistic"])
@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
@pytest.mark.parametrize("mode", ["FULL", "NONE"])
def test_speculating_loop_runs_under_sync_debug_error(mode, method, verification):
    """Prefill chunks beside speculating decodes, finishes, preemption; async + graphs."""
    llm = _tight(async_scheduling=True, cudagraph_mode=mode,
                 speculative_config=_spec(3, method, verification=verification))
    inputs, params = _inputs(16), _params(16)
    llm.generate(inputs[:4], params[:4], use_tqdm=False)  # warm-up: compile kernels
    outs = generate_without_sync(llm, inputs, params)
    assert all(o.finished for o in outs)
    assert llm.runner.spec.stats.num_accepted_tokens > 0
    assert llm.scheduler.num_preemptions > 0
    assert llm.kv_manager.num_free_blocks == llm.kv_manager.num_blocks


@pytest.mark.parametrize("method", ["ngram", "draft_model", "eagle"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_fp32_tokens_equal_without_speculation(k, method):
    """fp32: greedy and seeded tokens equal, logprobs close, async on, graphs on."""
    inputs, params = _inputs(12), _params(12)
    kw = {"dtype": "float32", "async_scheduling": True}
    want = _tight(**kw).generate(inputs, params, use_tqdm=False)
    llm = _tight(speculative_config=_spec(k, method), **kw)
    got = llm.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    for a, b in zip(want, got):
        if a.outputs[0].logprobs is not None:
            for pa, pb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                assert list(pa) == list(pb)
    assert llm.runner.spec.stats.num_accepted_tokens > 0


def test_sync_accepted_counts_costs_a_sync():
    """The benchmark toggle really syncs (and the default really does not)."""
    llm = _tight(async_scheduling=True, speculative_config=_spec(3, sync_accepted_counts=True))
    llm.generate(_inputs(2), _params(2), use_tqdm=False)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        # NOTE: the engine contains the sync error (mrv2/fault.py): the requests end with it.
        outs = llm.generate(_inputs(2), _params(2), use_tqdm=False)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    reasons = [(c.finish_reason, str(c.stop_reason)) for o in outs for c in o.outputs]
    assert any(r == "error" and "synchroniz" in why for r, why in reasons), reasons
