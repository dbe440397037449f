"""scripts/profile_host_step.py runs end to end on a tiny workload, and leaves no stub behind."""

from __future__ import annotations

from script_loader import load_script


def test_profile_host_step_reports_phases_and_restores_the_stubs(capsys):
    from triton.runtime.interpreter import InterpretedFunction

    import mrv2.sample.sampler as sampler_mod

    before = (InterpretedFunction.run, sampler_mod.gumbel_sample)
    mod = load_script("profile_host_step")
    res = mod.main(["--batch", "4", "--requests", "6", "--input-len", "5", "--output-len", "3",
                    "--repeats", "1"])
    (run,) = res["runs"]
    assert run["steps"] >= 3 * 6 // 4 and res["cpu_ms_per_step"] > 0
    assert {"schedule", "prep", "sample", "output", "other"} <= set(run["phases"])
    assert "CPU ms/step" in capsys.readouterr().out
    assert (InterpretedFunction.run, sampler_mod.gumbel_sample) == before
