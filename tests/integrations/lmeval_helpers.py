"""Helpers of the lm-eval bridge tests: a local multiple-choice task, running `ats lm-eval`, reading samples files
independently of ats's reader."""

from __future__ import annotations

import json
from pathlib import Path

TASK = "ats_toy_mc"


def toy_rows(n: int = 40) -> list[dict]:
    """Arithmetic questions; some choices are digits, so a target "0" could be read as an index or as a choice."""
    rows = []
    for i in range(n):
        a, b = i % 7, (3 * i) % 5
        right = str(a + b)
        wrong = [str(a + b + 1), str(abs(a - b) + 10), "none of these"]
        choices = wrong[:]
        answer = i % 4
        choices.insert(answer, right)
        if i % 10 == 3:  # the digit "0" as a choice that is not choice 0
            choices[(answer + 1) % 4] = "0"
        rows.append({"question": f"What is {a} plus {b}?", "choices": choices, "answer": answer})
    return rows


def write_task(folder: Path, rows: list[dict], name: str = TASK, extra: str = "") -> Path:
    """A local lm-eval multiple-choice task: `folder/name.yaml` reading `folder/name.jsonl`. Returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / f"{name}.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: \"Q: {{question}}\\nA:\"\ndoc_to_choice: \"{{choices}}\"\n"
        "doc_to_target: answer\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n" + extra)
    return folder


def run_lm_eval(argv: list[str]) -> int:
    """`ats lm-eval ARGV` in this process; its exit status."""
    from ats.cli.main import main

    return main(["lm-eval", *argv])


def evaluate_to_files(model: str, model_args: str, task_manager, out: Path, *, batch_size: int = 1) -> Path:
    """lm-eval on TASK with `--log_samples`, saved as lm-eval's command line saves it; the samples file."""
    import lm_eval
    from lm_eval.loggers import EvaluationTracker

    import ats.integrations.lm_eval_model  # noqa: F401  registers the "ats" model

    tracker = EvaluationTracker(output_path=str(out))
    results = lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=[TASK], task_manager=task_manager,
                                      device="cpu", batch_size=batch_size, log_samples=True,
                                      evaluation_tracker=tracker, verbosity="ERROR")
    samples = results.pop("samples")
    tracker.save_results_aggregated(results=results, samples=samples)
    tracker.save_results_samples(task_name=TASK, samples=samples[TASK])
    (path,) = out.rglob(f"samples_{TASK}_*.jsonl")
    return path


def read_lines(path: Path) -> list[dict]:
    """A samples file's lines by doc_id (read independently of ats's reader)."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda r: r["doc_id"])


def loglikelihoods(row: dict) -> list[float]:
    return [float(r[0]) for r in row["filtered_resps"]]


def rolling_loglikelihood(backbone, calibrator, text: str) -> tuple[float, int]:
    """Independently: (the calibrated log-likelihood of `text` as one rolling window, its token count): lm-eval's
    prefix token, then the text, scored by `calibrator.apply` on the whole row (no positions given)."""
    import torch

    tok = backbone.tokenizer
    ids = [tok.bos_token_id] + tok(text, add_special_tokens=False).input_ids
    hidden, _ = backbone.forward(torch.tensor([ids[:-1]]))
    logp = torch.log_softmax(calibrator.apply(backbone.logits(hidden), hidden), dim=-1)[0]
    return float(logp.gather(1, torch.tensor(ids[1:])[:, None]).sum()), len(ids) - 1
