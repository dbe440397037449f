"""Async scheduling, AsyncOutput, the timeline, ModelState and CUDA-graph bookkeeping (CPU).

The async engine launches step N+1 before it has seen step N's tokens; these tests
pin down that it changes nothing a user can see: the same tokens (greedy and
seeded), the same finish reasons, no extra token after a stop, every KV block and
state row freed — under queueing, chunked prefill and preemption too.
"""

import random

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.async_output import AsyncOutput
from mrv2.cuda_graphs import (
    CudaGraphManager,
    capture_sizes,
    graph_shape,
    prefill_capture_sizes,
)
from mrv2.model_state import ModelState
from mrv2.models.loader import DEFAULT_MODEL_DIR
from mrv2.timeline import Timeline, plot_timeline


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _prompts(rng, n, vocab, lo=1, hi=40):
    return [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(rng.randrange(lo, hi))]}
            for _ in range(n)]


def _tight(async_scheduling, **kw):
    # 4 rows, 16 tokens a step, 16 blocks of 4 tokens: queueing + chunked prefill + preemption.
    return LLM(DEFAULT_MODEL_DIR, dtype="float32", max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=16, num_gpu_blocks_override=16, block_size=4,
               async_scheduling=async_scheduling, **kw)


@pytest.fixture(scope="module")
def tight_pair():
    return _tight(False), _tight(True)


def test_async_default_is_on_for_v2_on_a_gpu_only():
    from mrv2 import platform

    llm = LLM(max_model_len=32, max_num_seqs=2)
    assert llm.engine.async_scheduling is platform.HAS_CUDA
    assert LLM(max_model_len=32, max_num_seqs=2, runner="v1").engine.async_scheduling is False


def test_async_equals_sync_greedy_and_seeded_under_preemption(tight_pair):
    sync, asyn = tight_pair
    inputs = _prompts(random.Random(0), 8, 2048)
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, top_k=20, seed=100 + i, max_tokens=3 + i,
                             ignore_eos=True) for i in range(8)]
    a = sync.generate(inputs, params, use_tqdm=False)
    b = asyn.generate(inputs, params, use_tqdm=False)
    assert asyn.scheduler.num_preemptions > 0
    assert _ids(a) == _ids(b)
    assert [o.outputs[0].finish_reason for o in a] == [o.outputs[0].finish_reason for o in b]
    for llm in (sync, asyn):
        assert not llm.engine.has_unfinished()
        assert llm.kv_manager.num_free_blocks == llm.kv_manager.num_blocks


def test_async_stop_token_gives_no_extra_tokens(tight_pair):
    sync, asyn = tight_pair
    inputs = _prompts(random.Random(1), 5, 2048)
    free = sync.generate(inputs, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                         use_tqdm=False)
    # Stop each request at its own 4th token: detected one step late by the async engine.
    params = [SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[ids[3]])
              for ids in _ids(free)]
    a = sync.generate(inputs, params, use_tqdm=False)
    b = asyn.generate(inputs, params, use_tqdm=False)
    for ids, out in zip(_ids(free), b):
        first = ids.index(ids[3])
        assert out.outputs[0].token_ids == ids[:first + 1]
        assert out.outputs[0].finish_reason == "stop"
    assert _ids(a) == _ids(b)
    # The stopped requests' state rows are freed at the next step, and once nothing is
    # left to run, all of them (the engine does not wait for a next call).
    asyn.generate(inputs[:1], SamplingParams(max_tokens=1), use_tqdm=False)
    assert asyn.runner.state.num_reqs == 0
    assert asyn.kv_manager.num_free_blocks == asyn.kv_manager.num_blocks


def test_async_max_tokens_one_wastes_no_step():
    llm = LLM(max_model_len=64, max_num_seqs=4, dtype="float32", async_scheduling=True)
    out = llm.generate(["ROMEO:", "JULIET:"], SamplingParams(max_tokens=1), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in out] == [1, 1]
    assert llm.engine.num_steps == 1  # the scheduler knew the token in flight ends them


def test_async_output_on_cpu_is_the_tensors():
    ids = torch.tensor([5, 7, 9])
    lp = (torch.tensor([[5, 1], [7, 2], [9, 3]]), torch.zeros(3, 2), torch.ones(3, dtype=torch.int64))
    out = AsyncOutput(["a", "b", "c"], ids, lp).get_output()
    assert out.req_ids == ["a", "b", "c"] and out.sampled_token_ids == [5, 7, 9]
    assert out.logprobs[0] == [[5, 1], [7, 2], [9, 3]] and out.logprobs[2] == [1, 1, 1]
    empty = AsyncOutput([], None).get_output()
    assert empty.sampled_token_ids == [] and empty.logprobs is None


