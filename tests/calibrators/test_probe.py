"""The correctness probe: a planted signal in one layer's view is found by the left-out-task choice and ranks new
answers where the uncalibrated confidence cannot; the fit meets the logistic regression's optimality conditions
(computed here by hand); saving, loading and the backbone check."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ats.calibrators import load_calibrator
from ats.calibrators.probe import VIEWS, CorrectnessProbe
from ats.errors import ATSError
from ats.training.answers import AnswerSet
from ats.training.probe_fit import FREE_SCALE, ProbeGrid, fit_probe, gold_choice_summary, probe_inputs

LAYERS = [1, 3, 5, 7]  # recorded; the signal is planted in layer 5 ("three-quarters"), view prompt_last
INFO = {"hidden_size": 6, "base_model": "tiny", "revision": "r0"}


def planted(n: int, seed: int, shift: float = 0.0) -> AnswerSet:
    """Letter answers whose correctness is the sign of unit 0 of layer 5's prompt_last view (plus noise), with
    uncalibrated confidences that carry no signal; `shift` moves every view (another task's distribution)."""
    g = torch.Generator().manual_seed(seed)
    probe = torch.randn(n, len(LAYERS), len(VIEWS), 6, generator=g) + shift
    right = (probe[:, 2, 0, 0] - shift + 0.3 * torch.randn(n, generator=g)) > 0
    letters = torch.randn(n, 3, generator=g)
    top = letters.argmax(1)
    answer = torch.where(right, top, (top + 1) % 3)
    tensors = {"hidden": torch.zeros(n, 6), "row_offsets": torch.arange(n + 1), "row_question": torch.arange(n),
               "pos_row": torch.arange(n), "pos_in_row": torch.zeros(n, dtype=torch.long),
               "pos_target": torch.full((n,), -1), "letter_logits": letters, "answer": answer,
               "n_choices": torch.full((n,), 3), "probe": probe, "probe_row": torch.arange(n)}
    return AnswerSet(kind="letters", tensors=tensors, meta={"task": {"name": f"planted{seed}"},
                                                            "probe_layers": LAYERS, "probe_views": list(VIEWS)})


def auroc(score: np.ndarray, correct: np.ndarray) -> float:
    """By hand: the share of (right, wrong) pairs ranked right above wrong, ties counting half."""
    right, wrong = score[correct], score[~correct]
    return float(((right[:, None] > wrong[None, :]) + 0.5 * (right[:, None] == wrong[None, :])).mean())


@pytest.fixture(scope="module")
def fitted():
    sets = {f"task{k}": planted(150, k, shift=0.5 * k) for k in range(3)}
    grid = ProbeGrid(layer_sets=("none", "middle", "three-quarters", "all"), views=(("prompt_last",), ("answer_mean",)),
                     c=(0.01, 1.0))
    return fit_probe(sets, None, INFO, grid=grid, progress=False), sets


def test_the_left_out_choice_finds_the_planted_layer_and_view_and_ranks_new_answers(fitted):
    probe, _ = fitted
    assert 5 in probe.layers and probe.views == ["prompt_last"]
    chosen = probe.selection["chosen"]
    assert chosen in probe.selection["settings"]
    assert len(probe.selection["settings"]) == 3 * 2 * 2 + 1 and set(chosen["per_fold_log_loss"]) == {"task0", "task1",
                                                                                                        "task2"}
    assert probe.selection["settings"][0]["layers"] == []  # the confidence alone was tried, and lost
    views, conf, correct = probe_inputs(planted(400, 9, shift=0.25), None)
    p = probe.answer_confidence(views[:, [LAYERS.index(layer) for layer in probe.layers]], conf)
    assert auroc(p, correct) > 0.9 and abs(auroc(conf, correct) - 0.5) < 0.1


def test_the_fit_meets_the_l2_logistic_regressions_optimality_conditions(fitted):
    probe, sets = fitted
    index = [LAYERS.index(layer) for layer in probe.layers]
    parts = [probe_inputs(s, None) for s in sets.values()]
    views = torch.cat([v[:, index] for v, _, _ in parts])
    conf = np.concatenate([c for _, c, _ in parts])
    y = np.concatenate([ok for _, _, ok in parts]).astype(float)
    x = ((probe.features(views, conf) - probe.mean) / probe.scale).double().numpy()
    p = probe.answer_confidence(views, conf)
    w = probe.weight.double().numpy()
    # the objective: 0.5 sum(w_j^2 / k_j^2) + C sum(log loss), k = 1 for hidden units and FREE_SCALE for the
    # confidence (last); its gradient vanishes at the optimum (bias unpenalized)
    k = np.ones_like(w)
    k[-1] = FREE_SCALE
    grad_w = w / k**2 + probe.c * x.T @ (p - y)
    assert np.abs(grad_w).max() < 1e-3 * max(1.0, np.abs(w).max())
    assert abs(float(np.sum(p - y))) < 1e-3 * len(y)
    np.testing.assert_allclose(probe.mean.numpy(), probe.features(views, conf).mean(0).numpy(), atol=1e-5)


def test_a_saved_probe_loads_equal_and_refuses_another_backbone(fitted, tmp_path):
    probe, _ = fitted
    views, conf, _ = probe_inputs(planted(50, 11), None)
    views = views[:, [LAYERS.index(layer) for layer in probe.layers]]
    probe.save_pretrained(tmp_path / "probe")
    loaded = load_calibrator(tmp_path / "probe")
    assert isinstance(loaded, CorrectnessProbe) and loaded.temperature == probe.temperature
    np.testing.assert_array_equal(loaded.answer_confidence(views, conf), probe.answer_confidence(views, conf))
    assert loaded.selection["chosen"]["layers"] == probe.layers and loaded.digest() == probe.digest()
    z = torch.randn(2, 5, 11)
    torch.testing.assert_close(loaded.apply(z), z / probe.temperature)  # tokens: the temperature

    class Other:
        name, revision, hidden_size = "tiny", "r1", 6
    with pytest.raises(ATSError, match=r"probe fitted on revision 'r0', backbone tiny has 'r1'"):
        loaded.check_backbone(Other())


def test_bad_options_and_sets_without_views_are_refused():
    with pytest.raises(ATSError, match=r"probe views \['middle'\]"):
        CorrectnessProbe(views=["middle"])
    bare = planted(10, 0)
    del bare.tensors["probe"]
    with pytest.raises(ATSError, match="answers 'planted0': no probe views recorded"):
        probe_inputs(bare, None)
    with pytest.raises(ATSError, match=r"probe layers \[4\] are not recorded"):
        fit_probe({"a": planted(30, 0), "b": planted(30, 1)}, None, INFO, layers=[4], progress=False)


def test_the_temperature_reads_only_the_right_choices_tokens():
    # two questions of 2 and 3 choices; rows 0-1 and 2-4; right answers: choice 1 (row 1) and choice 0 (row 2)
    summary = torch.arange(8, dtype=torch.float64)[:, None].repeat(1, 3)
    t = {"row_question": torch.tensor([0, 0, 1, 1, 1]), "answer": torch.tensor([1, 0]),
         "pos_row": torch.tensor([0, 1, 1, 2, 3, 3, 4, 4]), "summary": summary}
    rows = gold_choice_summary([AnswerSet(kind="choices", tensors=t)])
    assert rows[:, 0].tolist() == [1.0, 2.0, 3.0]


def confident(n: int, seed: int) -> AnswerSet:
    """Letter answers right with probability sigmoid(3 logit(confidence) - 1): the uncalibrated confidence carries
    the signal, every probe view is noise."""
    answers = planted(n, seed)
    g = torch.Generator().manual_seed(100 + seed)
    letters = torch.randn(n, 3, generator=g) * torch.rand(n, 1, generator=g) * 4  # sharp and flat rows
    conf = letters.softmax(1).max(1).values.double()
    right = torch.rand(n, generator=g, dtype=torch.float64) < torch.sigmoid(3 * torch.logit(conf) - 1)
    top = letters.argmax(1)
    answers.tensors.update(letter_logits=letters, answer=torch.where(right, top, (top + 1) % 3),
                           probe=torch.randn(n, len(LAYERS), len(VIEWS), 6, generator=g))
    return answers


def test_without_signal_in_the_layers_the_choice_is_platt_scaling_of_the_confidence():
    sets = {f"task{k}": confident(200, k) for k in range(3)}
    grid = ProbeGrid(layer_sets=("none", "middle", "all"), views=(("prompt_last",),), c=(0.01, 1.0))
    probe = fit_probe(sets, None, INFO, grid=grid, progress=False)
    assert probe.layers == [] and probe.views == []
    # independently: an unpenalized logistic regression of correctness on logit(confidence), by Newton's method
    parts = [probe_inputs(s, None) for s in sets.values()]
    conf = np.concatenate([c for _, c, _ in parts])
    y = np.concatenate([ok for _, _, ok in parts]).astype(float)
    x = np.stack([np.log(conf / (1 - conf)), np.ones_like(conf)], 1)  # (N, 2)
    beta = np.zeros(2)
    for _ in range(50):
        p = 1 / (1 + np.exp(-x @ beta))
        beta -= np.linalg.solve(x.T @ (x * (p * (1 - p))[:, None]), x.T @ (p - y))
    views = torch.zeros(len(conf), 0, len(VIEWS), 6)
    np.testing.assert_allclose(probe.answer_confidence(views, conf), 1 / (1 + np.exp(-x @ beta)), atol=2e-4)
    assert 2.0 < beta[0] < 4.0  # the planted slope 3, recovered: not shrunk


@pytest.mark.parametrize("free_last", [True, False])
def test_more_features_than_answers_fit_through_the_svd_to_the_same_optimum(free_last):
    from sklearn.linear_model import LogisticRegression

    from ats.training.probe_fit import _fit_logistic

    g = torch.Generator().manual_seed(3)
    x = torch.randn(40, 120, generator=g) * (1 + torch.rand(120, generator=g))  # N = 40 answers, D = 120
    y = (x[:, 0] + x[:, -1] + torch.randn(40, generator=g) > 0).numpy()
    weight, bias, mean, scale = _fit_logistic(x, y, 0.05, free_last=free_last)
    z = ((x - mean) / scale).double()
    k = torch.ones(120, dtype=torch.float64)
    k[-1] = FREE_SCALE if free_last else 1.0
    direct = LogisticRegression(C=0.05, max_iter=20000, tol=1e-10).fit((z * k).numpy(), y.astype(int))
    np.testing.assert_allclose(weight.double().numpy(), direct.coef_[0] * k.numpy(), atol=1e-4)
    assert bias == pytest.approx(float(direct.intercept_[0]), abs=1e-4)
