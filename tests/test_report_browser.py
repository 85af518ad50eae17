"""The run report in a real browser: headless Chromium (Debian's, which tests/run.sh installs) opens the
page from disk with no network, the curves render, a rollout opens from the address, what the policy wrote
stays text, and the screenshot is not blank."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
from test_run_records import report_of_a_run

pytestmark = pytest.mark.browser


def chromium(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    assert binary is not None
    flags = [
        "--headless=new",
        "--no-sandbox",  # the tests may run as root
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--hide-scrollbars",
        "--virtual-time-budget=5000",  # let the page's script run before the DOM is dumped
    ]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def report(tmp_path):
    return report_of_a_run(tmp_path, 6)


def test_the_report_renders_its_curves_and_opens_a_rollout(report, tmp_path):
    done = chromium("--dump-dom", f"{report.as_uri()}#rollout=3")
    assert done.returncode == 0, done.stderr[-2000:]
    dom = done.stdout
    assert dom.count("<polyline") >= 8  # the curves are on the page
    assert 'data-open="3"' in dom  # the page's script opened rollout 3 from the address
    assert "What is 3 + 1?" in dom and "The answer is 4." in dom and "→ add(" in dom
    assert "7 of 7 rollouts" in dom  # the list was built


def test_what_the_policy_wrote_stays_text(report):
    done = chromium("--dump-dom", f"{report.as_uri()}#rollout=6")
    dom = done.stdout
    assert 'data-open="6"' in dom
    assert re.search(r"<body[^>]*data-pwned", dom) is None  # its onerror never ran
    assert "<img" not in dom  # no element was made of it
    assert "&lt;img src=x onerror=" in dom  # it is shown, as text


def test_the_screenshot_is_not_blank(report, tmp_path):
    from PIL import Image, ImageStat

    shot = tmp_path / "report.png"
    done = chromium(f"--screenshot={shot}", "--window-size=1280,1600", f"{report.as_uri()}#rollout=1")
    assert done.returncode == 0 and shot.exists(), done.stderr[-2000:]
    image = Image.open(shot).convert("RGB")
    assert image.size == (1280, 1600)
    colors = image.getcolors(maxcolors=1 << 20)
    assert colors is not None and len(colors) > 50  # curves, text and borders, not one flat colour
    assert max(ImageStat.Stat(image).stddev) > 10
