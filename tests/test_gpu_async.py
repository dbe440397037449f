"""GPU: the V2 step loop never synchronises, and async / CUDA graphs change no output."""

import random

import pytest
import torch
from device_utils import generate_without_sync

pytestmark = pytest.mark.gpu

from mrv2 import LLM, SamplingParams
from mrv2.async_output import AsyncOutput
from mrv2.models.loader import DEFAULT_MODEL_DIR


def _prompts(seed, n, vocab, lo=1, hi=40):
    rng = random.Random(seed)
    return [{"prompt_token_ids": [rng.randrange(1, vocab) for _ in range(rng.randrange(lo, hi))]}
            for _ in range(n)]


def _mixed_params(n):
    """Greedy, seeded top-k/top-p, logprobs, a stop token, min_p, penalties: the lot."""
    out = []
    for i in range(n):
        kind = i % 5
        if kind == 0:
            out.append(SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        elif kind == 1:
            out.append(SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=i, max_tokens=9,
                                      ignore_eos=True))
        elif kind == 2:
            out.append(SamplingParams(temperature=0.7, seed=i, logprobs=3, max_tokens=7,
                                      ignore_eos=True))
        elif kind == 3:
            out.append(SamplingParams(temperature=1.0, seed=i, stop_token_ids=[5, 6, 7, 8],
                                      max_tokens=15))
        else:
            out.append(SamplingParams(temperature=0.8, seed=i, min_p=0.05, max_tokens=10,
                                      repetition_penalty=1.2, ignore_eos=True))
    return out


def _tight(**kw):
    return LLM(DEFAULT_MODEL_DIR, max_model_len=64, max_num_seqs=4, max_num_batched_tokens=16,
               num_gpu_blocks_override=16, block_size=4, **kw)


def test_v2_loop_runs_under_sync_debug_error():
    """Prefills, decodes, finishes and preemptions; async + CUDA graphs; no sync at all
    except the AsyncOutput events (which set_sync_debug_mode does not count)."""
    llm = _tight(async_scheduling=True)
    assert llm.runner.cuda_graphs.graphs  # captured
    inputs = _prompts(0, 24, llm.hf_config.vocab_size)
    params = _mixed_params(24)
    llm.generate(inputs[:4], params[:4], use_tqdm=False)  # warm-up: compile kernels
    outs = generate_without_sync(llm, inputs, params)
    assert llm.scheduler.num_preemptions > 0
    assert all(o.finished for o in outs)
    # The detector is live: a .tolist() of a device tensor does raise.
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            torch.ones(2, device="cuda").tolist()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_outputs_identical_async_and_graphs_on_off():
    """fp32 (so that padding a batch to a graph size cannot flip a near-tie argmax)."""
    inputs = _prompts(1, 16, 2048)
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True) if i % 2 else
              SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=20, ignore_eos=True)
              for i in range(16)]
    results = {}
    for async_scheduling in (False, True):
        for mode in ("NONE", "FULL_DECODE_ONLY", "FULL"):
            llm = LLM(DEFAULT_MODEL_DIR, dtype="float32", max_model_len=128, max_num_seqs=16,
                      async_scheduling=async_scheduling, cudagraph_mode=mode)
            graphs = llm.runner.cuda_graphs
            assert bool(graphs.graphs) == (mode != "NONE")
            assert any(isinstance(k, tuple) for k in graphs.graphs) == (mode == "FULL")
            replayed = []
            replay = graphs.replay
            graphs.replay = lambda key, replay=replay, seen=replayed: seen.append(key) or replay(key)
            outs = llm.generate(inputs, params, use_tqdm=False)
            results[(async_scheduling, mode)] = [o.outputs[0].token_ids for o in outs]
            # FULL: the prefill steps replay prefill graphs too; decode-only: never.
            assert any(isinstance(k, tuple) for k in replayed) == (mode == "FULL")
            assert any(isinstance(k, int) for k in replayed) == (mode != "NONE")
    first = results[(False, "NONE")]
    for key, ids in results.items():
        assert ids == first, key


