"""The book: built offline (Sphinx warnings as errors) and opened page by page in Chromium.

The browser test serves book/_build/html on 127.0.0.1, blocks every request that leaves
127.0.0.1, and fails on a console error, a failed request, an image that did not load,
maths left as raw ``\\(`` / ``$$``, a widget area left empty, a code line clipped by the
page column, or an internal link to a missing page or anchor. A screenshot of every page
lands in book/_screenshots/ (git-ignored; CI keeps it as an artifact).

Needs the ``book`` extra (jupyter-book, playwright), npm and Debian's ``chromium``
(``.ci/run`` installs them); without them these tests skip and say which is missing.
"""

from __future__ import annotations

import functools
import http.server
import re
import shutil
import sys
import threading
import time
from pathlib import Path
from urllib.parse import unquote, urljoin, urlparse

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
BOOK = ROOT / "book"
HTML = BOOK / "_build" / "html"
SHOTS = BOOK / "_screenshots"

pytestmark = pytest.mark.book


def _chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def local_only(context, blocked) -> None:
    """Let a playwright browser ``context`` reach 127.0.0.1 only: every other request is
    aborted and its URL handed to ``blocked``."""
    def route(r):
        if urlparse(r.request.url).hostname == "127.0.0.1":
            r.continue_()
        else:
            blocked(r.request.url)
            r.abort()

    context.route("**/*", route)


def test_toc_lists_every_chapter_and_page():
    """A new notebook or prose page cannot be forgotten by the table of contents."""
    toc = yaml.safe_load((BOOK / "_toc.yml").read_text())
    listed = {toc["root"]} | {ch["file"] for part in toc["parts"] for ch in part["chapters"]}
    on_disk = {f"notebooks/{p.stem}" for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")}
    on_disk |= {f"book/{p.stem}" for p in BOOK.glob("*.md")}
    assert on_disk - listed == set(), f"not in book/_toc.yml: {sorted(on_disk - listed)}"


def test_config_loads_nothing_from_a_cdn():
    """The pages' scripts are local paths (relative to _static), never URLs."""
    cfg = yaml.safe_load((BOOK / "_config.yml").read_text())["sphinx"]["config"]
    scripts = [cfg["mathjax_path"], *cfg["nb_ipywidgets_js"]]
    assert all("://" not in s for s in scripts), scripts
    assert "repository" not in yaml.safe_load((BOOK / "_config.yml").read_text())


def _sources_mtime() -> float:
    files = [*ROOT.glob("notebooks/*.ipynb"), *BOOK.glob("*.md"), *BOOK.glob("*.yml"),
             *BOOK.glob("_static/*.*"), *BOOK.glob("_ext/*.py"), BOOK / "package-lock.json"]
    return max(f.stat().st_mtime for f in files)


@pytest.fixture(scope="module")
def built_book() -> Path:
    """book/_build/html, rebuilt unless it is newer than every source of the book."""
    pytest.importorskip("jupyter_book", reason="the book extra: pip install -e '.[book]'")
    stamp = HTML / "index.html"
    if stamp.exists() and stamp.stat().st_mtime > _sources_mtime():
        return HTML
    if shutil.which("npm") is None:
        pytest.skip("npm not found (apt-get install -y npm)")
    sys.path.insert(0, str(ROOT / "scripts"))
    import build_book

    return build_book.build()


@pytest.fixture(scope="module")
def server(built_book):
    """The built book served on 127.0.0.1 (a free port); yields its base URL."""
    handler = functools.partial(_QuietHandler, directory=str(built_book))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/"
    httpd.shutdown()
    httpd.server_close()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):  # keep pytest's output clean
        pass


# Runs in the page: what a reader would see as broken.
_PAGE_CHECKS = r"""
() => {
  const article = document.querySelector('main') || document.body;
  const clone = article.cloneNode(true);
  clone.querySelectorAll('pre, code, script, style, mjx-container, .highlight, textarea')
       .forEach(e => e.remove());
  const text = clone.textContent;
  const raw = [];
  for (const d of ['\\(', '\\)', '\\[', '$$']) {
    const i = text.indexOf(d);
    if (i >= 0) raw.push(JSON.stringify(text.slice(Math.max(0, i - 30), i + 30)));
  }
  const images = Array.from(document.images)
    .filter(img => !(img.complete && img.naturalWidth > 0))
    .map(img => img.src.slice(0, 120));
  const clipped = Array.from(document.querySelectorAll('div.cell pre, div.highlight pre'))
    .filter(p => p.offsetParent !== null && p.scrollWidth > p.clientWidth + 2)
    .map(p => p.textContent.split('\n').reduce((a, b) => (b.length > a.length ? b : a), ''))
    .map(s => s.slice(0, 80));
  const links = Array.from(document.querySelectorAll('a[href]')).map(a => a.href);
  return {raw, images, clipped, links};
}
"""

