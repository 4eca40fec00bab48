"""`ats train`: train a calibrator on the model's own answers (`--on answers`, the default), or extract features of
instruction data (or run the backbone online) and train an ATS head on them (`--on instructions`, what `--data`
implies); on N processes when launched with `accelerate launch` / `torchrun` (docs/scaling.md)."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

from ..checks import check_nonnegative_float, check_nonnegative_int, check_positive_int
from . import options

logger = logging.getLogger(__name__)

ON = ("answers", "instructions")


def shown_defaults() -> dict[str, str]:
    """What --help states as the defaults of the options `run` resolves from --on (instruction data: the paper's
    transformer head, its loss and the automatic lr; answers: --method's default, the answer loss and its lr)."""
    from ..model.heads import HeadConfig
    from ..training.config import ANSWER_LR, DEFAULT_ANSWER_LOSS, DEFAULT_ANSWER_METHOD, TrainingConfig
    from ..training.data import DataConfig

    return {"source": f"{DataConfig.source}; giving --data implies --on instructions",
            "head_type": f"{HeadConfig.head_type} on instructions; on answers --method decides "
                         f"({DEFAULT_ANSWER_METHOD} by default)",
            "loss_type": f"{TrainingConfig.loss_type} on instructions, {DEFAULT_ANSWER_LOSS} on answers",
            "lr": f"on instructions from the number of optimizer steps, {ANSWER_LR:g} on answers"}


def add_parser(sub) -> None:
    """Add `ats train` to `sub`, the sub-command parsers of `ats`."""
    from ..workflows.answer_pool import AnswerPool

    pool = AnswerPool()  # the defaults of the answer options
    p = sub.add_parser("train", help="train a calibrator (default: on the model's own answers)",
                       description="Train a calibrator, saved in OUT/head (config + safetensors + fingerprint). By "
                                   "default (--on answers) the backbone answers a labelled QA pool once and --method "
                                   "learns from its own right and wrong answers (default: thermometer, what "
                                   "benchmarks/results/answers/ found best on both embedded models); --on "
                                   "instructions (or --data alpaca_gpt4, another instruction set) is the paper's "
                                   "recipe: hidden states of instruction data and a --head (default: transformer) "
                                   "trained with the selective loss.")
    p.add_argument("--on", choices=ON, default=None,
                   help="what the calibrator learns from: the model's own answers on a QA pool, or instruction "
                        "data (default: answers; instructions when --data is given)")
    options.add_model(p)
    shown = shown_defaults()
    options.add_data(p, defaults={"source": None}, shown=shown)
    options.add_training(p, head_defaults={"head_type": None}, shown=shown)
    p.add_argument("--resume", action="store_true", help="continue the interrupted training in OUT (same options)")
    p.add_argument("--online", action="store_true",
                   help="no feature cache: run the backbone inside the training loop (large models)")
    g = p.add_argument_group("answers (--on answers)")
    options.add_number(g, "--pool-size", int, check_positive_int, default=pool.pool_size,
                       help=f"questions per QA-pool task (default: {pool.pool_size})")
    options.add_number(g, "--mmlu-pool", int, check_nonnegative_int, default=pool.mmlu_per_subject,
                       help=f"MMLU validation questions per subject, 0 for none (default: {pool.mmlu_per_subject})")
    g.add_argument("--method", default=None, metavar="SPEC",
                   help="what learns from the answers: 'thermometer' (one temperature per question, read from the "
                        "prompt; the default), 'probe' (a correctness probe on several layers' hidden states at the "
                        "answer, beside one temperature for tokens), an ATS head type (transformer, linear, mlp, "
                        "constant; --head X is the same as --method X), or a head with '+tokens' (plus the "
                        "top-label loss on instruction tokens, so token calibration does not collapse; needs "
                        "--token-features)")
    g.add_argument("--token-features", default=None, metavar="DIR",
                   help="an `ats train --on instructions` features folder of the same model (its train/ split feeds "
                        "the '+tokens' term)")
    options.add_number(g, "--token-weight", float, check_nonnegative_float, default=pool.token_weight,
                       help=f"weight of the '+tokens' term (default: {pool.token_weight})")
    options.add_overwrite(p)
    p.add_argument("--out", type=options.out_folder("--out"), required=True,
                   help="run folder: answers (or features) in OUT/answers (OUT/features), "
                                                "the head in OUT/head")
    p.set_defaults(run=run, resumes=True)  # a rerun reuses finished steps


def learns_from(args) -> str:
    """What `ats train` trains on: --on, else instructions when --data is given, else answers.

    Raises:
        ATSError: if --on answers comes with --data, or --data names "answers" (the answers are --on answers).
    """
    from ..errors import ATSError

    if args.source == "answers":
        raise ATSError("--data answers: the model's own answers are --on answers (the default of ats train)")
    if args.on == "answers" and args.source is not None:
        raise ATSError(f"--data {args.source} is instruction data; with --on answers the data are the model's "
                       "answers on the QA pool (--pool-size, --mmlu-pool)")
    return args.on or ("instructions" if args.source is not None else "answers")


def run_answers(args) -> int:
    """`ats train --on answers`: the backbone's own labelled answers on the QA pool, a head trained on them."""
    from ..errors import ATSError
    from ..training.config import ANSWER_LOSSES, DEFAULT_ANSWER_LOSS, DEFAULT_ANSWER_METHOD

    options.check_model(args.model)
    loss = args.loss_type
    if loss not in ANSWER_LOSSES:
        if loss != "selective":  # the default of instruction data; an explicit token loss is a mistake here
            raise ATSError(f"--loss {loss} is a token loss; with --on answers use {' or '.join(ANSWER_LOSSES)}")
        loss = DEFAULT_ANSWER_LOSS
    if args.method and args.head_type:
        raise ATSError(f"--head {args.head_type} and --method {args.method}: with --on answers give one (--method)")
    for flag, value in (("--online", args.online), ("--resume", args.resume)):
        if value:
            raise ATSError(f"{flag}: instruction data only (answers are cached once and train in minutes)")
    world = os.environ.get("WORLD_SIZE", "1")
    if world != "1":  # each process would write the same folder
        raise ATSError(f"--on answers trains on one process (WORLD_SIZE={world}): run `ats train` without accelerate "
                       "launch / torchrun (answers are cached once and train in minutes)")
    training = options.training_config(args, loss_type=loss)
    spec = args.method or args.head_type or DEFAULT_ANSWER_METHOD

    from ..evaluation.metrics import summarize  # the library loads once the options are checked
    from ..evaluation.report import markdown_table
    from ..training.answers import score_answers
    from ..workflows.answer_methods import check_answer_head, train_answer_head
    from ..workflows.answer_pool import AnswerPool

    pool_options = AnswerPool(pool_size=args.pool_size, mmlu_per_subject=args.mmlu_pool,
                              token_weight=args.token_weight)
    reuse = check_answer_head(args.out, spec=spec, training=training, max_scale=args.max_scale, pool=pool_options,
                              token_features=args.token_features, overwrite=args.overwrite)  # before the model loads
    backbone = options.backbone_from_args(args)
    calibrator, pool, reused = train_answer_head(
        backbone, Path(args.out), spec=spec, training=training, max_scale=args.max_scale, pool=pool_options,
        token_features=args.token_features, overwrite=args.overwrite, progress=not args.quiet, reuse=reuse)
    rows = []
    for name, answers in pool.items():
        before = summarize(*score_answers(None, answers, backbone.logits))
        after = summarize(*score_answers(calibrator, answers, backbone.logits))
        rows.append([name, str(before["n"]), f"{before['accuracy']:.3f}",
                     f"{before['mean_confidence']:.3f} -> {after['mean_confidence']:.3f}",
                     f"{before['ece']:.3f} -> {after['ece']:.3f}",
                     "-" if not math.isfinite(before["auroc"]) else  # all right or all wrong: no ranking to judge
                     f"{before['auroc']:.3f} -> {after['auroc']:.3f}"])
    print(f"Answer calibration on the training pool (in sample: judge the head on tasks it was not trained on, "
          f"e.g. ats eval; {loss} loss, {spec}):")
    print(markdown_table(["task", "questions", "accuracy", "confidence", "ECE", "AUROC"], rows))
    print(f"\nhead {'reused from' if reused else 'saved to'} {Path(args.out) / 'head'}")
    return 0


def run(args) -> int:
    """Run `ats train` with the parsed `args`; returns the exit code."""
    if learns_from(args) == "answers":
        return run_answers(args)
    from ..calibrators.ats_config import ATSConfig
    from ..errors import ATSError
    from ..model.heads import HeadConfig
    from ..training.config import ANSWER_LOSSES
    from ..training.data import DataConfig

    for flag, value in (("--method", args.method), ("--token-features", args.token_features)):
        if value is not None:
            raise ATSError(f"{flag} {value}: only with --on answers (instruction data trains the --head type)")
    if args.loss_type in ANSWER_LOSSES:
        raise ATSError(f"--loss {args.loss_type} scores answers: use it with --on answers")
    args.source = args.source or DataConfig.source  # --on instructions without --data: the default instruction set
    args.head_type = args.head_type or HeadConfig.head_type  # the paper's transformer head
    # every option is checked before the library and the backbone load
    options.check_model(args.model)
    data = options.data_config(args)
    training = options.training_config(args)
    head = HeadConfig.from_args(args)
    max_scale = ATSConfig.from_args(args).max_scale

    from ..calibrators.base import Uncalibrated  # the library loads once the options are checked
    from ..evaluation.metrics import summarize
    from ..evaluation.report import token_table
    from ..evaluation.token_eval import gathered_token_confidences
    from ..model.backbone import load_backbone
    from ..training.distributed import init_distributed
    from ..workflows.pipeline import check_before_loading, fit_head, online_features, prepare_features

    out = Path(args.out)
    features = Path(args.features) if args.features else out / "features"
    if not args.online:
        check_before_loading(features, out / "head", data, head_type=head.head_type, max_scale=max_scale,
                             training=training, overwrite=args.overwrite)

    dist = init_distributed()
    if dist.distributed:
        if args.device:
            logger.warning("--device %s ignored: each of the %d processes uses its own device (%s here)",
                           args.device, dist.world_size, dist.device)
        # the frozen backbone is moved to each process's device and never wrapped
        backbone = load_backbone(args.model, dtype=args.dtype, device=dist.device,
                                 trust_remote_code=args.trust_remote_code)
    else:
        backbone = options.backbone_from_args(args)
    progress = not args.quiet and dist.is_main
    if args.online:
        train_store, val_store = online_features(backbone, data)
    else:
        train_store, val_store = prepare_features(backbone, features, data,
                                                  overwrite=args.overwrite, progress=progress, dist=dist)
    _, reused = fit_head(backbone, train_store, val_store, out / "head", head_type=head.head_type,
                         max_scale=max_scale, training=training, overwrite=args.overwrite, resume=args.resume,
                         progress=progress, dist=dist)
    calibrator = options.load_calibrator_folder(out / "head", backbone)  # reload: what users will load
    results = gathered_token_confidences(val_store, backbone, {"uncalibrated": Uncalibrated(), "ats": calibrator},
                                         dist, progress=progress)
    if dist.is_main:
        rows = {name: summarize(*value) for name, value in results.items()}
        print(f"Token-level calibration on the held-out split ({len(val_store)} sequences, "
              f"{len(results['ats'][0])} response tokens):")
        print(token_table(rows))
        record = calibrator.config_.training
        how = "automatic for" if record.get("lr_automatic") else "given, for"
        print(f"\nhead: {calibrator.config_.head.head_type}, {record.get('loss_type')} loss, lr {record.get('lr'):.3g} "
              f"({how} {record.get('optimizer_steps')} optimizer steps)")
        moved = abs(rows["ats"]["mean_confidence"] - rows["uncalibrated"]["mean_confidence"])
        if moved < 0.005:
            print(f"warning: the head barely moved (mean confidence changed by {moved:.4f}); with "
                  f"{record.get('optimizer_steps')} steps at lr {record.get('lr'):.3g} it may be undertrained: "
                  f"raise --lr or --epochs")
        print(f"\nhead {'reused from' if reused else 'saved to'} {out / 'head'}")
    return 0
