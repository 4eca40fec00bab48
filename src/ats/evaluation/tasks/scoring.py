"""Scoring calibrated answers from ONE backbone forward: the prefix KV cache and the two multiple-choice rules.

A task gives the backbone's hidden states of whole sequences (B, T, H), and each calibrator is applied to the logits
at the positions the task needs only (never the whole (T, V) matrix) with `Calibrator.apply` (calibrators that read
hidden states, ATS, get the whole sequence, its attention mask and the index (B, K) of the positions), then its
confidence map (binning methods) with `Calibrator.map_confidence`.

A shared few-shot prefix is encoded once (`PrefixCache`): its KV cache and hidden states are reused for every example
that starts with it, so an example costs only its own tokens.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import Tensor

from ...calibrators.base import Calibrator
from ...confidence import softmax_confidence
from ...errors import ATSError
from ...padding import pad_batch
from .base import TaskResult, chunks, progress_bar


def encode(tokenizer, text: str, *, special: bool) -> list[int]:
    """Token ids of `text`; `special` adds the tokenizer's BOS (for the start of a prompt).

    Args:
        tokenizer: the backbone's tokenizer.
        text: the text to encode.
        special: add the tokenizer's special tokens.

    Returns:
        The token ids.
    """
    return list(tokenizer(text, add_special_tokens=special).input_ids)


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens `a` and `b` share.

    Args:
        a: token ids.
        b: token ids.

    Returns:
        The length of their common prefix.
    """
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def continuation_token_id(tokenizer, context: str, continuation: str) -> int:
    """The single token that `continuation` adds after `context` (e.g. " A" after "Answer:"); error if not one.

    Falls back to `continuation` encoded alone when that is one token.

    Args:
        tokenizer: the backbone's tokenizer.
        context: the text before.
        continuation: the text whose token is wanted.

    Returns:
        The token id.

    Raises:
        ATSError: if `continuation` is not a single token, in context or alone.
    """
    base = encode(tokenizer, context, special=False)
    full = encode(tokenizer, context + continuation, special=False)
    if full[:len(base)] != base or len(full) != len(base) + 1:
        simple = encode(tokenizer, continuation, special=False)
        if len(simple) == 1:
            return simple[0]
        raise ATSError(f"tokenizer: {continuation!r} after {context!r} is not a single token "
                       f"({full[len(base):] if full[:len(base)] == base else simple}); letter scoring needs one")
    return full[-1]


def letter_token_ids(tokenizer, n: int, context: str = "Answer:") -> list[int]:
    """Token ids of " A", " B", ... (n letters) as they follow "Answer:"; each must be one distinct token.

    Args:
        tokenizer: the backbone's tokenizer.
        n: the number of letters, 2 to 26.
        context: the text the letters follow.

    Returns:
        n token ids, in letter order.

    Raises:
        ATSError: if `n` is out of range or a letter is not one token, or two letters share a token.
    """
    if not 2 <= n <= 26:
        raise ATSError(f"letter scoring supports 2 to 26 choices, got {n}")
    ids = [continuation_token_id(tokenizer, context, " " + chr(ord("A") + i)) for i in range(n)]
    if len(set(ids)) != n:
        raise ATSError(f"tokenizer: the letter tokens {ids} are not distinct")
    return ids


def gather_logits(backbone, hidden: Tensor, index: Tensor) -> Tensor:
    """Logits (B, K, V) float32 at positions `index` (B, K) of `hidden` (B, T, H), and nowhere else.

    Args:
        backbone: gives the output layer.
        hidden: (B, T, H) hidden states.
        index: (B, K) long positions into T.

    Returns:
        (B, K, V) float32 logits.
    """
    h = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
    return backbone.logits(h).float()


def pad_right(rows: Sequence[Sequence[int]], pad_id: int, device) -> tuple[Tensor, Tensor]:
    """`pad_batch(rows, pad_id)` on `device`: (ids (B, T_max), mask (B, T_max)), right-padded, long."""
    ids, mask = pad_batch(rows, pad_id)
    return ids.to(device), mask.to(device)


