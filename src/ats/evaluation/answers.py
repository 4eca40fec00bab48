"""The backbone's own labelled answers, cached once: what answer-level calibration trains and is judged on.

An `AnswerSet` holds one task's questions exactly as the task scores them (`ats.evaluation.tasks`): the prompt as the
task builds it, the model's answer (its letter or its choice for multiple choice, its greedy answer for free-form),
and whether that answer is right, together with the backbone's hidden states of every row the task runs, so that a
calibration head can be trained on, and scored by, answer confidence without running the backbone again.

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
                          choices / free-form the scale summary of every scored token, summary (P, D)
    answers.json          kind, the task's and backbone's descriptions, sizes, the answers' text (free-form), and
                          the sha256 of the tensors file (written last: marks the folder finished)

A scored position p predicts token `pos_target[p]` from the hidden state at `pos_in_row[p]` of row `pos_row[p]`.
"""

from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file, save
from torch import Tensor
from tqdm.auto import tqdm

from ..errors import ATSError
from ..io import atomic_file, read_json, write_json
from ..model.scale_summary import ScaleSummarySpec, summarize_logits
from .tasks.base import chunks
from .tasks.generative import GenerativeTask
from .tasks.scoring import ChoiceItem, LetterItem, PrefixCache

FORMAT_VERSION = 1
KINDS = ("letters", "choices", "free")
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


# --- building a set from a task --------------------------------------------------------------------------------------
class _Builder:
    """Accumulates rows, scored positions and questions while a task's questions run through the backbone."""

    def __init__(self, dtype: torch.dtype, logits_fn=None, spec: ScaleSummarySpec | None = None) -> None:
        self.dtype = dtype
        self.logits_fn, self.spec = logits_fn, spec
        self.summary: list[Tensor] = []
        self.hidden: list[Tensor] = []
        self.row_lengths: list[int] = []
        self.row_question: list[int] = []
        self.pos_row: list[int] = []
        self.pos_in_row: list[int] = []
        self.pos_target: list[int] = []
        self.letter_logits: list[Tensor] = []
        self.answer: list[int] = []
        self.n_choices: list[int] = []

    def add_row(self, hidden: Tensor, question: int, positions: list[int], targets: list[int]) -> None:
        """One row's hidden states (T, H) (real tokens only) and its scored positions and target ids."""
        row = len(self.row_lengths)
        self.hidden.append(hidden.to("cpu", self.dtype))
        self.row_lengths.append(hidden.shape[0])
        self.row_question.append(question)
        self.pos_row.extend([row] * len(positions))
        self.pos_in_row.extend(positions)
        self.pos_target.extend(targets)
        if self.spec is not None and targets and targets[0] >= 0:  # from the live logits, before any rounding
            z = self.logits_fn(hidden[positions])  # (k, V)
            self.summary.append(summarize_logits(z, torch.tensor(targets, device=z.device),
                                                 max_scale=self.spec.max_scale, intervals=self.spec.intervals,
                                                 knee=self.spec.knee).cpu())

    def tensors(self) -> dict[str, Tensor]:
        c_max = max(self.n_choices) if self.n_choices else 0
        letters = torch.full((len(self.answer), c_max if self.letter_logits else 0), float("-inf"))
        for q, z in enumerate(self.letter_logits):
            letters[q, :z.numel()] = z
        lengths = torch.tensor(self.row_lengths, dtype=torch.long)
        extra = {"summary": torch.cat(self.summary)} if self.summary else {}
        return {**extra, "hidden": torch.cat(self.hidden).contiguous(),
                "row_offsets": torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)]),
                "row_question": torch.tensor(self.row_question, dtype=torch.long),
                "pos_row": torch.tensor(self.pos_row, dtype=torch.long),
                "pos_in_row": torch.tensor(self.pos_in_row, dtype=torch.long),
                "pos_target": torch.tensor(self.pos_target, dtype=torch.long),
                "letter_logits": letters,
                "answer": torch.tensor(self.answer, dtype=torch.long),
                "n_choices": torch.tensor(self.n_choices, dtype=torch.long)}


