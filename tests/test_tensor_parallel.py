"""Tensor parallelism (mrv2/distributed/) on the CPU: gloo, 2 processes, Triton's interpreter.

One-process tests pin the sharding math (which slice each rank holds, and that the slices
of an MLP / embedding / lm_head recombine to the full layer). Two-process tests run
``LLM(tensor_parallel_size=2)`` against ``tensor_parallel_size=1`` on the embedded model (2
KV heads: one per rank) and on a tiny random Qwen3 with 1 KV head (replicated on both
ranks), an odd vocabulary (padded shards), biases and an untied lm_head: equal logprobs
(the logits, up to fp32 summation order) and equal tokens, through chunked prefill and
preemption; a killed worker makes ``generate`` raise a clear error in bounded time.
"""

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from mrv2 import LLM, SamplingParams
from mrv2.distributed.executor import TPWorkerError
from mrv2.distributed.layers import (
    VocabParallelEmbedding,
    check_tp_size,
    local_config,
    shard_model,
    shard_spec,
    shard_tensor,
    tp_layout,
)
from mrv2.distributed.worker import RankSpec, load_rank_model
from mrv2.models.loader import build_model, init_dummy_weights, load_model

TOL = {"atol": 1e-4, "rtol": 1e-4}


def _config(**kw):
    from transformers import Qwen3Config

    base = {"vocab_size": 301, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 16, "max_position_embeddings": 256, "tie_word_embeddings": False,
            "attention_bias": True, "initializer_range": 0.5, "rms_norm_eps": 1e-6,
            "eos_token_id": 0}
    return Qwen3Config(**(base | kw))


@pytest.fixture(scope="module")
def tiny_1kv(tmp_path_factory) -> Path:
    """A random Qwen3 with 1 KV head, vocab 301 (odd), q/k/v/o biases, untied lm_head."""
    from transformers import Qwen3ForCausalLM

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(_config())
    with torch.no_grad():  # HF zeroes biases: make them matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    path = tmp_path_factory.mktemp("tiny_1kv")
    model.save_pretrained(path, safe_serialization=True)
    return path


def _child_pids() -> set[int]:
    """This process's children (with multiprocessing's resource tracker among them)."""
    pids = set()
    for task in Path("/proc/self/task").iterdir():
        # NOTE: a thread may end between the listing and the read (its task folder goes):
        # it has no children to report then (a flake of CI run 13c, session 13)
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            pids |= {int(p) for p in (task / "children").read_text().split()}
    return pids


def _assert_reaped(worker_pids) -> None:
    """The workers are no children any more (exited and reaped), and no child is a zombie."""
    children = _child_pids()
    assert not children & set(worker_pids)
    for pid in children:
        with contextlib.suppress(FileNotFoundError):
            assert Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"


# -- the sharding math, in one process ---------------------------------------------------

@pytest.mark.parametrize("bad, field", [
    (0, "tensor_parallel_size"), (-2, "tensor_parallel_size"), (True, "tensor_parallel_size"),
    ("2", "tensor_parallel_size"), (3, "num_attention_heads"), (8, "num_attention_heads")])
def test_check_tp_size_names_the_field(bad, field):
    with pytest.raises(ValueError, match=field):
        check_tp_size(_config(), bad)


def test_check_tp_size_kv_heads_and_intermediate():
    with pytest.raises(ValueError, match="num_key_value_heads=4"):
        check_tp_size(_config(num_attention_heads=12, num_key_value_heads=4), 6)
    with pytest.raises(ValueError, match="intermediate_size=90"):
        check_tp_size(_config(intermediate_size=90), 4)
    check_tp_size(_config(num_attention_heads=8, num_key_value_heads=2), 8)  # replicated x4


@pytest.mark.parametrize("heads, kv_heads, tp", [(4, 2, 2), (4, 1, 2), (8, 2, 4), (8, 8, 4),
                                                 (16, 4, 8), (4, 4, 1)])
