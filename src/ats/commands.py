"""What each `ats` sub-command does, on top of the library (the CLI only parses arguments)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from .errors import ATSError

def _device(name: str | None) -> str:
    if name:
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def _backbone(args):
    from .backbone import load_backbone

    return load_backbone(args.model, dtype=getattr(args, "dtype", "float32"), device=_device(getattr(args, "device", None)),
                         trust_remote_code=getattr(args, "trust_remote_code", False))


def _data_options(args):
    from .pipeline import DataOptions

    return DataOptions(source=args.data, limit=args.limit, max_length=args.max_length,
                       val_fraction=args.val_fraction, seed=getattr(args, "seed", 0), batch_tokens=args.batch_tokens)


def cmd_train(args) -> int:
    """Extract features (or run the backbone online) and train a head; on N processes when launched with
    `accelerate launch` / `torchrun` (see docs/scaling.md)."""
    from .distributed import gathered_token_confidences, init_distributed
    from .pipeline import online_features, prepare_features, train_head
    from .calibrators.base import Uncalibrated
    from .experiment import token_table
    from .metrics import summarize
    from .training import TrainingConfig

    out = Path(args.out)
    dist = init_distributed()
    if dist.distributed:
        from .backbone import load_backbone

        if getattr(args, "device", None):
            print(f"[ats] --device {args.device} ignored: each of the {dist.world_size} processes uses its own "
                  f"device ({dist.device} here)")
        # the frozen backbone is moved to each process's device and never wrapped
        backbone = load_backbone(args.model, dtype=args.dtype, device=dist.device,
                                 trust_remote_code=args.trust_remote_code)
    else:
        backbone = _backbone(args)
    progress = not args.quiet and dist.is_main
    if args.online:
        train_store, val_store = online_features(backbone, _data_options(args), verbose=dist.is_main)
    else:
        train_store, val_store = prepare_features(backbone, args.features or out / "features", _data_options(args),
                                                  progress=progress, dist=dist)
    training = TrainingConfig(lr=args.lr, epochs=args.epochs, batch_size=args.batch_size,
                              micro_batch_size=args.micro_batch_size, seed=args.seed, bf16=args.bf16,
                              save_every=args.save_every)
    train_head(backbone, train_store, val_store, out / "head", head_type=args.head, loss_type=args.loss,
               alpha=args.alpha, weighting=args.weighting, max_scale=args.max_scale, training=training,
               resume=args.resume, progress=progress, dist=dist)
    from .ats import ATSCalibrator

    calibrator = ATSCalibrator.from_pretrained(out / "head", backbone=backbone)  # reload: what users will load
    calibrator.to(backbone.device)
    results = gathered_token_confidences(val_store, backbone, {"uncalibrated": Uncalibrated(), "ats": calibrator},
                                         dist, progress=progress)
    if dist.is_main:
        print(f"\nToken-level calibration on the held-out split ({len(val_store)} sequences, "
              f"{len(results['ats'][0])} response tokens):")
        print(token_table({name: summarize(*value) for name, value in results.items()}))
        print(f"\nhead saved to {out / 'head'}")
    return 0


def _calibrator_names(args) -> list[str]:
    """Check every --calibrator before anything is loaded: a folder or a known name."""
    from .calibrators import CALIBRATORS

    names = [c for item in (args.calibrator or ["none"]) for c in item.split(",") if c]
    for name in names:
        if not Path(name).is_dir() and name not in CALIBRATORS:
            raise ATSError(f"--calibrator {name!r}: not a folder and not a known calibrator "
                           f"({', '.join(sorted(CALIBRATORS))})")
    return names


def _calibrators_from_args(args, names: list[str], backbone, out: Path) -> dict:
    from .ats import ATSCalibrator
    from .calibrators import load_calibrator
    from .calibrators.base import Uncalibrated

    calibrators: dict = {"uncalibrated": Uncalibrated()}
    to_fit = []
    for name in names:
        if Path(name).is_dir():
            calibrator = load_calibrator(name)
            if isinstance(calibrator, ATSCalibrator):
                calibrator.check_backbone(backbone)
                calibrator.to(backbone.device)
            calibrators[Path(name).name if calibrator.name != "ats" else "ats"] = calibrator
        elif name != "none":
            to_fit.append(name)
    if to_fit:
        from .pipeline import fit_baselines, prepare_features

        train_store, _ = prepare_features(backbone, args.features or out / "features", _data_options(args),
                                          progress=not args.quiet)
        calibrators.update(fit_baselines(backbone, train_store, out / "baselines", tuple(to_fit)))
    return calibrators


def cmd_eval(args) -> int:
    from .evaluate import evaluate, format_table
    from .tasks import build_task

    out = Path(args.out)
    names = _calibrator_names(args)
    tasks = [build_task(t, limit=args.task_limit) for t in args.tasks.split(",") if t]  # validated before loading
    backbone = _backbone(args)
    calibrators = _calibrators_from_args(args, names, backbone, out)
    results = evaluate(backbone, calibrators, tasks, out, bootstrap=args.bootstrap, progress=not args.quiet)
    print(format_table(results))
    print(f"\nresults: {out / 'results.json'}, {out / 'results.md'}, figures in {out / 'figures'}")
    return 0


def cmd_generate(args) -> int:
    from .ats import ATSCalibrator
    from .generation import generate_calibrated, print_stream

    backbone = _backbone(args)
    calibrator = ATSCalibrator.from_pretrained(args.calibrator, backbone=backbone).to(backbone.device)
    torch.manual_seed(args.seed)
    outputs = generate_calibrated(backbone, calibrator, [" ".join(args.prompt)], max_new_tokens=args.max_new_tokens,
                                  do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, stop_strings=args.stop,
                                  chat_template=not args.no_chat_template, stream=print_stream)
    for out in outputs:
        print(f"\nsequence confidence: mean {out.mean_confidence:.3f}, product {out.product_confidence:.3g} "
              f"(uncalibrated mean {out.mean_uncalibrated:.3f})")
    return 0


def cmd_demo(args) -> int:
    """Train ATS on the embedded chat model, fit every baseline on the same data, evaluate all on three tasks."""
    from .backbone import load_backbone
    from .experiment import SIZES, run_experiment
    from .sources import data_dir

    start = time.time()
    if data_dir() is None and Path("../shared/data").is_dir():
        os.environ["ATS_DATA_DIR"] = str(Path("../shared/data").resolve())
    print(f"loading {args.model}")
    backbone = load_backbone(args.model, device=_device(None))
    run_experiment(backbone, args.out, SIZES[args.size], progress=not args.quiet)
    out = Path(args.out) / "eval"
    print(f"\nfigures: {out / 'figures'}; table: {out / 'results.md'}; total {(time.time() - start) / 60:.1f} min")
    return 0


def cmd_ablate(args) -> int:
    from .ablate import cmd_ablate as run_ablate

    return run_ablate(args)


COMMANDS = {"train": cmd_train, "eval": cmd_eval, "generate": cmd_generate, "demo": cmd_demo, "ablate": cmd_ablate}


def run(args: argparse.Namespace) -> int:
    if args.quiet:
        os.environ["TQDM_DISABLE"] = "1"
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    return COMMANDS[args.command](args)
