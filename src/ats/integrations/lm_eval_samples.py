"""lm-evaluation-harness sample files (`--log_samples`): the per-choice log-likelihoods of multiple-choice tasks.

lm-eval writes one `samples_<task>_<date>.jsonl` per task (and a `results_<date>.json` beside it). Each line of a
multiple-choice task holds one question: `doc_id`, `doc_hash`, `target` (the right choice: an index, a choice's text
or a list of indices, written with `str()`), `arguments` (one (context, continuation) pair per choice, as
`{"gen_args_i": {"arg_0": context, "arg_1": continuation}}`), `filtered_resps` (one `[log-likelihood, is_greedy]`
per choice, numbers written as strings) and the metrics lm-eval computed (`acc`, `acc_norm`, ...). Nothing in this
file depends on which model produced them or on lm-eval being installed.

From them `read_samples` rebuilds what lm-eval scored: `scores(sample, "acc")` are the log-likelihoods (lm-eval's
`acc` takes their argmax), `scores(sample, "acc_norm")` the log-likelihoods divided by each choice's length in
characters (lm-eval's `acc_norm`; a choice is its continuation without the task's `target_delimiter`). The gold
answer follows lm-eval's rules; a `target` such as "0" that could be an index or a choice's text is resolved by the
accuracy lm-eval recorded for that line. Every malformed line is one ATSError naming the file and line.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..errors import ATSError
from ..io import read_json, read_jsonl

logger = logging.getLogger(__name__)

VARIANTS = ("acc", "acc_norm")  # which of lm-eval's scores a confidence is a softmax of
SAMPLES_NAME = re.compile(r"^samples_(?P<task>.+)_(?P<date>\d{4}-\d{2}-\d{2}T[0-9.\-]+)\.jsonl$")
DEFAULT_DELIMITER = " "  # lm-eval's default target_delimiter


class NotMultipleChoice(ATSError):
    """A sample of a task that is not multiple choice (generate_until, loglikelihood of one continuation)."""


@dataclass
class Sample:
    """One multiple-choice question as lm-eval scored it."""

    doc_id: int
    doc_hash: str | None
    loglikelihoods: np.ndarray  # (C,) one per choice
    lengths: np.ndarray  # (C,) characters of each choice (lm-eval's acc_norm divides by them)
    gold: tuple[int, ...]  # the right choice(s)
    recorded: dict[str, float] = field(default_factory=dict)  # lm-eval's own acc / acc_norm for this line

    def scores(self, variant: str) -> np.ndarray:
        """(C,) what lm-eval's `variant` ("acc" or "acc_norm") takes the argmax of."""
        return self.loglikelihoods if variant == "acc" else self.loglikelihoods / self.lengths


@dataclass
class SamplesFile:
    """The multiple-choice samples of one task from one lm-eval run."""

    path: Path
    task: str
    label: str  # the model (and calibrator) that produced it, for tables
    samples: list[Sample]
    delimiter: str = DEFAULT_DELIMITER
    mismatches: dict[str, int] = field(default_factory=dict)  # lines where our argmax disagrees with lm-eval's metric

    @property
    def has_norm(self) -> bool:
        """Whether every choice has a length (acc_norm is defined)."""
        return all(bool((s.lengths > 0).all()) for s in self.samples)


def _number(value, where: str) -> float:
    try:
        out = float(value)
    except (TypeError, ValueError):
        raise ATSError(f"{where}: expected a number, got {value!r}") from None
    if np.isnan(out):
        raise ATSError(f"{where}: log-likelihood is NaN")
    return out


def _pairs(row: dict, where: str) -> list[tuple[str, str]]:
    """(context, continuation) per request, from the file layout or the in-memory one (a list of tuples)."""
    arguments = row.get("arguments")
    if isinstance(arguments, dict):
        items = [arguments[k] for k in sorted(arguments, key=lambda k: int(re.sub(r"\D", "", k) or 0))]
        items = [[a.get(f"arg_{j}") for j in range(len(a))] if isinstance(a, dict) else a for a in items]
    elif isinstance(arguments, list):
        items = arguments
    else:
        raise ATSError(f"{where}: field 'arguments' missing or not an object")
    pairs = []
    for item in items:
        if not isinstance(item, (list, tuple)) or len(item) != 2 or not all(isinstance(x, str) for x in item):
            raise NotMultipleChoice(f"{where}: not a multiple-choice sample (arguments hold {str(item)[:60]!r}, "
                                    f"expected (context, continuation) pairs); calibration reports need per-choice "
                                    f"log-likelihoods")
        pairs.append((item[0], item[1]))
    return pairs


