"""`ats lm-eval`: lm-eval's own command line with the `ats` model, then calibration reports of its multiple-choice
tasks (generative ones are run and skipped); bad `--model ats` arguments are refused before anything loads."""

from __future__ import annotations

import json

import pytest

from ats.calibrators import load_calibrator
from ats.integrations.calibration_report import calibration_report
from ats.integrations.lm_eval_samples import read_samples

from lmeval_helpers import TASK, run_lm_eval, toy_rows, write_task

GEN_TASK = """task: ats_toy_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Q: {{{{question}}}}\\nA:"
doc_to_target: "{{{{choices[answer]}}}}"
generation_kwargs:
  until: ["\\n"]
  max_gen_toks: 4
  do_sample: true
  temperature: 1.0
metric_list:
  - metric: exact_match
"""


@pytest.mark.slow  # lm-eval's whole command line, two tasks (about 12 s)
def test_one_command_runs_lm_eval_with_a_head_and_reports_calibration(tiny_folder, head_dir, tmp_path, capsys):
    tasks = write_task(tmp_path / "tasks", toy_rows(12))
    (tasks / "ats_toy_gen.yaml").write_text(GEN_TASK.format(data=tasks / f"{TASK}.jsonl"))
    out = tmp_path / "results"
    assert run_lm_eval(["--model", "ats", "--model_args", f"pretrained={tiny_folder},calibrator={head_dir}",
                        "--device", "cpu", "--include_path", str(tasks), "--tasks", f"{TASK},ats_toy_gen",
                        "--log_samples", "--output_path", str(out), "--limit", "6"]) == 0
    printed = capsys.readouterr().out
    (samples,) = out.rglob(f"samples_{TASK}_*.jsonl")
    assert len(list(out.rglob("samples_ats_toy_gen_*.jsonl"))) == 1  # generated, and no report for it
    (report_dir,) = out.rglob("calibration_*")
    written = json.loads((report_dir / "calibration.json").read_text())
    assert list(written["results"]) == [TASK, f"{TASK} (acc_norm)"]
    again = calibration_report([read_samples(samples)], tmp_path / "again")
    assert written["results"] == again["results"]
    assert "| ats_toy_mc | ats tiny-model0 calibrator=head | 6 |" in printed
    config = json.loads(next(out.rglob("results_*.json")).read_text())["config"]
    assert config["ats_calibrator_digest"] == load_calibrator(head_dir).digest()


@pytest.mark.parametrize("model_args, message", [
    ("pretrained={tiny},calibrator=temperature", "calibrator=temperature: a method name, not a fitted calibrator"),
    ("pretrained={tiny},calibrator={tmp}/missing", "no such calibrator folder"),
    ("pretrained={tmp}/no-model,calibrator=none", "pretrained={tmp}/no-model: no such file or folder"),
])
def test_bad_ats_model_arguments_are_refused_before_lm_eval_starts(tiny_folder, tmp_path, capsys, model_args,
                                                                   message):
    args = model_args.format(tiny=tiny_folder, tmp=tmp_path)
    assert run_lm_eval(["--model", "ats", "--model_args", args, "--tasks", TASK, "--output_path",
                        str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("ats: error: ") and message.format(tmp=tmp_path) in err and "\n" not in err
    assert not (tmp_path / "out").exists()


def test_lm_evals_refusal_of_its_arguments_is_one_line(tiny_folder, tmp_path, capsys):
    """lm-eval's own check of its arguments (here an unknown task, before any model loads) raises ValueError; the
    CLI prints it as one line, as it prints its own."""
    tasks = write_task(tmp_path / "tasks", toy_rows(4))
    assert run_lm_eval(["--model", "ats", "--model_args", f"pretrained={tiny_folder},calibrator=none",
                        "--include_path", str(tasks), "--tasks", f"{TASK},no_such_task_xyz", "--output_path",
                        str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == "ats: error: lm-eval: Tasks not found: no_such_task_xyz" and "Traceback" not in "\n".join(err)
    assert not (tmp_path / "out").exists()
