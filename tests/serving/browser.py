"""The playground page in a real browser, for the browser tests of both servers (`ats serve`,
tests/serving/test_playground_browser.py; `ats serve --engine vllm`, tests/vllm/test_vllm_server.py): Debian's
Chromium through its own chromedriver (selenium), and the page's shading recomputed here from the colour stops of
playground.js (`shade`), independently of the page.

`chromium()` skips, saying why, when Chromium, chromedriver or selenium is missing (scripts/setup.sh installs them).
"""

from __future__ import annotations

import math
import shutil
import tempfile
from pathlib import Path

import pytest

CHROMIUM, CHROMEDRIVER = Path("/usr/bin/chromium"), Path("/usr/bin/chromedriver")
STOPS = [(0.0, (226, 92, 78)), (0.5, (247, 196, 112)), (0.8, (252, 236, 180)), (1.0, (246, 249, 252))]


def shade(p: float) -> str:
    """The page's colour of probability p, computed here from the same stops."""
    x = min(1.0, max(0.0, p))
    for (p0, c0), (p1, c1) in zip(STOPS, STOPS[1:]):
        if x <= p1:
            t = (x - p0) / (p1 - p0)
            r, g, b = (math.floor(v + t * (w - v) + 0.5) for v, w in zip(c0, c1))
            return f"rgb({r}, {g}, {b})"
    return "rgb(246, 249, 252)"


def chromium():
    """Debian's Chromium through its own chromedriver (never one that selenium would download), fresh profile; a
    generator for a fixture (`yield from chromium()`)."""
    if not (CHROMIUM.exists() and CHROMEDRIVER.exists()):
        pytest.skip("needs Debian's chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver): "
                    "apt-get install -y chromium chromium-driver (scripts/setup.sh does it)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (the test extra)")
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="ats-chromium-")
    options = Options()
    options.binary_location = str(CHROMIUM)
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--disable-dev-shm-usage",
                 f"--user-data-dir={profile}", "--window-size=1400,1000"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=options)
    driver.set_script_timeout(120)
    yield driver
    driver.quit()
    shutil.rmtree(profile, ignore_errors=True)


def wait_for(driver, script: str, timeout: float = 120):
    from selenium.webdriver.support.ui import WebDriverWait

    return WebDriverWait(driver, timeout, poll_frequency=0.1).until(lambda d: d.execute_script(script))


def open_page(driver, url: str, api_key: str, *, forget_key: bool = False) -> None:
    """Load the page at `url`; `forget_key`: as a new visitor, who must give the key (a wrong one first, refused)
    before the page shows anything (else the tab's stored key is used)."""
    driver.get(url + "/")
    if forget_key:
        driver.execute_script("sessionStorage.clear()")
        driver.get(url + "/")
        wait_for(driver, "return !document.getElementById('key-panel').hidden")  # the page asks for the key first
        assert driver.find_element("id", "app").get_attribute("hidden") is not None
        key = driver.find_element("id", "key-input")
        key.send_keys("wrong-key\n")
        wait_for(driver, "return document.getElementById('key-error').textContent.includes('refused')")
        key.clear()
        key.send_keys(api_key + "\n")
    wait_for(driver, "return document.body.dataset.ready === 'true'")


def ask(driver, text: str, turn: int, max_tokens: int | None) -> None:
    """Type `text` as the prompt with `max_tokens` (None: the page's) and send it; wait until answer `turn` (counted
    from 1) is done."""
    if max_tokens is not None:
        driver.find_element("id", "max-tokens").clear()
        driver.find_element("id", "max-tokens").send_keys(str(max_tokens))
    driver.find_element("id", "prompt").send_keys(text)
    driver.find_element("id", "send").click()
    wait_for(driver, f"return document.body.dataset.turns === '{turn}' && document.body.dataset.streaming === 'false'")


def spans(driver, turn: int) -> list[dict]:
    """Each token of answer `turn` (from 0) as the page shows it: its values and its background colour."""
    return driver.execute_script(
        "const t = [...document.querySelectorAll('.turn.assistant')][arguments[0]];"
        "return [...t.querySelectorAll('.tok')].map(s => ({confidence: s.dataset.confidence, raw: s.dataset.raw, "
        "p: s.dataset.p, calibrator: s.dataset.calibrator, colour: getComputedStyle(s).backgroundColor}))", turn)


def markup_is_text(driver, url: str, api_key: str, max_tokens: int) -> None:
    """A prompt of markup and script is shown as text: no element made, no script run."""
    text = '<b id="bold">bold</b><img src="x" onerror="window.__pwned=1"><script>window.__pwned=2</script> & &amp;'
    open_page(driver, url, api_key)  # a fresh page
    ask(driver, text, 1, max_tokens)
    assert driver.execute_script("return document.querySelector('.turn.user .text').textContent") == text
    assert driver.find_elements("css selector", "#transcript b, #transcript img, #transcript script") == []
    assert driver.execute_script("return window.__pwned") is None
    assert driver.execute_script("return document.getElementById('bold')") is None
