"""scripts/probe_weight_stream_chain.py under the interpreter: its stream kernel against the
torch reference along a 3-kernel chain (each kernel scales by the value the previous wrote)."""

from script_loader import load_script


def test_smoke_chain_matches_reference(capsys):
    probe = load_script("probe_weight_stream_chain")
    assert probe.main(["--smoke"]) == 0
    assert "smoke ok" in capsys.readouterr().out
