"""TriviaQA (rc.nocontext), few-shot greedy generation, confidence = mean calibrated probability of the answer tokens.

Protocol (the paper's reference evaluator, with its defects fixed):

1. Prompt: `n_shots` (5) fixed-seed question/answer pairs from the same file, never among the evaluated questions,
   as "Q: {question}\\nA: {answer}\\n\\n", ending with "Q: {question}\\nA:". Raw completion: chat models get no chat
   template (the few-shot format is the instruction).
2. Greedy generation (the generation core's `Decoder`) of at most 16 new tokens, cut at the first newline (and at
   end-of-sequence).
3. Correct = exact match after SQuAD normalisation (lowercase, no punctuation, no articles a/an/the, single spaces)
   with any alias (`answer.aliases` + `answer.normalized_aliases`).
4. ONE forward over prompt + answer tokens (the few-shot prefix's KV cache is shared by all questions); each answer
   token's probability under each calibrator's calibrated distribution (hidden state t-1 predicts token t). At least
   one token is scored: for an empty answer, the first generated token. Binning calibrators map each token's
   probability. Confidence = the mean of those probabilities (reference protocol); their product (the sequence
   probability) is returned as the extra array `confidence_product`. Steps 2 and 4 are shared with TruthfulQA (gen)
   (`generative.py`).

Every calibrator scores the backbone's own greedy answer. ATS and temperature scaling never change the argmax, but
vector scaling can: its own greedy answer could differ, and we still score the backbone's answer under its
distribution, so that all methods judge the same answers.

Data: `ATS_DATA_DIR/triviaqa/validation.jsonl` when ATS_DATA_DIR is set, else the Hub's `mandarjoshi/trivia_qa`
("rc.nocontext", validation).
"""

from __future__ import annotations

import re
import string

import numpy as np

