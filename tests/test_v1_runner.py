"""The V1-style baseline runner (mrv2/v1/): V1's mechanics, V2's outputs.

End to end, greedy V1 equals V2 and transformers token for token (with logprobs),
also through chunked prefill, queueing and preemption; a seeded request samples the
same tokens alone, in a batch and across preemption. Unit tests pin the persistent
batch (add / remove / condense / swap against a dict reference), the numpy input
preparation (against a per-token loop) and the sampler (chi-squared against the
target distribution, seeded generators, logprobs, min_tokens).
"""

import random

import numpy as np
import pytest
import torch
from hf_reference import hf_greedy
from scipy.stats import chisquare

from mrv2 import LLM, SamplingParams
from mrv2.config import CacheConfig, SchedulerConfig
from mrv2.kernels.logprobs import compute_topk_logprobs_ref
from mrv2.kernels.top_k_top_p import top_k_top_p_min_p_sorted
from mrv2.models.loader import DEFAULT_MODEL_DIR, load_model
from mrv2.platform import DEVICE
from mrv2.request import Request
from mrv2.scheduler import NewRequestData, SchedulerOutput
from mrv2.v1 import V1ModelRunner
from mrv2.v1.input_batch import InputBatch
from mrv2.v1.request_state import CachedRequestState
from mrv2.v1.sampler import Sampler, SamplingMetadata

_rng = random.Random(0)
PROMPTS = [[_rng.randrange(3, 2048) for _ in range(n)] for n in (1, 5, 13, 21, 30, 9)]
INPUTS = [{"prompt_token_ids": p} for p in PROMPTS]
N_OUT = 8
SEEDED = 5  # the last prompt samples at random with a seed; the others are greedy
PARAMS = [SamplingParams(temperature=0, max_tokens=N_OUT, ignore_eos=True, logprobs=3)] * SEEDED + [
    SamplingParams(temperature=0.8, top_k=20, seed=11, max_tokens=N_OUT, ignore_eos=True)]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


def _assert_same_logprobs(a, b):
    for ca, cb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs):
        assert list(ca) == list(cb)  # same ids, same order (sampled first, then top-k)
        for tok in ca:
            assert abs(ca[tok].logprob - cb[tok].logprob) < 1e-4
            assert ca[tok].rank == cb[tok].rank


@pytest.fixture(scope="module")
def v1_llm():
    return LLM(max_model_len=48, max_num_seqs=8, runner="v1")


@pytest.fixture(scope="module")
def v1_free(v1_llm):
    return v1_llm.generate(INPUTS, PARAMS, use_tqdm=False)


@pytest.fixture(scope="module")
def v2_free():
    return LLM(max_model_len=48, max_num_seqs=8, runner="v2").generate(INPUTS, PARAMS,
                                                                        use_tqdm=False)


# -- end to end ------------------------------------------------------------------------

def test_v1_greedy_equals_v2_and_transformers(v1_llm, v1_free, v2_free):
    assert isinstance(v1_llm.runner, V1ModelRunner)
    assert _ids(v1_free)[:SEEDED] == _ids(v2_free)[:SEEDED]
    for a, b in zip(v1_free[:SEEDED], v2_free[:SEEDED]):
        _assert_same_logprobs(a, b)
        assert abs(a.outputs[0].cumulative_logprob - b.outputs[0].cumulative_logprob) < 1e-3
    some = [0, 3]
    assert [_ids(v1_free)[i] for i in some] == hf_greedy(DEFAULT_MODEL_DIR,
                                                         [PROMPTS[i] for i in some], N_OUT)


