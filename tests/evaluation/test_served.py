"""Certification answers are served answers: each question alone through the chat template, greedy, stopped by
end-of-sequence or max tokens, its confidence `answer_confidence`, computed here one question at a time by
`generate_calibrated` (the decoder `ats serve` runs) against the batched route; and the chat judge (an alias
contained in the answer, as whole words) by hand."""

from __future__ import annotations

import numpy as np
import pytest

from ats.evaluation.served import JUDGE, answer_format, served_answers
from ats.evaluation.tasks.triviaqa import contains_match, exact_match
from ats.generation import generate_calibrated

from helpers import calibrator_for, make_tiny_backbone


@pytest.mark.parametrize("answer, aliases, expected", [
    ("The capital of France is Paris.", ["Paris"], True),  # inside a sentence: exact match would say no
    ("It was the Beatles!", ["The Beatles"], True),  # articles and punctuation normalised on both sides
    ("Parisian food", ["Paris"], False),  # whole words only
    ("New York City", ["york city"], True),
    ("New York City", ["York Town"], False),
    ("", ["Paris"], False),
    ("anything at all", ["", "the", "!"], False),  # an alias that normalises to nothing never matches
])
def test_contains_match_by_hand(answer, aliases, expected):
    assert contains_match(answer, aliases) is expected


def test_contains_match_accepts_every_exact_match():
    for answer, aliases in (("Paris", ["paris"]), ("The Who", ["who"]), ("U.S.A.", ["USA"])):
        assert exact_match(answer, aliases) and contains_match(answer, aliases)


def test_served_answers_are_those_of_the_serving_decoder_one_question_at_a_time(tokenizer):
    tiny_backbone = make_tiny_backbone(tokenizer, tie_word_embeddings=False, output_scale=60.0)  # varied text
    calibrator = calibrator_for(tiny_backbone, "linear")
    questions = [{"question": q, "aliases": ["zzz"]} for q in
                 ("who lives in paris", "which city is in france", "what colour is the sky", "hello", "name a city")]
    alone = [generate_calibrated(tiny_backbone, calibrator, [q["question"]], max_new_tokens=6)[0] for q in questions]
    words = [g.text.split() for g in alone]
    questions[0]["aliases"] = [words[0][0]] if words[0] else ["zzz"]  # an alias the first answer contains
    got = served_answers(tiny_backbone, calibrator, questions, max_tokens=6, batch_size=2)
    assert len(got) == 5 and got.text == [g.text for g in alone]
    expected = [0.0 if not np.isfinite(g.answer_confidence) else g.answer_confidence for g in alone]
    np.testing.assert_allclose(got.confidence, expected, rtol=1e-5, atol=1e-7)
    assert got.correct.tolist() == [contains_match(g.text, q["aliases"]) for g, q in zip(alone, questions)]
    # the raw model's served confidence of the same answers: what it reports answering them itself (scaling never
    # changes a greedy answer)
    raw = [generate_calibrated(tiny_backbone, None, [q["question"]], max_new_tokens=6)[0] for q in questions]
    assert [g.text for g in raw] == got.text
    np.testing.assert_allclose(got.uncalibrated, [g.answer_confidence if np.isfinite(g.answer_confidence) else 0.0
                                                  for g in raw], rtol=1e-5, atol=1e-7)
    assert not np.allclose(got.uncalibrated, got.confidence, atol=1e-4)  # the head moved them
    assert words[0] and got.correct[0] and not got.correct[1:].any()
    assert got.finish == [g.finish_reason for g in alone] and set(got.finish) <= {"eos", "length"}
    assert "<|im_start|>user\nwho lives in paris<|im_end|>" in alone[0].prompt_text  # through the chat template
    fmt = answer_format(tiny_backbone, 6)
    assert fmt["chat_template"] is True and fmt["max_tokens"] == 6 and fmt["judge"] == JUDGE
