"""The command line (mrv2/cli.py): vLLM-like flags, a fast --help, labels, hints, bench paths."""

import subprocess
import sys

import pytest

from mrv2.__main__ import main
from mrv2.cli import build_parser, sampling_params_from_args


def test_help_imports_no_torch_and_has_no_rst():
    for args in ([], ["generate"], ["bench"]):
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "mrv2", *args, "--help"],
                              capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, proc.stderr
        imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines()}
        assert "torch" not in imported and "transformers" not in imported
        assert "``" not in proc.stdout and "usage: python -m mrv2" in proc.stdout
        if args == ["generate"]:
            assert "--min-p" in proc.stdout and "--max-num-seqs" in proc.stdout


def test_flags_become_sampling_params():
    args = build_parser().parse_args([
        "generate", "--stop", "\n\n", "--stop", "END", "--min-p", "0.1", "--logprobs", "3",
        "--presence-penalty", "0.5", "--frequency-penalty", "0.25", "--repetition-penalty", "1.2",
        "--stop-token-ids", "1,2", "--bad-words", "king", "--min-tokens", "2", "--top-k", "5",
        "--truncate-prompt-tokens", "8", "--max-num-seqs", "8", "--tokenizer", "tok"])
    sp = sampling_params_from_args(args)
    assert (sp.stop, sp.min_p, sp.logprobs, sp.stop_token_ids, sp.bad_words) == (
        ["\n\n", "END"], 0.1, 3, [1, 2], ["king"])
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty) == (0.5, 0.25, 1.2)
    assert (sp.min_tokens, sp.top_k, sp.truncate_prompt_tokens) == (2, 5, 8)
    assert (args.max_num_seqs, args.tokenizer) == (8, "tok")


def test_outputs_are_labelled_by_prompt_index(capsys):
    rc = main(["generate", "--prompt", "ROMEO:", "--prompt", "JULIET:", "--n", "2",
               "--max-tokens", "2", "--max-model-len", "64", "--max-num-seqs", "4", "--quiet",
               "--logprobs", "1"])
    out = capsys.readouterr().out
    assert rc == 0
    for label in ("--- prompt 0 [0]", "--- prompt 0 [1]", "--- prompt 1 [0]", "--- prompt 1 [1]"):
        assert label in out
    assert "cumulative logprob" in out


def test_bad_value_fails_before_loading(capsys):
    assert main(["generate", "--min-p", "2"]) == 2
    assert "min_p" in capsys.readouterr().err


def test_text_prompt_on_tokenizer_less_model_hints_flags(shared_data, capsys):
    model = str(shared_data / "stories260K" / "hf-llama")
    assert main(["generate", "--model", model, "--prompt", "Once", "--max-model-len", "64",
                 "--max-num-seqs", "2", "--quiet"]) == 2
    err = capsys.readouterr().err
    assert "--token-ids" in err and "--tokenizer" in err and "skip_tokenizer_init" not in err


def test_bench_writes_into_the_current_directory(tmp_path, monkeypatch):
    from mrv2.bench.report import CPU_NOTE, default_out_path

    monkeypatch.chdir(tmp_path)
    path = default_out_path("throughput", "standard", tiny=True)
    assert path.parent == tmp_path and path.name.startswith("bench_throughput_standard_tiny_")
    assert "interpreter" in CPU_NOTE


@pytest.mark.parametrize("argv", [["generate", "--chat", "--token-ids", "--prompt", "1,2"]])
def test_chat_needs_text_prompts(argv, capsys):
    assert main(argv) == 2
    assert "--chat" in capsys.readouterr().err