def test_v1_tight_budget_chunks_queues_and_preempts(v1_free, v2_free):
    # 3 rows, 8 tokens a step, 12 blocks x 4 tokens (one full-length sequence).
    tight = LLM(max_model_len=48, max_num_seqs=3, max_num_batched_tokens=8,
                num_gpu_blocks_override=12, block_size=4, runner="v1")
    outs = tight.generate(INPUTS, PARAMS, use_tqdm=False)
    assert tight.scheduler.num_preemptions > 0
    assert max(map(len, PROMPTS)) > 8  # some prompt was prefilled in chunks
    assert _ids(outs)[:SEEDED] == _ids(v2_free)[:SEEDED]
    for a, b in zip(outs[:SEEDED], v2_free[:SEEDED]):
        _assert_same_logprobs(a, b)
    # The seeded request's generator neither moved on discarded chunk samples nor
    # restarted after a preemption.
    assert _ids(outs)[SEEDED] == _ids(v1_free)[SEEDED]
    # Only requests that finished in the last step remain (freed at the next schedule).
    assert len(tight.runner.requests) <= 3


def test_v1_seeded_request_same_alone_and_in_batch(v1_llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=7, max_tokens=8, ignore_eos=True)
    alone = v1_llm.generate(["ROMEO:"], sp, use_tqdm=False)[0].outputs[0].token_ids
    others = [SamplingParams(temperature=1.0, max_tokens=n, ignore_eos=True) for n in (3, 10)]
    batch = v1_llm.generate(["JULIET:", "ROMEO:", "KING:"], [others[0], sp, others[1]],
                            use_tqdm=False)
    assert batch[1].outputs[0].token_ids == alone
    free = v1_llm.generate(["ROMEO:"] * 2, SamplingParams(temperature=1.0, max_tokens=8,
                                                           ignore_eos=True), use_tqdm=False)
    assert free[0].outputs[0].token_ids != free[1].outputs[0].token_ids


def test_env_var_selects_the_runner(monkeypatch):
    monkeypatch.setenv("MRV2_USE_V2_MODEL_RUNNER", "0")
    llm = LLM(max_model_len=32, max_num_seqs=2)
    assert isinstance(llm.runner, V1ModelRunner) and llm.runner_name == "v1"
    monkeypatch.setenv("MRV2_USE_V2_MODEL_RUNNER", "1")
    assert not isinstance(LLM(max_model_len=32, max_num_seqs=2).runner, V1ModelRunner)
    for bad in ("yes", "2", ""):
        monkeypatch.setenv("MRV2_USE_V2_MODEL_RUNNER", bad)
        with pytest.raises(ValueError, match="MRV2_USE_V2_MODEL_RUNNER"):
            LLM(max_model_len=32)


@pytest.mark.parametrize("kwargs, name", [
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": 0.5}, "frequency_penalty"),
    ({"repetition_penalty": 1.2}, "repetition_penalty"),
    ({"logit_bias": {5: 1.0}}, "logit_bias"),
    ({"allowed_token_ids": [5, 6]}, "allowed_token_ids"),
    ({"prompt_logprobs": 1}, "prompt_logprobs"),
    ({"logprobs": 5000}, "logprobs"),
])
def test_validate_params_rejects_unsupported_features(v1_llm, kwargs, name):
    with pytest.raises(ValueError, match=name):
        v1_llm.generate("ROMEO:", SamplingParams(max_tokens=2, **kwargs), use_tqdm=False)
    assert not v1_llm.engine.has_unfinished()  # nothing was submitted


def test_logits_processors_rejected(v1_llm):
    with pytest.raises(ValueError, match="logits_processors"):
        V1ModelRunner(v1_llm.model, v1_llm.hf_config, v1_llm.scheduler_config,
                      v1_llm.cache_config, 4, v1_llm.device, v1_llm.dtype,
                      logits_processors=[object()])


# -- the persistent batch ----------------------------------------------------------------

BLOCK, MAX_LEN, VOCAB = 4, 64, 100


