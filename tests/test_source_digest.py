"""mrv2.bench.report.source_digest: a results file names the source that ran, and
commit_of_digest finds its commit, uncommitted edits included (never a stale .git's)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from mrv2.bench.report import commit_of_digest, source_digest

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git binary")


def _git(root, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          cwd=root, capture_output=True, text=True, check=True).stdout.strip()


def test_the_digest_finds_its_commit_and_only_its_own(tmp_path):
    (tmp_path / "mrv2" / "kernels").mkdir(parents=True)
    (tmp_path / "mrv2" / "__init__.py").write_text("")
    (tmp_path / "mrv2" / "kernels" / "a.py").write_text("LAUNCH = (8, 8)\n")
    (tmp_path / "README.md").write_text("not source\n")
    _git(tmp_path, "init", "-q")
    _git(tmp_path, "add", "-A")
    _git(tmp_path, "commit", "-qm", "one")
    first = _git(tmp_path, "rev-parse", "HEAD")
    d1 = source_digest(tmp_path)
    assert commit_of_digest(d1, tmp_path) == first

    (tmp_path / "mrv2" / "kernels" / "a.py").write_text("LAUNCH = (32, 8)\n")  # uncommitted
    d2 = source_digest(tmp_path)
    assert d2 != d1 and commit_of_digest(d2, tmp_path) is None
    (tmp_path / "README.md").write_text("edited, still not source\n")
    assert source_digest(tmp_path) == d2

    _git(tmp_path, "commit", "-qam", "two")
    second = _git(tmp_path, "rev-parse", "HEAD")
    assert commit_of_digest(d2, tmp_path) == second
    assert commit_of_digest(d1, tmp_path) == first                # older commits are found too
    (tmp_path / "mrv2" / "__pycache__").mkdir()
    (tmp_path / "mrv2" / "__pycache__" / "x.py").write_text("junk")
    assert source_digest(tmp_path) == d2                           # bytecode folders don't count


def test_this_checkout_has_a_digest():
    d = source_digest()
    assert len(d) == 16 and int(d, 16) >= 0
