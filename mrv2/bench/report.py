"""What a results file says besides the figures: machine, versions, commit; the tables.

A number without its machine and software versions cannot be compared with
anything, so every benchmark JSON carries them (``environment()``), and the same
figures are printed as a table for the terminal.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import pathlib
import platform as py_platform
import subprocess

import torch

from mrv2 import platform
from mrv2.bench.spec import acceptance_lines

#: The checkout this package lives in (``benchmarks/results`` is under it).
REPO_ROOT = pathlib.Path(__file__).resolve().parents[2]


def _version(module: str) -> str | None:
    try:
        return __import__(module).__version__
    except Exception:  # noqa: BLE001  (absent or broken: say so, do not fail the benchmark)
        return None


def git_commit(root: pathlib.Path = REPO_ROOT) -> str:
    """The checkout's commit: ``$MRV2_GIT_COMMIT``, the ``.git`` files, ``git rev-parse``,
    or "unknown"."""
    if os.environ.get("MRV2_GIT_COMMIT"):
        return os.environ["MRV2_GIT_COMMIT"]
    try:  # read the files first: the GPU machine may have the tree but no git binary
        head = (root / ".git" / "HEAD").read_text().strip()
        if not head.startswith("ref: "):
            return head
        ref = head.removeprefix("ref: ")
        ref_file = root / ".git" / ref
        if ref_file.is_file():
            return ref_file.read_text().strip()
        for line in (root / ".git" / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line.split()[0]
    except OSError:
        pass
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True,
                             text=True, timeout=10, check=False)
        if out.returncode == 0 and out.stdout.strip():
            return out.stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def _blob_sha1(data: bytes) -> str:
    # git's object id of a file's bytes: what ``git ls-tree`` lists for it.
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def _digest(entries: list[tuple[str, str]]) -> str:
    lines = "".join(f"{path} {blob}\n" for path, blob in sorted(entries))
    return hashlib.sha256(lines.encode()).hexdigest()[:16]


def source_digest(root: pathlib.Path = REPO_ROOT) -> str:
    """A digest of the package's source as it ran: every ``mrv2/**/*.py`` by its path and git
    blob id. Unlike ``git_commit`` it cannot be stale or miss uncommitted edits (a GPU
    machine's copy of ``.git`` was, in session 23); ``commit_of_digest`` finds the commit."""
    pkg = root / "mrv2"
    return _digest([(p.relative_to(root).as_posix(), _blob_sha1(p.read_bytes()))
                    for p in pkg.rglob("*.py") if "__pycache__" not in p.parts])


def commit_of_digest(digest: str, root: pathlib.Path = REPO_ROOT, max_commits: int = 500
                     ) -> str | None:
    """The newest commit (of the last ``max_commits``) whose ``mrv2/**/*.py`` has ``digest``,
    from ``git ls-tree`` (no checkout); None if none has."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                              check=True).stdout
    for commit in git("rev-list", f"--max-count={max_commits}", "HEAD").split():
        entries = []
        for line in git("ls-tree", "-r", commit, "mrv2").splitlines():
            meta, path = line.split("\t", 1)
            if path.endswith(".py"):
                entries.append((path, meta.split()[2]))
        if _digest(entries) == digest:
            return commit
    return None


def _cpu_name() -> str:
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return py_platform.processor() or py_platform.machine() or "cpu"


def environment() -> dict:
    """Hardware, software versions, commit and date of this run."""
    if platform.HAS_CUDA:
        props = torch.cuda.get_device_properties(0)
        hw = {"device": "cuda", "name": torch.cuda.get_device_name(0),
              "gpu_memory_gib": round(props.total_memory / 2**30, 1)}
    else:
        hw = {"device": "cpu", "name": _cpu_name()}
    hw["cpu_count"] = os.cpu_count()
    hw["cpu_threads_torch"] = torch.get_num_threads()
    versions = {"python": py_platform.python_version(), "torch": torch.__version__,
                "cuda": torch.version.cuda, "triton": _version("triton"),
                "transformers": _version("transformers"), "numpy": _version("numpy"),
                "mrv2": _version("mrv2"), "triton_interpret": platform.TRITON_INTERPRET}
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "hardware": hw, "versions": versions, "git_commit": git_commit(),
            "source_digest": source_digest()}


def default_out_path(kind: str, workload: str | None, tiny: bool = False,
                     speculative: str | None = None) -> pathlib.Path:
    """``./bench_<kind>[_spec-<method>][_<workload>][_tiny]_<YYYY-MM-DD>.json`` in the current
    directory.

    NOTE: never inside the checkout: a run from elsewhere must not write into the package.
    """
    parts = (["bench", kind] + ([f"spec-{speculative}"] if speculative else [])
             + ([workload] if workload else []) + (["tiny"] if tiny else []))
    return pathlib.Path.cwd() / f"{'_'.join(parts)}_{datetime.date.today().isoformat()}.json"


#: Printed after a benchmark run without a GPU.
CPU_NOTE = ("[bench] note: no GPU: every kernel ran in Triton's CPU interpreter and nothing was "
            "overlapped, so these times and the V2/V1 ratio say nothing about GPU performance "
            "(they check that the benchmark runs)")


def write_json(results: dict, path: str | os.PathLike) -> pathlib.Path:
    """Write ``results`` as indented JSON (parents created); returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(x):
    if isinstance(x, (pathlib.Path, torch.dtype, torch.device)):
        return str(x)
    if hasattr(x, "item"):  # numpy / torch scalars
        return x.item()
    raise TypeError(f"not JSON serialisable: {type(x).__name__}")


def error_row(name: str, e: Exception, log=print) -> dict:
    """Log a runner's failure and return its row for the JSON (the error and traceback).

    Call it inside the ``except`` block (the traceback is the one being handled).
    """
    import traceback

    log(f"[bench] {name}: FAILED: {type(e).__name__}: {e}")
    return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}


