"""TruthfulQA as the paper runs it: free-form greedy answers after the QA primer, judged true or false.

1. Prompt: TruthfulQA's QA primer (`truthfulqa.QA_PRIMER`), then "\\n\\nQ: {question}\\nA:"; raw completion, no chat
   template. The authors' `format_prompt` and lm-eval's `truthfulqa_gen` end the prompt at the question and let the
   model write "\\nA:" itself (the authors then strip it); we end the prompt with "\\nA:", so that every scored token
   is an answer token.
2. Greedy answer of at most `max_new_tokens` (50, the authors' setting) new tokens, cut at the first newline (which
   also ends a "\\n\\nQ: ..." continuation) and at end-of-sequence (`generative.py`).
3. Judge: the paper judged answers with GPT-judge, a fine-tuned commercial model behind an API, which cannot run
   offline or reproducibly. We use the authors' automatic rule instead, as lm-eval's `truthfulqa_gen` computes it
   (`judge.py`): true when the answer's highest similarity to a true reference (Best Answer + Correct Answers + "I have
   no comment.") exceeds its highest similarity to a false reference (Incorrect Answers); similarity = ROUGE-L
   (`judge="rouge"`, the default, lm-eval's `rougeL_acc`) or BLEU (`judge="bleu"`, lm-eval's `bleu_acc`).
4. Confidence as TriviaQA: the mean calibrated probability of the scored answer tokens, every calibrator scoring the
   backbone's own greedy answer; the product is the extra array `confidence_product`. Further extra arrays: the
   answer (`prediction`), `n_tokens`, the similarities `similarity_true` / `similarity_false`, their difference
   `margin` (lm-eval's `{judge}_diff`) and the question's `category`.

Data: `ATS_DATA_DIR/truthfulqa/TruthfulQA.csv` (the authors' CSV, UTF-8 with BOM, answers separated by ";") when
ATS_DATA_DIR is set, else the Hub's `truthfulqa/truthful_qa` ("generation", validation).
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from ...checks import check_choice, check_positive_int
from ...errors import ATSError
from ...sources import hub_dataset, local_file
from .base import seeded_subset
from .generative import GenerativeTask
from .judge import JUDGES, NO_COMMENT, close_references, judge_answer
from .scoring import encode
from .truthfulqa import QA_PRIMER, render_context

COLUMNS = ("Category", "Question", "Best Answer", "Correct Answers", "Incorrect Answers")


def split_answers(cell: str) -> list[str]:
    """The answers of a CSV cell ("a; b; c", sometimes with a trailing ";"), stripped, empty ones dropped.

    Args:
        cell: the cell's text.

    Returns:
        The answers.
    """
    return [a.strip() for a in cell.split(";") if a.strip()]


def make_row(question, category, best, correct, incorrect, where: str) -> dict:
    """{question, category, true_refs, false_refs} with the references closed as lm-eval does (`judge.py`).

    Args:
        question: the question.
        category: its category (None: "").
        best: the best answer (first true reference).
        correct: further true answers.
        incorrect: the false answers.
        where: the row's location, quoted in the error.

    Returns:
        The row; the true references deduplicated, with "I have no comment." added when absent.

    Raises:
        ATSError: if the question is empty or a side has no reference.
    """
    question = str(question).strip()
    true_refs = list(dict.fromkeys(close_references([best, *correct])))
    false_refs = close_references(incorrect)
    if not question or not true_refs or not false_refs:
        raise ATSError(f"{where}: needs a question, a true and a false answer")
    if NO_COMMENT not in true_refs:
        true_refs.append(NO_COMMENT)
    return {"question": question, "category": str(category or ""), "true_refs": true_refs, "false_refs": false_refs}


def read_csv(path: Path) -> list[dict]:
    """Rows of the authors' TruthfulQA.csv (errors name the file and the row).

    Args:
        path: the CSV file (UTF-8 with BOM).

    Returns:
        Rows as `make_row` returns them.

    Raises:
        ATSError: if a column is missing, a row has too few fields or is invalid, or there is no row.
    """
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise ATSError(f"{path}: missing columns {', '.join(missing)}")
        rows = []
        for i, r in enumerate(reader, start=1):
            if any(r.get(c) is None for c in COLUMNS):
                raise ATSError(f"{path}: row {i}: too few fields")
            rows.append(make_row(r["Question"], r["Category"], r["Best Answer"], split_answers(r["Correct Answers"]),
                                 split_answers(r["Incorrect Answers"]), f"{path}: row {i}"))
    if not rows:
        raise ATSError(f"{path}: no questions")
    return rows


def load_truthfulqa_gen() -> list[dict]:
    """All questions with their closed true / false references.

    Returns:
        Rows as `make_row` returns them, from the local CSV under ATS_DATA_DIR or from the Hub.

    Raises:
        ATSError: if the data cannot be read or a row is malformed.
    """
    path = local_file("truthfulqa/TruthfulQA.csv")
    if path is not None:
        return read_csv(path)
    rows = []
    for i, r in enumerate(hub_dataset("truthfulqa/truthful_qa", "generation", "validation")):
        where = f"truthfulqa/truthful_qa (generation): row {i + 1}"
        try:
            rows.append(make_row(r["question"], r.get("category"), r["best_answer"], r["correct_answers"],
                                 r["incorrect_answers"], where))
        except (KeyError, TypeError) as err:
            raise ATSError(f"{where}: malformed TruthfulQA row ({err!r})") from None
    return rows


class TruthfulQAGenTask(GenerativeTask):
    """TruthfulQA generation judged by ROUGE-L or BLEU; `limit` = a seeded subset of questions.

    Args:
        limit: questions to evaluate; None: all.
        seed: the seed of the subset.
        max_new_tokens: the longest greedy answer.
        judge: "rouge" or "bleu".
        batch_size: questions per generation batch.

    Raises:
        ATSError: if `max_new_tokens` or `batch_size` is not a positive integer, or `judge` is unknown.
    """

    name = "truthfulqa_gen"

    def __init__(self, *, limit: int | None = None, seed: int = 0, max_new_tokens: int = 50, judge: str = "rouge",
                 batch_size: int = 8) -> None:
        self.limit = limit
        self.seed = seed
        self.max_new_tokens = check_positive_int("max_new_tokens", max_new_tokens)
        self.judge = check_choice("judge", judge, JUDGES)
        self.batch_size = check_positive_int("batch_size", batch_size)

    def describe(self) -> dict:
        """The settings that determine the results.

        Returns:
            {"name", "limit", "seed", "max_new_tokens", "judge"}.
        """
        return {"name": self.name, "limit": self.limit, "seed": self.seed, "max_new_tokens": self.max_new_tokens,
                "judge": self.judge}

    def load(self) -> list[dict]:
        """The evaluated questions: a seeded subset, in data order.

        Returns:
            Rows as `make_row` returns them.

        Raises:
            ATSError: if the data cannot be read or a row is malformed.
        """
        rows = load_truthfulqa_gen()
        return [rows[i] for i in seeded_subset(len(rows), self.limit, self.seed, salt=self.name)]

    def prompts(self, tokenizer) -> tuple[list[int], list[list[int]]]:
        """(the QA primer, each question's prompt after it) as token ids (`GenerativeTask.prompts`)."""
        return (encode(tokenizer, QA_PRIMER, special=True),
                [encode(tokenizer, render_context(r["question"]), special=True) for r in self.load()])

    def judge_answers(self, texts: list[str]) -> tuple[list[bool], dict[str, np.ndarray]]:
        """Each answer against its question's true and false references (the module docstring's arrays).

        Args:
            texts: one answer per evaluated question.

        Returns:
            (correct, {"similarity_true", "similarity_false", "margin", "category"}).

        Raises:
            ATSError: if the judge's package is missing.
        """
        rows = self.load()
        verdicts = [judge_answer(text, r["true_refs"], r["false_refs"], self.judge)
                    for text, r in zip(texts, rows)]
        extra = {"similarity_true": np.asarray([v.true_max for v in verdicts]),
                 "similarity_false": np.asarray([v.false_max for v in verdicts]),
                 "margin": np.asarray([v.margin for v in verdicts]),
                 "category": np.asarray([r["category"] for r in rows], dtype=str)}
        return [v.correct for v in verdicts], extra