def test_every_rank_holds_the_kv_heads_of_its_query_heads(heads, kv_heads, tp):
    cfg = _config(num_attention_heads=heads, num_key_value_heads=kv_heads)
    held = []
    for rank in range(tp):
        lay = tp_layout(cfg, tp, rank)
        q_heads = range(lay.q_head_start, lay.q_head_start + lay.num_heads)
        kv = range(lay.kv_head_start, lay.kv_head_start + lay.num_kv_heads)
        assert lay.num_heads == heads // tp and lay.num_kv_heads == max(1, kv_heads // tp)
        assert all(h // (heads // kv_heads) in kv for h in q_heads)   # GQA group is local
        held += list(q_heads)
    assert held == list(range(heads))                                 # each q head once


def test_shard_spec_ranges_tile_each_tensor():
    cfg = _config()  # vocab 301 over 2 ranks: 151 rows each, the last one padding
    lays = [tp_layout(cfg, 2, r) for r in range(2)]
    q = [shard_spec("model.layers.0.self_attn.q_proj.weight", lay) for lay in lays]
    assert [(s.dim, s.start, s.stop, s.full) for s in q] == [(0, 0, 32, 64), (0, 32, 64, 64)]
    o = [shard_spec("model.layers.1.self_attn.o_proj.weight", lay) for lay in lays]
    assert [(s.dim, s.start, s.stop) for s in o] == [(1, 0, 32), (1, 32, 64)]
    kv = [shard_spec("model.layers.0.self_attn.k_proj.bias", lay) for lay in lays]
    assert [(s.start, s.stop) for s in kv] == [(0, 16), (0, 16)]      # replicated
    down = shard_spec("model.layers.0.mlp.down_proj.weight", lays[1])
    assert (down.dim, down.start, down.stop, down.full) == (1, 48, 96, 96)
    vocab = [shard_spec("lm_head.weight", lay) for lay in lays]
    assert [(s.start, s.stop, s.full) for s in vocab] == [(0, 151, 301), (151, 302, 301)]
    for name in ("model.layers.0.self_attn.o_proj.bias", "model.norm.weight",
                 "model.layers.0.self_attn.q_norm.weight", "model.layers.0.mlp.down_proj.bias"):
        assert shard_spec(name, lays[0]) is None                      # whole on every rank
    last = shard_tensor(torch.arange(301.0).view(301, 1), vocab[1])
    assert last.shape == (151, 1) and last[-1].item() == 0 and last[-2].item() == 300


def _full_and_shards(cfg, tp):
    """A random full model and its ``tp`` rank models, weights sliced by ``shard_spec``."""
    full = build_model(cfg, torch.float32, torch.device("cpu"))
    init_dummy_weights(full, seed=1, std=0.3)
    state = full.state_dict()
    shards = []
    for rank in range(tp):
        lay = tp_layout(cfg, tp, rank)
        m = build_model(local_config(cfg, lay), torch.float32, torch.device("cpu"),
                        prepare=lambda m, lay=lay: shard_model(m, lay))
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.copy_(shard_tensor(state[name], shard_spec(name, lay)))
        shards.append(m)
    return full, shards


@pytest.mark.parametrize("tp", [2, 4])
def test_rank_partial_sums_equal_the_full_layers(tp):
    """At world size 1 the collectives are no-ops, so each rank's module returns its partial
    result: their sum (all-reduce) / concatenation (all-gather) must be the full layer's."""
    cfg = _config(num_attention_heads=8, num_key_value_heads=2, intermediate_size=96)
    full, shards = _full_and_shards(cfg, tp)
    x = torch.randn(5, cfg.hidden_size)                                # [T, hidden]
    with torch.no_grad():
        mlp = sum(s.model.layers[0].mlp(x) for s in shards)            # row-parallel partials
        torch.testing.assert_close(mlp, full.model.layers[0].mlp(x), **TOL)
        attn_in = torch.randn(5, 8 * 16)                               # o_proj input, all heads
        o = sum(s.model.layers[1].self_attn.o_proj(attn_in[:, r * 8 * 16 // tp:
                                                          (r + 1) * 8 * 16 // tp])
                for r, s in enumerate(shards))
        torch.testing.assert_close(o, full.model.layers[1].self_attn.o_proj(attn_in), **TOL)
        q = torch.cat([s.model.layers[0].self_attn.q_proj(x) for s in shards], dim=-1)
        torch.testing.assert_close(q, full.model.layers[0].self_attn.q_proj(x), **TOL)
        ids = torch.tensor([0, 5, 150, 151, 299, 300])                 # both sides of a cut
        assert isinstance(shards[0].model.embed_tokens, VocabParallelEmbedding)
        emb = sum(s.model.embed_tokens(ids) for s in shards)
        torch.testing.assert_close(emb, full.model.embed_tokens(ids), **TOL)
        logits = torch.cat([s.compute_logits(x) for s in shards], dim=-1)[:, :cfg.vocab_size]
        torch.testing.assert_close(logits, full.compute_logits(x), **TOL)


def test_loader_reads_each_ranks_slice(tiny_1kv):
    """Each rank's parameters are exactly its slice of the checkpoint (padding zeroed)."""
    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(tiny_1kv)
    full, _ = load_model(tiny_1kv, "float32", "cpu")
    state = full.state_dict()
    spec = RankSpec(str(tiny_1kv), cfg, 2, 0, torch.float32, "auto", 0, None, None)
    for rank in range(2):
        model, local = load_rank_model(spec, rank, torch.device("cpu"))
        assert local.num_key_value_heads == 1 and local.intermediate_size == 48
        lay = tp_layout(cfg, 2, rank)
        for name, p in model.named_parameters():
            torch.testing.assert_close(p, shard_tensor(state[name], shard_spec(name, lay)),
                                       atol=0, rtol=0)
        assert model.lm_head.weight.shape == (151, 64)
    assert model.lm_head.weight[-1].abs().sum() == 0                   # rank 1's padding row


# -- LLM(tensor_parallel_size=...) --------------------------------------------------------

@pytest.mark.parametrize("kwargs, match", [
    ({"tensor_parallel_size": 0}, "tensor_parallel_size must be a positive integer"),
    ({"tensor_parallel_size": 1.5}, "tensor_parallel_size must be a positive integer"),
    ({"tensor_parallel_size": 3}, "num_attention_heads=4"),
    ({"tensor_parallel_size": 2, "runner": "v1"}, "V2 runner"),
    ({"tensor_parallel_size": 2, "speculative_config": {"method": "ngram",
                                                        "num_speculative_tokens": 2}},
     "speculative_config")])
def test_llm_rejects_bad_tensor_parallel_size_before_spawning(kwargs, match, monkeypatch):
    def no_spawn(*args, **kwargs):
        raise AssertionError("a worker was spawned")

    monkeypatch.setattr("mrv2.distributed.executor.TPExecutor.__init__", no_spawn)
    with pytest.raises(ValueError, match=match):
        LLM(max_model_len=64, **kwargs)


PROMPTS = ["ROMEO:", "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo? Deny thy father",
           "First Citizen:\nBefore we proceed any further, hear me speak.", "To be, or not to be"]


def _compare_logprobs(a, b):
    """Same tokens; sampled and prompt logprobs equal within fp32 tolerance."""
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    for ea, eb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        for tok, lp in ea.items():
            assert abs(lp.logprob - eb[tok].logprob) < 1e-4
    assert (a.prompt_logprobs is None) == (b.prompt_logprobs is None)
    for ea, eb in zip((a.prompt_logprobs or [None])[1:], (b.prompt_logprobs or [None])[1:]):
        for tok, lp in ea.items():
            assert abs(lp.logprob - eb[tok].logprob) < 1e-4


@pytest.mark.slow
def test_tp2_equals_tp1_embedded_with_chunked_prefill_and_preemption():
    """2 KV heads: one per rank. A 16-token budget chunks the 17- and 19-token prompts; a
    pool of 9 blocks x 8 tokens for 4 rows preempts. Greedy and seeded rows, with logprobs
    (prompt logprobs on the greedy ones)."""
    kw = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 16,
          "num_gpu_blocks_override": 9, "block_size": 8}
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=2,
                             prompt_logprobs=2),
              SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=8,
                             ignore_eos=True, logprobs=2)] * 2
    ref = LLM(**kw)
    want = ref.generate(PROMPTS, params, use_tqdm=False)
    assert ref.scheduler.num_preemptions > 0
    llm = LLM(tensor_parallel_size=2, **kw)
    workers = llm.runner.worker_pids
    try:
        assert llm.runner.local_config.num_key_value_heads == 1
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.scheduler.num_preemptions > 0
        for a, b in zip(want, got):
            _compare_logprobs(a, b)
        assert [o.outputs[0].text for o in got] == [o.outputs[0].text for o in want]
    finally:
        llm.shutdown()
    _assert_reaped(workers)