def _f(x, fmt: str) -> str:
    """``x`` formatted, or a right-aligned "-" of the same width when it is missing."""
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return format(x, fmt)
    width = "".join(c for c in fmt.split(".")[0] if c.isdigit())
    return "-".rjust(int(width or 1))


def throughput_table(results: dict) -> str:
    """``runner | output tok/s | steps | ms/step | ratio vs v1`` (and the roofline)."""
    runners = results.get("runners", {})
    base = runners.get("v1", {}).get("output_tok_s")
    w = _name_width(results)
    roof = results.get("roofline", {}).get("decode")
    whole = results.get("roofline", {}).get("workload")
    roof_tok_s = (whole or roof or {}).get("tok_s")  # the workload's bound, else one step's
    head = (f"{'runner':<{w}} {'output tok/s':>13} {'steps':>7} {'ms/step':>8} {'vs v1':>6} "
            f"{'of roof':>7}")
    lines = [head + "  requests"]
    for name, r in runners.items():
        if "error" in r:
            lines.append(f"{name:<{w}} ERROR: {r['error'].splitlines()[-1][:90]}")
            continue
        tok_s = r.get("output_tok_s")
        ratio = tok_s / base if base and tok_s else None
        frac = tok_s / roof_tok_s if roof_tok_s and tok_s else None
        lines.append(f"{name:<{w}} {_f(tok_s, '13,.1f')} {_f(r.get('steps'), '7d')} "
                     f"{_f(r.get('mean_step_ms'), '8.2f')} {_f(ratio, '6.2f')} "
                     f"{_f(frac, '7.0%')}  {r.get('num_requests', '-')}")
    if roof:
        lines.append(f"{'roofline':<{w}} {_f(roof['tok_s'], '13,.1f')} {'':>7} "
                     f"{_f(roof['step_ms'], '8.2f')}         (decode, batch {roof['batch']}, "
                     f"context {roof['context']:.0f})")
    if whole:
        lines.append(f"{'roofline':<{w}} {_f(whole['tok_s'], '13,.1f')} "
                     f"{_f(whole['decode_steps'], '7d')} {'':>8}         (the workload's "
                     "decode steps, batch shrinking as requests finish)")
    for key, value in results.get("ratios", {}).items():
        lines.append(f"  {key}: {value:.3f}")
    return "\n".join(lines + acceptance_lines(results))


def latency_table(results: dict) -> str:
    """``runner | batch | TTFT ms | TPOT ms | e2e ms`` (and the roofline TPOT)."""
    w = _name_width(results)
    roof = {row["batch"]: row["step_ms"]
            for row in results.get("roofline", {}).get("per_batch", [])}
    head = (f"{'runner':<{w}} {'batch':>5} {'TTFT ms':>9} {'TPOT ms':>9} {'e2e ms':>10} "
            f"{'roof/TPOT':>9}")
    lines = [head]
    for name, r in results.get("runners", {}).items():
        if "error" in r:
            lines.append(f"{name:<{w}} ERROR: {r['error'].splitlines()[-1][:90]}")
            continue
        for row in r.get("batches", []):
            tpot, bound = row.get("tpot_ms"), roof.get(row["batch_size"])
            frac = bound / tpot if bound and tpot else None
            lines.append(f"{name:<{w}} {row['batch_size']:>5} {_f(row['ttft_ms'], '9.2f')} "
                         f"{_f(tpot, '9.3f')} {_f(row['e2e_ms'], '10.1f')} {_f(frac, '9.0%')}")
    for row in results.get("roofline", {}).get("per_batch", []):
        lines.append(f"{'roofline':<{w}} {row['batch']:>5} {'':>9} {_f(row['step_ms'], '9.3f')}")
    spec_ratios = {k: v for k, v in results.get("ratios", {}).items()
                   if any(r.get("spec_decode") for r in _rows(results, k.split("/")[0]))}
    for key, value in spec_ratios.items():  # speculative variants: TPOT ratio per batch
        lines.append(f"  {key} TPOT: " + ", ".join(f"b{b} {x:.3f}"
                                                  for b, x in value["tpot"].items()))
    return "\n".join(lines + acceptance_lines(results))


def _rows(results: dict, name: str) -> list[dict]:
    return (results.get("runners", {}).get(name) or {}).get("batches", [])


def _name_width(results: dict) -> int:
    return max([8] + [len(n) for n in results.get("runners", {})])
