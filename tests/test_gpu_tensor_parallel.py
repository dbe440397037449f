"""GPU: tensor parallelism over NCCL (2+ GPUs), and its checks on a one-GPU machine.

The multi-GPU tests skip with fewer than 2 GPUs. They run the embedded model in fp32 (so a
different summation order cannot flip a near-tie) with CUDA graphs (the NCCL all-reduces
captured inside them) and async scheduling, against TP=1.
"""

import pytest
import torch
from device_utils import generate_without_sync

from mrv2 import LLM, SamplingParams

pytestmark = pytest.mark.gpu

needs_2_gpus = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo? Deny thy father",
           "First Citizen:\nBefore we proceed any further, hear me speak.", "To be, or not to be"]


def _params():
    return [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2),
            SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True,
                           logprobs=2)] * 2


def _tight(**kw):
    return LLM(max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
               num_gpu_blocks_override=9, block_size=8, dtype="float32", **kw)


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="this machine has 2 GPUs")
def test_tp2_on_one_gpu_is_a_clear_error():
    with pytest.raises(ValueError, match="needs 2 GPUs"):
        LLM(tensor_parallel_size=2)


@needs_2_gpus
@pytest.mark.parametrize("eager", [False, True])
def test_tp2_equals_tp1_fp32_graphs_and_async(eager):
    want = _tight(enforce_eager=eager).generate(PROMPTS, _params(), use_tqdm=False)
    llm = _tight(tensor_parallel_size=2, enforce_eager=eager, async_scheduling=True)
    try:
        got = llm.generate(PROMPTS, _params(), use_tqdm=False)
        assert llm.scheduler.num_preemptions > 0
        for a, b in zip(want, got):
            assert a.outputs[0].token_ids == b.outputs[0].token_ids
            for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
                for tok, lp in ea.items():
                    assert abs(lp.logprob - eb[tok].logprob) < 1e-3
    finally:
        llm.shutdown()


@needs_2_gpus
def test_tp2_rank0_step_loop_never_syncs():
    """Rank 0's loop under sync-debug "error" (the workers run the same code)."""
    llm = _tight(tensor_parallel_size=2, async_scheduling=True)
    try:
        llm.generate(PROMPTS[:2], _params()[:2], use_tqdm=False)  # warm-up: compile kernels
        outs = generate_without_sync(llm, PROMPTS, _params())
        assert all(o.finished for o in outs)
    finally:
        llm.shutdown()


@needs_2_gpus
def test_tp2_bf16_qwen3_shape_dummy_runs():
    """The Qwen3-0.6B shape (16 q heads, 8 KV heads) in bf16 with dummy weights: TP=2 runs
    with graphs and async, and finishes every request."""
    from mrv2.models.loader import find_qwen3_0_6b

    path = find_qwen3_0_6b()
    if path is None:
        pytest.skip("no local Qwen3-0.6B config")
    llm = LLM(str(path), load_format="dummy", tensor_parallel_size=2, max_model_len=512,
              max_num_seqs=32, skip_tokenizer_init=True)
    try:
        sp = SamplingParams(temperature=0.6, seed=0, max_tokens=64, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": list(range(1, 100))}] * 32, sp,
                            use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == 64 for o in outs)
    finally:
        llm.shutdown()
