"""Evaluation tasks on the tiny random Llama (SmolLM2's real tokenizer) and the shared local data.

Every score is checked against an independent computation: a full `backbone.model(...)` forward without any cache,
batching or gathering, and the calibrators applied by hand.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ats.calibrators.base import Calibrator, Uncalibrated
from ats.errors import ATSError
from ats.evaluation.tasks import KNOWN_SPECS, MMLUTask, MultipleChoiceTask, TriviaQATask, TruthfulQAMC1Task, build_task
from ats.evaluation.tasks.generative import cut_answer
from ats.evaluation.tasks.mmlu import few_shot_prefix, render_prompt
from ats.evaluation.tasks.multiple_choice import letter_prompt
from ats.evaluation.tasks.scoring import PrefixCache, encode, letter_token_ids
from ats.evaluation.tasks.triviaqa import exact_match, normalize_answer
from ats.evaluation.tasks.truthfulqa import QA_PRIMER, render_context

from helpers import HalfTemperature, SquareConfidence, perturbed_ats

SUBJECTS = ["anatomy", "astronomy"]


# --- calibrators defined for the tests -------------------------------------------------------------------------------
class HiddenProbe(Calibrator):
    """Needs the hidden states: checks it gets the whole sequence and the right index, then sharpens by 3."""

    name = "probe"
    needs_hidden = True

    def __init__(self, backbone):
        self.backbone = backbone
        self.calls = []

    def fit(self, chunks):
        return self

    def calibrate(self, logits, hidden=None, *, attention_mask=None, index=None):
        assert hidden is not None and attention_mask is not None and index is not None
        B, K, V = logits.shape
        assert hidden.shape[0] == B and attention_mask.shape == hidden.shape[:2] and index.shape == (B, K)
        # the logits passed are exactly those of the hidden states at `index`
        h = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
        torch.testing.assert_close(self.backbone.logits(h).float(), logits, atol=1e-4, rtol=1e-4)
        # every indexed position is a real token, and the hidden states start at the sequence's first token
        assert bool(attention_mask.gather(1, index).all())
        self.calls.append((tuple(hidden.shape), index.clone(), attention_mask.sum(1).clone()))
        return logits * 3


def full_logits(backbone, ids: list[int]) -> torch.Tensor:
    """Logits (T, V) of the model's own forward over `ids`, no cache."""
    with torch.no_grad():
        return backbone.model(input_ids=torch.tensor([ids])).logits[0].float()


# --- MMLU ------------------------------------------------------------------------------------------------------------
def test_mmlu_prompt_format_one_shot():
    shot = {"subject": "high_school_biology", "question": "What is 2+2?", "choices": ["1", "2", "3", "4"], "answer": 3}
    row = {"subject": "high_school_biology", "question": "Which is a cell?", "choices": ["rock", "neuron", "air",
                                                                                          "light"], "answer": 1}
    expected = ("The following are multiple choice questions (with answers) about high school biology.\n\n"
                "What is 2+2?\nA. 1\nB. 2\nC. 3\nD. 4\nAnswer: D\n\n"
                "Which is a cell?\nA. rock\nB. neuron\nC. air\nD. light\nAnswer:")
    assert render_prompt("high_school_biology", [shot], row) == expected
    assert expected.startswith(few_shot_prefix("high_school_biology", [shot]))


def test_letter_tokens_are_single_tokens(tokenizer):
    ids = letter_token_ids(tokenizer, 4)
    assert ids == [tokenizer(" " + c, add_special_tokens=False).input_ids[0] for c in "ABCD"]
    assert all(len(tokenizer(" " + c, add_special_tokens=False).input_ids) == 1 for c in "ABCD")
    with pytest.raises(ATSError, match="2 to 26"):
        letter_token_ids(tokenizer, 27)