def _random_state(req_id: str, rng: random.Random) -> CachedRequestState:
    prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
    output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 8))]
    sp = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5]),
                        top_p=rng.choice([1.0, 0.9]), min_tokens=rng.choice([0, 3]))
    sp.all_stop_token_ids = {0}
    n = len(prompt) + len(output)
    blocks = rng.sample(range(1000), -(-n // BLOCK))
    gen = torch.Generator().manual_seed(rng.randrange(100)) if rng.random() < 0.3 else None
    return CachedRequestState(req_id, prompt, output, sp, blocks, rng.randrange(n), gen)


def _check_rows(batch: InputBatch, ref: dict[str, CachedRequestState]) -> None:
    assert set(batch.req_id_to_index) == set(ref)
    for req_id, s in ref.items():
        row = batch.req_id_to_index[req_id]
        assert batch._req_ids[row] == req_id
        n = s.num_tokens
        assert batch.num_tokens[row] == n and batch.num_prompt_tokens[row] == s.num_prompt_tokens
        assert batch.token_ids_cpu[row, :n].tolist() == s.prompt_token_ids + s.output_token_ids
        assert batch.num_computed_tokens_cpu[row] == s.num_computed_tokens
        nb = batch.block_table.num_blocks_per_row[row]
        assert batch.block_table.block_table_np[row, :nb].tolist() == s.block_ids
        sp = s.sampling_params
        assert batch.temperature_cpu[row] == np.float32(0.0 if sp.greedy else sp.temperature)
        assert batch.top_k_cpu[row] == (sp.top_k or VOCAB)
        assert batch.top_p_cpu[row] == np.float32(sp.top_p)
        assert batch.generators.get(row) is s.generator
        assert (row in batch.min_tokens) == (sp.min_tokens > 0)
        assert batch.req_output_token_ids[row] is s.output_token_ids
    assert set(batch.generators) | set(batch.min_tokens) <= set(batch.req_id_to_index.values())


def test_persistent_batch_add_remove_condense_swap_match_reference():
    rng = random.Random(0)
    batch = InputBatch(8, MAX_LEN, 64, BLOCK, VOCAB, torch.device("cpu"))
    ref: dict[str, CachedRequestState] = {}
    for step in range(400):
        op = rng.random()
        if op < 0.35 and len(batch._req_ids) - len(batch._holes) < 8 and \
                (batch._holes or len(batch._req_ids) < 8):
            s = _random_state(f"r{step}", rng)
            expect = min(batch._holes) if batch._holes else len(batch._req_ids)
            assert batch.add_request(s) == expect  # the first empty row
            ref[s.req_id] = s
        elif op < 0.6 and ref:
            req_id = rng.choice(sorted(ref))
            del ref[req_id]
            assert batch.remove_request(req_id) is not None
            assert batch.remove_request(req_id) is None
        elif op < 0.75 and len(ref) >= 2:
            a, b = rng.sample(sorted(ref), 2)
            batch.swap_states(batch.req_id_to_index[a], batch.req_id_to_index[b])
        elif op < 0.85 and ref:
            s = ref[rng.choice(sorted(ref))]
            if len(s.block_ids) < MAX_LEN // BLOCK:
                new = [rng.randrange(1000, 2000)]
                s.block_ids += new
                batch.block_table.append_row(new, batch.req_id_to_index[s.req_id])
        else:
            batch.condense()
            assert sorted(batch.req_id_to_index.values()) == list(range(len(ref)))
            assert batch.req_ids == sorted(ref, key=batch.req_id_to_index.get)
        _check_rows(batch, ref)


def test_sampling_metadata_mirrors_the_rows():
    rng = random.Random(1)
    batch = InputBatch(6, MAX_LEN, 64, BLOCK, VOCAB, torch.device("cpu"))
    states = [_random_state(f"r{i}", rng) for i in range(6)]
    for s in states:
        batch.add_request(s)
    batch.remove_request("r1")
    batch.condense()
    meta = batch.make_sampling_metadata()
    n = batch.num_reqs
    if meta.temperature is not None:
        assert meta.temperature.tolist() == batch.temperature_cpu[:n].tolist()
    if meta.top_k is not None:
        assert meta.top_k.tolist() == batch.top_k_cpu[:n].tolist()
    assert meta.all_greedy == all(batch.temperature_cpu[:n] == 0)
    assert not batch.batch_changed
    assert meta.output_token_ids == [s.output_token_ids for s in
                                     sorted((s for s in states if s.req_id != "r1"),
                                            key=lambda s: batch.req_id_to_index[s.req_id])]


def test_prepare_inputs_equal_a_per_token_loop():
    model, cfg = load_model(None, "float32", "cpu")
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=6 * MAX_LEN,
                             max_model_len=MAX_LEN)
    runner = V1ModelRunner(model, cfg, config,
                           CacheConfig(block_size=BLOCK), 256, torch.device("cpu"), torch.float32)
    rng = random.Random(2)
    for trial in range(5):
        batch = runner.input_batch
        for req_id in list(batch.req_id_to_index):
            batch.remove_request(req_id)
        batch.condense()
        states = [_random_state(f"t{trial}-{i}", rng) for i in range(rng.randrange(1, 7))]
        num_sched = []
        for s in states:
            batch.add_request(s)
            num_sched.append(rng.randrange(1, s.num_tokens - s.num_computed_tokens + 1))
        md, logits_indices = runner._prepare_inputs(np.array(num_sched, dtype=np.int64))
        ids, pos, slots, qsl, seq_lens = [], [], [], [0], []
        for s, n in zip(states, num_sched):
            tokens = s.prompt_token_ids + s.output_token_ids
            for p in range(s.num_computed_tokens, s.num_computed_tokens + n):
                ids.append(tokens[p])
                pos.append(p)
                slots.append(s.block_ids[p // BLOCK] * BLOCK + p % BLOCK)
            qsl.append(qsl[-1] + n)
            seq_lens.append(s.num_computed_tokens + n)
        T = len(ids)
        assert runner.input_ids[:T].tolist() == ids
        assert runner.positions[:T].tolist() == pos
        assert md.slot_mapping.tolist() == slots
        assert md.query_start_loc.tolist() == qsl and md.seq_lens.tolist() == seq_lens
        assert logits_indices.tolist() == [q - 1 for q in qsl[1:]]
        assert (md.max_query_len, md.max_seq_len) == (max(num_sched), max(seq_lens))
        for row, s in enumerate(states):
            assert md.block_table[row, :len(s.block_ids)].tolist() == s.block_ids


def _plan(num_scheduled, new_reqs=(), new_block_ids=None):
    return SchedulerOutput(new_reqs=list(new_reqs), new_block_ids=new_block_ids or {},
                           num_scheduled_tokens=num_scheduled,
                           total_num_scheduled_tokens=sum(num_scheduled.values()))


def test_unscheduled_request_leaves_the_batch_and_comes_back():
    """V1 drops a running request that is not scheduled from the batch, keeps its
    ``CachedRequestState`` and re-adds it later; nothing about it may change."""
    model, cfg = load_model(None, "float32", DEVICE)  # the kernels need CUDA on a GPU machine
    sp = SamplingParams(temperature=0, ignore_eos=True)
    prompts = {"A": [5, 6, 7, 8, 9], "B": [10, 11, 12]}

    def run(plans):
        runner = V1ModelRunner(model, cfg, SchedulerConfig(max_num_seqs=4, max_model_len=32,
                                                           max_num_batched_tokens=16),
                               CacheConfig(block_size=4), 8, DEVICE, torch.float32)
        new = [NewRequestData(r, p, len(p), Request(r, p, sp, arrival=0), blocks)
               for (r, p), blocks in zip(prompts.items(), ([0, 1], [2]))]
        runner.execute_model(_plan({"A": 5, "B": 3}, new))
        for plan in plans:
            out = runner.execute_model(plan).get_output()
            assert out.req_ids == list(plan.num_scheduled_tokens)  # the scheduler's order
            assert runner.input_batch.req_ids == out.req_ids
        return runner

    gap = run([_plan({"B": 1}),                                  # A sits out a step
               _plan({"B": 1, "A": 1}, new_block_ids={"B": [3]}),  # A comes back last
               _plan({"A": 1, "B": 1})])                          # rows swap
    steady = run([_plan({"A": 1, "B": 1}), _plan({"A": 1, "B": 1}, new_block_ids={"B": [3]}),
                  _plan({"B": 1})])
    for r in prompts:
        assert gap.requests[r].output_token_ids == steady.requests[r].output_token_ids
        assert gap.requests[r].block_ids == steady.requests[r].block_ids
    assert len(gap.requests["A"].output_token_ids) == 3


# -- the sampler ---------------------------------------------------------------------------

def _meta(temperature, top_k=None, top_p=None, min_p=None, generators=None, logprobs=None):
    t = torch.as_tensor(temperature, dtype=torch.float32)
    return SamplingMetadata(
        temperature=t, all_greedy=bool((t == 0).all()), all_random=bool((t > 0).all()),
        top_k=None if top_k is None else torch.as_tensor(top_k, dtype=torch.int32),
        top_p=None if top_p is None else torch.as_tensor(top_p, dtype=torch.float32),
        min_p=None if min_p is None else torch.as_tensor(min_p, dtype=torch.float32),
        generators=generators or {}, max_num_logprobs=logprobs,
        output_token_ids=[[] for _ in range(len(t))])


@pytest.mark.parametrize("temp, top_k, top_p, min_p", [
    (0.7, None, None, None), (1.0, 5, None, None), (1.3, None, 0.8, None),
    (1.0, None, None, 0.1), (0.9, 6, 0.9, None)])
def test_sampler_matches_target_distribution_chi_squared(temp, top_k, top_p, min_p):
    torch.manual_seed(0)
    V, N = 12, 20000
    logits = torch.randn(V) * 1.5
    rows = logits.expand(N, V).clone()
    meta = _meta([temp] * N, None if top_k is None else [top_k] * N,
                 None if top_p is None else [top_p] * N, None if min_p is None else [min_p] * N)
    sampled, _ = Sampler()(rows, meta)
    counts = torch.bincount(sampled, minlength=V).double()
    # V1's order: min-p, then top-k, then top-p over what top-k kept (renormalised).
    target = (logits / temp)[None]
    for k, p, m in ((0, 1.0, min_p or 0.0), (top_k or 0, 1.0, 0.0), (0, top_p or 1.0, 0.0)):
        target = top_k_top_p_min_p_sorted(target, torch.tensor([k]), torch.tensor([p]),
                                      torch.tensor([m]))
    target = target[0].softmax(-1).double()
    kept = target > 0
    assert counts[~kept].sum() == 0  # masked tokens are never drawn
    expected = target[kept] / target[kept].sum() * N
    assert chisquare(counts[kept].numpy(), expected.numpy()).pvalue > 1e-3


def test_seeded_row_same_draws_alone_and_in_batch():
    torch.manual_seed(1)
    logits = torch.randn(4, 50)
    temps = [0.0, 1.0, 0.8, 1.2]

    def draws(batch_rows, seeded_row):
        gen = torch.Generator().manual_seed(123)
        out = []
        for _ in range(6):
            meta = _meta([temps[r] for r in batch_rows], generators={seeded_row: gen})
            sampled, _ = Sampler()(logits[batch_rows], meta)
            out.append(int(sampled[seeded_row]))
        return out

    alone = draws([2], 0)
    assert draws([0, 1, 2, 3], 2) == alone
    assert draws([3, 2], 1) == alone
    assert len(set(alone)) > 1  # it does sample


def test_greedy_rows_and_logprobs_layout():
    torch.manual_seed(2)
    logits = torch.randn(3, 40)
    sampled, (ids, lps, ranks) = Sampler()(logits, _meta([0.0, 1.0, 0.0], logprobs=4))
    assert sampled[0] == logits[0].argmax() and sampled[2] == logits[2].argmax()
    ref_ids, ref_lps, ref_ranks = compute_topk_logprobs_ref(logits, 4, sampled)
    assert ids.tolist() == ref_ids.tolist() and ranks.tolist() == ref_ranks.tolist()
    torch.testing.assert_close(lps, ref_lps)
    assert ranks[0] == 1 and ranks[2] == 1


def test_min_tokens_bans_stop_ids_until_reached():
    logits = torch.zeros(2, 10)
    logits[:, 3] = 10.0  # the stop id is by far the most likely
    meta = _meta([0.0, 0.0])
    meta.min_tokens = {0: (2, {3}), 1: (2, {3})}
    meta.output_token_ids = [[5], [5, 6]]  # row 0 has 1 output (< 2), row 1 has 2
    sampled, _ = Sampler()(logits, meta)
    assert sampled[0] != 3 and sampled[1] == 3