def _loglikelihoods(row: dict, where: str) -> np.ndarray:
    resps = row.get("filtered_resps", row.get("resps"))
    if not isinstance(resps, list) or len(resps) < 2:
        raise NotMultipleChoice(f"{where}: not a multiple-choice sample (filtered_resps holds {str(resps)[:60]!r}); "
                                f"calibration reports need at least two per-choice log-likelihoods")
    values = []
    for i, r in enumerate(resps):
        if isinstance(r, list) and len(r) == 1 and isinstance(r[0], list):  # `resps` nests one level deeper
            r = r[0]
        if not isinstance(r, (list, tuple)) or len(r) != 2:
            raise NotMultipleChoice(f"{where}: not a multiple-choice sample (response {i} is {str(r)[:60]!r}, "
                                    f"expected [log-likelihood, is_greedy])")
        values.append(_number(r[0], f"{where}: response {i}"))
    return np.asarray(values, dtype=np.float64)


def _gold_options(target, choices: list[str], where: str) -> list[tuple[int, ...]]:
    """The readings of `target` as lm-eval's gold (an index, a choice's text, a list of indices), likeliest first."""
    n = len(choices)
    if isinstance(target, str):
        options = []
        try:
            parsed = json.loads(target)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, (int, list)) and not isinstance(parsed, bool):
            options += _gold_options(parsed, choices, where)
        if target in choices:
            options.append((choices.index(target),))
        if not options:
            raise ATSError(f"{where}: field 'target' {target[:60]!r} is neither a choice index nor one of the "
                           f"choices {[c[:20] for c in choices]}")
        return list(dict.fromkeys(options))
    if isinstance(target, bool) or not isinstance(target, (int, list)):
        raise ATSError(f"{where}: field 'target' must be an index, a choice or a list of indices, got {target!r}")
    indices = target if isinstance(target, list) else [target]
    gold = []
    for t in indices:
        if isinstance(t, str) and t in choices:
            t = choices.index(t)
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < n:
            raise ATSError(f"{where}: field 'target' {target!r} is not a choice index in 0-{n - 1}")
        gold.append(t)
    return [tuple(gold)]


