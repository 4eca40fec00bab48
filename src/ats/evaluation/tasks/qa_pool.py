"""The multiple-choice sets of the answer pool (SciQ, Social IQa, BoolQ, Winogrande), local or from the Hub.

With `ATS_DATA_DIR` set, `qa_pool/<name>.jsonl` there is read as it is. Otherwise (the online default) the set's
validation split is loaded from the Hub, converted to the pool's rows {question, choices, answer} the way the local
files were made (`../shared/data/README.md`), and written once under `$ATS_CACHE/qa_pool/` so that
`MultipleChoiceTask` reads a file either way:

- SciQ (`allenai/sciq`): the question; the three distractors and the correct answer in an order shuffled per row
  with `random.Random(0)` (the local file's order came from another shuffle with seed 0, so choices may be ordered
  differently online; the questions and answers are the same);
- Social IQa (`allenai/social_i_qa`): context + " " + question; answerA/B/C; label "1".."3" -> 0..2;
- BoolQ (`google/boolq`): passage + "\\nQuestion: " + question + "?"; choices no / yes;
- Winogrande (`allenai/winogrande`, "winogrande_xl"): the sentence with its blank; option1 / option2; "1"/"2" -> 0/1.
"""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

from ...errors import ATSError
from ...model.backbone import cache_dir
from ...sources import hub_dataset, local_file

HUB = {"sciq": ("allenai/sciq", None), "social_iqa": ("allenai/social_i_qa", None), "boolq": ("google/boolq", None),
       "winogrande": ("allenai/winogrande", "winogrande_xl")}


def _sciq(r: dict, rng: random.Random) -> dict:
    choices = [r["distractor1"], r["distractor2"], r["distractor3"], r["correct_answer"]]
    order = list(range(4))
    rng.shuffle(order)
    return {"question": r["question"], "choices": [choices[i] for i in order], "answer": order.index(3)}


def _social_iqa(r: dict, rng: random.Random) -> dict:
    return {"question": f"{r['context']} {r['question']}", "choices": [r["answerA"], r["answerB"], r["answerC"]],
            "answer": int(r["label"]) - 1}


def _boolq(r: dict, rng: random.Random) -> dict:
    return {"question": f"{r['passage']}\nQuestion: {r['question']}?", "choices": ["no", "yes"],
            "answer": int(bool(r["answer"]))}


def _winogrande(r: dict, rng: random.Random) -> dict:
    return {"question": r["sentence"], "choices": [r["option1"], r["option2"]], "answer": int(r["answer"]) - 1}


CONVERT = {"sciq": _sciq, "social_iqa": _social_iqa, "boolq": _boolq, "winogrande": _winogrande}


def convert_rows(name: str, rows) -> list[dict]:
    """The pool's rows {question, choices, answer} of a Hub split's records (see the module docstring).

    Raises:
        ATSError: if `name` is not a pool set or a record lacks a field (naming the record).
    """
    if name not in CONVERT:
        raise ATSError(f"qa pool: unknown set {name!r}; expected one of {', '.join(CONVERT)}")
    rng = random.Random(0)
    out = []
    for i, r in enumerate(rows):
        try:
            out.append(CONVERT[name](dict(r), rng))
        except (KeyError, TypeError, ValueError) as err:
            raise ATSError(f"{HUB[name][0]} validation record {i}: cannot convert ({err!r})") from None
    return out


def pool_path(name: str) -> Path:
    """The JSONL file of pool set `name`: `qa_pool/<name>.jsonl` under ATS_DATA_DIR, else converted from the Hub
    once into `$ATS_CACHE/qa_pool/<name>.jsonl` (written atomically).

    Raises:
        ATSError: if the set is unknown, the local file is missing, or the Hub cannot be reached.
    """
    if name not in HUB:
        raise ATSError(f"qa pool: unknown set {name!r}; expected one of {', '.join(HUB)}")
    path = local_file(f"qa_pool/{name}.jsonl")
    if path is not None:
        return path
    target = cache_dir() / "qa_pool" / f"{name}.jsonl"
    if not target.is_file():
        repo, config = HUB[name]
        rows = convert_rows(name, hub_dataset(repo, config, "validation"))
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(f".{os.getpid()}.partial")
        partial.write_text("".join(json.dumps(r) + "\n" for r in rows))
        partial.replace(target)
    return target
