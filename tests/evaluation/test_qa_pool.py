"""The answer pool's multiple-choice sets from Hub-shaped records: each conversion by hand, and the online path
through the real `datasets` loader on a local folder laid out like a Hub data set."""

from __future__ import annotations

import json

import pytest

from ats.errors import ATSError
from ats.evaluation.tasks import qa_pool
from ats.evaluation.tasks.multiple_choice import MultipleChoiceTask

RECORDS = {
    "social_iqa": [{"context": "Tracy stayed out.", "question": "What next?", "answerA": "a", "answerB": "b",
                    "answerC": "c", "label": "3"}],
    "boolq": [{"question": "is the sky blue", "answer": True, "passage": "The sky is blue."},
              {"question": "is fire cold", "answer": False, "passage": "Fire is hot."}],
    "winogrande": [{"sentence": "Sarah beat Maria so _ won.", "option1": "Sarah", "option2": "Maria", "answer": "1"}],
}


def test_conversions_by_hand():
    assert qa_pool.convert_rows("social_iqa", RECORDS["social_iqa"]) == [
        {"question": "Tracy stayed out. What next?", "choices": ["a", "b", "c"], "answer": 2}]
    assert qa_pool.convert_rows("boolq", RECORDS["boolq"]) == [
        {"question": "The sky is blue.\nQuestion: is the sky blue?", "choices": ["no", "yes"], "answer": 1},
        {"question": "Fire is hot.\nQuestion: is fire cold?", "choices": ["no", "yes"], "answer": 0}]
    assert qa_pool.convert_rows("winogrande", RECORDS["winogrande"]) == [
        {"question": "Sarah beat Maria so _ won.", "choices": ["Sarah", "Maria"], "answer": 0}]
    sciq = [{"question": f"q{i}", "distractor1": "x", "distractor2": "y", "distractor3": "z",
             "correct_answer": "right", "support": ""} for i in range(20)]
    rows = qa_pool.convert_rows("sciq", sciq)
    assert all(r["choices"][r["answer"]] == "right" and sorted(r["choices"]) == ["right", "x", "y", "z"]
               for r in rows)
    assert len({r["answer"] for r in rows}) > 1  # the correct answer is not always last
    assert rows == qa_pool.convert_rows("sciq", sciq)  # seeded
    with pytest.raises(ATSError, match="record 0"):
        qa_pool.convert_rows("boolq", [{"question": "q"}])
    with pytest.raises(ATSError, match="unknown set"):
        qa_pool.convert_rows("piqa", [])


def test_online_path_converts_once_into_the_cache(tmp_path, monkeypatch):
    hub = tmp_path / "hub_boolq"  # a folder laid out like a Hub data set: its split named by the file
    hub.mkdir()
    (hub / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS["boolq"]))
    monkeypatch.delenv("ATS_DATA_DIR", raising=False)
    monkeypatch.setenv("ATS_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(qa_pool.HUB, "boolq", (str(hub), None))
    path = qa_pool.pool_path("boolq")
    assert path == tmp_path / "cache" / "qa_pool" / "boolq.jsonl"
    assert [json.loads(line) for line in path.read_text().splitlines()] == qa_pool.convert_rows(
        "boolq", RECORDS["boolq"])
    task = MultipleChoiceTask(path, "likelihood")
    assert sorted((r["question"], r["answer"]) for r in task.selected()) == [
        ("Fire is hot.\nQuestion: is fire cold?", 0), ("The sky is blue.\nQuestion: is the sky blue?", 1)]
    (hub / "validation.jsonl").unlink()  # converted once: read from the cache from now on
    assert qa_pool.pool_path("boolq") == path


def test_local_files_are_read_as_they_are(tmp_path, monkeypatch):
    (tmp_path / "qa_pool").mkdir()
    (tmp_path / "qa_pool" / "sciq.jsonl").write_text(json.dumps({"question": "q", "choices": ["a", "b"],
                                                                 "answer": 0}) + "\n")
    monkeypatch.setenv("ATS_DATA_DIR", str(tmp_path))
    assert qa_pool.pool_path("sciq") == tmp_path / "qa_pool" / "sciq.jsonl"
    with pytest.raises(ATSError, match="not found under ATS_DATA_DIR"):
        qa_pool.pool_path("winogrande")
