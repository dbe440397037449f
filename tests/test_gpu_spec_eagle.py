"""GPU: the step loop with EAGLE never synchronises, and its fp32 tokens equal those without it."""

import pytest
from device_utils import generate_without_sync

from mrv2 import LLM, SamplingParams
from mrv2.models.loader import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.gpu

EAGLE = str(DEFAULT_MODEL_DIR) + "-eagle"
#: The embedded model's own greedy loop (see tests/test_spec_decode_e2e.py).
LOOP = [952, 26, 199, 47, 12, 292, 359, 850, 1, 199, 199, 952, 26]


def _inputs(n):
    return [{"prompt_token_ids": (LOOP * 3)[: 5 + (7 * i) % 30]} for i in range(n)]


def _params(n):
    kinds = [SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=10, ignore_eos=True),
             SamplingParams(temperature=0, logprobs=2, max_tokens=9, ignore_eos=True),
             SamplingParams(temperature=0, stop_token_ids=[292], max_tokens=15)]
    return [kinds[i % 4] for i in range(n)]


def _tight(k=3, **kw):
    return LLM(DEFAULT_MODEL_DIR, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
               num_gpu_blocks_override=16, block_size=4, speculative_config=
               {"method": "eagle", "model": EAGLE, "num_speculative_tokens": k,
                **kw.pop("spec", {})}, **kw)


@pytest.mark.parametrize("verification", ["exact", "probabilistic"])
@pytest.mark.parametrize("mode", ["FULL", "NONE"])
def test_eagle_loop_runs_under_sync_debug_error(mode, verification):
    """Prefill chunks beside speculating decodes, finishes, preemption; async + graphs."""
    llm = _tight(async_scheduling=True, cudagraph_mode=mode,
                 spec={"verification": verification})
    inputs, params = _inputs(16), _params(16)
    llm.generate(inputs[:4], params[:4], use_tqdm=False)  # warm-up: compile kernels
    outs = generate_without_sync(llm, inputs, params)
    assert all(o.finished for o in outs)
    assert llm.runner.spec.stats.num_accepted_tokens > 0
    assert llm.scheduler.num_preemptions > 0
    assert llm.kv_manager.num_free_blocks == llm.kv_manager.num_blocks


@pytest.mark.parametrize("k", [1, 3, 5])
def test_eagle_fp32_tokens_equal_without_speculation(k):
    inputs, params = _inputs(12), _params(12)
    want = LLM(DEFAULT_MODEL_DIR, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
               num_gpu_blocks_override=16, block_size=4, dtype="float32",
               async_scheduling=True).generate(inputs, params, use_tqdm=False)
    llm = _tight(k, dtype="float32", async_scheduling=True)
    got = llm.generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert llm.runner.spec.stats.num_accepted_tokens > 0
