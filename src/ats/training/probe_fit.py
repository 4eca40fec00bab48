"""Fitting a correctness probe (`ats.calibrators.probe.CorrectnessProbe`) on the backbone's own labelled answers.

The probe's layers, views and L2 strength are chosen by leaving each pool task out in turn: fit on the other tasks,
score the left-out one by the log loss, and take the smallest setting whose mean left-out loss is within one
standard error of the lowest (`_choose`; the probe's known weakness is transfer to a new task, so that is what the
choice measures; no reported task is ever read). The settings include
the confidence alone (no layers: Platt scaling of the answer's uncalibrated confidence), so hidden states are read
only where they beat it on tasks they were not fitted on. The L2 penalty shrinks hidden-state weights only: the
confidence's weight is left free (its column is scaled by `FREE_SCALE` before sklearn's uniformly penalized fit,
which divides its penalty by `FREE_SCALE**2`), so a strong penalty leaves the confidence, not a constant. The chosen
setting is then fitted on every pool task. Its token half, one temperature, is fitted by NLL on the right choices'
tokens of the pool's multiple-choice sets (reference text, as instruction tokens are; the greedy tokens of free-form
answers would drive it to zero), through their stored scale summary.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import roc_auc_score
from torch import Tensor
from tqdm.auto import tqdm

from ..calibrators.probe import VIEWS, CorrectnessProbe
from ..errors import ATSError
from ..log_loss import binary_log_loss
from .answers import AnswerSet, probe_views, score_answers

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ProbeGrid:
    """The settings tried when a probe's options are left empty."""

    layer_sets: tuple[str, ...] = ("none", "middle", "three-quarters", "last", "spread", "all")
    views: tuple[tuple[str, ...], ...] = (("prompt_last",), ("answer_mean",), VIEWS)
    c: tuple[float, ...] = (0.003, 0.03, 0.3)


FREE_SCALE = 1e3  # the confidence column's scale in the fit: its L2 penalty is 1e-6 of a hidden unit's


