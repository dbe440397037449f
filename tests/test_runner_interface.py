"""Both runners implement the declared runner interface, and the engine calls only it."""

import inspect

import pytest

from mrv2 import LLM, SamplingParams
from mrv2.engine import Engine, StepCallback
from mrv2.runner import ModelRunner
from mrv2.runner_interface import RunnerInterface
from mrv2.v1.runner import V1ModelRunner


@pytest.mark.parametrize("cls", [ModelRunner, V1ModelRunner])
def test_both_runners_implement_the_interface(cls):
    assert issubclass(cls, RunnerInterface)
    assert not inspect.isabstract(cls)
    for name in RunnerInterface.__abstractmethods__:
        ours = inspect.signature(getattr(RunnerInterface, name))
        theirs = inspect.signature(getattr(cls, name))
        assert list(theirs.parameters)[:len(ours.parameters)] == list(ours.parameters), name


def test_a_runner_missing_a_method_cannot_be_built():
    class Half(RunnerInterface):
        def execute_model(self, sched):
            return None

    with pytest.raises(TypeError, match="abstract"):
        Half()


@pytest.mark.parametrize("runner", ["v2", "v1"])
def test_llm_validates_through_the_interface(runner):
    llm = LLM(max_model_len=32, max_num_seqs=2, dtype="float32", runner=runner)
    assert isinstance(llm.runner, RunnerInterface)
    with pytest.raises(ValueError, match="logprobs"):
        llm.generate("ROMEO:", SamplingParams(max_tokens=1, logprobs=10**6), use_tqdm=False)


def test_step_callbacks_see_every_launch_and_output():
    llm = LLM(max_model_len=32, max_num_seqs=2, dtype="float32")
    seen = []

    class Log(StepCallback):
        def on_launch(self, step, sched):
            seen.append(("launch", step))

        def on_output(self, step, sched, output):
            seen.append(("output", step, len(output.sampled_token_ids)))

    assert isinstance(llm.engine, Engine)
    llm.engine.callbacks.append(Log())
    out = llm.generate("ROMEO:", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    launches = [s for s in seen if s[0] == "launch"]
    outputs = [s for s in seen if s[0] == "output"]
    assert [s[1] for s in launches] == list(range(len(launches))) and len(launches) >= 3
    assert [s[1] for s in outputs] == [s[1] for s in launches]  # each launch is processed once
    assert all(s[2] == 1 for s in outputs[:3])                  # one request, one sample a step
