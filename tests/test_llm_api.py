"""vLLM's offline API on the embedded model: inputs, outputs, stop conditions, errors."""

import pytest

from mrv2 import LLM, RequestOutput, SamplingParams
from mrv2.__main__ import main as cli_main


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=128, max_num_seqs=4, dtype="float32")


def test_prompt_forms_and_output_order(llm):
    ids = llm.tokenizer.encode("JULIET:")
    sp = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate(["ROMEO:", {"prompt_token_ids": ids}, {"prompt": "Nurse:"}], sp,
                        use_tqdm=False)
    assert [o.prompt for o in outs] == ["ROMEO:", None, "Nurse:"]
    assert outs[1].prompt_token_ids == ids
    single = llm.generate("JULIET:", sp, use_tqdm=False)
    assert isinstance(single[0], RequestOutput) and single[0].finished
    assert single[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    c = single[0].outputs[0]
    assert (c.index, c.finish_reason, c.stop_reason, len(c.token_ids)) == (0, "length", None, 4)


def test_n_completions_and_seeds(llm):
    out = llm.generate("ROMEO:", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8,
                                                ignore_eos=True), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    again = llm.generate("ROMEO:", SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=8,
                                                  ignore_eos=True), use_tqdm=False)[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]


def test_stop_token_ids_and_eos(llm):
    base = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].token_ids
    stop_id = base[5]
    first = base.index(stop_id)
    out = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                stop_token_ids=[stop_id]), use_tqdm=False)[0].outputs[0]
    assert out.token_ids == base[: first + 1]  # the stop token is kept in token_ids
    assert (out.finish_reason, out.stop_reason) == ("stop", stop_id)
    # EOS ends a request unless ignore_eos; with eos = base[5] the output stops there.
    saved = llm.eos_token_ids
    llm.eos_token_ids = {stop_id}
    try:
        out = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=12),
                           use_tqdm=False)[0].outputs[0]
    finally:
        llm.eos_token_ids = saved
    assert out.token_ids == base[: first + 1] and (out.finish_reason, out.stop_reason) == ("stop", None)


def test_stop_strings(llm):
    full = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip()
    out = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert out.text == full[: full.index(stop)]
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    keep = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=24, ignore_eos=True,
                                                 stop=stop, include_stop_str_in_output=True),
                        use_tqdm=False)[0].outputs[0]
    assert keep.text == full[: full.index(stop) + len(stop)]


@pytest.mark.parametrize("field,value", [
    ("temperature", -1.0), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -2), ("min_p", 2.0),
    ("max_tokens", 0), ("n", 0), ("presence_penalty", 3.0), ("repetition_penalty", 0.0),
    ("min_tokens", -1), ("seed", 1.5), ("stop_token_ids", [-1]), ("logprobs", -5),
])
def test_sampling_params_reject_bad_values(field, value):
    with pytest.raises((ValueError, TypeError), match=field):
        SamplingParams(**{field: value})


def test_bad_input_names_the_problem_and_loses_nothing(llm):
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(["ROMEO:", {"prompt_token_ids": [5] * 500}], use_tqdm=False)
    with pytest.raises(ValueError, match="token ids"):
        llm.generate({"prompt_token_ids": [10**9]}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling_params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    # Nothing of the rejected calls stayed queued; the engine still works.
    assert not llm.engine.has_unfinished()
    out = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) <= 3


def test_llm_rejects_bad_arguments(tmp_path):
    with pytest.raises(FileNotFoundError):
        LLM(model=str(tmp_path / "nope"))
    with pytest.raises(TypeError, match="unknown_arg"):
        LLM(unknown_arg=1)
    with pytest.raises(ValueError, match="block_size"):
        LLM(block_size=12)
    with pytest.raises(ValueError, match="max_num_seqs"):
        LLM(max_num_seqs=0)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(max_model_len=10**6)
    with pytest.raises(ValueError, match="KV pool"):
        LLM(max_model_len=64, num_gpu_blocks_override=3, block_size=16)


def test_skip_tokenizer_init_needs_token_ids():
    llm = LLM(skip_tokenizer_init=True, max_model_len=64, max_num_seqs=2, dtype="float32")
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("ROMEO:", use_tqdm=False)
    out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0, max_tokens=3),
                       use_tqdm=False)[0]
    assert out.outputs[0].text == "" and len(out.outputs[0].token_ids) <= 3


def test_cli_generate_prints_text(capsys):
    assert cli_main(["generate", "--prompt", "ROMEO:", "--max-tokens", "8", "--temperature", "0",
                     "--quiet", "--max-model-len", "64"]) == 0
    out = capsys.readouterr().out
    assert "ROMEO:" in out and "prompt 0" in out


def test_vllm_example_script_runs_with_only_the_import_changed():
    import os
    import pathlib
    import subprocess
    import sys

    script = pathlib.Path(__file__).parents[1] / "examples" / "offline_inference.py"
    root = str(script.parents[1])  # importable even where mrv2 is not pip-installed
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, str(script)], check=False, capture_output=True, text=True,
                         timeout=600, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.count("Prompt:") == 4 and "'KING RICHARD III:'" in res.stdout