def test_tp2_equals_tp1_one_kv_head_replicated(tiny_1kv):
    """1 KV head on 2 ranks (replicated), vocab 301 (padded shards), biases, untied
    lm_head; a 12-token budget chunks the prompts. Whole logprob rows compared: the logits."""
    kw = {"max_model_len": 64, "max_num_seqs": 4, "max_num_batched_tokens": 12,
          "skip_tokenizer_init": True}
    prompts = [{"prompt_token_ids": [int(t) for t in torch.randint(0, 301, (n,),
                                                                    generator=g)]}
               for n, g in ((3, torch.Generator().manual_seed(1)),
                            (20, torch.Generator().manual_seed(2)),
                            (9, torch.Generator().manual_seed(3)))]
    # -1: the full vocabulary, i.e. every logit (up to the row's log-sum-exp)
    sp = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=-1,
                        prompt_logprobs=-1)
    want = LLM(str(tiny_1kv), **kw).generate(prompts, sp, use_tqdm=False)
    assert len({tuple(o.outputs[0].token_ids) for o in want}) == 3     # varied output
    llm = LLM(str(tiny_1kv), tensor_parallel_size=2, **kw)
    pids = set(llm.runner.worker_pids)
    assert len(pids) == 1 and pids <= _child_pids()
    try:
        got = llm.generate(prompts, sp, use_tqdm=False)
        for a, b in zip(want, got):
            _compare_logprobs(a, b)
            assert all(len(e) == 301 for e in b.outputs[0].logprobs)      # whole rows
    finally:
        llm.shutdown()
    _assert_reaped(pids)
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(prompts, sp, use_tqdm=False)


