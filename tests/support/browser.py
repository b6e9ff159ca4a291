"""Open a page in a real headless Chromium (Debian package `chromium`): screenshot it and read back what
the page saw (images loaded, script errors, console errors)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--hide-scrollbars", "--enable-logging=stderr", "--v=0"]

PROBE = """<script>
window.__errors = [];
window.addEventListener('error', e => window.__errors.push(String(e.message || e)));
window.addEventListener('load', () => {
  const imgs = [...document.images];
  const broken = imgs.filter(i => !(i.complete && i.naturalWidth > 0));
  document.body.setAttribute('data-probe', JSON.stringify({images: imgs.length, broken: broken.length,
    widths: imgs.map(i => i.naturalWidth), errors: window.__errors}));
});
</script>"""


def chromium() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


def require_chromium() -> str:
    """The browser's path. Without one the test skips, saying why — except under CI (CI=true), where a
    browser test that cannot run is a failure: CI installs Chromium, and a silent skip would pass."""
    import pytest
    found = chromium()
    if found is None:
        message = "needs the Debian package chromium (apt-get install chromium)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(message + " — under CI this is a failure, not a skip")
        pytest.skip(message)
    return found


def _run(args: list[str], timeout: float = 90) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="chromium-profile-") as profile:
        return subprocess.run([chromium(), *FLAGS, f"--user-data-dir={profile}", *args], capture_output=True,
                              text=True, timeout=timeout)


def screenshot(page: Path, out: Path, width: int = 1280, height: int = 6000) -> subprocess.CompletedProcess:
    return _run([f"--window-size={width},{height}", f"--screenshot={out}", page.resolve().as_uri()])


def probe(page: Path) -> tuple[dict, list[str]]:
    """Loads a copy of `page` with a probe script (the copy's CSP allows inline scripts, nothing else
    changes: images stay restricted to data: URIs). Returns the probe's findings and console errors."""
    import json
    html = page.read_text()
    html = html.replace("default-src 'none';", "default-src 'none'; script-src 'unsafe-inline';", 1)
    html = html.replace("<head>", "<head>" + PROBE, 1)
    copy = page.with_name("probe-" + page.name)
    copy.write_text(html)
    try:
        out = _run(["--virtual-time-budget=5000", "--dump-dom", copy.resolve().as_uri()])
    finally:
        copy.unlink()
    found = re.search(r'data-probe="([^"]*)"', out.stdout)
    result = json.loads(found.group(1).replace("&quot;", '"')) if found else {}
    console = [ln for ln in out.stderr.splitlines() if "CONSOLE" in ln or "Content Security Policy" in ln]
    return result, console