class PrefixCache:
    """A prompt prefix encoded once: its KV cache and hidden states, reused by every example that starts with it.

    `forward(rows)` runs a batch of full token sequences (each one starting with some of the prefix's tokens) and
    returns the hidden states of the WHOLE sequences (B, T, H) (prefix included, as ATS's head attends to it) and the
    attention mask (B, T), right-padded, at the cost of the tokens after the shared prefix only.

    The cache is never mutated: each batch gets a copy cropped to the shared length and repeated over the batch
    (transformers' DynamicCache is extended in place by a forward).

    Args:
        backbone: the frozen backbone.
        prefix_ids: the prefix's token ids; empty: no cache (every batch runs in full).
    """

    def __init__(self, backbone, prefix_ids: Sequence[int], capture=None) -> None:
        self.backbone = backbone
        self.ids = list(prefix_ids)
        self.hidden: Tensor | None = None
        self.cache = None
        self.capture = capture  # a LayerCapture (entered) whose layers `forward_layers` returns too, or None
        self.layers: Tensor | None = None  # (1, T_prefix, L, H) the captured layers' states of the prefix
        if len(self.ids) > 0:
            x = torch.tensor([self.ids], dtype=torch.long, device=backbone.device)
            self.hidden, self.cache = backbone.forward(x, attention_mask=torch.ones_like(x), use_cache=True)
            if capture is not None:
                self.layers = capture.take()

    def _cache_for(self, length: int, batch: int):
        cache = copy.deepcopy(self.cache)
        remove = len(self.ids) - length
        if remove > 0:
            cache.crop(-remove)  # negative: remove that many positions (all transformers versions)
        if batch > 1:
            cache.batch_repeat_interleave(batch)
        return cache

    def shared_length(self, row: Sequence[int]) -> int:
        """How many of `row`'s first tokens the cache covers (at least one token is left to run).

        Args:
            row: a full token sequence.

        Returns:
            The shared length, at most len(row) - 1.
        """
        return min(common_prefix_length(self.ids, row), len(row) - 1)

    def forward(self, rows: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor]:
        """Hidden states (B, T, H) and attention mask (B, T) of the right-padded full sequences `rows`.

        Args:
            rows: B full token sequences (prefix included).

        Returns:
            (hidden (B, T, H), attention_mask (B, T)), T the longest row; positions are those of the full rows.
        """
        backbone = self.backbone
        device = backbone.device
        pad = backbone.tokenizer.pad_token_id
        shared = min(self.shared_length(r) for r in rows) if self.cache is not None else 0
        self._shared = shared  # read by forward_layers
        if shared == 0:
            ids, mask = pad_right(rows, pad, device)
            hidden, _ = backbone.forward(ids, attention_mask=mask)
            return hidden, mask
        B = len(rows)
        ids, mask = pad_right([r[shared:] for r in rows], pad, device)
        past_mask = torch.ones((B, shared), dtype=mask.dtype, device=device)
        full_mask = torch.cat([past_mask, mask], dim=1)
        new_hidden, _ = backbone.forward(ids, attention_mask=full_mask, past_key_values=self._cache_for(shared, B),
                                         use_cache=True)
        prefix_hidden = self.hidden[:, :shared].expand(B, -1, -1)
        return torch.cat([prefix_hidden.to(new_hidden.dtype), new_hidden], dim=1), full_mask

    def forward_layers(self, rows: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor, Tensor]:
        """`forward(rows)` and the captured layers' states of the whole rows (B, T, L, H), the prefix's from the
        cache (needs a `capture` at construction)."""
        if self.capture is None:
            raise ATSError("PrefixCache.forward_layers needs a LayerCapture at construction")
        hidden, mask = self.forward(rows)
        new = self.capture.take()  # (B, T - shared, L, H)
        if self._shared:
            prefix = self.layers[:, :self._shared].expand(len(rows), -1, -1, -1).to(new.dtype)
            new = torch.cat([prefix, new], dim=1)
        return hidden, mask, new


# --- the scoring rules (the confidence rules are in `ats.training.answers`, shared with answer training) ---------
def sequence_log_likelihood(logp: Tensor, valid: Tensor) -> Tensor:
    """A continuation's summed log-likelihood: (..., K) token log-probabilities, summed where `valid` (..., K)."""
    return (logp * valid).sum(-1)


