"""Fixtures of the lm-eval bridge tests: the tiny random Llama saved as a model folder (so lm-eval's `hf` model loads
it by path), a perturbed ATS head for it, and a local multiple-choice task (YAML reading a JSONL file; no Hub).

`lm_eval_runs` runs lm-eval once per session for three models on that task and writes real `--log_samples` files as
its command line does: `hf` (lm-eval's Hugging Face model), `ats` with `calibrator=none`, and `ats` with the head.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local JSON tasks only; set before `datasets` is imported

from ats.calibrators.ats import ATSCalibrator  # noqa: E402
from ats.model.backbone import load_backbone  # noqa: E402

from lmeval_helpers import evaluate_to_files, toy_rows, write_task  # noqa: E402

pytest.importorskip("lm_eval")


@contextlib.contextmanager
def torch_threads(n: int):
    """Run with n torch threads (then restore): these tests run many tiny operations, which on a shared machine
    are far slower with 2 OpenMP threads than with 1."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _one_thread():
    with torch_threads(1):
        yield


@pytest.fixture(scope="session")
def toy_task(tmp_path_factory) -> Path:
    """The include folder of the local task TASK."""
    return write_task(tmp_path_factory.mktemp("tasks"), toy_rows())


@pytest.fixture(scope="session")
def tiny_folder(tiny_backbone, tmp_path_factory) -> Path:
    """The tiny random Llama (SmolLM2's tokenizer) as a Hugging Face model folder."""
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_backbone.model.save_pretrained(folder)
    tiny_backbone.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def folder_backbone(tiny_folder):
    """The tiny model loaded from its folder (named by the path, as the lm-eval model names it)."""
    return load_backbone(str(tiny_folder))


@pytest.fixture(scope="session")
def head_dir(folder_backbone, tmp_path_factory) -> Path:
    """A transformer ATS head for the tiny folder model, perturbed away from the identity (tau != 0)."""
    calibrator = ATSCalibrator.for_backbone(folder_backbone, head_type="transformer")
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # tau about -1..1 by token
        calibrator.head.proj.weight.copy_(0.1 * torch.randn(calibrator.head.proj.weight.shape, generator=g))
    folder = tmp_path_factory.mktemp("head") / "head"
    calibrator.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def lm_eval_runs(tiny_folder, head_dir, toy_task, tmp_path_factory) -> dict[str, Path]:
    """name -> the samples file lm-eval wrote for TASK: hf, ats calibrator=none, ats with the head."""
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(toy_task), include_defaults=False)  # indexing lm-eval's own: ~20 s
    with torch_threads(1):
        return {name: evaluate_to_files(model, args, tasks, tmp_path_factory.mktemp(f"run-{name}"))
                for name, model, args in (("hf", "hf", f"pretrained={tiny_folder}"),
                                          ("none", "ats", f"pretrained={tiny_folder},calibrator=none"),
                                          ("head", "ats", f"pretrained={tiny_folder},calibrator={head_dir}"))}