def test_prefix_cache_matches_full_forward(tiny_backbone):
    tok = tiny_backbone.tokenizer
    prefix_text = "The following are examples.\n\nQ: one\nA: 1\n\n"
    rows = [encode(tok, prefix_text + q, special=True) for q in ["Q: two\nA:", "Q: a much longer question here?\nA:"]]
    cache = PrefixCache(tiny_backbone, encode(tok, prefix_text, special=True))
    for _ in range(2):  # the stored cache is not mutated by a forward: a second batch gives the same
        hidden, mask = cache.forward(rows)
        for i, r in enumerate(rows):
            assert int(mask[i].sum()) == len(r)
            ref, _ = tiny_backbone.forward(torch.tensor([r]))
            torch.testing.assert_close(hidden[i, :len(r)], ref[0], atol=1e-4, rtol=1e-4)
            torch.testing.assert_close(tiny_backbone.logits(hidden[i, len(r) - 1]).float(),
                                       full_logits(tiny_backbone, r)[-1], atol=1e-4, rtol=1e-4)


def test_mmlu_matches_independent_full_forward(tiny_backbone):
    task = MMLUTask(limit=2, subjects=SUBJECTS, n_shots=2, batch_size=3)
    probe = HiddenProbe(tiny_backbone)
    calibrators = {"none": Uncalibrated(), "copy": Uncalibrated(), "half": HalfTemperature(),
                   "square": SquareConfidence(), "probe": probe}
    res = task.run(tiny_backbone, calibrators, progress=False)
    questions, shots = task.load()
    letters = letter_token_ids(tiny_backbone.tokenizer, 4)
    conf, correct, lengths = [], [], []
    for s in SUBJECTS:
        assert len(questions[s]) == 2 and len(shots[s]) == 2
        for row in questions[s]:
            ids = encode(tiny_backbone.tokenizer, render_prompt(s, shots[s], row), special=True)
            lengths.append(len(ids))
            probs = torch.softmax(full_logits(tiny_backbone, ids)[-1, letters], dim=-1)
            conf.append(probs.max().item())
            correct.append(int(probs.argmax()) == row["answer"])
    np.testing.assert_allclose(res["none"].confidence, conf, atol=1e-4)
    np.testing.assert_array_equal(res["none"].correct, correct)
    np.testing.assert_array_equal(res["copy"].confidence, res["none"].confidence)
    # calibrators change the confidence, never the correctness
    assert np.all(res["half"].confidence < res["none"].confidence)
    assert np.all(res["probe"].confidence > res["none"].confidence)
    np.testing.assert_allclose(res["square"].confidence, res["none"].confidence ** 2, atol=1e-6)
    for m in calibrators:
        np.testing.assert_array_equal(res[m].correct, res["none"].correct)
    # the probe saw the whole sequence (few-shot prefix included) and the answer position of every question
    seen = [(int(n), int(i)) for _, index, counts in probe.calls for n, i in zip(counts, index[:, 0])]
    assert seen == [(n, n - 1) for n in lengths]


def test_mmlu_stratified_seeded_subset():
    a = MMLUTask(limit=3, subjects=SUBJECTS, n_shots=0, seed=1).load()[0]
    b = MMLUTask(limit=3, subjects=SUBJECTS, n_shots=0, seed=1).load()[0]
    c = MMLUTask(limit=3, subjects=SUBJECTS, n_shots=0, seed=2).load()[0]
    assert list(a) == SUBJECTS and all(len(v) == 3 for v in a.values())
    assert a == b and a != c
    assert all(r["subject"] == s for s in SUBJECTS for r in a[s])
    with pytest.raises(ATSError, match="unknown subject"):
        MMLUTask(subjects=["not_a_subject"]).load()


def test_ats_calibrator_sees_prefix(tiny_backbone):
    """A real ATS head (perturbed away from identity) on the cached prefix = ATS on a full, uncached forward."""
    ats = perturbed_ats(tiny_backbone)
    task = MMLUTask(limit=1, subjects=SUBJECTS, n_shots=2)
    res = task.run(tiny_backbone, {"none": Uncalibrated(), "ats": ats}, progress=False)
    questions, shots = task.load()
    letters = letter_token_ids(tiny_backbone.tokenizer, 4)
    expected = []
    for s in SUBJECTS:
        ids = encode(tiny_backbone.tokenizer, render_prompt(s, shots[s], questions[s][0]), special=True)
        hidden, _ = tiny_backbone.forward(torch.tensor([ids]))
        z = tiny_backbone.logits(hidden).float()  # (1, T, V)
        q = ats.calibrate(z, hidden, attention_mask=torch.ones(1, len(ids), dtype=torch.long))[0, -1]
        expected.append(torch.softmax(q[letters], -1).max().item())
    np.testing.assert_allclose(res["ats"].confidence, expected, atol=1e-4)
    assert not np.allclose(res["ats"].confidence, res["none"].confidence)
    np.testing.assert_array_equal(res["ats"].correct, res["none"].correct)