def _assert_raises_soon(llm, prompts, sp, limit_s):
    t0 = time.monotonic()
    with pytest.raises(TPWorkerError, match=r"rank 1 \(pid \d+\) exited with code -9"):
        llm.generate(prompts, sp, use_tqdm=False)
    assert time.monotonic() - t0 < limit_s


def test_killed_worker_makes_generate_raise(tiny_1kv):
    """Killed between steps (the pipe breaks) and then the next call again: a clear
    RuntimeError at once, the dead worker reaped, the LLM still answering."""
    llm = LLM(str(tiny_1kv), tensor_parallel_size=2, max_model_len=64, skip_tokenizer_init=True)
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 2, 3]}]
    assert len(llm.generate(prompts, sp, use_tqdm=False)[0].outputs[0].token_ids) == 4
    (pid,) = llm.runner.worker_pids
    os.kill(pid, signal.SIGKILL)
    for _ in range(200):  # until it is dead (a zombie: its pipe closed), not yet reaped
        if Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] == "Z":
            break
        time.sleep(0.05)
    _assert_raises_soon(llm, prompts, sp, 15)
    _assert_reaped([pid])
    with pytest.raises(TPWorkerError, match="exited with code -9"):
        llm.generate(prompts, sp, use_tqdm=False)                     # still the clear error
    assert not llm.llm_engine.engine.has_unfinished()
    llm.shutdown()


@pytest.mark.slow
def test_worker_killed_mid_generation_raises_in_bounded_time(tiny_1kv):
    """Killed while ``generate`` runs: rank 0's next collective fails (gloo sees the closed
    socket), and ``generate`` raises within seconds instead of hanging."""
    llm = LLM(str(tiny_1kv), tensor_parallel_size=2, max_model_len=256,
              skip_tokenizer_init=True)
    (pid,) = llm.runner.worker_pids
    sp = SamplingParams(temperature=0, max_tokens=240, ignore_eos=True)
    killer = threading.Timer(1.0, os.kill, (pid, signal.SIGKILL))
    killer.start()
    try:
        _assert_raises_soon(llm, [{"prompt_token_ids": [1, 2, 3]}] * 2, sp, 30)
    finally:
        killer.cancel()
        llm.shutdown()
    _assert_reaped([pid])



def test_broken_checkpoint_fails_construction_and_stops_the_workers(tiny_1kv, tmp_path):
    """Every rank fails to read the file: LLM raises the loader's ValueError, and the
    spawned worker does not outlive the failed construction."""
    (tmp_path / "config.json").write_text((tiny_1kv / "config.json").read_text())
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    before = _child_pids()
    with pytest.raises(ValueError, match="cannot read safetensors file"):
        LLM(str(tmp_path), tensor_parallel_size=2, skip_tokenizer_init=True, max_model_len=64)
    for pid in _child_pids() - before:  # only multiprocessing's resource tracker may be new
        assert b"resource_tracker" in Path(f"/proc/{pid}/cmdline").read_bytes()
    _assert_reaped([])
