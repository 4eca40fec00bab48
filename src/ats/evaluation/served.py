"""Free-form questions answered as `ats serve` answers a chat request, and judged: the answers `ats certify`
certifies, so that the certified confidence and correctness are those of a served answer.

Each question goes alone as one user turn through the backbone's chat template (raw text for a backbone without
one), and is answered greedily from the calibrated logits by the decoder `ats serve` and `ats generate` run
(`generation.generate_calibrated`), until an end-of-sequence token or `max_tokens` new tokens (no stop strings).
The confidence is the served one, `answer_confidence` (a correctness probe's P(correct); otherwise the mean
calibrated probability of the answer's tokens, the end-of-sequence token left out, through the calibrator's map when
it has one); an answer without tokens has none and
is never answered, recorded here as confidence 0. Correct = a normalised alias occurs in the normalised answer as
whole words (`tasks.triviaqa.contains_match`): a chat answer states its answer inside a sentence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from ..confidence import ANSWER_MAX_TOKENS
from ..errors import ATSError
from .tasks.triviaqa import contains_match

JUDGE = "a normalised alias contained in the normalised answer, as whole words"


def answer_format(backbone, max_tokens: int = ANSWER_MAX_TOKENS) -> dict:
    """How the certified answers were made and judged (recorded in threshold.json): the prompt, whether the chat
    template was applied, decoding, stop rule, max tokens, confidence and judge."""
    return {"prompt": "the question alone, one user turn", "chat_template": bool(backbone.is_chat),
            "decoding": "greedy on the calibrated logits (ats serve's decoder)",
            "stop": "end-of-sequence tokens only", "max_tokens": int(max_tokens),
            "confidence": "answer_confidence as served (a correctness probe's P(correct); otherwise the mean "
                          "calibrated token probability, end-of-sequence left out)",
            "judge": JUDGE}


@dataclass
class ServedAnswers:
    """Answers to questions, in order: confidence (N,), correct (N,) bool, text and finish reason per answer, and
    `uncalibrated` (N,): the backbone's own answer confidence of the same answers (a scaling calibrator never changes
    the greedy answer, so this is the raw model's served confidence too; 0 where there is none)."""

    confidence: np.ndarray = field(default_factory=lambda: np.zeros(0))
    uncalibrated: np.ndarray = field(default_factory=lambda: np.zeros(0))
    correct: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=bool))
    text: list[str] = field(default_factory=list)
    finish: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return int(self.confidence.size)

    def extend(self, other: "ServedAnswers") -> None:
        """Append `other`'s answers."""
        self.confidence = np.concatenate([self.confidence, other.confidence])
        self.uncalibrated = np.concatenate([self.uncalibrated, other.uncalibrated])
        self.correct = np.concatenate([self.correct, other.correct])
        self.text += other.text
        self.finish += other.finish

    def to_dict(self) -> dict:
        """The answers as JSON columns (a float64 goes through JSON unchanged, so `from_dict` gives them back
        exactly)."""
        return {"confidence": self.confidence.tolist(), "uncalibrated": self.uncalibrated.tolist(),
                "correct": self.correct.tolist(), "text": list(self.text), "finish": list(self.finish)}

    @classmethod
    def from_dict(cls, columns, *, where: str) -> "ServedAnswers":
        """The answers `to_dict` wrote.

        Raises:
            ATSError: naming `where` and the column, if one is missing, of the wrong type or of another length.
        """
        number = ((int, float), "number")
        kinds = {"confidence": number, "uncalibrated": number, "correct": ((bool,), "bool"), "text": ((str,), "str"),
                 "finish": ((str,), "str")}
        if not isinstance(columns, dict):
            raise ATSError(f"{where}: expected an object of answer columns, got {type(columns).__name__}")
        for name, (kind, word) in kinds.items():
            value = columns.get(name)
            if not isinstance(value, list) or not all(isinstance(v, kind) for v in value):
                raise ATSError(f"{where}: field '{name}' must be a list of {word}")
            if len(value) != len(columns["confidence"]):
                raise ATSError(f"{where}: field '{name}' has {len(value)} answers, 'confidence' "
                               f"{len(columns['confidence'])}")
        return cls(np.asarray(columns["confidence"], dtype=np.float64),
                   np.asarray(columns["uncalibrated"], dtype=np.float64), np.asarray(columns["correct"], dtype=bool),
                   list(columns["text"]), list(columns["finish"]))


def served_answers(backbone, calibrator, questions: list[dict], *, max_tokens: int = ANSWER_MAX_TOKENS,
                   batch_size: int = 16) -> ServedAnswers:
    """Answer `questions` as served and judge them (the module docstring).

    Args:
        backbone: the frozen backbone.
        calibrator: the calibrator whose logits decode and whose confidence is reported (None: the model's own).
        questions: rows {"question", "aliases"}.
        max_tokens: new tokens at most per answer.
        batch_size: questions decoded together (the answers' confidences depend on it only by float rounding,
            through the padding of the batch).

    Returns:
        The answers, in the order of `questions`.
    """
    from ..generation import generate_calibrated

    out = ServedAnswers()
    conf: list[float] = []
    raw: list[float] = []
    for start in range(0, len(questions), batch_size):
        batch = questions[start:start + batch_size]
        for q, gen in zip(batch, generate_calibrated(backbone, calibrator, [q["question"] for q in batch],
                                                     max_new_tokens=max_tokens, chat_template=True)):
            conf.append(_probability(gen.answer_confidence))
            raw.append(_probability(gen.uncalibrated_answer_confidence))
            out.text.append(gen.text)
            out.finish.append(gen.finish_reason)
    out.confidence = np.asarray(conf, dtype=np.float64)
    out.uncalibrated = np.asarray(raw, dtype=np.float64)
    out.correct = np.asarray([contains_match(t, q["aliases"]) for t, q in zip(out.text, questions)], dtype=bool)
    return out


def _probability(value: float | None) -> float:
    """An answer's confidence as recorded: 0 for an answer without one (never answered)."""
    return 0.0 if value is None or not math.isfinite(value) else float(value)