@torch.no_grad()
def build_answer_set(backbone, task, *, dtype: str = "float16", batch_size: int = 8,
                     summary: ScaleSummarySpec | None = ScaleSummarySpec(), progress: bool = True) -> AnswerSet:
    """Run `task`'s questions through the backbone once, as the task runs them, and keep what answer-level
    calibration needs (the module docstring).

    Args:
        backbone: the frozen backbone.
        task: a task with `groups(tokenizer)` (letters / choices: MMLU, mc:PATH, TruthfulQA MC1) or a
            `GenerativeTask` (TriviaQA, NQ-open, TruthfulQA gen).
        dtype: the stored hidden states' dtype ("float16", "bfloat16" or "float32").
        batch_size: questions per forward pass (letters) or per generation batch (free-form).
        summary: the scale summary of every scored token (`ats.model.scale_summary`), so that training and scoring
            never touch the vocabulary; None: none (the exact route recomputes the logits from the stored h).
        progress: show a progress bar.

    Returns:
        The answer set (not saved).

    Raises:
        ATSError: if the dtype is unknown or the task has neither item groups nor generation.
    """
    store_dtype = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}.get(dtype)
    if store_dtype is None:
        raise ATSError(f"answer dtype must be float16, bfloat16 or float32, got {dtype!r}")
    builder = _Builder(store_dtype, backbone.logits, summary)
    meta = {"task": task.describe(), "backbone": backbone.describe(), "dtype": dtype,
            "summary": None if summary is None else dataclasses.asdict(summary)}
    if isinstance(task, GenerativeTask):
        kind = "free"
        meta["text"] = _add_free(backbone, task, builder, batch_size, progress)
    elif hasattr(task, "groups"):
        groups = task.groups(backbone.tokenizer)
        items = [it for g in groups for it in g.items]
        kind = "letters" if items and isinstance(items[0], LetterItem) else "choices"
        bar = tqdm(total=len(items), desc=f"answers {task.name}", disable=not progress, leave=False)
        for group in groups:
            prefix = PrefixCache(backbone, group.prefix)
            if kind == "letters":
                _add_letters(backbone, prefix, group.items, builder, batch_size, bar)
            else:
                _add_choices(prefix, group.items, builder, bar)
        bar.close()
    else:
        raise ATSError(f"task {task.name!r} has no item groups and no generation: it cannot give answers")
    return AnswerSet(kind=kind, tensors=builder.tensors(), meta=meta)


def _add_letters(backbone, prefix: PrefixCache, items: list[LetterItem], builder: _Builder, batch_size: int,
                 bar) -> None:
    for batch in chunks(items, batch_size):
        hidden, _ = prefix.forward([it.ids for it in batch])  # (B, T, H)
        for b, it in enumerate(batch):
            q = len(builder.answer)
            last = len(it.ids) - 1
            builder.add_row(hidden[b, :len(it.ids)], q, [last], [-1])
            builder.letter_logits.append(backbone.logits(hidden[b, last]).float()[it.letters].cpu())
            builder.answer.append(it.answer)
            builder.n_choices.append(len(it.letters))
        bar.update(len(batch))


def _add_choices(prefix: PrefixCache, items: list[ChoiceItem], builder: _Builder, bar) -> None:
    for it in items:
        if any(len(c) == 0 for c in it.choices):
            raise ATSError("a choice has no tokens")
        rows = [it.context + c for c in it.choices]
        hidden, _ = prefix.forward(rows)  # (C, T, H)
        q, start = len(builder.answer), len(it.context)
        for b, c in enumerate(it.choices):  # position start + j - 1 predicts choice token j
            builder.add_row(hidden[b, :len(rows[b])], q, [start - 1 + j for j in range(len(c))], list(c))
        builder.answer.append(it.answer)
        builder.n_choices.append(len(it.choices))
        bar.update(1)


def _add_free(backbone, task: GenerativeTask, builder: _Builder, batch_size: int, progress: bool) -> list[str]:
    """Add one row per question (prompt + the scored tokens of the task's own greedy answer) to `builder`, and the
    task judge's verdicts as the answers; returns the answers' text."""
    prefix_ids, prompts = task.prompts(backbone.tokenizer)
    prefix = PrefixCache(backbone, prefix_ids)
    texts = []
    for batch in task.greedy_batches(backbone, prompts, batch_size, progress=progress, desc=f"answers {task.name}"):
        hidden, _ = prefix.forward([p + a for p, a in zip(batch.prompts, batch.tokens)])  # (B, T, H)
        for b, (p, a) in enumerate(zip(batch.prompts, batch.tokens)):
            builder.add_row(hidden[b, :len(p) + len(a)], len(texts) + b, [len(p) - 1 + j for j in range(len(a))], a)
            builder.n_choices.append(0)
        texts.extend(batch.texts)
    correct, _ = task.judge_answers(texts)
    builder.answer.extend(int(bool(c)) for c in correct)
    return texts


# --- answer confidence as the tasks compute it, differentiable in the scale ------------------------------------------
def answer_confidence(answers: AnswerSet, questions: Tensor, row_scale: Tensor, position_log_p: Tensor,
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
    from .tasks.scoring import mean_token_confidence, softmax_confidence

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

