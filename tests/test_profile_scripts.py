"""The step-profiling scripts run end to end on the CPU (tiny runs: they check the tools work;
their figures mean something only on a GPU)."""

from __future__ import annotations

import json

from script_loader import load_script


def test_profile_spec_step_reports_phases_ops_and_python(tmp_path, monkeypatch):
    mod = load_script("profile_spec_step")
    out = tmp_path / "p.json"
    monkeypatch.setattr("sys.argv", ["profile_spec_step.py", "--methods", "none,ngram",
                                     "--output-len", "8", "--top", "40", "--cprofile", "5",
                                     "--out", str(out)])
    mod.main()
    res = json.loads(out.read_text())
    assert [r["method"] for r in res] == ["none", "ngram"]
    for r in res:
        assert r["tpot_ms"] > 0 and r["output_len"] == 8
        assert {"prep", "forward", "sample"} <= set(r["timeline"]["cpu_ms"])
        assert "runner.execute_model" in r["profile_table"]
        assert "Ordered by" in r["cprofile"]
    assert "spec.verify" in res[1]["profile_table"]  # the speculating step's own functions