# --- TriviaQA --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("text, expected", [
    ("The Beatles", "beatles"),
    ("  A  Tale of Two Cities! ", "tale of two cities"),
    ("Sunset Blvd.", "sunset blvd"),
    ("an apple, the pear", "apple pear"),
    ("Theatre", "theatre"),  # articles only as whole words
    ("Campbell-Bannerman", "campbellbannerman"),
    ("", ""),
])
def test_squad_normalisation(text, expected):
    assert normalize_answer(text) == expected


def test_exact_match_with_aliases():
    aliases = ["Sunset Blvd", "Sunset Boulevard", "sunset boulevard"]
    assert exact_match("sunset boulevard.", aliases)
    assert exact_match("The Sunset Blvd", aliases)
    assert not exact_match("Sunset", aliases)
    assert not exact_match("", aliases + [""])  # an empty answer is never correct


def test_cut_answer(tokenizer):
    stop = {tokenizer.eos_token_id}
    ids = tokenizer("Paris\n\nQ: What", add_special_tokens=False).input_ids
    text, k = cut_answer(tokenizer, ids, stop)
    assert text == "Paris" and tokenizer.decode(ids[:k]) == "Paris"
    ids = tokenizer(" Rome", add_special_tokens=False).input_ids + [tokenizer.eos_token_id] + [5, 6]
    text, k = cut_answer(tokenizer, ids, stop)
    assert text == "Rome" and k == len(ids) - 3
    text, k = cut_answer(tokenizer, tokenizer("\nQ:", add_special_tokens=False).input_ids, stop)
    assert text == "" and k == 1  # empty answer: the first generated token is scored


def test_triviaqa_matches_independent_computation(tiny_backbone):
    task = TriviaQATask(limit=3, n_shots=2, max_new_tokens=5, batch_size=2)
    res = task.run(tiny_backbone, {"none": Uncalibrated(), "half": HalfTemperature(), "square": SquareConfidence()},
                   progress=False)
    shots, questions = task.load()
    assert len(questions) == 3 and not {q["question"] for q in shots} & {q["question"] for q in questions}
    tok = tiny_backbone.tokenizer
    for i, q in enumerate(questions):
        prompt = encode(tok, few_shot_prefix_tqa(shots) + f"Q: {q['question']}\nA:", special=True)
        generated = task.generate(tiny_backbone, [prompt])[0]  # unbatched generation
        text, k = cut_answer(tok, generated, {tok.eos_token_id})
        assert res["none"].extra["prediction"][i] == text
        assert res["none"].extra["n_tokens"][i] == k
        assert bool(res["none"].correct[i]) == exact_match(text, q["aliases"])
        logits = full_logits(tiny_backbone, prompt + generated[:k])
        for method, scale in (("none", 1.0), ("half", 0.5)):
            probs = torch.softmax(logits[len(prompt) - 1:len(prompt) - 1 + k] * scale, -1)
            p = probs[torch.arange(k), torch.tensor(generated[:k])].numpy()
            assert res[method].confidence[i] == pytest.approx(p.mean(), abs=1e-4)
            assert res[method].extra["confidence_product"][i] == pytest.approx(p.prod(), rel=1e-3, abs=1e-8)
            if method == "none":
                assert res["square"].confidence[i] == pytest.approx((p ** 2).mean(), abs=1e-4)
    for m in res:
        np.testing.assert_array_equal(res[m].correct, res["none"].correct)
        assert np.all(res[m].extra["confidence_product"] <= res[m].confidence + 1e-9)


def few_shot_prefix_tqa(shots):
    return "".join(f"Q: {s['question']}\nA: {s['value']}\n\n" for s in shots)


