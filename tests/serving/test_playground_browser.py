"""The playground page in a real browser (Debian's Chromium through its chromedriver, driven by selenium) against a
real `ats serve` on the tiny model, started with an API key, a certified threshold, two calibrators to compare and a
saved evaluation: the page asks for the key; each token's shading is the server's calibrated probability (the same
greedy request through the API gives the values), the switch shows the raw one, the decision shown is the `ats`
field's; a calibrator picked to compare shows what the rescore route returns for the same tokens; markup and script
in a prompt are shown as text; the record shows the saved evaluation's ECE and one method's diagram.

The shading is recomputed from the colour stops of playground.js (browser.py's `shade`), independently of the page.
Skipped with the reason when Chromium, chromedriver or selenium is missing (scripts/setup.sh installs them).
"""

from __future__ import annotations

import math
from pathlib import Path

import httpx
import numpy as np
import pytest

from ats.evaluation.evaluate import summarize_task
from ats.evaluation.tasks.base import TaskResult
from ats.io import write_json

from browser import ask, chromium, markup_is_text, open_page, shade, spans, wait_for
from helpers import certified_copy, random_thermometer
from server_process import API_KEY, MODEL_NAME, Server

MAX_TOKENS = 12

pytestmark = pytest.mark.slow  # a server process and a browser: about 20 s for the module


def _thermometer_folder(backbone, root: Path) -> Path:
    thermometer = random_thermometer(backbone.hidden_size, 11)
    thermometer.save_pretrained(root / "thermometer")
    return root / "thermometer"


def _eval_folder(calibrator, root: Path) -> Path:
    """A saved evaluation in the layout `ats eval` writes (tasks/<task>.json with digests, results.json), with the
    served head as method "ats" and an uncalibrated method, on made-up answers."""
    from ats.calibrators.base import Uncalibrated

    rng = np.random.default_rng(0)
    conf = rng.uniform(0.2, 1.0, 300)
    by_method = {"ats": TaskResult(conf, rng.uniform(size=300) < conf),
                 "uncalibrated": TaskResult(np.minimum(1, conf + 0.15), rng.uniform(size=300) < conf)}
    digests = {"ats": calibrator.digest(), "uncalibrated": Uncalibrated().digest()}
    folder = root / "eval"
    write_json(folder / "tasks" / "triviaqa.json",
               {"task": {}, "backbone": {}, "n": 300,
                "methods": {m: {"digest": digests[m], **r.to_dict()} for m, r in by_method.items()}})
    write_json(folder / "results.json", {"triviaqa": summarize_task(by_method, bootstrap=200)})
    return folder


@pytest.fixture(scope="module")
def served(model_dir, head_dir, calibrator, backbone, tmp_path_factory):
    root = tmp_path_factory.mktemp("playground")
    head = certified_copy(head_dir, root / "head", calibrator, backbone, seed=1)  # as ats certify writes it
    srv = Server(["--model", str(model_dir), "--calibrator", str(head), "--served-model-name", MODEL_NAME,
                  "--compare", str(_thermometer_folder(backbone, root)), "--compare", "none",
                  "--eval", str(_eval_folder(calibrator, root))], root / "server.log", api_key=API_KEY)
    yield srv
    srv.stop()
    log = (root / "server.log").read_text()
    assert "Traceback" not in log and '" 500 ' not in log, log[-3000:]


@pytest.fixture(scope="module")
def browser():
    yield from chromium()


def _open(driver, served, *, forget_key: bool = False) -> None:
    open_page(driver, served.url, API_KEY, forget_key=forget_key)


def _ask(driver, text: str, turn: int) -> None:
    ask(driver, text, turn, MAX_TOKENS)


def _api_chat(served, text: str) -> dict:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": text}], "max_tokens": MAX_TOKENS,
            "temperature": 0, "logprobs": True, "top_logprobs": 5}
    response = httpx.post(served.url + "/v1/chat/completions", json=body, headers=served.headers(), timeout=60)
    response.raise_for_status()
    return response.json()["choices"][0]


