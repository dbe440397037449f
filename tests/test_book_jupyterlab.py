"""The environment learners actually open: chapter 02 run live in JupyterLab, in Chromium.

JupyterLab starts on 127.0.0.1 with a token, serving a copy of chapter 02 (so nothing is
saved into the repository); headless Chromium opens it with every request outside
127.0.0.1 blocked, runs all cells, waits for the step slider's figure, moves the slider
one step and checks that the figure changed. Bounded: every wait has a deadline, the
whole test a few minutes at most.
"""

from __future__ import annotations

import os
import secrets
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from test_book import _chromium, local_only

ROOT = Path(__file__).resolve().parent.parent
CHAPTER = "02_stable_state_table.ipynb"
SHOTS = ROOT / "book" / "_screenshots"

pytestmark = [pytest.mark.book, pytest.mark.slow]

_FIGURE = """() => {
  const img = document.querySelector('.widget-output img');  // the slider's figure
  return img ? img.src.slice(-200) : null;
}"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def lab(tmp_path):
    """A JupyterLab server on 127.0.0.1 serving a copy of chapter 02; yields (url, token)."""
    pytest.importorskip("jupyterlab", reason="the notebooks extra: pip install -e '.[notebooks]'")
    shutil.copy(ROOT / "notebooks" / CHAPTER, tmp_path / CHAPTER)
    port, token = _free_port(), secrets.token_hex(16)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}",
         "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={token}",
         f"--ServerApp.root_dir={tmp_path}", "--LabApp.expose_app_in_browser=True",
         "--LabApp.news_url=", "--allow-root",  # CI runs as root
         "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            break
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                pytest.fail("JupyterLab did not start within 60 s")
            time.sleep(0.5)
    yield url, token
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_chapter_02_runs_live_and_its_slider_moves_the_figure(lab):
    playwright = pytest.importorskip("playwright.sync_api", reason="pip install playwright")
    exe = _chromium()
    if exe is None:
        pytest.skip("chromium not found (apt-get install -y chromium)")
    url, token = lab
    outside: list[str] = []
    with playwright.sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=exe, headless=True)
        context = browser.new_context(viewport={"width": 1400, "height": 1000})

        local_only(context, outside.append)
        page = context.new_page()
        page.goto(f"{url}/lab/tree/{CHAPTER}?token={token}")
        page.wait_for_function(
            "() => window.jupyterapp && window.jupyterapp.shell.currentWidget &&"
            " window.jupyterapp.shell.currentWidget.sessionContext &&"
            " window.jupyterapp.shell.currentWidget.sessionContext.session &&"
            " window.jupyterapp.shell.currentWidget.sessionContext.session.kernel &&"
            " window.jupyterapp.shell.currentWidget.sessionContext.session.kernel.status"
            " === 'idle'", timeout=90_000)
        page.evaluate("() => window.jupyterapp.commands.execute('notebook:run-all-cells')")
        slider = page.locator(".widget-slider .noUi-handle").first
        slider.wait_for(state="attached", timeout=180_000)
        page.wait_for_function(f"() => ({_FIGURE})() !== null", timeout=60_000)
        before = page.evaluate(_FIGURE)
        label = page.locator(".widget-readout").first.inner_text()
        slider.scroll_into_view_if_needed()
        slider.focus()
        page.keyboard.press("ArrowRight")
        page.wait_for_function(f"(b) => ({_FIGURE})() !== null && ({_FIGURE})() !== b",
                               arg=before, timeout=60_000)
        after_label = page.locator(".widget-readout").first.inner_text()
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / "jupyterlab__02_stable_state_table.png"))
        browser.close()
    assert int(after_label) == int(label) + 1, (label, after_label)
    assert not outside, f"JupyterLab asked for hosts outside 127.0.0.1: {outside[:5]}"
