"""Feature extraction throughput vs. a bare backbone forward pass, and head training throughput from the cache.

    ATS_DATA_DIR=/work/shared/data python benchmarks/bench_extraction.py --limit 200 --reps 2

For each dtype (float32, bfloat16) the same length-sorted batches (features.shard_plan + _token_batches, the
batches extract_features runs) go through (a) `backbone.forward` only, results discarded, and (b) the full
`extract_features` into a fresh folder (copy to CPU, fp16 cast, safetensors + sha256 writes). Variants are
interleaved (order alternating per repetition) so that load changes from other jobs hit all of them; the median
over repetitions is reported. Then one epoch of head training per head type on a float16 cache.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from ats.calibrators.ats import ATSCalibrator
from ats.model.backbone import load_backbone
from ats.training.config import TrainingConfig
from ats.training.data import load_instructions, tokenize_instructions
from ats.training.features import _token_batches, extract_features, pad_batch, shard_plan
from ats.training.trainer import train_ats

RESULTS = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        return platform.processor() or "unknown"


def batches_of(examples, batch_tokens, shard_sequences):
    out = []
    for indices in shard_plan(examples, shard_sequences):
        for batch in _token_batches([len(examples[i].input_ids) for i in indices], batch_tokens):
            out.append([examples[indices[j]].input_ids for j in batch])
    return out


@torch.no_grad()
def bare(backbone, batches) -> float:
    start = time.perf_counter()
    for ids in batches:
        input_ids, mask = pad_batch(ids, backbone.tokenizer.pad_token_id or 0)
        backbone.forward(input_ids, mask)
    return time.perf_counter() - start


def extract(backbone, examples, args) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        start = time.perf_counter()
        extract_features(backbone, examples, tmp, batch_tokens=args.batch_tokens, shard_sequences=args.shard_sequences,
                         progress=False)
        return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--limit", type=int, default=200)
    parser.add_argument("--max-length", type=int, default=256)
    parser.add_argument("--batch-tokens", type=int, default=4096)
    parser.add_argument("--shard-sequences", type=int, default=64)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--head-sequences", type=int, default=48, help="sequences for the head-training timing")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.time()
    backbones = {"float32": load_backbone("smollm2-135m-instruct"),
                 "bfloat16": load_backbone("smollm2-135m-instruct", dtype="bfloat16")}
    tok = backbones["float32"].tokenizer
    examples = tokenize_instructions(tok, load_instructions("alpaca_gpt4", limit=args.limit, seed=0),
                                     max_length=args.max_length)[0]
    batches = batches_of(examples, args.batch_tokens, args.shard_sequences)
    real = sum(len(x) for b in batches for x in b)
    padded = sum(len(b) * max(len(x) for x in b) for b in batches)
    # the same tokens in random order (no length sorting), for the padding comparison only
    import random
    shuffled = list(examples)
    random.Random(0).shuffle(shuffled)
    unsorted = _token_batches([len(e.input_ids) for e in shuffled], args.batch_tokens)
    padded_unsorted = sum(len(b) * max(len(shuffled[j].input_ids) for j in b) for b in unsorted)
    print(f"{len(examples)} examples, {real} tokens, {len(batches)} batches; padding {1 - real / padded:.1%} "
          f"(length-sorted) vs {1 - real / padded_unsorted:.1%} (random order)", flush=True)
    bare(backbones["float32"], batches[:1])  # warm-up
    bare(backbones["bfloat16"], batches[:1])
    times: dict[str, list[float]] = {}
    for rep in range(args.reps):
        order = [("float32", "bare"), ("float32", "extract"), ("bfloat16", "bare"), ("bfloat16", "extract")]
        if rep % 2:
            order = order[::-1]
        for dtype, kind in order:
            bb = backbones[dtype]
            seconds = bare(bb, batches) if kind == "bare" else extract(bb, examples, args)
            times.setdefault(f"{dtype}/{kind}", []).append(seconds)
            print(f"rep {rep} {dtype:8s} {kind:8s} {real / seconds:8.0f} tok/s ({seconds:.1f} s)", flush=True)
    extraction = {}
    for dtype in ("float32", "bfloat16"):
        b = statistics.median(times[f"{dtype}/bare"])
        e = statistics.median(times[f"{dtype}/extract"])
        extraction[dtype] = {"bare_tok_s": real / b, "extract_tok_s": real / e, "ratio": b / e,
                             "bare_s": times[f"{dtype}/bare"], "extract_s": times[f"{dtype}/extract"]}
    # head training from a float16 cache (the default feature dtype), one epoch per head type
    heads = {}
    with tempfile.TemporaryDirectory() as tmp:
        store = extract_features(backbones["float32"], examples[: args.head_sequences], Path(tmp) / "f",
                                 batch_tokens=args.batch_tokens, progress=False)
        for head_type in ("linear", "mlp", "transformer"):
            cal = ATSCalibrator.for_backbone(backbones["float32"], head_type=head_type)
            config = TrainingConfig(epochs=1, batch_size=8, micro_batch_size=4)
            start = time.perf_counter()
            train_ats(cal, store, backbones["float32"], config=config, progress=False)
            seconds = time.perf_counter() - start
            heads[head_type] = {"seconds": seconds, "tok_s": store.meta["tokens"] / seconds,
                                "response_tok_s": store.meta["response_tokens"] / seconds}
            print(f"head {head_type:11s} {heads[head_type]['tok_s']:8.0f} tok/s "
                  f"({heads[head_type]['response_tok_s']:.0f} response tok/s, {seconds:.1f} s)", flush=True)
        head_sizes = {"sequences": len(store), "tokens": store.meta["tokens"],
                      "response_tokens": store.meta["response_tokens"]}
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    result = {
        "command": "ATS_DATA_DIR=/work/shared/data python " + " ".join(["benchmarks/bench_extraction.py", *sys.argv[1:]]),
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "torch_threads": args.threads,
                    "torch": torch.__version__, "loadavg_at_end": load},
        "model": "smollm2-135m-instruct (H=576, V=49152, 30 layers)",
        "sizes": {"examples": len(examples), "tokens": real, "batches": len(batches), "max_length": args.max_length,
                  "batch_tokens": args.batch_tokens, "shard_sequences": args.shard_sequences, "reps": args.reps,
                  "padding_fraction_sorted": 1 - real / padded, "padding_fraction_random": 1 - real / padded_unsorted},
        "extraction": extraction, "head_training": {"sizes": head_sizes, **heads},
        "total_seconds": time.time() - t0,
    }
    lines = ["| dtype | bare forward tok/s | extraction tok/s | ratio (target >= 0.9) |", "|---|---|---|---|"]
    for dtype, r in extraction.items():
        lines.append(f"| {dtype} | {r['bare_tok_s']:.0f} | {r['extract_tok_s']:.0f} | {r['ratio']:.3f} |")
    lines += ["", "| head (train from fp16 cache, 1 epoch) | tokens/s | response tokens/s |", "|---|---|---|"]
    for head_type, r in heads.items():
        lines.append(f"| {head_type} | {r['tok_s']:.0f} | {r['response_tok_s']:.0f} |")
    table = "\n".join(lines)
    print("\n" + table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "extraction.json").write_text(json.dumps(result, indent=2))
    s = result["sizes"]
    (RESULTS / "extraction.md").write_text(
        f"# Feature extraction and head training throughput\n\nCommand: `{result['command']}`\n\n"
        f"Machine: {result['machine']['cpu']}, {result['machine']['cores']} cores, torch {torch.__version__} "
        f"({args.threads} threads), load average at the end {load}.\n\n"
        f"Model: {result['model']}. Data: {s['examples']} Alpaca-GPT4 examples (max length {s['max_length']}), "
        f"{s['tokens']} tokens in {s['batches']} length-sorted batches of at most {s['batch_tokens']} padded tokens. "
        f"Padding: {s['padding_fraction_sorted']:.1%} of the computed positions (length-sorted) vs "
        f"{s['padding_fraction_random']:.1%} with the same batch budget in random order. Median of {s['reps']} "
        f"interleaved repetitions.\n\n{table}\n\nHead training: {head_sizes['sequences']} sequences, "
        f"{head_sizes['tokens']} tokens ({head_sizes['response_tokens']} response tokens), batch 8, micro-batch 4, "
        f"float32 on CPU; the time includes the chunked loss over the 49k vocabulary.\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
