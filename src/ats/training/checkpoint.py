"""Training checkpoints: head weights, optimizer and schedule state, and the position in the data, as safetensors
and JSON (never pickle), written atomically; `latest.json` points at the newest one.

A resumed run continues from the checkpoint and ends with the same weights as an uninterrupted run, because the data
order depends only on (seed, epoch) and the optimizer state is restored exactly.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..calibrators.ats import ATSCalibrator
from ..io import atomic_dir, read_json, write_json

POINTER = "latest.json"


def save_checkpoint(path: Path, calibrator: ATSCalibrator, optimizer, scheduler, state: dict) -> None:
    """Write one checkpoint folder; `state` is the trainer's JSON-ready position and logs.

    The folder holds `calibrator/` (the head), `optimizer.safetensors` and `trainer_state.json` (`state`, the
    optimizer's param groups and the scheduler's state).

    Args:
        path: the checkpoint folder; an existing one is replaced.
        calibrator: the calibrator being trained.
        optimizer: its torch optimizer.
        scheduler: its learning-rate scheduler.
        state: the trainer's JSON-ready position and logs.
    """
    with atomic_dir(path) as tmp:
        calibrator.save_pretrained(tmp / "calibrator")
        opt = optimizer.state_dict()
        tensors = {}
        for pid, pstate in opt["state"].items():
            for key, value in pstate.items():
                tensors[f"{pid}.{key}"] = value if torch.is_tensor(value) else torch.tensor(value)
        save_file(tensors, str(tmp / "optimizer.safetensors"))
        trainer = {**state, "param_groups": opt["param_groups"], "scheduler": scheduler.state_dict()}
        (tmp / "trainer_state.json").write_text(json.dumps(trainer, indent=2))


def load_checkpoint(path: Path, calibrator: ATSCalibrator, optimizer, scheduler) -> dict:
    """Restore the head, optimizer and scheduler in place; returns the trainer state that was saved.

    Args:
        path: the checkpoint folder, as written by `save_checkpoint`.
        calibrator: the calibrator whose head weights are replaced.
        optimizer: the optimizer whose state is replaced.
        scheduler: the scheduler whose state is replaced.

    Returns:
        The `state` given to `save_checkpoint`.

    Raises:
        ATSError: if the saved head or trainer state is missing or invalid.
    """
    loaded = ATSCalibrator.from_pretrained(path / "calibrator")
    calibrator.head.load_state_dict(loaded.head.state_dict())
    trainer = read_json(path / "trainer_state.json")
    tensors = load_file(str(path / "optimizer.safetensors"))
    state: dict = {}
    for key, value in tensors.items():
        pid, name = key.split(".", 1)
        state.setdefault(int(pid), {})[name] = value
    optimizer.load_state_dict({"state": state, "param_groups": trainer.pop("param_groups")})
    scheduler.load_state_dict(trainer.pop("scheduler"))
    return trainer


def latest_checkpoint(out_dir: Path) -> Path | None:
    """The newest checkpoint folder of a run, or None.

    Args:
        out_dir: the run folder (checkpoints are under `out_dir/checkpoints`).

    Returns:
        The folder `latest.json` points at, or None if there is no pointer or the folder is gone.
    """
    pointer = Path(out_dir) / "checkpoints" / POINTER
    if not pointer.exists():
        return None
    name = read_json(pointer)["checkpoint"]
    path = Path(out_dir) / "checkpoints" / Path(name).name  # never outside the run folder
    return path if path.exists() else None


def checkpoint_and_prune(out_dir: Path, name: str, calibrator: ATSCalibrator, optimizer, scheduler,
                         state: dict) -> None:
    """Save checkpoint `name`, point `latest.json` at it, and delete the previous one.

    Args:
        out_dir: the run folder.
        name: the new checkpoint's folder name under `out_dir/checkpoints`.
        calibrator: the calibrator being trained.
        optimizer: its torch optimizer.
        scheduler: its learning-rate scheduler.
        state: the trainer's JSON-ready position and logs.
    """
    previous = latest_checkpoint(out_dir)
    save_checkpoint(out_dir / "checkpoints" / name, calibrator, optimizer, scheduler, state)
    write_json(out_dir / "checkpoints" / POINTER, {"checkpoint": name})
    if previous is not None and previous.name != name:
        shutil.rmtree(previous, ignore_errors=True)
