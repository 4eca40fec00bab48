"""MMLU, 5-shot, scored by the four letter tokens (the paper's reference protocol, with its defects fixed).

Prompt of a subject (the few-shot examples are the first `n_shots` of the subject's dev split):

    The following are multiple choice questions (with answers) about {subject, _ -> space}.\\n\\n
    {question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer: {letter}\\n\\n      (x n_shots)
    {question}\\nA. ..\\nB. ..\\nC. ..\\nD. ..\\nAnswer:

Confidence = softmax over the tokens " A", " B", " C", " D" of the calibrated logits at the answer position;
correct = its argmax is the answer. Binning calibrators map that top-1 confidence.

Chat models are NOT given their chat template here: MMLU is a raw few-shot completion, as in the reference evaluator
(the letters must follow "Answer:" directly).

The few-shot prefix of a subject is encoded once (KV cache + hidden states, `PrefixCache`); each question then costs
only its own tokens, batched with the cache repeated over the batch.

Data: `ATS_DATA_DIR/mmlu/{dev,test}.jsonl` when ATS_DATA_DIR is set, else the Hub's `cais/mmlu` ("all").
"""

from __future__ import annotations

from collections import defaultdict

from ...calibrators.base import Calibrator
from ...errors import ATSError
from ...sources import hub_dataset, local_file
from .base import Task, TaskResult, read_jsonl, seeded_subset
from .multiple_choice import letter_prompt
from .scoring import ItemGroup, LetterItem, encode, letter_token_ids, score_groups

LETTERS = "ABCD"


def format_subject(subject: str) -> str:
    """The subject as it reads in the header ("high_school_physics" -> "high school physics").

    Args:
        subject: the subject's name.

    Returns:
        The name with underscores as spaces.
    """
    return subject.replace("_", " ")


def header(subject: str) -> str:
    """The first line of every prompt of `subject`, with the blank line after it.

    Args:
        subject: the subject's name.

    Returns:
        "The following are multiple choice questions (with answers) about {subject}.\\n\\n".
    """
    return f"The following are multiple choice questions (with answers) about {format_subject(subject)}.\n\n"


def format_example(row: dict, *, with_answer: bool) -> str:
    """One question in the letter layout, ending with "Answer:" (and its letter, for a few-shot example).

    Args:
        row: {question, choices[4], answer}.
        with_answer: append " {letter}\\n\\n" (a few-shot example).

    Returns:
        The question's text.
    """
    text = letter_prompt(row["question"], list(row["choices"]))
    if with_answer:
        text += f" {LETTERS[int(row['answer'])]}\n\n"
    return text


def few_shot_prefix(subject: str, shots: list[dict]) -> str:
    """The part of every prompt of `subject` before its question.

    Args:
        subject: the subject's name.
        shots: the few-shot examples, with their answers.

    Returns:
        The header followed by the answered examples.
    """
    return header(subject) + "".join(format_example(r, with_answer=True) for r in shots)


def render_prompt(subject: str, shots: list[dict], row: dict) -> str:
    """The full prompt of one question, ending with "Answer:".

    Args:
        subject: the subject's name.
        shots: the few-shot examples.
        row: the question.

    Returns:
        The prompt.
    """
    return few_shot_prefix(subject, shots) + format_example(row, with_answer=False)


def _check_row(row: dict, where: str) -> dict:
    try:
        out = {"subject": str(row["subject"]), "question": str(row["question"]),
               "choices": [str(c) for c in row["choices"]], "answer": int(row["answer"])}
    except (KeyError, TypeError, ValueError) as err:
        raise ATSError(f"{where}: malformed MMLU row ({err!r})") from None
    if len(out["choices"]) != 4 or not 0 <= out["answer"] < 4:
        raise ATSError(f"{where}: MMLU rows need 4 choices and an answer 0-3")
    return out


def load_mmlu(split: str) -> list[dict]:
    """Rows {subject, question, choices[4], answer} of split 'dev' / 'validation' / 'test'.

    Args:
        split: the split's name.

    Returns:
        The validated rows (answer: 0-3).

    Raises:
        ATSError: if the data cannot be read or a row is malformed.
    """
    path = local_file(f"mmlu/{split}.jsonl")
    if path is not None:
        return [_check_row(r, f"{path}: row {i + 1}") for i, r in enumerate(read_jsonl(path))]
    data = hub_dataset("cais/mmlu", "all", split)
    return [_check_row(dict(r), f"cais/mmlu {split} row {i}") for i, r in enumerate(data)]


