"""vLLM's offline-inference examples (examples/*.py), run with only the import changed.

Basic generation is examples/offline_inference.py, run by tests/test_llm_api.py.
"""

import pathlib
import re
import runpy

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


def _as_vllm(source: str) -> str:
    """The same script for vLLM: the import lines changed back, nothing else."""
    return re.sub(r"^from mrv2(\.inputs)? import", r"from vllm\1 import", source, flags=re.MULTILINE)


@pytest.mark.parametrize("name,expect", [
    ("chat", ["Generated text:", "ASSISTANT:"]),
    ("token_prompts", ["Prompt token ids:", "Generated token ids:"]),
    ("logprobs", ["Cumulative logprob:", "rank"]),
])
def test_example_runs_with_only_the_import_changed(name, expect, capsys):
    source = (EXAMPLES / f"{name}.py").read_text()
    vllm_source = _as_vllm(source)
    # Only import lines differ, and the vLLM version names mrv2 nowhere but in the model path.
    changed = [a for a, b in zip(source.splitlines(), vllm_source.splitlines()) if a != b]
    assert changed and all(line.startswith("from mrv2") for line in changed)
    assert all("mrv2" not in line or '"mrv2"' in line for line in vllm_source.splitlines())
    runpy.run_path(str(EXAMPLES / f"{name}.py"), run_name="__main__")
    out = capsys.readouterr().out
    for text in expect:
        assert text in out
