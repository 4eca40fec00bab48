"""`ats` command line: thin argument parsing over the library.

    ats train    --model M --data alpaca_gpt4 --head transformer --loss selective --alpha 0.5 --out DIR
    ats eval     --model M --calibrator DIR|temperature|... --tasks mmlu,triviaqa,truthfulqa_mc1 --out DIR
    ats generate --model M --calibrator DIR "prompt"
    ats demo     --out DIR         (the README's main job)

    accelerate launch --num_processes N -m ats train ...   (or torchrun --nproc_per_node N -m ats train ...):
    extraction and head training on N processes (docs/scaling.md)

Every user error prints one line `ats: error: ...` and exits with status 2; nothing half-written is left behind.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from .errors import ATSError


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct",
                   help="embedded name (smollm2-135m-instruct, gemma3-270m), .gguf file, model folder or Hub id")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1, ... (default: cuda if available)")
    p.add_argument("--trust-remote-code", action="store_true", help="allow custom model code from the Hub")


def _add_data(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", default="alpaca_gpt4",
                   help="alpaca_gpt4, alpaca_cleaned, a .json/.jsonl file of {instruction,input,output}, or a Hub id")
    p.add_argument("--limit", type=int, default=None, help="use a seeded random subset of this many examples")
    p.add_argument("--max-length", type=int, default=512)
    p.add_argument("--val-fraction", type=float, default=0.1)
    p.add_argument("--features", default=None, help="feature cache folder (default: OUT/features)")
    p.add_argument("--batch-tokens", type=int, default=8192, help="tokens per extraction forward pass")


def _add_training(p: argparse.ArgumentParser) -> None:
    p.add_argument("--head", default="transformer", choices=["linear", "mlp", "transformer"])
    p.add_argument("--loss", default="selective", choices=["selective", "none", "full"])
    p.add_argument("--alpha", type=float, default=0.5)
    p.add_argument("--weighting", default="token", choices=["token", "reference"],
                   help="selective loss: mean over tokens (default) or the reference code's group weighting")
    p.add_argument("--max-scale", type=float, default=10.0, help="clamp on exp(tau)")
    p.add_argument("--lr", type=float, default=5e-5)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step")
    p.add_argument("--micro-batch-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true", help="bf16 autocast for the head (GPU)")
    p.add_argument("--save-every", type=int, default=0, help="checkpoint every N optimizer steps")
    p.add_argument("--resume", action="store_true", help="continue from the last checkpoint in OUT")
    p.add_argument("--online", action="store_true",
                   help="no feature cache: run the backbone inside the training loop (large models)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ats", description="Adaptive Temperature Scaling for causal LMs")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="extract features and train an ATS head")
    _add_model(p), _add_data(p), _add_training(p)
    p.add_argument("--out", required=True, help="run folder; the head is saved in OUT (config + safetensors)")

    p = sub.add_parser("eval", help="evaluate calibrators on MMLU / TriviaQA / TruthfulQA / your own MC sets")
    _add_model(p), _add_data(p)
    p.add_argument("--calibrator", action="append", default=None,
                   help="a saved calibrator folder, or a baseline name to fit on --data: temperature, vector, "
                        "scaling-binning, histogram, isotonic, none (repeatable or comma-separated)")
    p.add_argument("--tasks", default="mmlu,triviaqa,truthfulqa_mc1",
                   help="comma-separated: mmlu, triviaqa, truthfulqa_mc1, mc:PATH[:letters|likelihood]")
    p.add_argument("--task-limit", type=int, default=None, help="examples per task (MMLU: per subject)")
    p.add_argument("--bootstrap", type=int, default=0, help="bootstrap resamples for confidence intervals")
    p.add_argument("--out", required=True)

    p = sub.add_parser("generate", help="generate with calibrated per-token confidence")
    _add_model(p)
    p.add_argument("--calibrator", required=True)
    p.add_argument("prompt", nargs="+")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--do-sample", action="store_true")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    p.add_argument("--no-chat-template", action="store_true")

    from .ablate import add_ablate_parser

    add_ablate_parser(sub)

    p = sub.add_parser("demo", help="the end-to-end demo on the embedded model and local data")
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--size", default="demo", choices=["tiny", "demo", "benchmark"],
                   help="tiny: a smoke run of a few minutes; demo: about 20 min on 2 CPU cores; benchmark: ~1 h")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from . import commands

    try:
        return commands.run(args)
    except ATSError as err:
        print(f"ats: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ats: interrupted; finished work is kept, run the same command again to continue", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
