"""`ats certify --start-coverage choose`: the start is chosen on the served answers to the questions after the
certification ones (none shared with them or with training), by `choose_start` at the target risk, and the
certificate is the library's on the certification answers from that start (both recomputed here independently);
the choice is recorded, reused and guarded like every other option."""

from __future__ import annotations

import json

import pytest

from ats.cli.main import main
from ats.errors import ATSError
from ats.evaluation.served import served_answers
from ats.evaluation.start_choice import START_GRID, choose_start
from ats.evaluation.threshold import THRESHOLD_NAME, certify_threshold, read_threshold
from ats.workflows.answer_pool import free_form_tasks
from ats.workflows.certify import certify, interleaved_order

from helpers import calibrator_for


def _answers(backbone, calibrator, offsets: dict[str, int], size: int, max_tokens: int):
    """The served answers to `size` questions per task from `offsets` on, in the order certify makes them, and the
    questions."""
    questions = {n: t.load()[1] for n, t in free_form_tasks(size, offsets).items()}
    order = interleaved_order(questions)
    got = served_answers(backbone, calibrator, [questions[t][i] for t, i in order], max_tokens=max_tokens)
    return got, questions


def test_the_start_is_chosen_on_the_questions_after_the_certification_ones(tiny_backbone, tmp_path):
    calibrator = calibrator_for(tiny_backbone, "linear")
    calibrator.save_pretrained(tmp_path / "head")
    done = certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.9, delta=0.2, size=3, max_tokens=4,
                   start_coverage=None, selection_size=3, progress=False)
    # independently: certification takes NQ positions 5-7 and TriviaQA 1005-1007, selection the next 3 of each
    certified, asked = _answers(tiny_backbone, calibrator, {"nq_open": 0, "triviaqa_pool": 1000}, 3, 4)
    selection, chosen_on = _answers(tiny_backbone, calibrator, {"nq_open": 3, "triviaqa_pool": 1003}, 3, 4)
    for name in asked:
        assert not {r["question"] for r in asked[name]} & {r["question"] for r in chosen_on[name]}
    choice = choose_start(selection.confidence, selection.correct, target_risks=(0.9,), delta=0.2)
    assert done.start_chosen and done.start_coverage == choice.start in START_GRID
    expected = certify_threshold(certified.confidence, certified.correct, target_risk=0.9, delta=0.2,
                                 start_coverage=choice.start)
    assert done.threshold == expected == read_threshold(tmp_path / "head")
    record = json.loads((tmp_path / "head" / THRESHOLD_NAME).read_text())
    assert [(s["name"], s["start"], s["n"]) for s in record["start_choice"]["sets"]] == [
        ("nq_open_selection", 8, 3), ("triviaqa_pool_selection", 1008, 3)]
    assert [(s["name"], s["start"]) for s in record["sets"]] == [("nq_open_held_out", 5),
                                                                 ("triviaqa_pool_held_out", 1005)]
    assert record["start_choice"]["scores"] == choice.to_dict()["scores"]
    assert record["reachable"]["start_coverage"] == choice.start
    assert record["start_choice"]["error_rate"] == pytest.approx(1 - selection.correct.mean())
    # reused as made; another selection size or a fixed start is another threshold, refused without --overwrite
    again = certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.9, delta=0.2, size=3, max_tokens=4,
                    start_coverage=None, selection_size=3, progress=False)
    assert again.reused and again.threshold == done.threshold
    assert again.start_coverage == done.start_coverage and again.start_chosen
    with pytest.raises(ATSError, match=r"threshold made with other options: start_choice.sets"):
        certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.9, delta=0.2, size=3, max_tokens=4,
                start_coverage=None, selection_size=2, progress=False)
    with pytest.raises(ATSError, match=r"threshold made with other options: .*start_coverage 'choose' -> 0.3"):
        certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.9, delta=0.2, size=3, max_tokens=4,
                progress=False)
    with pytest.raises(ATSError, match=r"^selection_size 3: selection questions choose the start coverage"):
        certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.9, delta=0.2, size=3, max_tokens=4,
                selection_size=3, progress=False)


def test_no_selection_questions_left_is_refused_in_one_line(tiny_backbone, tmp_path):
    calibrator = calibrator_for(tiny_backbone, "linear")
    calibrator.save_pretrained(tmp_path / "head")  # the tiny NQ-open ends at position 12: 7 certified, none after
    with pytest.raises(ATSError, match=r"^selection set nq_open: no questions left after"):
        certify(tiny_backbone, calibrator, tmp_path / "head", target_risk=0.9, delta=0.2, size=7, max_tokens=4,
                start_coverage=None, names=("nq_open",), progress=False)
    assert not (tmp_path / "head" / THRESHOLD_NAME).exists()


def test_the_command_says_the_start_was_chosen(tiny_backbone, tokenizer, tmp_path, capsys):
    model = tmp_path / "tiny-model"
    tiny_backbone.model.save_pretrained(model)
    tokenizer.save_pretrained(model)
    from ats.model.backbone import load_backbone

    calibrator_for(load_backbone(str(model)), "linear").save_pretrained(tmp_path / "head")
    argv = ["certify", "--model", str(model), "--calibrator", str(tmp_path / "head"), "--target-risk", "0.9",
            "--delta", "0.2", "--size", "3", "--max-tokens", "4", "--tasks", "nq_open"]
    assert main([*argv, "--start-coverage", "choose", "--selection-size", "2"]) == 0
    start = json.loads((tmp_path / "head" / THRESHOLD_NAME).read_text())["reachable"]["start_coverage"]
    at = f"at {100 * start:g}% of them" if start else "at the fewest answers that can certify"
    assert f", the sequence started {at} (chosen on served answers to other questions: --start-coverage choose)\n" \
        in capsys.readouterr().out
    # the option errors: tests/cli/test_startup.py (one line, before anything heavy is imported)
