"""`ats export --engine vllm --model M --calibrator C OUT`: a model folder that vLLM loads as the calibrated model
(docs/vllm.md)."""

from __future__ import annotations

from . import options

ENGINES = ("vllm",)


def add_parser(sub) -> None:
    """Add `ats export` to `sub`, the sub-command parsers of `ats`."""
    p = sub.add_parser("export", help="write a model folder that an inference engine (vLLM) loads as the calibrated "
                                      "model", description="Write OUT: the base model's files (linked, or copied "
                                      "with --copy), the calibrator, and a config.json naming the calibrated "
                                      "architecture that installing ats registers with vLLM (docs/vllm.md).")
    p.add_argument("out", type=options.out_folder("OUT"), help="the folder to write")
    p.add_argument("--engine", default="vllm", choices=ENGINES, help="the engine that will load OUT")
    options.add_model(p, loading=False)
    p.add_argument("--revision", default=None, help="the Hub revision of --model")
    p.add_argument("--calibrator", type=options.nonempty("--calibrator"), required=True,
                   help="a saved calibrator folder or Hub id (ATS heads, the paper's released heads, the selective "
                        "controls, temperature or vector scaling), or 'none'")
    p.add_argument("--copy", action="store_true", help="copy the base model's files instead of linking them")
    options.add_overwrite(p)
    p.set_defaults(run=run)


def run(args) -> int:
    """Run `ats export` with the parsed `args`; returns the exit code."""
    from ..integrations.vllm.export import export_for_vllm

    options.check_model(args.model)
    calibrator = None if args.calibrator.strip().lower() == "none" else options.calibrator_folder(args.calibrator)
    out = export_for_vllm(args.model, calibrator, args.out, revision=args.revision, copy=args.copy,
                          overwrite=args.overwrite)
    print(f"{args.model} calibrated by {args.calibrator} for vLLM: {out} (serve it: python -m "
          f"vllm.entrypoints.launchers.api_server.entry --model {out})")
    return 0
