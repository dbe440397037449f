"""scripts/probe_weight_stream_chain.py under the interpreter: its stream kernel against the
torch reference along a 3-kernel chain (each kernel scales by the value the previous wrote)."""

import json
import os
import subprocess
import sys

import pytest
from script_loader import load_script

from mrv2.bench.report import REPO_ROOT


def test_smoke_chain_matches_reference(capsys):
    probe = load_script("probe_weight_stream_chain")
    assert probe.main(["--smoke"]) == 0
    assert "smoke ok" in capsys.readouterr().out


def test_sm90_ptx_prefetches_before_the_wait():
    """Compiled for sm_90 (no GPU; a process of its own, where Triton compiles): each
    ``--prefetch`` mode issues its instruction, before ``griddepcontrol.wait``; none without."""
    pytest.importorskip("triton.backends.nvidia")
    code = ("import json, sys; sys.path[:0] = ['scripts', '.']; import probe_weight_stream_chain "
            "as p; print(json.dumps([p.sm90_ptx(m) for m in ('none', 'line', 'bulk')]))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300, check=False,
                          env={**os.environ, "TRITON_INTERPRET": "0"})  # compile
    assert proc.returncode == 0, proc.stderr[-2000:]
    none, line, bulk = json.loads(proc.stdout.splitlines()[-1])
    for ptx, op in ((line, "prefetch.global.L2 "), (bulk, "cp.async.bulk.prefetch.L2")):
        head, sep, _ = ptx.partition("griddepcontrol.wait")
        assert sep and op in head
    assert "prefetch.global.L2" not in none and "cp.async.bulk" not in none