def parse_sample(row, where: str, delimiter: str = DEFAULT_DELIMITER) -> Sample:
    """One line of a samples file as a Sample (see the module docstring).

    Args:
        row: the line's JSON object.
        where: "path:line", quoted in errors.
        delimiter: the task's target_delimiter, stripped from each continuation to get the choice text.

    Returns:
        The sample.

    Raises:
        ATSError: if a field is missing or malformed, or arguments and responses differ in number.
    """
    if not isinstance(row, dict):
        raise ATSError(f"{where}: expected a JSON object (an lm-eval sample), got {type(row).__name__}")
    for key in ("doc_id", "target"):
        if key not in row:
            raise ATSError(f"{where}: missing field '{key}' (not an lm-eval --log_samples file?)")
    if isinstance(row["doc_id"], bool) or not isinstance(row["doc_id"], int):
        raise ATSError(f"{where}: field 'doc_id' must be an integer, got {row['doc_id']!r}")
    lls = _loglikelihoods(row, where)
    pairs = _pairs(row, where)
    if len(pairs) != len(lls):
        raise ATSError(f"{where}: {len(pairs)} arguments but {len(lls)} responses")
    if "acc_mutual_info" in row and len(lls) % 2 == 0:  # lm-eval appends one unconditional request per choice
        lls, pairs = lls[: len(lls) // 2], pairs[: len(pairs) // 2]
    choices = [cont[len(delimiter):] if delimiter and cont.startswith(delimiter) else cont for _, cont in pairs]
    recorded = {k: _number(row[k], f"{where}: field '{k}'") for k in VARIANTS if k in row}
    options = _gold_options(row["target"], choices, where)
    gold = options[0]
    if len(options) > 1 and "acc" in recorded:  # e.g. target "0": index 0 or the choice "0"; lm-eval's acc decides
        pred = int(np.argmax(lls))
        gold = next((g for g in options if float(pred in g) == recorded["acc"]), gold)
    return Sample(doc_id=row["doc_id"], doc_hash=row.get("doc_hash"), loglikelihoods=lls,
                  lengths=np.asarray([float(len(c)) for c in choices]), gold=gold, recorded=recorded)


def _run_info(path: Path, task: str) -> tuple[str | None, str | None]:
    """(target_delimiter of `task`, a model label) from the `results_<date>.json` lm-eval wrote beside `path`."""
    match = SAMPLES_NAME.match(path.name)
    results = path.with_name(f"results_{match['date']}.json") if match else None
    if results is None or not results.is_file():
        return None, None
    data = read_json(results)
    if not isinstance(data, dict):
        return None, None
    delimiter = (data.get("configs", {}).get(task) or {}).get("target_delimiter")
    config = data.get("config") or {}
    args = config.get("model_args")
    if isinstance(args, str):
        args = dict(kv.split("=", 1) for kv in args.split(",") if "=" in kv)
    label = str(config.get("model") or "") or None
    if label and isinstance(args, dict):
        if args.get("pretrained"):
            label += f" {Path(str(args['pretrained'])).name}"
        if "calibrator" in args:
            cal = str(args["calibrator"])
            label += f" calibrator={Path(cal).name if cal.lower() != 'none' else 'none'}"
    return delimiter if isinstance(delimiter, str) else None, label


def read_samples(path: str | Path, *, task: str | None = None, delimiter: str | None = None,
                 label: str | None = None, filter_name: str | None = None) -> SamplesFile:
    """Read the multiple-choice samples of one lm-eval samples file.

    Args:
        path: the `samples_<task>_<date>.jsonl` file.
        task: default from the file name.
        delimiter: the task's target_delimiter; default from the `results_<date>.json` beside the file, else
            lm-eval's default " ".
        label: the model's label in reports; default from that results file (model, pretrained, calibrator), else
            the file's name.
        filter_name: which of lm-eval's filters to read when a file holds several (default "none" if present,
            else the only one).

    Returns:
        The parsed file (a warning counts the lines whose recorded acc the log-likelihoods do not reproduce).

    Raises:
        ATSError: if the file is missing or empty, holds several filters and none is chosen, a line is malformed,
            or a doc_id appears twice.
    """
    path = Path(path)
    if not path.is_file():
        raise ATSError(f"{path}: samples file not found")
    match = SAMPLES_NAME.match(path.name)
    task = task or (match["task"] if match else path.stem)
    found_delimiter, found_label = _run_info(path, task)
    delimiter = delimiter if delimiter is not None else found_delimiter if found_delimiter is not None \
        else DEFAULT_DELIMITER
    rows = list(read_jsonl(path))
    if not rows:
        raise ATSError(f"{path}: empty samples file")
    filters = list(dict.fromkeys(r.get("filter", "none") for _, r in rows if isinstance(r, dict)))
    if filter_name is None:
        if len(filters) > 1 and "none" not in filters:
            raise ATSError(f"{path}: several filters ({', '.join(filters)}); choose one")
        filter_name = "none" if "none" in filters or not filters else filters[0]
    samples, seen, mismatches = [], set(), {k: 0 for k in VARIANTS}
    for lineno, row in rows:
        where = f"{path}:{lineno}"
        if isinstance(row, dict) and row.get("filter", "none") != filter_name:
            continue
        sample = parse_sample(row, where, delimiter)
        if sample.doc_id in seen:
            raise ATSError(f"{where}: doc_id {sample.doc_id} appears twice (several runs appended to one file?)")
        seen.add(sample.doc_id)
        samples.append(sample)
        for variant, value in sample.recorded.items():
            if float(int(np.argmax(sample.scores(variant))) in sample.gold) != value:
                if not mismatches[variant]:
                    logger.warning("%s: the %s recomputed from the log-likelihoods differs from lm-eval's (%s); "
                                   "the task may score choices its own way", where, variant, value)
                mismatches[variant] += 1
    if not samples:
        raise ATSError(f"{path}: no samples with filter {filter_name!r}")
    return SamplesFile(path=path, task=task, label=label or found_label or path.stem, samples=samples,
                       delimiter=delimiter, mismatches={k: v for k, v in mismatches.items() if v})
