"""Greedy answers and their calibrated confidence: what the generation tasks (TriviaQA, TruthfulQA gen) share.

1. `GenerativeTask.generate`: greedy continuations of a batch of raw prompts by the generation core (the decoder of
   `ats generate` and `ats serve`), at most `max_new_tokens` new tokens, each stopping at its first newline.
2. `cut_answer`: the answer is cut at end-of-sequence and at the first newline; its scored tokens are those whose
   decoded text holds no newline yet (at least one: for an empty answer, the first generated token).
3. `GenerativeTask.answer`: ONE forward over prompt + scored answer tokens (through the prompt prefix's KV cache);
   each scored token's probability under each calibrator's calibrated distribution (hidden state t-1 predicts token
   t), through its confidence map (binning methods). Confidence = the mean of those probabilities; their product (the
   sequence probability) is kept as `confidence_product`.

Every calibrator scores the backbone's own greedy answer, so that all methods judge the same answers (vector scaling
can move the argmax; its own greedy answer could differ).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator, NamedTuple, Sequence

import numpy as np
import torch

from ...calibrators.base import Calibrator
from ...confidence import mean_token_confidence
from ...generation.decoder import Decoder, Row, eos_ids
from ...generation.sampling import SamplingParams
from .base import Task, TaskResult, chunks, progress_bar
from .scoring import PrefixCache, gather_logits


def cut_answer(tokenizer, generated: list[int], stop_ids: set[int]) -> tuple[str, int]:
    """(answer text, number of tokens to score) of a greedy continuation: cut at end-of-sequence and first newline.

    The scored tokens are those whose decoded text holds no newline yet (at least one token).

    Args:
        tokenizer: the backbone's tokenizer.
        generated: the new token ids.
        stop_ids: end-of-sequence ids.

    Returns:
        (the answer's first line, stripped; the number of leading tokens to score, >= 1).
    """
    tokens = []
    for t in generated:
        if t in stop_ids:
            break
        tokens.append(int(t))
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    answer = text.split("\n")[0].strip()
    n = 0
    for k in range(1, len(tokens) + 1):
        if "\n" in tokenizer.decode(tokens[:k], skip_special_tokens=True):
            break
        n = k
    return answer, max(n, 1)


class GreedyBatch(NamedTuple):
    """One batch of greedy answers: the prompts, and per prompt the answer's text and its scored tokens."""

    prompts: list[list[int]]
    texts: list[str]
    tokens: list[list[int]]  # the first k generated ids, k from `cut_answer` (>= 1)


@dataclass
class Answers:
    """Greedy answers of a task's questions and, per calibrator, their mean and product token probability."""

    text: list[str] = field(default_factory=list)
    n_tokens: list[int] = field(default_factory=list)
    mean: dict[str, list[float]] = field(default_factory=dict)
    product: dict[str, list[float]] = field(default_factory=dict)

    def results(self, correct: Sequence[bool], extra: dict[str, np.ndarray] | None = None) -> dict[str, TaskResult]:
        """One TaskResult per calibrator; `extra` (per-question arrays shared by all methods) is added to each.

        Args:
            correct: (N,) whether each answer is right.
            extra: name -> (N,) arrays to add.

        Returns:
            method -> results: confidence = the mean token probability; extra: "confidence_product", "n_tokens",
            "prediction" (the answer text) and `extra`.
        """
        shared = {"n_tokens": np.asarray(self.n_tokens, dtype=np.int64), "prediction": np.asarray(self.text, dtype=str),
                  **(extra or {})}
        return {m: TaskResult(np.asarray(self.mean[m]), np.asarray(correct, dtype=bool),
                              {"confidence_product": np.asarray(self.product[m]), **shared}) for m in self.mean}


class GenerativeTask(Task):
    """A task judged on the backbone's greedy answers; subclasses set `max_new_tokens` and `batch_size`."""

    max_new_tokens: int
    batch_size: int

    def prompts(self, tokenizer) -> tuple[list[int], list[list[int]]]:
        """(the shared prompt prefix, each question's full prompt) as token ids; subclasses define it.

        Args:
            tokenizer: the backbone's tokenizer.

        Returns:
            (prefix ids, one prompt per question, each starting with the prefix).
        """
        raise NotImplementedError

    def judge_answers(self, texts: list[str]) -> tuple[list[bool], dict[str, np.ndarray]]:
        """(whether each answer is right, per-question extra arrays) for the answers `texts` to the questions of
        `prompts`, in order; subclasses define it.

        Args:
            texts: one answer per question.

        Returns:
            (correct, extra arrays added to every method's result).
        """
        raise NotImplementedError

    def run(self, backbone, calibrators: dict[str, Calibrator], *, progress: bool = True) -> dict[str, TaskResult]:
        """Greedy answers to `prompts`, judged by `judge_answers`, scored by every calibrator (the module docstring).

        Same arguments as `Task.run`; returns method -> per-question results (extra: "confidence_product",
        "n_tokens", "prediction" and the judge's arrays).
        """
        prefix_ids, prompts = self.prompts(backbone.tokenizer)
        answers = self.answer(backbone, calibrators, prompts, PrefixCache(backbone, prefix_ids), progress=progress)
        correct, extra = self.judge_answers(answers.text)
        return answers.results(correct, extra)

    def generate(self, backbone, prompts: list[list[int]]) -> list[list[int]]:
        """Greedy continuations (new tokens only) of a batch of prompts, decoded by the generation core
        (`ats.generation.Decoder`, the one `ats generate` and `ats serve` use): each stops at end-of-sequence, at its
        first newline (the answer is cut there anyway) or after `max_new_tokens`.

        Args:
            backbone: the backbone.
            prompts: B prompts as token ids.

        Returns:
            B lists of new token ids, the token that ended each (end-of-sequence, newline) included.
        """
        rows = [Row(p, i, backbone.tokenizer, max_tokens=self.max_new_tokens, sampling=SamplingParams(temperature=0),
                    stop=("\n",)) for i, p in enumerate(prompts)]
        Decoder(backbone).run(rows)
        return [row.generated for row in rows]

    def answer(self, backbone, calibrators: dict[str, Calibrator], prompts: list[list[int]], prefix: PrefixCache, *,
               progress: bool = True) -> Answers:
        """Greedy answers of `prompts` (token ids, each starting with the prefix's) scored by every calibrator.

        Args:
            backbone: the frozen backbone.
            calibrators: method name -> fitted calibrator.
            prompts: the prompts as token ids.
            prefix: the prompts' shared prefix, encoded once.
            progress: show a progress bar.

        Returns:
            The answers and, per method, their mean and product token probabilities.
        """
        out = Answers(mean={m: [] for m in calibrators}, product={m: [] for m in calibrators})
        for batch in self.greedy_batches(backbone, prompts, self.batch_size, progress=progress, desc=self.name):
            out.text.extend(batch.texts)
            out.n_tokens.extend(len(a) for a in batch.tokens)
            self._score(backbone, calibrators, prefix, batch.prompts, batch.tokens, out)
        return out

    def greedy_batches(self, backbone, prompts: list[list[int]], batch_size: int, *, progress: bool,
                       desc: str) -> Iterator[GreedyBatch]:
        """The greedy answers of `prompts`, `batch_size` at a time, cut by `cut_answer`: the one generation loop
        that scoring (`answer`) and the answer cache (`ats.evaluation.answers`) share, so both judge the same answers.

        Args:
            backbone: the frozen backbone.
            prompts: the prompts as token ids.
            batch_size: prompts per generation batch.
            progress: show a progress bar labelled `desc`.
            desc: the progress bar's label.

        Yields:
            One `GreedyBatch` per batch, in order.
        """
        stop_ids = eos_ids(backbone)
        for batch in progress_bar(chunks(prompts, batch_size), enabled=progress, desc=desc):
            generated = self.generate(backbone, list(batch))
            cuts = [cut_answer(backbone.tokenizer, g, stop_ids) for g in generated]
            yield GreedyBatch(list(batch), [text for text, _ in cuts], [g[:k] for g, (_, k) in zip(generated, cuts)])

    @torch.no_grad()
    def _score(self, backbone, calibrators: dict[str, Calibrator], prefix: PrefixCache, prompts: Sequence[list[int]],
               answers: list[list[int]], out: Answers) -> None:
        """Append each calibrator's mean / product probability of the `answers` tokens after `prompts` to `out`."""
        hidden, mask = prefix.forward([p + a for p, a in zip(prompts, answers)])
        K = max(len(a) for a in answers)
        index = torch.tensor([[len(p) - 1 + min(j, len(a) - 1) for j in range(K)]
                              for p, a in zip(prompts, answers)], device=hidden.device)  # (B, K)
        targets = torch.tensor([[a[min(j, len(a) - 1)] for j in range(K)] for a in answers], device=hidden.device)
        valid = np.array([[j < len(a) for j in range(K)] for a in answers])
        z = gather_logits(backbone, hidden, index)  # (B, K, V)
        for method, calibrator in calibrators.items():
            q = calibrator.apply(z, hidden, attention_mask=mask, index=index)
            p = torch.softmax(q, dim=-1).gather(2, targets[..., None])[..., 0]  # (B, K)
            p = calibrator.map_confidence(p)
            out.mean[method].extend(mean_token_confidence(p, valid))
            out.product[method].extend(np.prod(np.where(valid, p, 1.0), axis=1))
