"""NQ-open: free-form questions from Google search queries, answered greedily after five solved examples and judged
by exact match against the aliases, exactly as TriviaQA (`triviaqa.TriviaQATask`) with another data set.

A training-pool task (`../shared/data/qa_pool/nq_open.jsonl`, or `nq_open` validation on the Hub): nothing reported
is drawn from it.
"""

from __future__ import annotations

from ...errors import ATSError
from ...io import read_jsonl
from ...sources import hub_dataset, local_file
from .triviaqa import TriviaQATask


def load_nq_open() -> list[dict]:
    """Every question as {question, value, aliases} (value: the first answer).

    Returns:
        The rows, from `qa_pool/nq_open.jsonl` under ATS_DATA_DIR or from the Hub.

    Raises:
        ATSError: if the data cannot be read or a row has no question or no answer (naming the line).
    """
    path = local_file("qa_pool/nq_open.jsonl")
    rows = read_jsonl(path) if path is not None else enumerate(hub_dataset("nq_open", None, "validation"), start=1)
    out = []
    for line, r in rows:
        answers = r.get("answers") if isinstance(r, dict) else None
        question = r.get("question") if isinstance(r, dict) else None
        if not isinstance(question, str) or not question.strip() or not answers or not isinstance(answers, list):
            raise ATSError(f"{path or 'nq_open'}: line {line}: expected {{question, answers: [...]}}, got "
                           f"{str(r)[:80]}")
        out.append({"question": question.strip(), "value": str(answers[0]), "aliases": [str(a) for a in answers]})
    return out


class NQOpenTask(TriviaQATask):
    """NQ-open generation; the options and the protocol are TriviaQA's (`TriviaQATask`)."""

    name = "nq_open"

    def rows(self) -> list[dict]:
        """Every NQ-open question as {question, value, aliases}."""
        return load_nq_open()