def test_tight_pool_async_equals_sync_bf16():
    inputs = _prompts(2, 16, 2048)
    params = _mixed_params(16)
    a = _tight(async_scheduling=False).generate(inputs, params, use_tqdm=False)
    b = _tight(async_scheduling=True).generate(inputs, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_async_output_copies_on_side_stream():
    x = torch.arange(5, device="cuda")
    torch.cuda._sleep(50_000_000)  # keep the main stream busy
    out = AsyncOutput(list("abcde"), x * 2)
    assert out.event is not None
    assert out.get_output().sampled_token_ids == [0, 2, 4, 6, 8]
    assert out.is_ready()


def test_v1_baseline_graphs_equal_eager_and_v2():
    inputs = _prompts(3, 16, 2048)
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for runner, mode in (("v1", "FULL"), ("v1", "FULL_DECODE_ONLY"), ("v1", "NONE"),
                         ("v2", "FULL")):
        llm = LLM(DEFAULT_MODEL_DIR, dtype="float32", max_model_len=128, max_num_seqs=16,
                  runner=runner, cudagraph_mode=mode)
        graphs = llm.runner.cuda_graphs
        assert bool(graphs.graphs) == (mode != "NONE")
        replayed = []
        replay = graphs.replay
        graphs.replay = lambda key, replay=replay, seen=replayed: seen.append(key) or replay(key)
        outs[(runner, mode)] = [o.outputs[0].token_ids for o in
                                llm.generate(inputs, sp, use_tqdm=False)]
        assert any(isinstance(k, tuple) for k in replayed) == (mode == "FULL")  # prefill graphs
    assert len({tuple(map(tuple, ids)) for ids in outs.values()}) == 1, outs.keys()


def test_new_batch_sizes_and_lengths_compile_no_kernel():
    """Batch sizes and prompt lengths never seen before reuse the compiled kernels: the
    size arguments of the step's kernels are not specialised on (``do_not_specialize``)
    and their blocks are fixed, so nothing compiles inside a timed run."""
    from mrv2.bench.timing import count_triton_compiles

    llm = LLM(DEFAULT_MODEL_DIR, max_model_len=128, max_num_seqs=64, seed=0)
    vocab = llm.hf_config.vocab_size

    def run(seed, n, lo, hi, max_tokens):
        params = [SamplingParams(temperature=0.8, max_tokens=max_tokens, ignore_eos=True)] * n
        return llm.generate(_prompts(seed, n, vocab, lo, hi), params, use_tqdm=False)

    # Warm-up: 3 requests with 20-29-token prompts (the attention's prefill and decode
    # launch configurations), ending at batch 1.
    run(0, 3, 20, 30, 4)
    with count_triton_compiles() as compiled:
        run(1, 37, 17, 60, 9)   # 37 requests (odd, then 36, 33 ...), longer prompts
        run(2, 16, 33, 34, 3)   # a batch divisible by 16, 33-token prompts
        run(3, 1, 1, 2, 2)      # a single one-token prompt
    assert compiled == [], f"compiled inside the runs: {sorted(set(compiled))}"


def test_large_decode_batches_order_requests_without_a_sync_or_a_change(monkeypatch):
    """At >= ORDER_MIN_REQS decode requests (and a long enough model) attention's programs
    take the longest requests first (``attention.longest_first``, in the captured graphs): the step loop stays free of
    syncs and the fp32 greedy tokens equal those of a runner without the order."""
    from mrv2.kernels import attention

    seen = []
    real = attention.longest_first

    def spy(md):
        out = real(md)
        seen.append(out.req_order is not None)
        return out

    monkeypatch.setattr(attention, "longest_first", spy)
    kw = {"dtype": "float32", "max_model_len": attention.ORDER_MIN_SEQ_LEN, "max_num_seqs": 72,
          "seed": 0}
    _greedy_unsynced_equals_plain(
        kw, 70, 6, (3, 90), lambda: monkeypatch.setattr(attention, "ORDER_ENABLED", False),
        check_on=lambda llm: any(seen))  # the large decode graphs were captured with an order


def _greedy_unsynced_equals_plain(kw, n, max_tokens, lens, turn_off, check_on=None):
    """fp32 greedy tokens of ``n`` random prompts (lengths in ``lens``): an LLM built with
    ``kw`` runs them (after a warm-up) with no sync; ``turn_off()``, then a fresh LLM gives
    the same tokens. ``check_on(llm)`` asserts the path under test is on."""
    llm = LLM(DEFAULT_MODEL_DIR, **kw)
    assert check_on is None or check_on(llm)
    prompts = _prompts(7, n, llm.hf_config.vocab_size, *lens)
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)] * n
    llm.generate(prompts, params, use_tqdm=False)  # warm-up
    outs = generate_without_sync(llm, prompts, params)
    del llm
    turn_off()
    plain = LLM(DEFAULT_MODEL_DIR, **kw).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]


def test_fixed_key_partitions_without_a_sync_or_a_change(monkeypatch):
    """Every decode step on fixed-size key partitions (``attention.DECODE_PARTITIONS``: a rule
    for 1-256 requests, parts of 128 keys): the fused kernel's batches (<= 32) and paged
    attention's (33+), mixed contexts, in the captured graphs; the step loop stays free of
    syncs and the fp32 greedy tokens equal those of the runner without partitions."""
    from mrv2.kernels import attention

    kw = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 48, "seed": 0}
    monkeypatch.setattr(attention, "DECODE_PARTITIONS",
                        [{"lo": 1, "hi": 256, "min_seq_len": 0, "keys": 128}])
    cfg = attention._pick_config(40, 2, 2, 1, 512)  # the embedded model: 2 KV heads, GQA 2
    assert cfg["part_tiles"] > 0 and cfg["num_splits"] == 4
    _greedy_unsynced_equals_plain(
        kw, 44, 8, (3, 300), lambda: monkeypatch.setattr(attention, "DECODE_PARTITIONS", []))


def test_folded_kv_heads_without_a_sync_or_a_change(monkeypatch):
    """Paged attention's decode launches of 33+ requests with both KV heads of the embedded
    model in one program (``kv_fold`` 2, ``attention_table.fold_rows``' rows), mixed
    contexts, in the captured graphs: the step loop stays free of syncs and the fp32 greedy
    tokens equal those of the runner without the fold."""
    from script_loader import load_script

    from mrv2.kernels import attention

    kw = {"dtype": "float32", "max_model_len": 512, "max_num_seqs": 48, "seed": 0}
    plain_pick = attention._pick_config
    monkeypatch.setattr(attention, "_pick_config", plain_pick)  # restored after the test
    load_script("bench_with").override_paged_launch(
        {"lo": 33, "hi": 256, "kv_fold": 2, "block_n": 16, "num_warps": 4, "num_stages": 3})
    cfg = attention._pick_config(40, 2, 2, 1, 512)
    assert (cfg["kv_fold"], cfg["block_q"]) == (2, 4)
    _greedy_unsynced_equals_plain(
        kw, 44, 8, (3, 300), lambda: monkeypatch.setattr(attention, "_pick_config", plain_pick))