def test_page_is_open_but_its_data_needs_the_key(served):
    assert httpx.get(served.url + "/", timeout=10).status_code == 200
    assert httpx.get(served.url + "/static/playground.js", timeout=10).status_code == 200
    assert httpx.get(served.url + "/v1/playground", timeout=10).status_code == 401
    info = httpx.get(served.url + "/v1/playground", headers=served.headers(), timeout=10).json()
    assert info["engine"] == "ats" and info["unavailable"] == {}  # the page shows everything here
    assert [c["id"] for c in info["calibrators"]] == ["ats", "thermometer", "uncalibrated"]
    assert info["calibrators"][0]["evaluation_method"] == "ats"  # matched by digest
    assert info["calibrators"][2]["evaluation_method"] == "uncalibrated"
    assert info["calibrators"][1]["evaluation_method"] is None


def test_shading_switch_and_decision_equal_the_api(served, browser):
    text = "Tell me about the sea."
    _open(browser, served, forget_key=True)
    _ask(browser, text, 1)
    choice = _api_chat(served, text)
    ats = choice["ats"]
    shown = spans(browser, 0)
    assert len(shown) == len(ats["confidence"]) > 0
    for span, conf, raw in zip(shown, ats["confidence"], ats["uncalibrated_logprobs"]):
        assert float(span["confidence"]) == pytest.approx(conf, abs=1e-6)
        assert float(span["p"]) == float(span["confidence"]) and span["calibrator"] == "ats"
        assert span["colour"] == shade(float(span["p"]))
        assert float(span["raw"]) == pytest.approx(math.exp(raw), abs=1e-6)
    assert any(abs(c - math.exp(r)) > 0.02 for c, r in zip(ats["confidence"], ats["uncalibrated_logprobs"]))
    verdict = browser.find_element("id", "verdict")
    assert verdict.get_attribute("data-answered") == str(ats["answered"]).lower()
    assert browser.find_element("id", "decision").text == ("Answer" if ats["answered"] else "Abstain")
    assert float(verdict.get_attribute("data-answer-confidence")) == pytest.approx(ats["answer_confidence"], abs=1e-9)
    assert browser.find_element("id", "answer-confidence").text == f"{ats['answer_confidence']:.3f}"
    assert ats["certified_format"] is False  # 12 new tokens, the certificate's are 64: the page says so
    assert verdict.get_attribute("data-certified-format") == "false"
    assert ats["outside_certificate"] in browser.find_element("id", "outside-certificate").text

    browser.find_element("css selector", "input[name=shade][value=raw]").click()  # the switch: raw probabilities
    for span, raw in zip(spans(browser, 0), ats["uncalibrated_logprobs"]):
        assert float(span["p"]) == pytest.approx(math.exp(raw), abs=1e-6)
        assert span["colour"] == shade(float(span["p"]))
    browser.find_element("css selector", "input[name=shade][value=calibrated]").click()
    assert [float(s["p"]) for s in spans(browser, 0)] == pytest.approx(ats["confidence"], abs=1e-6)

    # hovering a token shows its values and alternatives; the keyboard moves between tokens
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.keys import Keys

    tokens = browser.find_elements("css selector", ".turn.assistant .tok")
    ActionChains(browser).move_to_element(tokens[0]).perform()
    assert browser.find_element("id", "token-calibrated").text == f"{ats['confidence'][0]:.3f}"
    assert browser.find_element("id", "token-raw").text == f"{math.exp(ats['uncalibrated_logprobs'][0]):.3f}"
    assert len(browser.find_elements("css selector", "#token-detail tbody tr")) == 5
    answer = browser.find_element("css selector", ".turn.assistant .answer")
    answer.send_keys(Keys.END)
    assert browser.find_element("id", "token-calibrated").text == f"{ats['confidence'][-1]:.3f}"
    answer.send_keys(Keys.HOME, Keys.ARROW_RIGHT)
    assert browser.find_element("id", "token-calibrated").text == f"{ats['confidence'][1]:.3f}"


def test_the_page_asks_for_certified_answers_by_default(served, browser):
    _open(browser, served)  # a fresh page: max tokens at the certified limit, temperature 0
    limit = httpx.get(served.url + "/v1/playground", headers=served.headers(), timeout=10).json()[
        "certified_format"]["max_tokens"]
    assert browser.find_element("id", "max-tokens").get_attribute("value") == str(limit)
    ask(browser, "Name a colour.", 1, None)
    assert browser.find_element("id", "verdict").get_attribute("data-certified-format") == "true"
    assert browser.find_elements("id", "outside-certificate") == []
    # the server's count of its decisions, read after the answer: as GET /v1/ats/monitor reports it now
    report = httpx.get(served.url + "/v1/ats/monitor", headers=served.headers(), timeout=10).json()
    monitor = browser.find_element("id", "monitor")
    inside = report["served"]["true"]
    assert inside["answers"] >= 1 and monitor.get_attribute("data-answers") == str(inside["answers"])
    assert monitor.get_attribute("data-answered") == str(inside["answered"])
    assert monitor.get_attribute("data-alarm") == str(report["shift"]["alarm"]).lower()
    assert f"{100 * report['certified']['coverage']:.1f}%" in monitor.text
    _open(browser, served)