_WIDGET_AREAS = r"""
() => Array.from(document.querySelectorAll(
    'script[type="application/vnd.jupyter.widget-view+json"]')).map(s => {
  const sub = s.parentElement.querySelector('.widget-subarea');
  return sub ? sub.getBoundingClientRect().height : -1;
})
"""


def _anchors(path: Path, cache: dict) -> set[str]:
    if path not in cache:
        cache[path] = set(re.findall(r'\bid="([^"]+)"', path.read_text(errors="replace")))
    return cache[path]


def _broken_links(links: list[str], base: str, html: Path, cache: dict) -> list[str]:
    broken = []
    for link in links:
        url = urlparse(link)
        if not link.startswith(base):
            continue  # external links are for the reader's own browser, not loaded here
        target = html / unquote(url.path[len(urlparse(base).path):])
        if target.is_dir():
            target = target / "index.html"
        missing_anchor = (target.exists() and url.fragment and target.suffix == ".html"
                          and unquote(url.fragment) not in _anchors(target, cache))
        if not target.exists() or missing_anchor:
            broken.append(link)
    return broken


def test_every_page_renders_offline_in_chromium(server, built_book):
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium not found (apt-get install -y chromium)")
    pages = sorted(p.relative_to(built_book).as_posix() for p in built_book.rglob("*.html")
                   if "_static" not in p.parts and "_sources" not in p.parts)
    SHOTS.mkdir(exist_ok=True)
    problems: list[str] = []
    anchors: dict = {}
    t0 = time.perf_counter()
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True)
        context = browser.new_context(viewport={"width": 1280, "height": 900})

        local_only(context, lambda url: problems.append(
            f"{current}: request outside 127.0.0.1: {url}"))
        page = context.new_page()
        current = ""
        page.on("console", lambda m: m.type == "error" and problems.append(
            f"{current}: console error: {m.text[:300]}"))
        page.on("pageerror", lambda e: problems.append(f"{current}: page error: {e}"))
        page.on("requestfailed", lambda r: problems.append(
            f"{current}: failed request {r.url} ({r.failure})"))
        page.on("response", lambda r: r.status >= 400 and problems.append(
            f"{current}: HTTP {r.status} for {r.url}"))
        for name in pages:
            current = name
            text = (built_book / name).read_text(errors="replace")
            redirect = re.search(r'http-equiv="Refresh" content="0; url=([^"]+)"', text,
                                 re.IGNORECASE)
            if redirect:  # index.html: only its target must exist
                target = urljoin(urljoin(server, name), redirect.group(1))
                problems += [f"{name}: broken redirect {u}"
                             for u in _broken_links([target], server, built_book, anchors)]
                continue
            page.goto(urljoin(server, name), wait_until="load")
            page.evaluate("() => window.MathJax && MathJax.startup ? "
                          "MathJax.startup.promise.then(() => true) : true")
            areas = page.evaluate(_WIDGET_AREAS)
            deadline = time.monotonic() + 20
            while areas and min(areas) <= 0 and time.monotonic() < deadline:
                page.wait_for_timeout(200)
                areas = page.evaluate(_WIDGET_AREAS)
            if areas and min(areas) <= 0:
                problems.append(f"{name}: empty widget area(s): heights {areas}")
            found = page.evaluate(_PAGE_CHECKS)
            for kind in ("raw", "images", "clipped"):
                if found[kind]:
                    problems.append(f"{name}: {kind}: {found[kind][:5]}")
            for link in _broken_links(found["links"], server, built_book, anchors):
                problems.append(f"{name}: broken internal link {link}")
            page.screenshot(path=str(SHOTS / (name.replace("/", "__")[:-5] + ".png")),
                            full_page=True)
        browser.close()
    print(f"\n{len(pages)} pages in {time.perf_counter() - t0:.1f} s; screenshots in {SHOTS}")
    assert not problems, "\n".join(problems)
