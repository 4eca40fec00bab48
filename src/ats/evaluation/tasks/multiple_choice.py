"""Any multiple-choice set from a JSONL file: `mc:PATH` (letters, the default), `mc:PATH:letters`,
`mc:PATH:likelihood`.

Each line: {"question": str, "choices": [str, ...], "answer": int (0-based index of the right choice)}.

- letters: zero-shot, the MMLU layout without header: "{question}\\nA. ..\\nB. ..\\nAnswer:"; confidence = softmax over
  the letter tokens " A", " B", ... (as many as there are choices) of the calibrated logits at the answer position.
- likelihood: "Q: {question}\\nA:" followed by each " {choice}", scored by its summed log-likelihood under the
  calibrated logits (as TruthfulQA MC1, without the primer); softmax over the choices.

Prompts are raw completions (no chat template), as for MMLU. Every malformed line is one ATSError naming the file, the
line number, the field and the bad value.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

from ...calibrators.base import Calibrator
from ...errors import ATSError
from ...io import read_jsonl
from .base import Task, TaskResult, seeded_subset
from .scoring import ItemGroup, LetterItem, choice_item, encode, letter_token_ids, score_groups

logger = logging.getLogger(__name__)

MODES = ("letters", "likelihood")


def letter_prompt(question: str, choices: list[str]) -> str:
    """"{question}\\nA. {c0}\\nB. {c1}...\\nAnswer:" (the MMLU layout).

    Args:
        question: the question.
        choices: the choices, lettered A, B, ... in order.

    Returns:
        The prompt, ending with "Answer:".
    """
    lines = [question] + [f"{chr(ord('A') + i)}. {c}" for i, c in enumerate(choices)]
    return "\n".join(lines) + "\nAnswer:"


def _short(value, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def read_mc_file(path: str | Path) -> list[dict]:
    """Read and validate a multiple-choice JSONL file.

    Repeated choices are logged as a warning and kept.

    Args:
        path: the JSONL file (the line format is the module docstring's).

    Returns:
        The rows {question, choices, answer}, in file order.

    Raises:
        ATSError: if the file is missing or empty, or a line is invalid (naming the line, field and value).
    """
    path = Path(path)
    if not path.is_file():
        raise ATSError(f"{path}: multiple-choice file not found")
    rows = []
    for lineno, row in read_jsonl(path):
        where = f"{path}:{lineno}"
        if not isinstance(row, dict):
            raise ATSError(f"{where}: expected a JSON object with question, choices, answer; got {_short(row)}")
        for key in ("question", "choices", "answer"):
            if key not in row:
                raise ATSError(f"{where}: missing field '{key}'")
        question, choices, answer = row["question"], row["choices"], row["answer"]
        if not isinstance(question, str) or not question.strip():
            raise ATSError(f"{where}: field 'question' must be a non-empty string, got {_short(question)}")
        if not isinstance(choices, list) or not all(isinstance(c, str) for c in choices):
            raise ATSError(f"{where}: field 'choices' must be a list of strings, got {_short(choices)}")
        if len(choices) < 2:
            raise ATSError(f"{where}: field 'choices' needs at least 2 choices, got {len(choices)}")
        if any(not c.strip() for c in choices):
            raise ATSError(f"{where}: field 'choices' has an empty choice: {_short(choices)}")
        duplicates = sorted({c for c in choices if [x.strip() for x in choices].count(c.strip()) > 1})
        if duplicates:  # real benchmark files have such rows (MMLU dev); scoring them is still well defined
            logger.warning("%s: field 'choices' repeats %s; scored as given", where, _short(duplicates[0]))
        if isinstance(answer, bool) or not isinstance(answer, int):
            raise ATSError(f"{where}: field 'answer' must be an integer index, got {_short(answer)}")
        if not 0 <= answer < len(choices):
            raise ATSError(f"{where}: field 'answer' is {answer}, out of range for {len(choices)} choices "
                           f"(0-{len(choices) - 1})")
        rows.append({"question": question, "choices": choices, "answer": answer})
    if not rows:
        raise ATSError(f"{path}: empty multiple-choice file (no questions)")
    return rows


def safe_stem(path: str | Path) -> str:
    """The file's stem made safe for a task (and file) name.

    Args:
        path: the file.

    Returns:
        The stem with every run of other characters than letters, digits, "_", "." and "-" replaced by "_";
        "file" if nothing is left.
    """
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(path).stem).strip("._") or "file"


def parse_mc_spec(rest: str, spec: str) -> tuple[str, str]:
    """(path, mode) of 'mc:PATH[:letters|likelihood]' from the text after 'mc:'.

    Raises:
        ATSError: if the path is empty, or names a file followed by an unknown mode.
    """
    path, mode = rest, "letters"
    head, sep, tail = rest.rpartition(":")
    if sep and tail in MODES:
        path, mode = head, tail
    elif sep and Path(head).is_file() and not Path(rest).exists():  # mc:quiz.jsonl:likelyhood
        raise ATSError(f"task {spec!r}: unknown scoring mode {tail!r}; expected mc:PATH[:letters|likelihood]")
    if not path:
        raise ATSError(f"task {spec!r}: missing file path; expected mc:PATH[:letters|likelihood]")
    return path, mode


class MultipleChoiceTask(Task):
    """A JSONL multiple-choice set scored by letters (zero-shot) or by choice likelihood.

    The file is read and validated on construction; the task's name is `mc_<stem>` (plus `_likelihood`).

    Args:
        path: the JSONL file.
        mode: "letters" or "likelihood".
        limit: a seeded subset of this many questions; None: all.
        seed: the seed of the subset.
        batch_size: questions per forward pass (letters mode).
        held_out_from: questions outside the seeded subset of this size only (`seeded_subset`); None: any.

    Raises:
        ATSError: if `mode` is unknown or the file is invalid.
    """

    def __init__(self, path: str | Path, mode: str = "letters", *, limit: int | None = None, seed: int = 0,
                 batch_size: int = 8, held_out_from: int | None = None) -> None:
        if mode not in MODES:
            raise ATSError(f"mc task: unknown scoring {mode!r}; expected one of {', '.join(MODES)}")
        self.path = Path(path)
        self.mode = mode
        self.limit = limit
        self.seed = seed
        self.batch_size = batch_size
        self.rows = read_mc_file(self.path)  # validate early, before any backbone work
        self.name = f"mc_{safe_stem(self.path)}" + ("" if mode == "letters" else f"_{mode}")
        self.salt = self.name  # the subset's salt stays the file's when the task is renamed
        self.held_out_from = held_out_from

    def describe(self) -> dict:
        """The settings that determine the results.

        Returns:
            {"name", "path", "mode", "limit", "seed"}.
        """
        out = {"name": self.name, "path": str(self.path), "mode": self.mode, "limit": self.limit, "seed": self.seed}
        return out if self.held_out_from is None else {**out, "held_out_from": self.held_out_from}

    def selected(self) -> list[dict]:
        """The evaluated rows: a seeded subset of `limit` rows, in file order.

        Returns:
            The rows {question, choices, answer}.
        """
        return [self.rows[i] for i in seeded_subset(len(self.rows), self.limit, self.seed, salt=self.salt,
                                                    held_out_from=self.held_out_from)]

    def groups(self, tokenizer) -> list[ItemGroup]:
        """The selected questions as one group without a shared prefix, scored by `mode` (letters or likelihood)."""
        rows = self.selected()
        if self.mode == "letters":
            items = [LetterItem(ids=encode(tokenizer, letter_prompt(r["question"], r["choices"]), special=True),
                                letters=letter_token_ids(tokenizer, len(r["choices"])), answer=r["answer"])
                     for r in rows]
        else:
            items = [choice_item(tokenizer, f"Q: {r['question']}\nA:", r["choices"], r["answer"]) for r in rows]
        return [ItemGroup(self.name, [], items)]

    def run(self, backbone, calibrators: dict[str, Calibrator], *, progress: bool = True) -> dict[str, TaskResult]:
        """Score the selected questions by letters or by choice likelihood (see the module docstring).

        Same arguments as `Task.run`; returns method -> per-question results (extra: "prediction", "answer").
        Raises `ATSError` if the letters are not single tokens (letters mode) or a choice has no tokens.
        """
        return score_groups(backbone, calibrators, self.groups(backbone.tokenizer), batch_size=self.batch_size,
                            progress=progress)