from ...errors import ATSError
from ...sources import hub_dataset, local_file
from .base import read_jsonl
from .generative import GenerativeTask
from .scoring import encode

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, remove punctuation, remove articles, collapse whitespace.

    Args:
        text: an answer.

    Returns:
        The normalised text.
    """
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, aliases: list[str]) -> bool:
    """Whether the normalised prediction equals a normalised alias (an empty prediction never matches).

    Args:
        prediction: the model's answer.
        aliases: the accepted answers.

    Returns:
        True on a match.
    """
    pred = normalize_answer(prediction)
    return bool(pred) and any(pred == normalize_answer(a) for a in aliases)


def contains_match(prediction: str, aliases: list[str]) -> bool:
    """Whether a normalised alias occurs in the normalised prediction as whole words: the judge of a chat answer,
    which states the answer inside a sentence ("The capital of France is Paris."), where exact match would fail.
    An empty alias never matches. It accepts an answer that names the right alias among wrong ones; the certified
    risk is the risk under this judge.

    Args:
        prediction: the model's answer.
        aliases: the accepted answers.

    Returns:
        True on a match.
    """
    pred = f" {normalize_answer(prediction)} "
    return any(alias and f" {alias} " in pred for alias in (normalize_answer(a) for a in aliases))


def answer_aliases(row: dict) -> list[str]:
    """The accepted answers of a TriviaQA row: its aliases, normalised aliases and value.

    Args:
        row: a TriviaQA row with an "answer" dict.

    Returns:
        The aliases (duplicates kept).
    """
    answer = row["answer"]
    out = list(answer.get("aliases") or []) + list(answer.get("normalized_aliases") or [])
    if answer.get("value"):
        out.append(answer["value"])
    return out


def load_triviaqa() -> list[dict]:
    """The validation questions (local file under ATS_DATA_DIR, else the Hub).

    Returns:
        Rows {question, value, aliases}.

    Raises:
        ATSError: if the data cannot be read or a row is malformed.
    """
    path = local_file("triviaqa/validation.jsonl")
    rows = read_jsonl(path) if path is not None else [dict(r) for r in
                                                       hub_dataset("mandarjoshi/trivia_qa", "rc.nocontext",
                                                                   "validation")]
    out = []
    for i, r in enumerate(rows):
        try:
            out.append({"question": str(r["question"]).strip(), "value": str(r["answer"]["value"]),
                        "aliases": answer_aliases(r)})
        except (KeyError, TypeError, AttributeError) as err:
            where = path or "mandarjoshi/trivia_qa"
            raise ATSError(f"{where}: row {i + 1}: malformed TriviaQA row ({err!r})") from None
    return out


def few_shot_prefix(shots: list[dict]) -> str:
    """The few-shot part of every prompt.

    Args:
        shots: rows {question, value}.

    Returns:
        "Q: {question}\\nA: {value}\\n\\n" per shot ("" for none).
    """
    return "".join(f"Q: {s['question']}\nA: {s['value']}\n\n" for s in shots)


def render_prompt(shots: list[dict], question: str) -> str:
    """The full prompt of one question, ending with "A:".

    Args:
        shots: the few-shot rows.
        question: the question.

    Returns:
        The prompt.
    """
    return few_shot_prefix(shots) + f"Q: {question}\nA:"


class TriviaQATask(GenerativeTask):
    """TriviaQA generation; `limit` = a seeded subset of questions (the few-shot examples are never among them).

    Args:
        limit: questions to evaluate; None: all but the few-shot examples.
        seed: the seed of the few-shot examples and the subset.
        n_shots: few-shot examples per prompt.
        max_new_tokens: the longest greedy answer.
        batch_size: questions per generation batch.
        offset: questions of the permutation skipped after the few-shot examples (a training pool disjoint from
            the reported questions).
    """

    name = "triviaqa"

    def __init__(self, *, limit: int | None = None, seed: int = 0, n_shots: int = 5, max_new_tokens: int = 16,
                 batch_size: int = 8, offset: int = 0) -> None:
        self.limit = limit
        self.offset = offset
        self.seed = seed
        self.n_shots = n_shots
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size

    def describe(self) -> dict:
        """The settings that determine the results.

        Returns:
            {"name", "limit", "seed", "n_shots", "max_new_tokens"}.
        """
        out = {"name": self.name, "limit": self.limit, "seed": self.seed, "n_shots": self.n_shots,
               "max_new_tokens": self.max_new_tokens}
        return {**out, "offset": self.offset} if self.offset else out  # old results (no offset) stay valid

    def rows(self) -> list[dict]:
        """Every question of the data set as {question, value, aliases}.

        Returns:
            The rows (TriviaQA validation).
        """
        return load_triviaqa()

    def load(self) -> tuple[list[dict], list[dict]]:
        """(few-shot examples, evaluated questions).

        Returns:
            (the `n_shots` examples of a seeded permutation; after skipping `offset` more, the next `limit`
            questions, in file order: offset 1000 gives questions disjoint from every reported subset of up to
            1000).

        Raises:
            ATSError: if the data cannot be read or holds no more than `n_shots` questions.
        """
        rows = self.rows()
        if len(rows) <= self.n_shots:
            raise ATSError(f"triviaqa: {len(rows)} questions, not more than n_shots={self.n_shots}")
        order = np.random.default_rng(self.seed).permutation(len(rows))
        shots = [rows[i] for i in order[:self.n_shots]]
        rest = order[self.n_shots + self.offset:]
        if self.limit is not None:
            rest = rest[:self.limit]
        return shots, [rows[i] for i in sorted(rest)]

    def prompts(self, tokenizer) -> tuple[list[int], list[list[int]]]:
        """(the few-shot prefix, each question's prompt ending with "A:") as token ids (`GenerativeTask.prompts`)."""
        shots, questions = self.load()
        prefix_text = few_shot_prefix(shots)
        prefix = encode(tokenizer, prefix_text, special=True) if prefix_text else []
        return prefix, [encode(tokenizer, render_prompt(shots, q["question"]), special=True) for q in questions]

    def judge_answers(self, texts: list[str]) -> tuple[list[bool], dict[str, np.ndarray]]:
        """Exact match against each question's aliases (no extra arrays).

        Args:
            texts: one answer per evaluated question.

        Returns:
            (correct, {}).
        """
        _, questions = self.load()
        return [exact_match(text, q["aliases"]) for text, q in zip(texts, questions)], {}