# --- TruthfulQA MC1 --------------------------------------------------------------------------------------------------
def test_truthfulqa_primer():
    assert QA_PRIMER.count("Q: ") == 6 and QA_PRIMER.count("\nA: ") == 6
    assert QA_PRIMER.startswith("Q: What is human life expectancy in the United States?\nA: Human life expectancy")
    assert QA_PRIMER.endswith("A: The 1992 Olympics were held in Barcelona, Spain.")
    assert render_context("Why?") == QA_PRIMER + "\n\nQ: Why?\nA:"


def test_truthfulqa_likelihood_matches_per_choice_forward(tiny_backbone):
    task = TruthfulQAMC1Task(limit=2, seed=3)
    res = task.run(tiny_backbone, {"none": Uncalibrated(), "half": HalfTemperature()}, progress=False)
    rows = task.load()
    assert all(len(r["choices"]) >= 2 and 0 <= r["answer"] < len(r["choices"]) for r in rows)
    tok = tiny_backbone.tokenizer
    for i, r in enumerate(rows):
        context = encode(tok, render_context(r["question"]), special=True)
        for method, scale in (("none", 1.0), ("half", 0.5)):
            totals = []
            for choice in r["choices"]:
                cont = encode(tok, " " + choice, special=False)
                logp = torch.log_softmax(full_logits(tiny_backbone, context + cont) * scale, -1)
                totals.append(sum(logp[len(context) - 1 + j, t].item() for j, t in enumerate(cont)))
            probs = torch.softmax(torch.tensor(totals), 0)
            assert res[method].confidence[i] == pytest.approx(probs.max().item(), abs=1e-4)
            assert bool(res[method].correct[i]) == (int(probs.argmax()) == r["answer"])


# --- multiple-choice files -------------------------------------------------------------------------------------------
def write_jsonl(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


GOOD = {"question": "Which is a colour?", "choices": ["red", "seven", "dog"], "answer": 0}


@pytest.mark.parametrize("bad, message", [
    ('{"question": "x", "choices": ["a", "b"], "answer": 0', ":2: invalid JSON"),
    ({"choices": ["a", "b"], "answer": 0}, ":2: missing field 'question'"),
    ({"question": "x", "answer": 0}, ":2: missing field 'choices'"),
    ({"question": "x", "choices": ["a", "b"]}, ":2: missing field 'answer'"),
    ({"question": 5, "choices": ["a", "b"], "answer": 0}, ":2: field 'question'"),
    ({"question": "x", "choices": "a,b", "answer": 0}, ":2: field 'choices' must be a list of strings, got 'a,b'"),
    ({"question": "x", "choices": ["a", 3], "answer": 0}, ":2: field 'choices'"),
    ({"question": "x", "choices": ["a", "b"], "answer": 2}, ":2: field 'answer' is 2, out of range"),
    ({"question": "x", "choices": ["a", "b"], "answer": -1}, ":2: field 'answer' is -1"),
    ({"question": "x", "choices": ["a", "b"], "answer": "0"}, ":2: field 'answer' must be an integer"),
    ({"question": "x", "choices": ["a", "b"], "answer": True}, ":2: field 'answer'"),
    ({"question": "x", "choices": ["a"], "answer": 0}, ":2: field 'choices' needs at least 2"),
    ([1, 2], ":2: expected a JSON object"),
])
def test_mc_validation_errors(tmp_path, bad, message):
    path = write_jsonl(tmp_path / "set.jsonl", [GOOD, bad])
    with pytest.raises(ATSError) as err:
        build_task(f"mc:{path}")
    assert message in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_real_mmlu_dev_file_with_a_repeated_choice_evaluates(tiny_backbone, caplog, shared_data):
    # the official MMLU dev split repeats a choice on line 93: such rows are scored as given, with a warning
    from ats.sources import local_file

    path = local_file("mmlu/dev.jsonl")
    with caplog.at_level("WARNING", logger="ats"):
        task = build_task(f"mc:{path}")
    assert any(f"{path}:93: field 'choices' repeats" in r.getMessage() for r in caplog.records)
    assert len(task.rows) == 285 and len(set(task.rows[92]["choices"])) < 4
    res = task.run(tiny_backbone, {"none": Uncalibrated()}, progress=False)["none"]
    assert len(res) == 285 and np.isfinite(res.confidence).all()


def test_mc_empty_and_missing_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ATSError, match="empty"):
        build_task(f"mc:{empty}")
    with pytest.raises(ATSError, match="not found"):
        build_task(f"mc:{tmp_path / 'nope.jsonl'}")


