"""Issue 13: every bad value is refused before any work, and nothing is lost.

Each case of the issue, on stories260K (vocab 512): a clear ``ValueError``/``TypeError``
naming the field (or it works), no other request lost, the ``LLM`` still usable and no
row or KV block held afterwards. Fault containment is exercised by injected faults.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
from engine_checks import PROMPT, STORIES, assert_nothing_held, stories_llm

from mrv2 import SamplingParams
from mrv2.sample.logits_processors import LogitsProcessor

GREEDY = {"temperature": 0, "max_tokens": 4, "ignore_eos": True}


@pytest.fixture(scope="module")
def llm():
    return stories_llm()


@pytest.fixture(scope="module")
def clean(llm):
    """The clean-run greedy tokens of PROMPT (4 tokens)."""
    return llm.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0].token_ids


def _refused(llm, clean, field, make, exc=(ValueError, TypeError)):
    """``make()`` (build or submit) raises naming ``field``; the LLM still serves PROMPT."""
    with pytest.raises(exc, match=field):
        llm.generate([PROMPT, PROMPT], [SamplingParams(**GREEDY), make()], use_tqdm=False)
    assert_nothing_held(llm)
    assert llm.generate([PROMPT], SamplingParams(**GREEDY),
                        use_tqdm=False)[0].outputs[0].token_ids == clean
    assert_nothing_held(llm)


# -- 1. accepted by validation, then a crash inside the step (now refused at submit) -------

@pytest.mark.parametrize("field,kwargs", [
    ("logprobs", {"logprobs": 10**6}),
    ("prompt_logprobs", {"prompt_logprobs": 10**6}),
    ("seed", {"seed": 2**70}),
    ("seed", {"seed": 2**63 - 1, "n": 2}),
    ("stop_token_ids", {"stop_token_ids": [10**6], "min_tokens": 1}),
    ("logit_bias", {"logit_bias": {5: "x"}}),
    ("logit_bias", {"logit_bias": [1, 2]}),
    ("logit_bias", {"logit_bias": {10**6: 1.0}}),
    ("allowed_token_ids", {"allowed_token_ids": [512]}),
])
def test_step_crashers_are_refused_before_any_work(llm, clean, field, kwargs):
    _refused(llm, clean, field, lambda: SamplingParams(max_tokens=4, **kwargs))


def test_huge_top_k_means_the_whole_vocabulary(llm):
    # As in vLLM, top_k >= vocab is no top_k (no int32 overflow on the device).
    sp = {"temperature": 1.0, "seed": 7, "max_tokens": 5, "ignore_eos": True}
    a = llm.generate([PROMPT], SamplingParams(top_k=2**40, **sp), use_tqdm=False)
    b = llm.generate([PROMPT], SamplingParams(top_k=0, **sp), use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert_nothing_held(llm)


def test_largest_seed_that_fits_works(llm):
    out = llm.generate([PROMPT], SamplingParams(seed=2**63 - 2, n=2, max_tokens=2),
                       use_tqdm=False)
    assert [len(c.token_ids) for c in out[0].outputs] == [2, 2]


# -- 3. NaN / inf ------------------------------------------------------------------------

@pytest.mark.parametrize("field,kwargs", [
    ("logit_bias", {"logit_bias": {5: math.nan}}),
    ("logit_bias", {"logit_bias": {5: math.inf}}),
    ("logit_bias", {"logit_bias": {5: -math.inf}}),
    ("temperature", {"temperature": math.inf}),
    ("temperature", {"temperature": math.nan}),
    ("repetition_penalty", {"repetition_penalty": math.inf}),
    ("presence_penalty", {"presence_penalty": math.nan}),
    ("top_p", {"top_p": math.nan}),
    ("min_p", {"min_p": math.nan}),
])
def test_non_finite_values_are_refused(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


# -- 4. fully masked logits ----------------------------------------------------------------

def test_fully_masked_by_bias_is_refused():
    with pytest.raises(ValueError, match="logit_bias"):
        SamplingParams(allowed_token_ids=[7], logit_bias={7: -math.inf})


def test_fully_masked_by_min_tokens_is_refused_at_submit(llm, clean):
    _refused(llm, clean, "allowed_token_ids",
             lambda: SamplingParams(allowed_token_ids=[7], stop_token_ids=[7], min_tokens=2))
    _refused(llm, clean, "allowed_token_ids",  # EOS (2) is banned too while min_tokens
             lambda: SamplingParams(allowed_token_ids=[2], min_tokens=1))


class _MaskAll(LogitsProcessor):
    """Masks every logit of the rows whose request has ``allowed_token_ids``."""

    def __init__(self, max_num_reqs, device):
        import torch

        self.on = torch.zeros(max_num_reqs, dtype=torch.bool, device=device)
        self.cpu = np.zeros(max_num_reqs, dtype=bool)

    def add_request(self, row, prompt_token_ids, sampling_params):
        self.cpu[row] = sampling_params.allowed_token_ids is not None

    def remove_request(self, row):
        self.cpu[row] = False

    def apply_staged_writes(self):
        import torch

        self.on.copy_(torch.from_numpy(self.cpu))

    def apply(self, logits, idx_mapping, state):
        rows = self.on[idx_mapping[:logits.shape[0]].long()]              # [B]
        return logits.masked_fill(rows[:, None], float("-inf"))


def test_mask_the_validation_cannot_see_ends_only_that_request():
    llm = stories_llm(logits_processors=[_MaskAll])
    clean = llm.generate([PROMPT], SamplingParams(**GREEDY), use_tqdm=False)[0].outputs[0]
    outs = llm.generate([PROMPT, PROMPT], [SamplingParams(**GREEDY),
                                           SamplingParams(allowed_token_ids=[7], **GREEDY)],
                        use_tqdm=False)
    assert outs[0].outputs[0].token_ids == clean.token_ids
    bad = outs[1].outputs[0]
    assert bad.finish_reason == "error" and "allowed_token_ids" in bad.stop_reason
    assert all(t == 7 for t in bad.token_ids)  # never a token outside the allowed set
    assert_nothing_held(llm)


# -- 5. mutation after construction ----------------------------------------------------------

@pytest.mark.parametrize("field,value", [("n", 0), ("max_tokens", 0), ("temperature", -1.0),
                                         ("logit_bias", {1: math.nan}), ("stop_token_ids", 5)])
def test_mutation_after_construction_is_caught_at_submit(llm, clean, field, value):
    def make():
        sp = SamplingParams(max_tokens=4)
        setattr(sp, field, value)
        return sp

    _refused(llm, clean, field, make)


def test_params_changed_after_submit_do_not_reach_the_engine(llm, clean):
    eng = llm.llm_engine
    sp = SamplingParams(**GREEDY)
    eng.add_request("m", PROMPT, sp)
    sp.max_tokens, sp.temperature = 1, 5.0
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == clean


# -- 6. types ---------------------------------------------------------------------------------

@pytest.mark.parametrize("field,value", [
    ("stop", 5), ("stop_token_ids", 5), ("allowed_token_ids", 5), ("temperature", "0.5"),
    ("stop_token_ids", [True]), ("allowed_token_ids", [1.0]), ("max_tokens", 2.0),
    ("ignore_eos", "yes"), ("logit_bias", {"5": 1.0}), ("top_k", True), ("n", None),
])
def test_wrong_types_are_type_errors_naming_the_field(field, value):
    with pytest.raises(TypeError, match=field):
        SamplingParams(**{field: value})


def test_numpy_token_ids_are_accepted_and_bool_refused(llm, clean):
    ids = np.array(PROMPT["prompt_token_ids"], dtype=np.int64)
    out = llm.generate([{"prompt_token_ids": list(ids)}], SamplingParams(**GREEDY),
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == clean
    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(**GREEDY), use_tqdm=False)
    assert out[0].outputs[0].token_ids == clean
    sp = SamplingParams(stop_token_ids=[np.int32(5)], logit_bias={np.int64(3): np.float32(1)},
                        allowed_token_ids=list(np.arange(10)))
    assert sp.stop_token_ids == [5] and type(sp.stop_token_ids[0]) is int
    assert list(sp.logit_bias) == [3] and sp.allowed_token_ids == list(range(10))
    with pytest.raises(TypeError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": [1, True, 5]}], use_tqdm=False)
    with pytest.raises(TypeError, match="prompt_token_ids"):
        llm.generate([{"prompt_token_ids": 5}], use_tqdm=False)
    assert_nothing_held(llm)


# -- 7./8. LLM arguments, checked before anything is loaded -----------------------------------

@pytest.mark.parametrize("kwargs,exc,field", [
    ({"seed": "abc"}, TypeError, "seed"),
    ({"max_num_batched_tokens": 0}, ValueError, "max_num_batched_tokens"),
    ({"max_model_len": 0}, ValueError, "max_model_len"),
    ({"max_num_seqs": 0}, ValueError, "max_num_seqs"),
    ({"gpu_memory_utilization": 0.0}, ValueError, "gpu_memory_utilization"),
    ({"num_gpu_blocks_override": 0}, ValueError, "num_gpu_blocks_override"),
    ({"block_size": 3}, ValueError, "block_size"),
    ({"max_model_len": 10**6}, ValueError, "max_model_len"),
    ({"num_gpu_blocks_override": 2, "block_size": 16, "max_model_len": 128}, ValueError, "KV pool"),
])
def test_llm_arguments_fail_before_loading(monkeypatch, kwargs, exc, field):
    from mrv2.models import loader

    def no_load(*a, **k):
        raise AssertionError("weights were loaded before the arguments were checked")

    monkeypatch.setattr(loader, "load_model", no_load)
    with pytest.raises(exc, match=field):
        stories_llm(**kwargs)


# -- 2. exceptions and Ctrl-C inside generate --------------------------------------------------

@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_interrupted_generate_cleans_up_and_the_llm_stays_usable(llm, error):
    many = [PROMPT] * 5
    want = llm.generate(many, SamplingParams(**GREEDY), use_tqdm=False)
    step, calls = llm.engine.step, []

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise error("interrupted")
        return step()

    llm.engine.step = interrupted
    try:
        with pytest.raises(error):
            llm.generate(many, SamplingParams(**GREEDY), use_tqdm=False)
    finally:
        del llm.engine.step
    assert_nothing_held(llm)
    again = llm.generate(many, SamplingParams(**GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]


# -- 9. loading ---------------------------------------------------------------------------------

def _folder(tmp_path, weights: bytes | None = None, index=None):
    shutil.copy(STORIES / "config.json", tmp_path / "config.json")
    if weights is not None:
        (tmp_path / "model.safetensors").write_bytes(weights)
    if index is not None:
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path


@pytest.mark.parametrize("how", ["empty", "garbage", "truncated"])
def test_bad_safetensors_name_the_file(tmp_path, how):
    from mrv2.models.loader import load_model

    if not STORIES.is_dir():
        pytest.skip("no stories260K")
    real = (STORIES / "model.safetensors").read_bytes()
    data = {"empty": b"", "garbage": b"\x08\x00\x00\x00\x00\x00\x00\x00notjson!",
            "truncated": real[:len(real) // 2]}[how]
    folder = _folder(tmp_path, data)
    with pytest.raises(ValueError, match="model.safetensors"):
        load_model(folder, "float32", "cpu")


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "a/../../x"])
def test_index_shards_must_stay_inside_the_folder(tmp_path, shard):
    from mrv2.models.loader import load_model

    if not STORIES.is_dir():
        pytest.skip("no stories260K")
    inner = tmp_path / "m"
    inner.mkdir()
    (tmp_path / "outside.safetensors").write_bytes(b"")
    folder = _folder(inner, index={"weight_map": {"model.embed_tokens.weight": shard}})
    with pytest.raises(ValueError, match="outside the model folder"):
        load_model(folder, "float32", "cpu")


# -- the CLI ----------------------------------------------------------------------------------

@pytest.mark.parametrize("argv,needle", [
    (["--token-ids"], "--prompt"),
    (["--token-ids", "--prompt", "a,b"], "--prompt"),
    (["--max-token", "8"], "unrecognized arguments"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "nan"], "top_p"),
    (["--max-model-len", "0"], "max-model-len"),
])
def test_cli_refuses_bad_arguments_before_loading(monkeypatch, capsys, argv, needle):
    import mrv2.llm
    from mrv2.__main__ import main

    def no_llm(*a, **k):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(mrv2.llm, "LLM", no_llm)
    try:  # argparse's own errors exit; the CLI's value checks return 2
        code = main(["generate", *argv])
    except SystemExit as e:
        code = e.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert needle in err[-1] and "Traceback" not in "\n".join(err)


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_ctrl_c_inside_the_runner_step_leaves_a_consistent_engine(async_scheduling):
    llm = stories_llm(async_scheduling=async_scheduling, max_num_batched_tokens=8)
    many = [{"prompt_token_ids": [1, 403 + i, 407]} for i in range(4)]
    want = llm.generate(many, SamplingParams(**GREEDY), use_tqdm=False)
    real, calls = llm.runner.execute_model, []

    def interrupted(sched):
        calls.append(1)
        if len(calls) == 3:  # mid-flight: some prefills done, one step in flight (async)
            raise KeyboardInterrupt
        return real(sched)

    llm.runner.execute_model = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(many, SamplingParams(**GREEDY), use_tqdm=False)
    finally:
        llm.runner.execute_model = real
    assert_nothing_held(llm)
    again = llm.generate(many, SamplingParams(**GREEDY), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in want]
    assert_nothing_held(llm)
