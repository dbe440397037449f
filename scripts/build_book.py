"""Build the book offline: npm assets into book/_static/vendor, then Jupyter Book (v1).

The pages load MathJax 3, the ipywidgets HTML manager and require.js from the book's own
``_static/vendor/`` (never from a CDN). Those files come from the npm packages pinned in
``book/package.json`` / ``book/package-lock.json``, installed into ``book/node_modules``
(git-ignored) with ``npm ci --prefer-offline``, so once npm's cache holds them the build
needs no network. The table of contents is ``book/_toc.yml`` minus the files that do not
exist (a chapter still being written is left out with a note, not an error), and Sphinx
runs with warnings as errors.

Usage (from anywhere)::

    python scripts/build_book.py            # -> book/_build/html/index.html
    python scripts/build_book.py --skip-npm # reuse book/_static/vendor as it is
    python scripts/build_book.py --npm-only # only fill book/node_modules (CI, before tests)
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
VENDOR = BOOK / "_static" / "vendor"
NODE_MODULES = BOOK / "node_modules"
BUILD = BOOK / "_build"
STAMP = NODE_MODULES / ".mrv2-lock-sha256"


def npm_install() -> None:
    """Install book/package-lock.json's packages into book/node_modules, once per lock file.

    Raises:
        RuntimeError: when npm is missing or fails.
    """
    lock = (BOOK / "package-lock.json").read_bytes()
    digest = hashlib.sha256(lock).hexdigest()
    if STAMP.exists() and STAMP.read_text() == digest:
        return
    npm = shutil.which("npm")
    if npm is None:
        raise RuntimeError("npm not found: install Node.js (Debian: apt-get install -y npm)")
    cmd = [npm, "ci", "--prefer-offline", "--no-audit", "--no-fund", "--ignore-scripts"]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, cwd=BOOK, check=True)
    STAMP.write_text(digest)


def copy_vendor() -> None:
    """Copy the files the pages load from node_modules into book/_static/vendor/."""
    if VENDOR.exists():
        shutil.rmtree(VENDOR)
    VENDOR.mkdir(parents=True)
    # MathJax loads its input/output/font components relative to its own script.
    shutil.copytree(NODE_MODULES / "mathjax" / "es5", VENDOR / "mathjax" / "es5")
    shutil.copy2(NODE_MODULES / "requirejs" / "require.js", VENDOR / "require.js")
    dist = NODE_MODULES / "@jupyter-widgets" / "html-manager" / "dist"
    out = VENDOR / "html-manager"
    out.mkdir()
    for f in dist.iterdir():
        # embed-amd.js is the one the pages load; the fonts are its webpack assets.
        if f.suffix in {".woff", ".woff2", ".ttf", ".eot", ".svg"} or f.name == "embed-amd.js":
            shutil.copy2(f, out / f.name)


def existing_toc(src: Path, dst: Path) -> list[str]:
    """Write ``src`` to ``dst`` without the entries whose file does not exist.

    Args:
        src: the committed table of contents (book/_toc.yml).
        dst: where to write the filtered copy.

    Returns:
        The ``file`` entries that were left out.
    """
    import yaml  # here, so that --npm-only runs before the book extra is installed

    toc = yaml.safe_load(src.read_text())
    missing: list[str] = []

    def exists(entry: str) -> bool:
        return any((ROOT / (entry + ext)).exists() for ext in ("", ".md", ".ipynb"))

    parts = []
    for part in toc.get("parts", []):
        chapters = []
        for ch in part["chapters"]:
            if exists(ch["file"]):
                chapters.append(ch)
            else:
                missing.append(ch["file"])
        if chapters:
            parts.append({**part, "chapters": chapters})
    toc["parts"] = parts
    dst.write_text(yaml.safe_dump(toc, sort_keys=False))
    return missing


def build(skip_npm: bool = False) -> Path:
    """Build the book; return the folder of its HTML pages.

    Args:
        skip_npm: reuse book/_static/vendor as it is (no npm run, no copy).

    Returns:
        book/_build/html.

    Raises:
        RuntimeError: when npm or the build fails.
    """
    if not skip_npm or not VENDOR.exists():
        npm_install()
        copy_vendor()
    BUILD.mkdir(exist_ok=True)
    toc = BUILD / "_toc.yml"
    for f in existing_toc(BOOK / "_toc.yml", toc):
        print(f"note: {f} is in book/_toc.yml but does not exist; left out of this build")
    jb = Path(sys.executable).with_name("jupyter-book")
    jb_cmd = [str(jb)] if jb.exists() else [sys.executable, "-m", "jupyter_book.cli.main"]
    cmd = jb_cmd + ["build", str(ROOT), "--config", str(BOOK / "_config.yml"),
                    "--toc", str(toc), "--path-output", str(BOOK), "--all", "-W",
                    "--keep-going"]
    print("+", " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"jupyter-book build failed (exit {proc.returncode})")
    return BUILD / "html"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--skip-npm", action="store_true",
                    help="reuse book/_static/vendor as it is")
    ap.add_argument("--npm-only", action="store_true",
                    help="only install the npm packages (what .ci/run does before the tests)")
    args = ap.parse_args()
    if args.npm_only:
        npm_install()
        return
    html = build(skip_npm=args.skip_npm)
    print(f"book: {html / 'index.html'}")


if __name__ == "__main__":
    main()