def layer_set(name: str, candidates: Sequence[int]) -> list[int]:
    """A named subset of the recorded layers: none (the confidence alone), middle, three-quarters, last, spread
    (those three) or all."""
    n = len(candidates)
    middle, late = candidates[max(0, n // 2 - 1)], candidates[max(0, (3 * n) // 4 - 1)]
    sets = {"none": [], "middle": [middle], "three-quarters": [late], "last": [candidates[-1]],
            "spread": sorted({middle, late, candidates[-1]}), "all": list(candidates)}
    if name not in sets:
        raise ATSError(f"probe layer set {name!r}: expected one of {', '.join(sets)}")
    return sets[name]


def probe_inputs(answers: AnswerSet, logits_fn) -> tuple[Tensor, np.ndarray, np.ndarray]:
    """(views (Q, L, 3, H) of every recorded layer, uncalibrated confidence (Q,), correct (Q,)) of a set's answers.

    Raises:
        ATSError: if the set records no probe views (made with `probe_layers=()`).
    """
    views = probe_views(answers, answers.meta.get("probe_layers", []))
    confidence, correct = score_answers(None, answers, logits_fn)
    return views, confidence, correct


def _standardize(x: Tensor) -> tuple[Tensor, Tensor]:
    mean = x.mean(0)
    scale = x.std(0)
    return mean, torch.where(scale > 1e-8, scale, torch.ones_like(scale))


class _Design:
    """Standardized features (N, D) ready for the logistic fits of several C: the last one (the confidence) nearly
    free when `free_last`; with more penalized features than answers (P > N: thousands of hidden units, hundreds of
    answers) reduced, exactly, to their thin SVD from the answers' Gram matrix (N^2 P, not a wide SVD): the optimal
    penalized weight lies in the span of the answers' feature rows (moving it out of that span changes no logit and
    adds penalty), so w = V u with u fitted on X V = U S (N, r), whose penalty |u|^2 equals |w|^2."""

    def __init__(self, x: Tensor, y: np.ndarray, *, free_last: bool) -> None:
        if len(set(y.tolist())) < 2:
            raise ATSError(f"probe: the answers are all {'right' if y.all() else 'wrong'}; nothing to tell apart")
        self.y = y.astype(int)
        self.mean, self.scale = _standardize(x)
        z = ((x - self.mean) / self.scale).double()  # (N, D)
        free = 1 if free_last else 0
        hidden, self.basis = z[:, :z.shape[1] - free], None  # (N, P) the penalized features
        if hidden.shape[1] > hidden.shape[0]:
            eigenvalues, u = torch.linalg.eigh(hidden @ hidden.T)  # (N,), (N, N) ascending
            keep = eigenvalues > eigenvalues[-1] * 1e-10  # rank r (standardized answers: at most N - 1)
            sv, u = eigenvalues[keep].sqrt(), u[:, keep]  # (r,), (N, r)
            hidden, self.basis = u * sv, (hidden.T @ u / sv).T  # (N, r) = X V and V^T (r, P)
        self.penalized = hidden.shape[1]
        self.design = torch.cat([hidden, z[:, z.shape[1] - free:] * FREE_SCALE], dim=1).numpy()  # (N, r + free)

    def fit(self, c: float) -> tuple[Tensor, float, Tensor, Tensor]:
        """(weight (D,), bias, mean (D,), scale (D,)): the weights L2-penalized with inverse strength `c`."""
        # Newton steps with a Cholesky solve: ~10 iterations where lbfgs takes thousands on this design (its
        # free column, scaled by FREE_SCALE, makes it ill-conditioned), 15-25x faster at 1,000 answers x 1,000
        # columns; a tight optimum, checked against an independent fit in the tests.
        model = LogisticRegression(C=c, solver="newton-cholesky", max_iter=200, tol=1e-8)
        model.fit(self.design, self.y)
        coef = torch.from_numpy(model.coef_[0])  # (r + free,)
        weight = coef[:self.penalized] if self.basis is None else self.basis.T @ coef[:self.penalized]  # (P,)
        weight = torch.cat([weight, coef[self.penalized:] * FREE_SCALE])  # (D,) on the standardized features
        return weight.float(), float(model.intercept_[0]), self.mean, self.scale


def _fit_logistic(x: Tensor, y: np.ndarray, c: float, *, free_last: bool) -> tuple[Tensor, float, Tensor, Tensor]:
    """(weight (D,), bias, mean (D,), scale (D,)) of the logistic regression `_Design` describes."""
    return _Design(x, y, free_last=free_last).fit(c)


def _probe(layers, views, c, *, with_confidence: bool, info: dict) -> CorrectnessProbe:
    return CorrectnessProbe(layers=list(layers), views=list(views), c=c, with_confidence=with_confidence, **info)


def _fitted(probe: CorrectnessProbe, views: Tensor, confidence: np.ndarray, correct: np.ndarray,
            design: _Design | None = None) -> CorrectnessProbe:
    """`probe` with its logistic regression fitted on these answers (on `design` when given: their features)."""
    design = design or _Design(probe.features(views, confidence), correct, free_last=probe.with_confidence)
    probe.set_weights(*design.fit(probe.c))
    probe.temperature = probe.temperature or 1.0
    return probe


def gold_choice_summary(sets: Sequence[AnswerSet]) -> Tensor | None:
    """The scale summary rows (N, D) of the right choices' tokens of the multiple-choice ('choices') sets."""
    rows = []
    for answers in sets:
        t = answers.tensors
        if answers.kind != "choices" or "summary" not in t:
            continue
        first = torch.searchsorted(t["row_question"], torch.arange(len(answers)))  # (Q,) rows are in question order
        gold_row = first + t["answer"]  # (Q,) the right choice's row
        rows.append(t["summary"][(t["pos_row"][:, None] == gold_row[None, :]).any(1)])
    return torch.cat(rows) if rows else None


def fit_probe(sets: Mapping[str, AnswerSet], logits_fn, backbone_info: dict, *, grid: ProbeGrid = ProbeGrid(),
              layers: Sequence[int] = (), views: Sequence[str] = (), c: float = 0.0, with_confidence: bool = True,
              progress: bool = True) -> CorrectnessProbe:
    """A probe fitted on the answers of `sets` (task name -> answer set with probe views), its empty options chosen
    on left-out tasks (the module docstring); its `selection` records every setting's left-out scores.

    Args:
        sets: the pool's answer sets, by task (at least two to leave one out; one set is split in five folds).
        logits_fn: the backbone's output layer (the uncalibrated confidence of sets without a scale summary).
        backbone_info: {"hidden_size", "base_model", "revision"} of the backbone.
        grid: the settings tried for the options left empty.
        layers, views, c: fixed options instead of chosen ones.
        with_confidence: also read the answer's uncalibrated confidence.
        progress: show a progress bar over the settings.

    Returns:
        The fitted probe.
    """
    inputs = {name: probe_inputs(answers, logits_fn) for name, answers in sets.items()}
    recorded = [list(a.meta.get("probe_layers", [])) for a in sets.values()]
    if any(r != recorded[0] for r in recorded):
        raise ATSError(f"probe: the answer sets record different layers: {recorded}")
    candidates = recorded[0]
    layer_options = [list(layers)] if layers else [layer_set(n, candidates) for n in grid.layer_sets]
    missing = [layer for layer in layer_options[0] if layer not in candidates] if layers else []
    if missing:
        raise ATSError(f"probe layers {missing} are not recorded in the answers (recorded: {candidates})")
    cs = [c] if c else list(grid.c)
    reading = [lay for lay in layer_options if lay]
    settings = list(itertools.product(reading, [list(views)] if views else [list(v) for v in grid.views], cs))
    if with_confidence and len(reading) < len(layer_options):  # the confidence alone: one setting (C shrinks nothing)
        settings.insert(0, ([], [], cs[0]))
    if not settings:
        raise ATSError("probe: with_confidence=False and no layers to read: the probe would read nothing")
    folds = _folds(inputs)
    results = {}  # (setting index, fold) -> (left-out log loss, AUROC)
    groups = itertools.groupby(enumerate(settings), key=lambda s: (s[1][0], s[1][1]))  # same features, several C
    for (lay, vws), group in tqdm(list((k, list(g)) for k, g in groups), desc="probe settings",
                                  disable=not progress or len(settings) == 1):
        idx = [candidates.index(layer) for layer in lay]
        for held, (train, test) in folds.items():
            views_, conf_, ok_ = _join(inputs, train, idx)
            shape = _probe(lay, vws, 1.0, with_confidence=with_confidence, info=backbone_info)
            design = _Design(shape.features(views_, conf_), ok_, free_last=with_confidence)
            v, conf, ok = _join(inputs, test, idx)
            for i, (_, _, c_) in group:
                probe = _fitted(_probe(lay, vws, c_, with_confidence=with_confidence, info=backbone_info),
                                views_, conf_, ok_, design)
                p = probe.answer_confidence(v, conf)
                results[i, held] = (float(np.mean(binary_log_loss(p, ok))),
                                    roc_auc_score(ok, p) if 0 < ok.sum() < ok.size else np.nan)
    scores = []
    for i, (lay, vws, c_) in enumerate(settings):
        losses = [results[i, held][0] for held in folds]
        scores.append({"layers": lay, "views": vws, "c": c_, "left_out_log_loss": float(np.mean(losses)),
                       "left_out_auroc": float(np.nanmean([results[i, held][1] for held in folds])),
                       "per_fold_log_loss": dict(zip(folds, losses))})
    best = _choose(scores)
    idx = [candidates.index(layer) for layer in best["layers"]]
    probe = _fitted(_probe(best["layers"], best["views"], best["c"], with_confidence=with_confidence,
                           info=backbone_info), *(_join(inputs, list(inputs), idx)))
    summary = gold_choice_summary(list(sets.values()))
    temperature = "gold choices' tokens" if summary is not None and probe._fit_summary(summary) else "none (T = 1)"
    probe.selection = {"criterion": "the smallest setting within one standard error of the lowest mean left-out "
                                    "log loss (leave one pool task out)", "chosen": best,
                       "settings": scores, "tasks": {n: int(len(i[2])) for n, i in inputs.items()},
                       "recorded_layers": candidates, "temperature_fitted_on": temperature}
    logger.info("probe: layers %s, views %s, C %g (left-out log loss %.4f, AUROC %.3f); temperature %.4g",
                best["layers"], best["views"], best["c"], best["left_out_log_loss"], best["left_out_auroc"],
                probe.temperature)
    return probe


def _size(setting: dict) -> tuple[int, float]:
    """How much a setting reads: features (layers x views), then C (a larger C shrinks less)."""
    return len(setting["layers"]) * len(setting["views"]), setting["c"]


def _choose(scores: list[dict]) -> dict:
    """The smallest setting (`_size`) whose mean left-out log loss is within one standard error of the lowest one
    (the one-standard-error rule, Hastie et al., ESL 7.10; the error of the best setting's mean over the left-out
    folds): a setting that reads more must beat a smaller one by more than the left-out tasks' spread, so near-ties
    go to the confidence alone."""
    best = min(scores, key=lambda s: s["left_out_log_loss"])
    losses = np.array(list(best["per_fold_log_loss"].values()))  # (F,)
    error = losses.std(ddof=1) / np.sqrt(losses.size) if losses.size > 1 else 0.0
    return min((s for s in scores if s["left_out_log_loss"] <= best["left_out_log_loss"] + error), key=_size)


def _folds(inputs: dict) -> dict[str, tuple[list, list]]:
    """name -> (training keys, test keys): each task left out; a single task: five folds of its questions."""
    if len(inputs) >= 2:
        return {name: ([n for n in inputs if n != name], [name]) for name in inputs}
    (name, (views, conf, ok)), = inputs.items()
    order = np.random.default_rng(0).permutation(len(ok))
    parts = np.array_split(order, 5)
    for k, part in enumerate(parts):
        inputs[f"{name}#{k}"] = (views[torch.as_tensor(part)], conf[part], ok[part])
    keys = [f"{name}#{k}" for k in range(len(parts))]
    del inputs[name]
    return {k: ([j for j in keys if j != k], [k]) for k in keys}


def _join(inputs: dict, keys: list, layer_index: list[int]) -> tuple[Tensor, np.ndarray, np.ndarray]:
    """The views at `layer_index`, confidences and correctness of the tasks `keys`, concatenated."""
    return (torch.cat([inputs[k][0][:, layer_index] for k in keys]), np.concatenate([inputs[k][1] for k in keys]),
            np.concatenate([inputs[k][2] for k in keys]))