class MMLUTask(Task):
    """MMLU letter scoring; `limit` = questions per subject (a seeded subset), `subjects` = which subjects.

    Args:
        limit: questions per subject; None: all.
        seed: the seed of the subsets.
        n_shots: few-shot examples per prompt, the first of the subject's dev split.
        subjects: a subject or a list of them; None: all.
        batch_size: questions per forward pass.
        split: the evaluated split ("test", "validation" or "dev").
        held_out_from: per subject, questions outside the seeded subset of this size only; None: any.

    Raises:
        ATSError: if `n_shots` < 0.
    """

    name = "mmlu"

    def __init__(self, *, limit: int | None = None, seed: int = 0, n_shots: int = 5,
                 subjects: list[str] | str | None = None, batch_size: int = 8, split: str = "test",
                 held_out_from: int | None = None) -> None:
        if n_shots < 0:
            raise ATSError(f"mmlu: n_shots must be >= 0, got {n_shots}")
        self.limit = limit
        self.seed = seed
        self.n_shots = n_shots
        self.subjects = [subjects] if isinstance(subjects, str) else (list(subjects) if subjects else None)
        self.batch_size = batch_size
        self.split = split
        self.held_out_from = held_out_from

    def describe(self) -> dict:
        """The settings that determine the results.

        Returns:
            {"name", "limit", "seed", "n_shots", "subjects", "split"}.
        """
        out = {"name": self.name, "limit": self.limit, "seed": self.seed, "n_shots": self.n_shots,
               "subjects": self.subjects, "split": self.split}
        return out if self.held_out_from is None else {**out, "held_out_from": self.held_out_from}

    def load(self) -> tuple[dict[str, list[dict]], dict[str, list[dict]]]:
        """(questions per subject, few-shot examples per subject), subjects sorted, questions subsampled.

        Returns:
            (subject -> evaluated questions, subject -> few-shot examples).

        Raises:
            ATSError: if the data cannot be read, a subject is unknown, or one has fewer than `n_shots` dev examples.
        """
        test = defaultdict(list)
        for row in load_mmlu(self.split):
            test[row["subject"]].append(row)
        dev = defaultdict(list)
        if self.n_shots:
            for row in load_mmlu("dev"):
                dev[row["subject"]].append(row)
        names = sorted(test)
        if self.subjects is not None:
            unknown = [s for s in self.subjects if s not in test]
            if unknown:
                raise ATSError(f"mmlu: unknown subject(s) {', '.join(unknown)}; known: {', '.join(names)}")
            names = [s for s in names if s in set(self.subjects)]
        questions, shots = {}, {}
        for s in names:
            questions[s] = [test[s][i] for i in seeded_subset(len(test[s]), self.limit, self.seed, salt=s,
                                                              held_out_from=self.held_out_from)]
            shots[s] = dev[s][:self.n_shots]
            if len(shots[s]) < self.n_shots:
                raise ATSError(f"mmlu: subject {s} has {len(shots[s])} dev examples, fewer than n_shots="
                               f"{self.n_shots}")
        return questions, shots

    def groups(self, tokenizer) -> list[ItemGroup]:
        """One group per subject: the few-shot prefix and the letter-scored questions (the prompts `run` scores).

        Args:
            tokenizer: the backbone's tokenizer.

        Returns:
            The groups, subjects in sorted order.

        Raises:
            ATSError: if the data cannot be loaded or the letters are not single tokens.
        """
        letters = letter_token_ids(tokenizer, 4)
        questions, shots = self.load()
        groups = []
        for subject in questions:
            prefix_text = few_shot_prefix(subject, shots[subject])
            items = [LetterItem(ids=encode(tokenizer, prefix_text + format_example(r, with_answer=False), special=True),
                                letters=letters, answer=r["answer"]) for r in questions[subject]]
            groups.append(ItemGroup(subject, encode(tokenizer, prefix_text, special=True), items))
        return groups

    def run(self, backbone, calibrators: dict[str, Calibrator], *, progress: bool = True) -> dict[str, TaskResult]:
        """Score every selected question by its letters, subject by subject (each prefix encoded once).

        Same arguments as `Task.run`; returns method -> per-question results, subjects in sorted order (extra:
        "prediction", "answer"). Raises `ATSError` if the data cannot be loaded or the letters are not single
        tokens.
        """
        return score_groups(backbone, calibrators, self.groups(backbone.tokenizer), batch_size=self.batch_size,
                            progress=progress)
