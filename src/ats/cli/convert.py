"""`ats convert SRC OUT`: a calibrator in any layout `load_calibrator` reads (the paper's released heads, a Hub id)
written as an `ats` calibrator folder (calibrator_config.json + model.safetensors)."""

from __future__ import annotations

from pathlib import Path

from ..errors import ATSError
from . import options


def add_parser(sub) -> None:
    """Add `ats convert` to `sub`, the sub-command parsers of `ats`."""
    p = sub.add_parser("convert", help="write a calibrator (e.g. the paper's released head) in ats's own format",
                       description="Read SRC (an ats calibrator folder, a folder in the layout of the paper's code: "
                                   "config.json + calibration_head.safetensors, or a Hub id of either) and write it "
                                   "to OUT as calibrator_config.json + model.safetensors (docs/official_heads.md).")
    p.add_argument("src", help="calibrator folder or Hub id (owner/name)")
    p.add_argument("out", type=options.out_folder("OUT"), help="output folder (must not exist, unless --overwrite)")
    p.add_argument("--base-model", type=options.nonempty("--base-model"), default=None,
                   help="the backbone the head was trained on, recorded in OUT (default: what SRC records)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.set_defaults(run=run)


def run(args) -> int:
    """Run `ats convert` with the parsed `args`; returns the exit code."""
    out = Path(args.out)
    if out.exists() and not args.overwrite:
        raise ATSError(f"{out}: already exists (use --overwrite to replace it)")
    from ..calibrators import load_calibrator

    calibrator = load_calibrator(args.src)
    if args.base_model is not None:
        calibrator.config_.base_model = args.base_model
    calibrator.save_pretrained(out)
    print(f"{calibrator.label} calibrator from {args.src} written to {out}")
    return 0