def test_build_task_specs(tmp_path):
    path = write_jsonl(tmp_path / "my set.jsonl", [GOOD])
    assert isinstance(build_task("mmlu", limit=2), MMLUTask)
    assert isinstance(build_task("triviaqa"), TriviaQATask)
    assert isinstance(build_task("truthfulqa_mc1"), TruthfulQAMC1Task)
    letters = build_task(f"mc:{path}")
    assert isinstance(letters, MultipleChoiceTask) and letters.mode == "letters" and letters.name == "mc_my_set"
    assert build_task(f"mc:{path}:letters").mode == "letters"
    likelihood = build_task(f"mc:{path}:likelihood")
    assert likelihood.mode == "likelihood" and likelihood.name == "mc_my_set_likelihood"
    with pytest.raises(ATSError) as err:
        build_task("hellaswag")
    assert all(spec in str(err.value) for spec in KNOWN_SPECS)
    with pytest.raises(ATSError, match="bad option"):
        build_task("mmlu", n_shot=3)


def test_mc_letters_and_likelihood_match_full_forward(tiny_backbone, tmp_path):
    rows = [GOOD, {"question": "Pick the largest number.", "choices": ["1", "10", "100", "5", "2"], "answer": 2},
            {"question": "Is water wet?", "choices": ["yes", "no"], "answer": 0}]
    path = write_jsonl(tmp_path / "quiz.jsonl", rows)
    tok = tiny_backbone.tokenizer
    res = build_task(f"mc:{path}").run(tiny_backbone, {"none": Uncalibrated()}, progress=False)
    for i, r in enumerate(rows):
        ids = encode(tok, letter_prompt(r["question"], r["choices"]), special=True)
        letters = letter_token_ids(tok, len(r["choices"]))
        probs = torch.softmax(full_logits(tiny_backbone, ids)[-1, letters], -1)
        assert res["none"].confidence[i] == pytest.approx(probs.max().item(), abs=1e-4)
        assert bool(res["none"].correct[i]) == (int(probs.argmax()) == r["answer"])
    assert letter_prompt("Q?", ["x", "y", "z"]) == "Q?\nA. x\nB. y\nC. z\nAnswer:"
    res = build_task(f"mc:{path}:likelihood").run(tiny_backbone, {"none": Uncalibrated()}, progress=False)
    for i, r in enumerate(rows):
        context = encode(tok, f"Q: {r['question']}\nA:", special=True)
        totals = []
        for choice in r["choices"]:
            cont = encode(tok, " " + choice, special=False)
            logp = torch.log_softmax(full_logits(tiny_backbone, context + cont), -1)
            totals.append(sum(logp[len(context) - 1 + j, t].item() for j, t in enumerate(cont)))
        probs = torch.softmax(torch.tensor(totals), 0)
        assert res["none"].confidence[i] == pytest.approx(probs.max().item(), abs=1e-4)


@pytest.mark.slow
def test_mmlu_real_model_five_shot(smollm2, shared_data):
    """The embedded SmolLM2 with a 3-shot prefix: cached scoring = the model's own uncached forward."""
    task = MMLUTask(limit=1, subjects=["astronomy"], n_shots=3)
    res = task.run(smollm2, {"none": Uncalibrated()}, progress=False)
    questions, shots = task.load()
    letters = letter_token_ids(smollm2.tokenizer, 4)
    prefix = encode(smollm2.tokenizer, few_shot_prefix("astronomy", shots["astronomy"]), special=True)
    for i, row in enumerate(questions["astronomy"]):
        ids = encode(smollm2.tokenizer, render_prompt("astronomy", shots["astronomy"], row), special=True)
        assert len(ids) > 200
        assert ids[:len(prefix) - 1] == prefix[:-1]  # the cached prefix covers (nearly) all of the shots
        probs = torch.softmax(full_logits(smollm2, ids)[-1, letters], -1)
        assert res["none"].confidence[i] == pytest.approx(probs.max().item(), abs=1e-4)
        assert bool(res["none"].correct[i]) == (int(probs.argmax()) == row["answer"])
