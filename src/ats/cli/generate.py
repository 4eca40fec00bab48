"""`ats generate`: generate with calibrated per-token confidence, streamed and coloured by confidence."""

from __future__ import annotations

import logging
from functools import partial

from ..checks import check_number, check_positive_int
from ..confidence import ANSWER_MAX_TOKENS
from . import options

logger = logging.getLogger("ats.cli.generate")


def add_parser(sub) -> None:
    """Add `ats generate` to `sub`, the sub-command parsers of `ats`."""
    p = sub.add_parser("generate", help="generate with calibrated per-token confidence")
    options.add_model(p)
    p.add_argument("--calibrator", type=options.nonempty("--calibrator"), required=True,
                   help="a saved calibrator folder of any type (an ATS head such as runs/smol/head, temperature, "
                        "vector, binning, isotonic, Thermometer, ...), the paper's released head, a Hub id, or 'none' "
                        "(the model's own probabilities)")
    p.add_argument("prompt", nargs="+")
    options.add_number(p, "--max-new-tokens", int, check_positive_int, default=ANSWER_MAX_TOKENS)
    p.add_argument("--do-sample", action="store_true")
    options.add_number(p, "--temperature", float, partial(check_number, low=0, low_open=True), default=1.0)
    options.add_number(p, "--top-k", int, check_positive_int, default=None)
    options.add_number(p, "--top-p", float, partial(check_number, low=0, high=1, low_open=True), default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--no-chat-template", action="store_true")
    p.set_defaults(run=run)


def run(args) -> int:
    """Run `ats generate` with the parsed `args`; returns the exit code."""
    options.check_model(args.model)
    folder = None
    if args.calibrator.strip().lower() != "none":
        folder = options.calibrator_folder(args.calibrator)  # a missing or wrong folder fails before the model loads

    import torch  # the library loads once the options are checked

    from ..evaluation.threshold import read_certificate
    from ..generation import DecodingCalibration, generate_calibrated, print_stream

    certificate = None if folder is None else read_certificate(folder)  # a bad threshold.json fails before the model

    backbone = options.backbone_from_args(args)
    calibrator = None if folder is None else options.load_calibrator_folder(folder, backbone)
    threshold = None if certificate is None else certificate.check_loaded(backbone, calibrator)
    outside = None if certificate is None else certificate.outside(
        max_tokens=args.max_new_tokens, chat_template=not args.no_chat_template and backbone.is_chat,
        sampled=args.do_sample, stops=bool(args.stop))
    if outside is not None:
        logger.warning("%s", outside)
    logger.info("%s", DecodingCalibration(calibrator, backbone).describe())
    torch.manual_seed(args.seed)
    outputs = generate_calibrated(backbone, calibrator, [" ".join(args.prompt)], max_new_tokens=args.max_new_tokens,
                                  do_sample=args.do_sample, temperature=args.temperature, top_k=args.top_k,
                                  top_p=args.top_p, stop_strings=args.stop,
                                  chat_template=not args.no_chat_template, stream=print_stream, threshold=threshold)
    for out in outputs:
        print(f"\nsequence confidence: mean {out.mean_confidence:.3f}, product {out.product_confidence:.3g} "
              f"(uncalibrated mean {out.mean_uncalibrated:.3f})")
        kind = "through the calibrator's bins" if out.confidence_kind == "mapped" else "mean token probability"
        print(f"answer confidence: {out.answer_confidence:.3f} ({kind}, as ats eval scores answers)")
        if threshold is not None:
            rule = ("no threshold was certified" if threshold.threshold is None else
                    f"certified threshold {threshold.threshold:.3f}: risk <= {threshold.target_risk:g} with "
                    f"probability >= {1 - threshold.delta:g}")
            print(f"{'answered' if out.answered else 'abstains'} ({rule})")
    return 0