@dataclass
class LetterItem:
    """One question scored by letters: its full prompt tokens (ending at "Answer:") and the letter token ids."""

    ids: list[int]
    letters: list[int]  # token ids of " A", " B", ... (one per choice)
    answer: int


def score_letters(backbone, calibrators: dict[str, Calibrator], items: Sequence[LetterItem], *,
                  prefix: PrefixCache | None = None, batch_size: int = 8, progress: bool = False,
                  desc: str = "letters") -> dict[str, TaskResult]:
    """Confidence = softmax over the letter tokens of the calibrated logits at the answer position.

    Correct = the argmax letter is the answer; binning calibrators map the confidence.

    Args:
        backbone: the frozen backbone.
        calibrators: method name -> fitted calibrator.
        items: the questions.
        prefix: a shared prompt prefix encoded once; None: none.
        batch_size: questions per forward pass.
        progress: show a progress bar.
        desc: the progress bar's label.

    Returns:
        method -> per-question results (extra: "prediction", "answer").
    """
    prefix = prefix or PrefixCache(backbone, [])
    conf: dict[str, list[np.ndarray]] = {m: [] for m in calibrators}
    pred: dict[str, list[np.ndarray]] = {m: [] for m in calibrators}
    answers = []
    for batch in progress_bar(chunks(list(items), batch_size), enabled=progress, desc=desc):
        hidden, mask = prefix.forward([it.ids for it in batch])
        last = torch.tensor([[len(it.ids) - 1] for it in batch], device=hidden.device)  # (B, 1)
        z = gather_logits(backbone, hidden, last)  # (B, 1, V)
        n = max(len(it.letters) for it in batch)
        letter_ids = torch.tensor([it.letters + [it.letters[0]] * (n - len(it.letters)) for it in batch],
                                  device=z.device)  # (B, n)
        valid = torch.tensor([[j < len(it.letters) for j in range(n)] for it in batch], device=z.device)
        answers.extend(it.answer for it in batch)
        for method, calibrator in calibrators.items():
            q = calibrator.apply(z, hidden, attention_mask=mask, index=last)[:, 0]  # (B, V)
            c, p = softmax_confidence(q.gather(1, letter_ids).masked_fill(~valid, float("-inf")))
            conf[method].append(calibrator.map_confidence(c))
            pred[method].append(p.cpu().numpy())
    return _collect(conf, pred, np.asarray(answers, dtype=np.int64))


@dataclass
class ChoiceItem:
    """One question scored by choice likelihood: context tokens and each choice's continuation tokens."""

    context: list[int]
    choices: list[list[int]]
    answer: int


def choice_item(tokenizer, context: str, choices: Sequence[str], answer: int) -> ChoiceItem:
    """A likelihood-scored question: `context` encoded as a prompt start (BOS), each choice as " {choice}" after it.

    Args:
        tokenizer: the backbone's tokenizer.
        context: the text before the choices (ending with "A:").
        choices: the choices' texts.
        answer: the index of the right choice.

    Returns:
        The item.
    """
    return ChoiceItem(context=encode(tokenizer, context, special=True),
                      choices=[encode(tokenizer, " " + c, special=False) for c in choices], answer=answer)