def test_comparing_calibrators_rescores_the_same_tokens(served, browser):
    from selenium.webdriver.support.ui import Select

    if browser.execute_script("return document.body.dataset.turns") != "1":
        _open(browser, served)
        _ask(browser, "Tell me about the sea.", 1)
    before = spans(browser, 0)
    Select(browser.find_element("id", "calibrator")).select_by_value("thermometer")
    wait_for(browser, "return document.body.dataset.rescoring === 'false' && "
                      "document.getElementById('verdict').dataset.calibrator === 'thermometer'")
    after = spans(browser, 0)
    choice = _api_chat(served, "Tell me about the sea.")
    ids = httpx.post(served.url + "/tokenize", headers=served.headers(), timeout=30, json={
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Tell me about the sea."}]}).json()["tokens"]
    rescored = httpx.post(served.url + "/v1/playground/rescore", headers=served.headers(), timeout=60, json={
        "model": MODEL_NAME, "calibrator": "thermometer", "prompt_tokens": ids,
        "tokens": choice["ats"]["token_ids"]}).json()
    assert len(after) == len(before) == len(rescored["tokens"])
    for span, token in zip(after, rescored["tokens"]):
        assert span["calibrator"] == "thermometer" and span["colour"] == shade(float(span["p"]))
        assert float(span["confidence"]) == pytest.approx(token["confidence"], abs=1e-6)
    assert [s["raw"] for s in after] == [s["raw"] for s in before]  # the same tokens: the raw values do not move
    assert any(abs(float(a["confidence"]) - float(b["confidence"])) > 1e-3 for a, b in zip(after, before))
    verdict = browser.find_element("id", "verdict")
    assert float(verdict.get_attribute("data-answer-confidence")) == pytest.approx(
        rescored["ats"]["answer_confidence"], abs=1e-9)
    assert verdict.get_attribute("data-answered") == "none"  # no threshold for this one: no decision shown
    Select(browser.find_element("id", "calibrator")).select_by_value("ats")
    wait_for(browser, "return document.getElementById('verdict').dataset.calibrator === 'ats'")


def test_markup_in_a_prompt_is_text(served, browser):
    markup_is_text(browser, served.url, API_KEY, MAX_TOKENS)


def test_record_shows_the_saved_evaluation_and_one_diagram(served, browser):
    from selenium.webdriver.support.ui import Select

    _open(browser, served)
    info = httpx.get(served.url + "/v1/playground", headers=served.headers(), timeout=10).json()
    ece = info["evaluation"]["tasks"][0]["metrics"]["ats"]["ece"]
    lo, hi = info["evaluation"]["tasks"][0]["metrics"]["ats"]["ece_ci"]
    row = browser.find_element("css selector", "#eval-table tbody tr").text
    assert f"{ece:.3f}" in row and f"[{lo:.3f}, {hi:.3f}]" in row
    wait_for(browser, "return document.getElementById('diagram').dataset.shown === 'triviaqa/ats'")
    width = browser.execute_script("return document.getElementById('diagram').naturalWidth")
    Select(browser.find_element("id", "diagram-method")).select_by_value("uncalibrated")
    wait_for(browser, "return document.getElementById('diagram').dataset.shown === 'triviaqa/uncalibrated'")
    assert browser.execute_script("return document.getElementById('diagram').naturalWidth") == width > 0
    png = httpx.get(served.url + "/v1/playground/reliability.png", params={"task": "triviaqa", "method": "ats"},
                    headers=served.headers(), timeout=30)
    assert png.headers["content-type"] == "image/png" and png.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert httpx.get(served.url + "/v1/playground/reliability.png", params={"task": "triviaqa", "method": "x"},
                     headers=served.headers(), timeout=30).status_code == 404