def test_timeline_records_every_phase_and_plots(tmp_path):
    import matplotlib
    matplotlib.use("Agg")
    llm = LLM(max_model_len=64, max_num_seqs=4, dtype="float32")
    tl = Timeline(use_cuda=False)
    llm.engine.timeline = tl
    llm.generate(["ROMEO:", "JULIET:"], SamplingParams(max_tokens=5, ignore_eos=True),
                 use_tqdm=False)
    data = tl.finalize().to_dict()
    names = {d["name"] for d in data["cpu"]}
    assert {"schedule", "prep", "forward", "sample", "wait", "output"} <= names
    # NOTE: with async scheduling (on by default on a GPU) the last call only processes the
    # step launched before it: one timeline step more than launched steps.
    assert llm.engine.num_steps == 5 and tl.step == 5 + llm.async_scheduling
    for d in data["cpu"]:
        assert 0 <= d["start_ms"] <= d["end_ms"]
    assert set(data["summary"]["cpu_ms"]) == names
    ax = plot_timeline(data, num_steps=3)
    ax.figure.savefig(tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 0


# -- ModelState: the runner goes through the interface only ---------------------------

class _OffsetEmbedding(ModelState):
    """A test double: embeddings shifted by a constant (as a multimodal hook would splice)."""

    OFFSET = 0.05

    def get_inputs_embeds(self, input_ids):
        return self.model.model.embed_tokens(input_ids) + self.OFFSET


class _ShiftedEmbedding(torch.nn.Embedding):
    def forward(self, ids):
        return super().forward(ids) + _OffsetEmbedding.OFFSET


def test_model_state_test_double_changes_outputs_exactly_as_expected():
    prompts = ["ROMEO:", "JULIET:\nO Romeo,", "First Citizen:"]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    kw = {"max_model_len": 64, "max_num_seqs": 4, "dtype": "float32"}
    plain = _ids(LLM(**kw).generate(prompts, sp, use_tqdm=False))
    via_state = _ids(LLM(model_state_cls=_OffsetEmbedding, **kw).generate(prompts, sp,
                                                                           use_tqdm=False))
    # The expected result, made without the hook: the model's own embedding shifted
    # (the weight stays the same Parameter, so tied logits are untouched).
    # NOTE: eager: a swapped module would not be in graphs captured when the LLM was built.
    ref = LLM(enforce_eager=True, **kw)
    emb = ref.model.model.embed_tokens
    shifted = _ShiftedEmbedding(emb.num_embeddings, emb.embedding_dim)
    shifted.weight = emb.weight
    ref.model.model.embed_tokens = shifted
    expected = _ids(ref.generate(prompts, sp, use_tqdm=False))
    assert via_state == expected
    assert via_state != plain
    with pytest.raises(ValueError, match="model_state_cls needs the V2 runner"):
        LLM(model_state_cls=_OffsetEmbedding, runner="v1", **kw)


# -- CUDA-graph bookkeeping (capture itself runs in tests/test_gpu_async.py) ---------------

def test_capture_sizes():
    sizes = capture_sizes(512)
    assert sizes[:5] == [1, 2, 4, 8, 16] and 256 in sizes and 272 in sizes and sizes[-1] == 512
    assert all(s % 8 == 0 for s in sizes if 8 <= s <= 256)
    assert all(s % 16 == 0 for s in sizes if s > 256)
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(3) == [1, 2, 3]
    assert capture_sizes(1000, max_size=300)[-1] == 300
    with pytest.raises(ValueError, match="positive"):
        capture_sizes(0)


def test_padded_size_only_for_captured_uniform_decodes():
    mgr = CudaGraphManager([1, 2, 4, 8])
    assert mgr.padded_size(3, 3) is None  # nothing captured yet
    mgr.graphs = {s: None for s in mgr.sizes}
    assert [mgr.padded_size(n, n) for n in (1, 2, 3, 5, 8)] == [1, 2, 4, 8, 8]
    assert mgr.padded_size(9, 9) is None      # larger than the largest graph: eager
    assert mgr.padded_size(3, 7) is None      # a prefill in the batch: eager
    assert not CudaGraphManager([]).enabled


def test_prefill_graph_sizes_and_lookup():
    """Prefill graphs: (num_reqs, num_tokens) pairs within the limits, captured most
    tokens first; a step takes the decode graph if it is a uniform decode batch, else the
    smallest prefill graph holding it, else runs eagerly."""
    assert prefill_capture_sizes(256, 8192) == [
        (r, t) for t in (32, 64, 128, 256, 512, 1024, 2048, 4096) for r in (1, 4, 16, 32)]
    assert prefill_capture_sizes(4, 16) == [(1, 16), (4, 16)]  # the limits themselves
    assert prefill_capture_sizes(8, 40) == [(1, 32), (4, 32), (8, 32), (1, 40), (4, 40),
                                            (8, 40)]
    with pytest.raises(ValueError, match="positive"):
        prefill_capture_sizes(4, 0)
    assert graph_shape(8) == (8, 8, 1) and graph_shape((4, 64)) == (4, 64, 64)

    mgr = CudaGraphManager([1, 2, 4, 8], prefill_capture_sizes(16, 128))
    keys = mgr.keys()
    assert keys[0] == (16, 128) and keys[-1] == 1          # the most tokens first
    assert [graph_shape(k)[1] for k in keys] == sorted((graph_shape(k)[1] for k in keys),
                                                       reverse=True)
    assert mgr.graph_for(3, 3) is None                     # nothing captured yet
    mgr.graphs = dict.fromkeys(keys)
    assert mgr.graph_for(3, 3) == 4                        # uniform decode: decode graph
    assert mgr.graph_for(1, 20) == (1, 32)                 # one short prompt
    assert mgr.graph_for(3, 7) == (4, 32)                  # decodes + a chunk
    assert mgr.graph_for(5, 100) == (16, 128)
    assert mgr.graph_for(9, 9) == (16, 32)                 # decodes past the decode graphs
    assert mgr.graph_for(2, 129) is None                   # more tokens than any graph
    assert mgr.graph_for(17, 60) is None                   # more requests than any graph
    assert CudaGraphManager([], [(1, 32)]).keys() == []    # no decode graphs: none at all


def test_cudagraph_mode_is_checked():
    with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
        LLM(max_model_len=32, max_num_seqs=2, cudagraph_mode="PIECEWISE")
    assert LLM(max_model_len=32, max_num_seqs=2, enforce_eager=True).cudagraph_mode == "NONE"


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU side of graph capture")
def test_cpu_runner_has_no_graphs():
    llm = LLM(max_model_len=32, max_num_seqs=2)
    assert not llm.runner.cuda_graphs.enabled
    llm.runner.capture_cuda_graphs()  # a no-op
    assert llm.runner.cuda_graphs.graphs == {}