def score_choices(backbone, calibrators: dict[str, Calibrator], items: Sequence[ChoiceItem], *,
                  prefix: PrefixCache | None = None, progress: bool = False,
                  desc: str = "choices") -> dict[str, TaskResult]:
    """Each choice scored by its summed log-likelihood under the calibrated logits; softmax over the choices.

    The choices of one question run as one batch (they share the context, and the prefix cache when given).
    Arguments and result as for `score_letters` (no `batch_size`); raises `ATSError` if a choice has no tokens.
    """
    prefix = prefix or PrefixCache(backbone, [])
    conf: dict[str, list[np.ndarray]] = {m: [] for m in calibrators}
    pred: dict[str, list[np.ndarray]] = {m: [] for m in calibrators}
    answers = []
    for item in progress_bar(items, enabled=progress, desc=desc):
        if any(len(c) == 0 for c in item.choices):
            raise ATSError("a choice has no tokens")
        rows = [item.context + c for c in item.choices]
        hidden, mask = prefix.forward(rows)
        start = len(item.context)
        K = max(len(c) for c in item.choices)
        # position start + j - 1 predicts choice token j; padded entries repeat a valid position and are masked out
        index = torch.tensor([[start - 1 + min(j, len(c) - 1) for j in range(K)] for c in item.choices],
                             device=hidden.device)  # (C, K)
        targets = torch.tensor([[c[min(j, len(c) - 1)] for j in range(K)] for c in item.choices],
                               device=hidden.device)  # (C, K)
        valid = torch.tensor([[j < len(c) for j in range(K)] for c in item.choices], device=hidden.device)
        z = gather_logits(backbone, hidden, index)  # (C, K, V)
        answers.append(item.answer)
        for method, calibrator in calibrators.items():
            q = calibrator.apply(z, hidden, attention_mask=mask, index=index)
            logp = torch.log_softmax(q, dim=-1).gather(2, targets[..., None])[..., 0]  # (C, K)
            c, p = softmax_confidence(sequence_log_likelihood(logp, valid)[None])  # (1,) each
            conf[method].append(calibrator.map_confidence(c))
            pred[method].append(p.reshape(1).cpu().numpy())
    return _collect(conf, pred, np.asarray(answers, dtype=np.int64))


def _collect(conf: dict[str, list[np.ndarray]], pred: dict[str, list[np.ndarray]],
             answers: np.ndarray) -> dict[str, TaskResult]:
    out = {}
    for method in conf:
        c = np.concatenate(conf[method]) if conf[method] else np.zeros(0)
        p = np.concatenate(pred[method]).astype(np.int64) if pred[method] else np.zeros(0, dtype=np.int64)
        out[method] = TaskResult(confidence=c, correct=p == answers, extra={"prediction": p, "answer": answers})
    return out


def concat_results(parts: list[dict[str, TaskResult]], methods: Iterable[str]) -> dict[str, TaskResult]:
    """Join per-group results (e.g. MMLU subjects) in order.

    Args:
        parts: per group, method -> results; every part has every method and the same extra keys.
        methods: the method names.

    Returns:
        method -> the concatenated results (empty when there is no part).
    """
    out = {}
    for m in methods:
        rs = [p[m] for p in parts]
        if not rs:
            out[m] = TaskResult(np.zeros(0), np.zeros(0, dtype=bool))
            continue
        keys = set(rs[0].extra)
        out[m] = TaskResult(np.concatenate([r.confidence for r in rs]), np.concatenate([r.correct for r in rs]),
                            {k: np.concatenate([r.extra[k] for r in rs]) for k in keys})
    return out


@dataclass
class ItemGroup:
    """Questions that share one prompt prefix (encoded once): what a scored task asks of the backbone.

    Every item of a group is a `LetterItem` (letter scoring) or every one a `ChoiceItem` (choice likelihood).
    """

    name: str
    prefix: list[int]
    items: list


def score_groups(backbone, calibrators: dict[str, Calibrator], groups: Sequence[ItemGroup], *, batch_size: int = 8,
                 progress: bool = False) -> dict[str, TaskResult]:
    """Score every group by its items' rule (letters or choice likelihood), each prefix encoded once; in order.

    Args:
        backbone: the frozen backbone.
        calibrators: method name -> fitted calibrator.
        groups: the question groups (a task's `groups(tokenizer)`).
        batch_size: questions per forward pass (letter scoring).
        progress: show progress bars.

    Returns:
        method -> per-question results, the groups' questions in order.
    """
    parts = []
    for group in groups:
        prefix = PrefixCache(backbone, group.prefix)
        if group.items and isinstance(group.items[0], LetterItem):
            parts.append(score_letters(backbone, calibrators, group.items, prefix=prefix, batch_size=batch_size,
                                       progress=progress, desc=group.name))
        else:
            parts.append(score_choices(backbone, calibrators, group.items, prefix=prefix, progress=progress,
                                       desc=group.name))
    return concat_results(parts, calibrators)
