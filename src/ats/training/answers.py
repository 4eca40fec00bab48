"""The backbone's own labelled answers as a training source: what answer-level calibration trains and is judged on.

An `AnswerSet` holds one task's questions exactly as the task scores them (`ats.evaluation.tasks`; the set is built
there, `ats.evaluation.answers.build_answer_set`): the prompt as the task builds it, the model's answer (its letter or
its choice for multiple choice, its greedy answer for free-form), and whether that answer is right, together with the
backbone's hidden states of every row the task runs, so that a calibrator can be trained on, and scored by, answer
confidence without running the backbone again. It is cached once per backbone and task, and fingerprinted
(`ats.workflows.pipeline.prepare_answers`), like the instruction features of `FeatureStore`; a calibrator trains on
answers through the one training loop (`ats.training.answer_objective`).

Three kinds, by the task's scoring rule (`ats.evaluation.tasks.scoring`):
- letters: one row (the prompt, ending with "Answer:"); confidence = softmax over the letter logits scaled by the
  last position's s; the letter logits are stored (C per question).
- choices: one row per choice (context + choice); confidence = softmax over the choices' summed calibrated
  log-likelihoods; prediction = its argmax (a per-token scale can change it, as in the task).
- free: one row (prompt + the scored tokens of the greedy answer); confidence = the mean calibrated probability of
  the answer's tokens; right or wrong by the task's judge (exact match, ROUGE).

Layout of an answer folder (one per task):

    answers.safetensors   hidden (N_tok, H), row_offsets (R+1,), row_question (R,), pos_row (P,), pos_in_row (P,),
                          pos_target (P,), letter_logits (Q, C_max), answer (Q,), n_choices (Q,), and for
                          choices / free-form the scale summary of every scored token, summary (P, D); for
                          correctness probes, probe (Q, L, 3, H): the `PROBE_VIEWS` of L layers at the model's own
                          answer, and probe_row (Q,): the row of that answer (its choice's, for choices)
    answers.json          kind, the task's and backbone's descriptions, sizes, the answers' text (free-form), and
                          the sha256 of the tensors file (written last: marks the folder finished)

A scored position p predicts token `pos_target[p]` from the hidden state at `pos_in_row[p]` of row `pos_row[p]`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save
from torch import Tensor

from ..confidence import mean_token_confidence, softmax_confidence  # noqa: F401 (their home; importable here)
from ..errors import ATSError
from ..io import atomic_file, read_json, write_json
from ..model.layers import ANSWER_VIEWS
from ..model.scale_summary import ScaleSummarySpec, SummaryView
from ..model.token_ce import summary_route, token_ce

FORMAT_VERSION = 1
KINDS = ("letters", "choices", "free")
PROBE_VIEWS = ANSWER_VIEWS  # what a set records for correctness probes at the model's own answer, per layer
TENSORS_NAME, META_NAME = "answers.safetensors", "answers.json"


@dataclass
class AnswerSet:
    """One task's answers and the hidden states of its rows (the module docstring's layout)."""

    kind: str
    tensors: dict[str, Tensor]
    meta: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        """The task's name."""
        return self.meta.get("task", {}).get("name", "answers")

    def __len__(self) -> int:
        return int(self.tensors["answer"].numel())

    @property
    def scale_summary(self) -> ScaleSummarySpec | None:
        """The settings of the scored tokens' scale summary (read from its rows), or None without one."""
        rows = self.tensors.get("summary")
        return SummaryView(rows).spec if rows is not None and rows.shape[0] else None

    def subset(self, questions: list[int]) -> "AnswerSet":
        """The set of only `questions` (increasing indices), rows and positions re-indexed; meta notes the subset."""
        t = self.tensors
        q = torch.as_tensor(questions, dtype=torch.long)
        new_q = torch.full((len(self),), -1, dtype=torch.long)
        new_q[q] = torch.arange(q.numel())
        rows = (new_q[t["row_question"]] >= 0).nonzero().flatten()  # (R',) kept rows, in order
        new_row = torch.full((t["row_question"].numel(),), -1, dtype=torch.long)
        new_row[rows] = torch.arange(rows.numel())
        keep_pos = new_row[t["pos_row"]] >= 0
        offsets = t["row_offsets"]
        lengths = offsets[rows + 1] - offsets[rows]
        hidden = torch.cat([t["hidden"][offsets[r]:offsets[r + 1]] for r in rows.tolist()])
        tensors = {"hidden": hidden, "row_offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                   "row_question": new_q[t["row_question"][rows]], "pos_row": new_row[t["pos_row"][keep_pos]],
                   "pos_in_row": t["pos_in_row"][keep_pos], "pos_target": t["pos_target"][keep_pos],
                   "letter_logits": t["letter_logits"][q],
                   "answer": t["answer"][q], "n_choices": t["n_choices"][q]}
        if "summary" in t:
            tensors["summary"] = t["summary"][keep_pos]
        if "probe" in t:
            tensors.update(probe=t["probe"][q], probe_row=new_row[t["probe_row"][q]])
        meta = {**self.meta, "subset": len(questions)}
        if "text" in meta:
            meta["text"] = [meta["text"][i] for i in questions]
        return AnswerSet(kind=self.kind, tensors=tensors, meta=meta)

    def save(self, folder: str | Path) -> None:
        """Write the folder (tensors first, then the JSON that marks it finished), atomically."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        data = save({k: v.contiguous() for k, v in self.tensors.items()}, metadata={"format": "pt"})
        with atomic_file(folder / TENSORS_NAME, "wb") as f:
            f.write(data)
        write_json(folder / META_NAME, {**self.meta, "kind": self.kind, "format_version": FORMAT_VERSION,
                                        "sha256": hashlib.sha256(data).hexdigest()})

    @classmethod
    def load(cls, folder: str | Path) -> "AnswerSet":
        """Read a finished folder, its checksum verified.

        Raises:
            ATSError: if the folder is unfinished, its checksum differs, or its format is another version.
        """
        folder = Path(folder)
        meta_path, tensors_path = folder / META_NAME, folder / TENSORS_NAME
        if not meta_path.is_file() or not tensors_path.is_file():
            raise ATSError(f"{folder}: not a finished answer folder (no {META_NAME} or {TENSORS_NAME})")
        meta = read_json(meta_path)
        if meta.get("format_version") != FORMAT_VERSION:
            raise ATSError(f"{meta_path}: format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
        data = tensors_path.read_bytes()
        if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
            raise ATSError(f"{tensors_path}: checksum differs from {meta_path} (a corrupt or partial file)")
        return cls(kind=meta["kind"], tensors=load_file(str(tensors_path)), meta=meta)


# --- answer confidence as the tasks compute it, differentiable in the scale ------------------------------------------
def questions_confidence(answers: AnswerSet, questions: Tensor, row_scale: Tensor, position_log_p: Tensor,
                      positions: Tensor) -> tuple[Tensor, Tensor]:
    """(confidence (Q_b,), correct (Q_b,) bool) of the questions `questions`, differentiable w.r.t. the scales.

    Args:
        answers: the set.
        questions: (Q_b,) question indices, increasing.
        row_scale: (P_b,) the calibrated scale s at each of `positions` (letters: used on the letter logits).
        position_log_p: (P_b,) calibrated log-probability of each position's target (choices / free; ignored for
            letters).
        positions: (P_b,) the scored positions of those questions (indices into the set's positions), in order.

    Returns:
        (confidence, correct), by the task's own rule (`ats.evaluation.tasks.scoring`).
    """
    t = answers.tensors
    local = {int(q): i for i, q in enumerate(questions.tolist())}
    pos_question = t["row_question"][t["pos_row"][positions]]  # (P_b,)
    q_local = torch.tensor([local[int(q)] for q in pos_question.tolist()], dtype=torch.long)
    Q = questions.numel()
    if answers.kind == "letters":  # one position per question, in question order
        scores = row_scale[:, None] * t["letter_logits"][questions]  # (Q_b, C_max), -inf stays -inf
        conf, pred = softmax_confidence(scores)
        return conf, pred == t["answer"][questions]
    if answers.kind == "free":
        valid = torch.zeros(Q, positions.numel())
        valid[q_local, torch.arange(positions.numel())] = 1.0
        conf = mean_token_confidence(torch.exp(position_log_p)[None, :], valid)  # (Q_b,)
        return conf, t["answer"][questions].bool()
    # choices: a row's summed log-likelihood, then the softmax over the question's rows
    rows = t["pos_row"][positions]
    first_row = {}
    for r, q in zip(rows.tolist(), q_local.tolist()):
        first_row.setdefault(q, r)
    slot = torch.tensor([r - first_row[q] for r, q in zip(rows.tolist(), q_local.tolist())], dtype=torch.long)
    c_max = int(t["n_choices"][questions].max())
    totals = torch.zeros(Q, c_max, dtype=position_log_p.dtype).index_put((q_local, slot), position_log_p,
                                                                           accumulate=True)
    absent = torch.arange(c_max)[None, :] >= t["n_choices"][questions][:, None]
    conf, pred = softmax_confidence(totals.masked_fill(absent, float("-inf")))
    return conf, pred == t["answer"][questions]


# --- a calibrator's answer confidence -----------------------------------------------------------------------------
def _span(sorted_ids: Tensor, first: int, last: int) -> tuple[int, int]:
    """[start, end) of the entries of a nondecreasing tensor within [first, last]."""
    lo = int(torch.searchsorted(sorted_ids, torch.tensor(first)))
    hi = int(torch.searchsorted(sorted_ids, torch.tensor(last), right=True))
    return lo, hi


def position_scales(calibrator, t: dict, rows: tuple[int, int], positions: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """(scale s (P_b,), penalty ()) at the scored positions [p0, p1) of the rows [r0, r1) of an answer set's tensors.

    None: s = 1. Otherwise the calibrator's own `scales_at` on the rows (the ATS family: its head's per-token s over
    each whole row; Thermometer: one s per row from the prompt's last token, with its prior as the penalty).
    """
    (r0, r1), (p0, p1) = rows, positions
    if calibrator is None:
        return torch.ones(p1 - p0), torch.zeros(())
    offsets = t["row_offsets"]
    local = t["pos_row"][p0:p1] - r0  # (P_b,) row of each position within the batch, nondecreasing
    counts = torch.bincount(local, minlength=r1 - r0)  # (R_b,)
    first = counts.cumsum(0) - counts  # (R_b,) index of each row's first scored position within the batch
    lengths = (offsets[r0 + 1:r1 + 1] - offsets[r0:r1]).tolist()
    hidden = torch.zeros(r1 - r0, max(lengths), t["hidden"].shape[1])  # (R_b, T, H) float32
    mask = torch.zeros(r1 - r0, max(lengths), dtype=torch.long)  # (R_b, T)
    for i, n in enumerate(lengths):
        hidden[i, :n] = t["hidden"][offsets[r0 + i]:offsets[r0 + i] + n]
        mask[i, :n] = 1
    slot = torch.arange(p1 - p0) - first[local]  # (P_b,) rank within its row
    index = torch.zeros(r1 - r0, max(1, int(counts.max())), dtype=torch.long)  # (R_b, K); padding: position 0
    scored = torch.zeros(r1 - r0, index.shape[1], dtype=torch.bool)  # (R_b, K) the real entries of `index`
    index[local, slot] = t["pos_in_row"][p0:p1]
    scored[local, slot] = True
    scale, penalty = calibrator.scales_at(hidden, mask, index, scored)  # (R_b, K), ()
    return scale.float().cpu()[local, slot], penalty.float().cpu()


def scored_confidence(calibrator, answers: AnswerSet, questions: Tensor, logits_fn, *,
                      chunk_size: int = 1024, exact: bool = False) -> tuple[Tensor, Tensor]:
    """(confidence (Q_b,), correct (Q_b,)) of a contiguous run of questions under `calibrator` (None: uncalibrated);
    differentiable w.r.t. the head's parameters when grad is enabled.

    Args:
        calibrator: a calibrator with `scales_at` (the ATS family, Thermometer), or None for s = 1.
        answers: the set.
        questions: (Q_b,) consecutive question indices, increasing.
        logits_fn: the backbone's output layer, h (n, H) -> z (n, V).
        chunk_size: positions per logits chunk (exact route).
        exact: recompute the logits from the stored h even when the set carries the scale summary.

    Returns:
        (confidence, correct), by the task's own rule.
    """
    conf, correct, _ = confidence_and_penalty(calibrator, answers, questions, logits_fn, chunk_size=chunk_size,
                                              exact=exact)
    return conf, correct


def confidence_and_penalty(calibrator, answers: AnswerSet, questions: Tensor, logits_fn, *, chunk_size: int = 1024,
                           exact: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """(confidence, correct, penalty): `scored_confidence` (same arguments) and the calibrator's penalty on these
    questions (`position_scales`), which training adds to the answer loss."""
    t = answers.tensors
    r0, r1 = _span(t["row_question"], int(questions[0]), int(questions[-1]))
    p0, p1 = _span(t["pos_row"], r0, r1 - 1)
    positions = torch.arange(p0, p1)
    offsets = t["row_offsets"]
    pos_row, pos_in_row = t["pos_row"][p0:p1], t["pos_in_row"][p0:p1]
    scale, penalty = position_scales(calibrator, t, (r0, r1), (p0, p1))
    if answers.kind == "letters":
        log_p = torch.zeros_like(scale)
    else:
        summary = t["summary"][p0:p1] if summary_route(answers.scale_summary, exact=exact) else None
        h = t["hidden"][offsets[pos_row] + pos_in_row].float() if summary is None else None  # (P_b, H)
        log_p = -token_ce(h, scale, t["pos_target"][p0:p1], logits_fn, chunk_size=chunk_size,
                          summary=summary).ce_label
    return (*questions_confidence(answers, questions, scale, log_p, positions), penalty)


@torch.no_grad()
def score_answers(calibrator, answers: AnswerSet, logits_fn, *, batch_size: int = 32,
                  exact: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """(confidence (Q,), correct (Q,)) of every question of `answers` under `calibrator` (None: uncalibrated).

    Args:
        calibrator: an ATS-family calibrator, Thermometer, or None.
        answers: the set.
        logits_fn: the backbone's output layer.
        batch_size: questions per head pass.
        exact: the exact route even when the set carries the scale summary.

    Returns:
        float64 confidences and bool correctness, in question order.
    """
    if calibrator is not None and calibrator.answer_probe:  # the probe's P(correct) of the model's own answers
        conf, correct = score_answers(None, answers, logits_fn, batch_size=batch_size, exact=exact)
        return calibrator.answer_confidence(probe_views(answers, calibrator.layers), conf), correct
    if calibrator is not None:
        calibrator.trainable.eval()
    conf, correct = [], []
    for start in range(0, len(answers), batch_size):
        q = torch.arange(start, min(start + batch_size, len(answers)))
        c, ok = scored_confidence(calibrator, answers, q, logits_fn, exact=exact)
        conf.append(c.double().numpy())
        correct.append(ok.numpy())
    return np.concatenate(conf), np.concatenate(correct)


def probe_views(answers: AnswerSet, layers) -> Tensor:
    """(Q, len(layers), 3, H): the recorded probe views of `layers` (decoder-layer indices) at each answer.

    Raises:
        ATSError: if the set records no probe views, or not of every one of `layers`.
    """
    recorded = list(answers.meta.get("probe_layers", []))
    if "probe" not in answers.tensors:
        raise ATSError(f"answers {answers.name!r}: no probe views recorded (rebuild them with probe layers)")
    missing = [layer for layer in layers if layer not in recorded]
    if missing:
        raise ATSError(f"answers {answers.name!r}: probe layers {missing} are not recorded (recorded: {recorded})")
    return answers.tensors["probe"][:, [recorded.index(layer) for layer in layers]]
