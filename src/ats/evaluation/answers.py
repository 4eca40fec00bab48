"""Building the backbone's own labelled answers from a task (`ats.training.answers.AnswerSet`): each question run
through the backbone once, exactly as the task runs and scores it, its hidden states and scored positions kept.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import Tensor
from tqdm.auto import tqdm

from ..errors import ATSError
from ..model.layers import LayerCapture, answer_views
from ..model.scale_summary import ScaleSummarySpec, summarize_logits
from ..training.answers import PROBE_VIEWS, AnswerSet
from .tasks.base import chunks
from .tasks.generative import GenerativeTask
from .tasks.scoring import ChoiceItem, LetterItem, PrefixCache


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
        self.probe: list[Tensor] = []  # per question (L, V, H): the probe views of the answered row
        self.probe_row: list[int] = []  # per question: the row of the model's own (uncalibrated) answer

    def add_probe(self, states: Tensor, prompt_last: int, answer_len: int, row: int) -> None:
        """The probe views (`answer_views`) of one question's answered row, from its captured layers (T, L, H)."""
        self.probe.append(answer_views(states, prompt_last, answer_len).to("cpu", self.dtype))  # (L, 3, H)
        self.probe_row.append(row)

    def add_row(self, hidden: Tensor, question: int, positions: list[int], targets: list[int], *,
                log_likelihood: bool = False) -> float | None:
        """One row's hidden states (T, H) (real tokens only) and its scored positions and target ids; with
        `log_likelihood`, returns the row's summed uncalibrated log-likelihood of its targets (a choice's score)."""
        row = len(self.row_lengths)
        self.hidden.append(hidden.to("cpu", self.dtype))
        self.row_lengths.append(hidden.shape[0])
        self.row_question.append(question)
        self.pos_row.extend([row] * len(positions))
        self.pos_in_row.extend(positions)
        self.pos_target.extend(targets)
        if not (targets and targets[0] >= 0) or (self.spec is None and not log_likelihood):
            return None
        z = self.logits_fn(hidden[positions])  # (k, V) from the live logits, before any rounding
        target = torch.tensor(targets, device=z.device)
        if self.spec is not None:
            self.summary.append(summarize_logits(z, target, max_scale=self.spec.max_scale,
                                                 intervals=self.spec.intervals, knee=self.spec.knee).cpu())
        if log_likelihood:
            return float(torch.log_softmax(z.float(), dim=-1).gather(1, target[:, None]).sum())
        return None

    def tensors(self) -> dict[str, Tensor]:
        c_max = max(self.n_choices) if self.n_choices else 0
        letters = torch.full((len(self.answer), c_max if self.letter_logits else 0), float("-inf"))
        for q, z in enumerate(self.letter_logits):
            letters[q, :z.numel()] = z
        lengths = torch.tensor(self.row_lengths, dtype=torch.long)
        extra = {"summary": torch.cat(self.summary)} if self.summary else {}
        if self.probe:
            extra.update(probe=torch.stack(self.probe), probe_row=torch.tensor(self.probe_row, dtype=torch.long))
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
                     summary: ScaleSummarySpec | None = ScaleSummarySpec(), probe_layers: tuple[int, ...] = (),
                     progress: bool = True) -> AnswerSet:
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
        probe_layers: decoder layers whose states are kept at the model's own answer for correctness probes
            (`PROBE_VIEWS` of each question: (Q, L, 3, H)); (): none.
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
    if probe_layers:
        meta.update(probe_layers=list(probe_layers), probe_views=list(PROBE_VIEWS))
    with contextlib.ExitStack() as stack:
        capture = stack.enter_context(LayerCapture(backbone.model, probe_layers)) if probe_layers else None
        if isinstance(task, GenerativeTask):
            kind = "free"
            meta["text"] = _add_free(backbone, task, builder, batch_size, progress, capture)
        elif hasattr(task, "groups"):
            groups = task.groups(backbone.tokenizer)
            items = [it for g in groups for it in g.items]
            kind = "letters" if items and isinstance(items[0], LetterItem) else "choices"
            bar = tqdm(total=len(items), desc=f"answers {task.name}", disable=not progress, leave=False)
            for group in groups:
                prefix = PrefixCache(backbone, group.prefix, capture)
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
        rows = [it.ids for it in batch]
        hidden, _, states = _forward(prefix, rows)  # (B, T, H), (B, T, L, H) or None
        for b, it in enumerate(batch):
            q = len(builder.answer)
            last = len(it.ids) - 1
            if states is not None:  # the letter is predicted at the prompt's last position: no answer token
                builder.add_probe(states[b], last, 0, len(builder.row_lengths))
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
        hidden, _, states = _forward(prefix, rows)  # (C, T, H), (C, T, L, H) or None
        q, start, first_row = len(builder.answer), len(it.context), len(builder.row_lengths)
        scores = [builder.add_row(hidden[b, :len(rows[b])], q, [start - 1 + j for j in range(len(c))], list(c),
                                  log_likelihood=states is not None)
                  for b, c in enumerate(it.choices)]  # position start + j - 1 predicts choice token j
        if states is not None:  # the model's own answer: the choice of highest uncalibrated likelihood
            b = max(range(len(scores)), key=scores.__getitem__)
            builder.add_probe(states[b], start - 1, len(it.choices[b]), first_row + b)
        builder.answer.append(it.answer)
        builder.n_choices.append(len(it.choices))
        bar.update(1)


def _add_free(backbone, task: GenerativeTask, builder: _Builder, batch_size: int, progress: bool,
              capture: LayerCapture | None = None) -> list[str]:
    """Add one row per question (prompt + the scored tokens of the task's own greedy answer) to `builder`, and the
    task judge's verdicts as the answers; returns the answers' text."""
    prefix_ids, prompts = task.prompts(backbone.tokenizer)
    prefix = PrefixCache(backbone, prefix_ids, capture)
    texts = []
    for batch in task.greedy_batches(backbone, prompts, batch_size, progress=progress, desc=f"answers {task.name}"):
        hidden, _, states = _forward(prefix, [p + a for p, a in zip(batch.prompts, batch.tokens)])  # (B, T, H)
        for b, (p, a) in enumerate(zip(batch.prompts, batch.tokens)):
            if states is not None:
                builder.add_probe(states[b], len(p) - 1, len(a), len(builder.row_lengths))
            builder.add_row(hidden[b, :len(p) + len(a)], len(texts) + b, [len(p) - 1 + j for j in range(len(a))], a)
            builder.n_choices.append(0)
        texts.extend(batch.texts)
    correct, _ = task.judge_answers(texts)
    builder.answer.extend(int(bool(c)) for c in correct)
    return texts


def _forward(prefix: PrefixCache, rows: list[list[int]]) -> tuple[Tensor, Tensor, Tensor | None]:
    """(hidden (B, T, H), mask (B, T), the captured layers (B, T, L, H) or None without a capture)."""
    if prefix.capture is None:
        return (*prefix.forward(rows), None)
    return prefix.forward_layers(rows)
