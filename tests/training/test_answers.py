"""Answer-level calibration: the answer source against the tasks' own scoring, the answer loss and its gradient
against an independent full-vocabulary computation, the head's position-only pass, and a planted signal that a
per-token head must recover and a global temperature cannot."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ats.calibrators.base import Uncalibrated
from ats.errors import ATSError
from ats.evaluation.answers import build_answer_set
from ats.evaluation.metrics import auroc
from ats.evaluation.tasks import build_task
from ats.evaluation.tasks.nq_open import NQOpenTask
from ats.evaluation.tasks.triviaqa import TriviaQATask
from ats.model.heads import tau_at
from ats.training.answer_objective import train_on_answers
from ats.training.answers import AnswerSet, score_answers, scored_confidence
from ats.training.config import TrainingConfig
from ats.training.losses import answer_loss

from helpers import calibrator_for, fresh_ats, make_tiny_backbone, planted_answers

QUESTIONS = [("What color is the sky?", ["blue", "green", "red"], 0), ("2+2?", ["3", "4"], 1),
             ("Capital of France?", ["Paris", "Rome", "Berlin", "Madrid"], 0),
             ("Water freezes at?", ["0 C", "100 C"], 0),
             ("Largest planet?", ["Mars", "Jupiter", "Venus"], 1), ("Fastest animal?", ["cheetah", "snail"], 0)]


@pytest.fixture(scope="module")
def sharp(tokenizer):
    """A tiny random Llama that writes varied text with non-trivial confidences."""
    return make_tiny_backbone(tokenizer, tie_word_embeddings=False, output_scale=60.0)


@pytest.fixture()
def mc_file(tmp_path):
    path = tmp_path / "mc.jsonl"
    path.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    return path


@pytest.fixture()
def data_dir(tmp_path, monkeypatch):
    """A data folder with small NQ-open and TriviaQA files written here (no folder outside the repository)."""
    (tmp_path / "qa_pool").mkdir()
    (tmp_path / "triviaqa").mkdir()
    rows = [{"question": f"what is item number {i}", "answers": [f"item {i}", str(i)]} for i in range(12)]
    (tmp_path / "qa_pool" / "nq_open.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    trivia = [{"question": f"Question {i}?", "answer": {"value": f"A{i}", "aliases": [f"A{i}"]}} for i in range(30)]
    (tmp_path / "triviaqa" / "validation.jsonl").write_text("".join(json.dumps(r) + "\n" for r in trivia))
    monkeypatch.setenv("ATS_DATA_DIR", str(tmp_path))
    return tmp_path


@pytest.mark.parametrize("mode", ["letters", "likelihood"])
def test_multiple_choice_answers_equal_the_task_scoring(sharp, mc_file, mode):
    task = build_task(f"mc:{mc_file}:{mode}")
    head = calibrator_for(sharp)
    expected = task.run(sharp, {"uncalibrated": Uncalibrated(), "ats": head}, progress=False)
    answers = build_answer_set(sharp, task, dtype="float32", progress=False)
    assert answers.kind == ("letters" if mode == "letters" else "choices") and len(answers) == len(QUESTIONS)
    for name, calibrator in (("uncalibrated", None), ("ats", head)):
        for exact, tolerance in ((True, 1e-5), (False, 1e-4)):  # the logits from h, or the stored scale summary
            conf, correct = score_answers(calibrator, answers, sharp.logits, exact=exact)
            np.testing.assert_allclose(conf, expected[name].confidence, atol=tolerance)
            np.testing.assert_array_equal(correct, expected[name].correct)


def test_free_form_answers_equal_the_task_scoring(sharp, data_dir):
    task = NQOpenTask(limit=6, n_shots=2, max_new_tokens=5, batch_size=3)
    head = calibrator_for(sharp)
    expected = task.run(sharp, {"uncalibrated": Uncalibrated(), "ats": head}, progress=False)
    answers = build_answer_set(sharp, task, dtype="float32", batch_size=4, progress=False)  # other batching
    assert answers.kind == "free" and answers.meta["text"] == list(expected["ats"].extra["prediction"])
    for name, calibrator in (("uncalibrated", None), ("ats", head)):
        for exact, tolerance in ((True, 1e-5), (False, 1e-4)):  # the logits from h, or the stored scale summary
            conf, correct = score_answers(calibrator, answers, sharp.logits, exact=exact)
            np.testing.assert_allclose(conf, expected[name].confidence, atol=tolerance)
            np.testing.assert_array_equal(correct, expected[name].correct)


SHORT = [("Pick a color", [" red", " blue", " green"], 0), ("Pick a word", [" two", " bird"], 0),
         ("Pick a letter", [" a", " b", " red", " blue"], 2), ("Pick a thing", [" green", " two"], 0)]


def test_answer_loss_and_gradient_equal_a_full_vocabulary_computation(tokenizer, tmp_path):
    sharp = make_tiny_backbone(tokenizer, tie_word_embeddings=False, output_scale=6.0)  # confidences away from 1
    path = tmp_path / "short.jsonl"  # one-token choices: likelihoods a few nats apart, so no confidence saturates
    path.write_text("".join(json.dumps({"question": q, "choices": [c.strip() for c in cs], "answer": a}) + "\n"
                            for q, cs, a in SHORT))
    answers = build_answer_set(sharp, build_task(f"mc:{path}:likelihood"), dtype="float32", progress=False)
    head = calibrator_for(sharp, head_type="linear")
    conf, correct = scored_confidence(head, answers, torch.arange(len(answers)), sharp.logits, exact=True)
    assert float(conf.detach().max()) < 1 - 1e-5 and 0 < int(correct.sum()) < len(SHORT)  # the clamp is not reached
    loss = answer_loss(conf, correct, "answer-log")
    loss.backward()
    grad = head.head.proj.weight.grad.clone()
    head.head.zero_grad()
    # independently: every row's whole logits, scaled per token, log-softmax over the vocabulary, summed choice
    # log-likelihoods, softmax over the choices, the binary log loss of the top choice
    t, losses = answers.tensors, []
    for q, (_, choices, answer) in enumerate(SHORT):
        totals = []
        for r in (t["row_question"] == q).nonzero().flatten().tolist():
            h = t["hidden"][t["row_offsets"][r]:t["row_offsets"][r + 1]]  # (T, H)
            s = torch.exp(head.head.proj(h)[:, 0]).clamp(max=10.0)  # (T,)
            log_p = torch.log_softmax(sharp.logits(h).double() * s[:, None].double(), dim=-1)  # (T, V)
            at = t["pos_row"] == r
            totals.append(log_p[t["pos_in_row"][at], t["pos_target"][at]].sum())
        probs = torch.softmax(torch.stack(totals), dim=0)
        p, pred = probs.max(dim=0)
        losses.append(-torch.log(p) if int(pred) == answer else -torch.log1p(-p))
    reference = torch.stack(losses).mean()
    reference.backward()
    assert loss.item() == pytest.approx(reference.item(), rel=1e-5)
    torch.testing.assert_close(grad, head.head.proj.weight.grad.float(), rtol=1e-4, atol=1e-9)
    head.head.zero_grad()  # the scale-summary route: the same loss and gradient to the summary's accuracy
    conf, correct = scored_confidence(head, answers, torch.arange(len(answers)), sharp.logits)
    summary_loss = answer_loss(conf, correct, "answer-log")
    summary_loss.backward()
    assert summary_loss.item() == pytest.approx(reference.item(), rel=1e-4)
    torch.testing.assert_close(grad, head.head.proj.weight.grad, rtol=1e-3, atol=1e-8)


def test_brier_loss_by_hand():
    conf = torch.tensor([0.9, 0.2, 0.5])
    correct = torch.tensor([True, False, False])
    assert float(answer_loss(conf, correct, "answer-brier")) == pytest.approx((0.01 + 0.04 + 0.25) / 3)
    assert float(answer_loss(conf, correct, "answer-log")) == pytest.approx(
        -(np.log(0.9) + np.log(0.8) + np.log(0.5)) / 3, rel=1e-6)
    with pytest.raises(ATSError, match="answer loss"):
        answer_loss(conf, correct, "selective")


def test_transformer_head_at_positions_equals_the_full_pass(sharp):
    head = calibrator_for(sharp).head
    hidden = torch.randn(2, 9, sharp.hidden_size)
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, 6:] = 0  # right padding
    index = torch.tensor([[0, 4, 8], [2, 5, 5]])
    torch.testing.assert_close(tau_at(head, hidden, mask, index), head(hidden, mask).gather(1, index),
                               rtol=1e-5, atol=1e-5)


def test_saved_answers_round_trip_and_refuse_corruption(sharp, mc_file, tmp_path):
    answers = build_answer_set(sharp, build_task(f"mc:{mc_file}:likelihood"), progress=False)
    answers.save(tmp_path / "a")
    loaded = AnswerSet.load(tmp_path / "a")
    assert loaded.kind == "choices" and set(loaded.tensors) == set(answers.tensors)
    np.testing.assert_array_equal(score_answers(None, loaded, sharp.logits)[0],
                                  score_answers(None, answers, sharp.logits)[0])
    data = bytearray((tmp_path / "a" / "answers.safetensors").read_bytes())
    data[-1] ^= 1
    (tmp_path / "a" / "answers.safetensors").write_bytes(bytes(data))
    with pytest.raises(ATSError, match="checksum"):
        AnswerSet.load(tmp_path / "a")


def test_subset_scores_like_the_whole(sharp, mc_file):
    answers = build_answer_set(sharp, build_task(f"mc:{mc_file}:likelihood"), dtype="float32", progress=False)
    whole = score_answers(None, answers, sharp.logits)[0]
    part = answers.subset([1, 3, 4])
    np.testing.assert_allclose(score_answers(None, part, sharp.logits)[0], whole[[1, 3, 4]], atol=1e-6)


def test_triviaqa_pool_is_disjoint_from_reported_questions(data_dir):
    reported = {q["question"] for q in TriviaQATask(limit=10, n_shots=2).load()[1]}
    pool = {q["question"] for q in TriviaQATask(limit=10, n_shots=2, offset=10).load()[1]}
    shots = {q["question"] for q in TriviaQATask(limit=10, n_shots=2).load()[0]}
    assert len(reported) == 10 and len(pool) == 10
    assert not reported & pool and not shots & pool


def log_loss(confidence: np.ndarray, correct: np.ndarray) -> float:
    """The mean binary log loss of answer confidences (scikit-learn's)."""
    from sklearn.metrics import log_loss as sk_log_loss

    return float(sk_log_loss(correct, confidence, labels=[False, True]))


def test_planted_correctness_is_recovered_by_a_per_token_head_not_by_a_global_temperature():
    train, test = planted_answers(400, 16, seed=0), planted_answers(200, 16, seed=1)
    config = TrainingConfig(loss_type="answer-log", lr=3e-2, epochs=8, batch_size=16, micro_batch_size=16)
    scores = {}
    for head_type in ("linear", "constant"):
        calibrator = fresh_ats(head_type, 16)
        train_on_answers(calibrator, [train], None, config=config, progress=False)
        conf, correct = score_answers(calibrator, test, None)
        scores[head_type] = (auroc(conf, correct), log_loss(conf, correct))
    base_conf, base_correct = score_answers(None, test, None)
    assert auroc(base_conf, base_correct) == pytest.approx(0.5)  # every confidence the same
    assert scores["linear"][0] > 0.95  # the head reads the sign of h_0
    assert scores["constant"][0] == pytest.approx(0.5)  # one temperature cannot rank equal confidences
    assert scores["linear"][1] < scores["constant"][1] - 0.2
    # the constant head still learns the level: the log loss of the base rate (~0.69), not of 0.79 confidence
    assert scores["constant"][1] == pytest.approx(log_loss(np.full(len(test), base_correct.mean()),
                                                                base_correct), abs=0.05)


def test_cached_answers_refuse_other_storage_settings(sharp, mc_file, tmp_path):
    from ats.workflows.pipeline import prepare_answers as cached_answers

    task = build_task(f"mc:{mc_file}:likelihood")
    first = cached_answers(sharp, task, tmp_path / "a", progress=False)
    again = cached_answers(sharp, task, tmp_path / "a", progress=False)  # same settings: reused, same bytes
    assert torch.equal(first.tensors["summary"], again.tensors["summary"])
    meta = json.loads((tmp_path / "a" / "answers.json").read_text())
    # other summary settings: reused as made (each row carries its own nodes), the same rows
    (tmp_path / "a" / "answers.json").write_text(json.dumps({**meta, "summary": {**meta["summary"], "intervals": 24}}))
    assert torch.equal(cached_answers(sharp, task, tmp_path / "a", progress=False).tensors["summary"],
                       first.tensors["summary"])
    (tmp_path / "a" / "answers.json").write_text(json.dumps({**meta, "dtype": "float32"}))
    with pytest.raises(ATSError, match=r"answers made with other options: dtype 'float32' -> 'float16'"):
        cached_answers(sharp, task, tmp_path / "a", progress=False)
    rebuilt = cached_answers(sharp, task, tmp_path / "a", progress=False, overwrite=True)  # --overwrite rebuilds
    assert rebuilt.meta["dtype"] == "float16" and torch.equal(rebuilt.tensors["summary"], first.tensors["summary"])


def test_thermometer_scales_every_position_of_a_question_by_its_prompt_state(sharp, mc_file):
    from ats.calibrators.thermometer import Thermometer
    from ats.training.answers import position_scales

    answers = build_answer_set(sharp, build_task(f"mc:{mc_file}:likelihood"), dtype="float32", progress=False)
    t = answers.tensors
    therm = Thermometer(hidden_size=sharp.hidden_size, seed=3)
    with torch.no_grad():  # a non-trivial network: its output depends on the input
        for p in therm.net.parameters():
            p.normal_(0.0, 0.3)
    rows, positions = (0, int(t["row_question"].numel())), (0, int(t["pos_row"].numel()))
    scale, penalty = position_scales(therm, t, rows, positions)
    with torch.no_grad():
        for p in range(positions[1]):  # independently: the row's first scored position is its prompt's last token
            r = int(t["pos_row"][p])
            first = int((t["pos_row"] == r).nonzero()[0])
            h = t["hidden"][t["row_offsets"][r] + t["pos_in_row"][first]]
            assert scale[p].item() == pytest.approx(therm.inverse_temperature(h[None])[0].item(), rel=1e-5)
        s_rows = torch.stack([scale[(t["pos_row"] == r).nonzero()[0, 0]] for r in range(rows[1])])
        assert penalty.item() == pytest.approx((therm.prior_weight * therm.prior(1 / s_rows)).mean().item(), rel=1e-5)
    for q in range(len(answers)):  # the choices of one question share the prompt, so one temperature
        q_scales = scale[t["row_question"][t["pos_row"]] == q]
        assert torch.allclose(q_scales, q_scales[0].expand_as(q_scales), rtol=1e-4)


def test_thermometer_trained_on_answers_recovers_a_prompt_signal_and_round_trips(tmp_path):
    from ats.calibrators import load_calibrator
    from ats.calibrators.thermometer import Thermometer
    from ats.workflows.answer_methods import reusable_answer_head

    train, test = planted_answers(400, 16, seed=0), planted_answers(200, 16, seed=1)
    therm = Thermometer(hidden_size=16, seed=0, lr=3e-2, epochs=8, batch_size=16)
    config = TrainingConfig(loss_type="answer-log", lr=3e-2, epochs=8, batch_size=16, micro_batch_size=16)
    train_on_answers(therm, [train], None, config=config, progress=False)
    conf, correct = score_answers(therm, test, None)
    assert therm.fitted and auroc(conf, correct) > 0.9  # one temperature per prompt, read from h at the answer slot
    therm.save_pretrained(tmp_path / "t")

    class Backbone:  # load_calibrator checks only the hidden size of a Thermometer
        hidden_size = 16
    again = load_calibrator(tmp_path / "t", Backbone())
    np.testing.assert_allclose(score_answers(again, test, None)[0], conf, rtol=1e-6)
    record = {k: therm.history[0][k] for k in ("lr", "seed", "epochs", "loss_type", "batch_size", "tasks")}
    assert reusable_answer_head(tmp_path / "t", {**record, "token_weight": 0.0}, head_type="thermometer",
                                max_scale=10.0, overwrite=False)
    with pytest.raises(ATSError, match="lr"):
        reusable_answer_head(tmp_path / "t", {**record, "lr": 1.0}, head_type="thermometer", max_scale=10.0,
                             overwrite=False)


def test_token_term_joins_the_answer_loss(tiny_backbone, mc_file, tmp_path):
    from ats.training.answer_objective import token_term
    from ats.training.data import Instruction, tokenize_instructions
    from ats.training.features import extract_features
    from ats.training.losses import calibration_loss

    records = [Instruction(f"Say something about {w}.", "", f"{w} is a word with {len(w)} letters.")
               for w in ("sky", "tree", "river", "stone")]
    examples = tokenize_instructions(tiny_backbone.tokenizer, records, max_length=64)[0]
    # without the scale summary: the term and the check below both take the exact full-vocabulary route
    store = extract_features(tiny_backbone, examples, tmp_path / "f", dtype="float32", progress=False, summary=None)
    answers = build_answer_set(tiny_backbone, build_task(f"mc:{mc_file}:likelihood"), dtype="float32", progress=False)
    head = calibrator_for(tiny_backbone, "linear")
    batch = next(store.batches(1))
    with torch.no_grad():  # the term is the top-label loss of the head's scales, by the exact route too
        tau = head.head(batch.hidden, batch.attention_mask)
        sel = batch.labels != -100
        exact = calibration_loss(batch.hidden[sel], head.scale(tau)[sel], batch.labels[sel], tiny_backbone.logits,
                                 loss_type="top-label").loss
        term = token_term(head, batch, tiny_backbone.logits, chunk_size=64)
        assert term.item() == pytest.approx(exact.item(), rel=1e-5)
    config = TrainingConfig(loss_type="answer-log", lr=1e-3, epochs=1, batch_size=3, micro_batch_size=3)
    with pytest.raises(ATSError, match="token_weight"):
        train_on_answers(head, [answers], tiny_backbone.logits, config=config, token_weight=1.0,
                         progress=False)
    result = train_on_answers(head, [answers], tiny_backbone.logits, config=config,
                              token_store=store, token_weight=0.5, progress=False)
    for entry in result.history:
        assert entry["loss"] == pytest.approx(entry["answer_loss"] + 0.5 * entry["token_loss"], rel=1e-5)
    assert head.config_.training["token_weight"] == 0.5
    # a subset of the response tokens: the same loss over exactly those tokens
    batch = next(store.batches(1))
    with torch.no_grad():
        g = torch.Generator().manual_seed(5)
        part = token_term(head, batch, tiny_backbone.logits, chunk_size=64, max_tokens=4, generator=g)
        keep = torch.randperm(int((batch.labels != -100).sum()), generator=torch.Generator().manual_seed(5))[:4]
        tau = head.head(batch.hidden, batch.attention_mask)
        sel = batch.labels != -100
        by_hand = calibration_loss(batch.hidden[sel][keep], head.scale(tau)[sel][keep], batch.labels[sel][keep],
                                   tiny_backbone.logits, loss_type="top-label").loss
        assert part.item() == pytest.approx(by_hand.item(), rel=1e-5)
    # a window: the first positions only, where a causal head's output equals its output on the whole sequence
    with torch.no_grad():
        head = calibrator_for(tiny_backbone, "transformer")
        tau = head.head(batch.hidden, batch.attention_mask)  # (1, T) the whole sequence
        sel = (batch.labels != -100) & (torch.arange(batch.labels.shape[1]) < 20)
        by_hand = calibration_loss(batch.hidden[sel], head.scale(tau)[sel], batch.labels[sel], tiny_backbone.logits,
                                   loss_type="top-label").loss
        part = token_term(head, batch, tiny_backbone.logits, chunk_size=64, window=20)
        assert part.item() == pytest.approx(by_hand.item(), rel=1e-4)
