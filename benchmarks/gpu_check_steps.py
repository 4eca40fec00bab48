"""The GPU check's steps (benchmarks/gpu_check.py): each times variants of one step of ats, interleaved, against the
same step without the head, and returns its result rows; with the device's timing and memory helpers."""

from __future__ import annotations

import gc
import math
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from bench_generation import random_probe, randomised_calibrator
from gpu_check_models import Sizes, SyntheticQA, synthetic_prompts, synthetic_questions

from ats.calibrators.base import Uncalibrated
from ats.calibrators.thermometer import Thermometer
from ats.evaluation.answers import build_answer_set
from ats.evaluation.tasks.scoring import score_choices, score_letters
from ats.generation import encode_prompts, generate_calibrated
from ats.model.backbone import Backbone
from ats.model.layers import candidate_layers, decoder_layers
from ats.model.scale_summary import ScaleSummarySpec
from ats.padding import pad_batch
from ats.training.answers import AnswerSet
from ats.training.config import DEFAULT_ANSWER_LOSS, DEFAULT_ANSWER_METHOD, TrainingConfig
from ats.training.data import TokenizedExample
from ats.training.features import FeatureStore, _token_batches, extract_features, shard_plan
from ats.training.online import OnlineFeatures
from ats.training.trainer import train_ats
from ats.workflows.answer_methods import train_spec
from ats.workflows.answer_pool import AnswerPool

GIB = 1024 ** 3


# --- the device -------------------------------------------------------------------------------------------------------
def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    """Start a new peak-memory window (CUDA only)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_gib(device: torch.device) -> float | None:
    """The peak allocated memory since the last `reset_peak`, in GiB; None on the CPU."""
    return torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None


def free_memory(device: torch.device) -> None:
    """Collect garbage and return cached blocks (after a model or a failed step)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def device_info(device: torch.device) -> dict:
    """The device's name and memory, the CPU and the library versions."""
    info = {"device": str(device), "cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "cuda": torch.version.cuda}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(name=props.name, memory_gib=round(props.total_memory / GIB, 1),
                    capability=f"{props.major}.{props.minor}")
    else:
        info["name"] = f"CPU ({info['cpu']}, {torch.get_num_threads()} torch threads)"
    return info


# --- timing -----------------------------------------------------------------------------------------------------------
def timed(fn: Callable[[], object], device: torch.device) -> tuple[float, float | None]:
    """(seconds, peak GiB) of one call, the device synchronised before and after."""
    synchronize(device)
    reset_peak(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start, peak_gib(device)


def interleaved(variants: dict[str, Callable[[], object]], device: torch.device, repeats: int) -> dict[str, dict]:
    """Each variant once untimed (warm-up), then `repeats` timed rounds with the order alternating.

    Returns:
        variant -> {"seconds": median, "runs": [seconds], "peak_gib": the largest peak (None on the CPU)}.
    """
    for fn in variants.values():
        fn()
    runs: dict[str, list[tuple[float, float | None]]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(repeats):
        for name in (names if r % 2 == 0 else names[::-1]):
            runs[name].append(timed(variants[name], device))
    out = {}
    for name, values in runs.items():
        peaks = [p for _, p in values if p is not None]
        out[name] = {"seconds": statistics.median(s for s, _ in values), "runs": [s for s, _ in values],
                     "peak_gib": max(peaks) if peaks else None}
    return out


def rows_from(measured: dict[str, dict], tokens: dict[str, int], compare: dict[str, list[str]]) -> list[dict]:
    """Result rows: time, tokens/s, peak memory and the ratio of each variant's time to the variants it is compared
    with (`compare[variant]`, e.g. the same step without the head)."""
    rows = []
    for name, m in measured.items():
        row = {"variant": name, **m, "tokens": tokens[name], "tokens_per_s": tokens[name] / m["seconds"],
               "ratios": {other: m["seconds"] / measured[other]["seconds"] for other in compare.get(name, [])}}
        rows.append(row)
    return rows


# --- the steps --------------------------------------------------------------------------------------------------------
@dataclass
class Context:
    """What the steps of one model share."""

    backbone: Backbone
    sizes: Sizes
    device: torch.device
    workdir: Path
    examples: list[TokenizedExample]
    summary: ScaleSummarySpec
    store: FeatureStore | None = None

    @property
    def tokens(self) -> int:
        """Tokens of the extraction / training sequences."""
        return sum(len(e.input_ids) for e in self.examples)

    def fresh_dir(self, label: str) -> Path:
        """A new empty folder under the work folder."""
        return Path(tempfile.mkdtemp(prefix=f"{label}-", dir=self.workdir))

    def summary_store(self) -> FeatureStore:
        """The features with the scale summary (extracted once, untimed, when the extraction step did not)."""
        if self.store is None:
            self.store = extract_features(self.backbone, self.examples, self.fresh_dir("features"),
                                          batch_tokens=self.sizes.batch_tokens, progress=False, summary=self.summary)
        return self.store

    def training_config(self, *, exact: bool) -> TrainingConfig:
        """One epoch of `sequences / batch` optimizer steps."""
        return TrainingConfig(epochs=1, batch_size=self.sizes.batch, micro_batch_size=self.sizes.micro_batch,
                              lr=1e-4, exact_loss=exact)


def forward_batches(ctx: Context) -> list[list[list[int]]]:
    """The token batches `extract_features` runs (length-sorted shards cut at `batch_tokens`)."""
    out = []
    for indices in shard_plan(ctx.examples, 256):
        for batch in _token_batches([len(ctx.examples[i].input_ids) for i in indices], ctx.sizes.batch_tokens):
            out.append([ctx.examples[indices[j]].input_ids for j in batch])
    return out


def step_extraction(ctx: Context) -> list[dict]:
    """Backbone forward only vs extraction without and with the scale summary."""
    batches = forward_batches(ctx)
    pad_id = ctx.backbone.tokenizer.pad_token_id

    def forward_only() -> None:
        with torch.no_grad():
            for ids in batches:
                input_ids, mask = pad_batch(ids, pad_id)
                ctx.backbone.forward(input_ids.to(ctx.device), mask.to(ctx.device))

    def extract(summary: ScaleSummarySpec | None) -> Callable[[], object]:
        return lambda: extract_features(ctx.backbone, ctx.examples, ctx.fresh_dir("extract"),
                                        batch_tokens=ctx.sizes.batch_tokens, progress=False, summary=summary)

    variants = {"forward only": forward_only, "extract, no summary": extract(None),
                "extract + summary": extract(ctx.summary)}
    measured = interleaved(variants, ctx.device, ctx.sizes.repeats)
    compare = {"extract, no summary": ["forward only"], "extract + summary": ["forward only", "extract, no summary"]}
    return rows_from(measured, dict.fromkeys(variants, ctx.tokens), compare)


def iterate(source, ctx: Context) -> None:
    """Read every training micro-batch of `source` onto the device (the data side of a training epoch)."""
    for batch in source.batches(ctx.sizes.micro_batch, shuffle=True, seed=0):
        batch.hidden.to(ctx.device)
        batch.labels.to(ctx.device)
        if getattr(batch, "summary", None) is not None:
            batch.summary.to(ctx.device)


def trainer_run(ctx: Context, source, *, exact: bool) -> Callable[[], object]:
    """A training run of one epoch on `source`, always continuing the same head (created once, untimed)."""
    calibrator = randomised_calibrator(ctx.backbone, "transformer")
    config = ctx.training_config(exact=exact)
    return lambda: train_ats(calibrator, source, ctx.backbone, config=config, progress=False)


def step_training_cached(ctx: Context) -> list[dict]:
    """Iterating the cached batches vs training the head on them: summary route and exact route."""
    store = ctx.summary_store()
    variants = {"batches only": lambda: iterate(store, ctx),
                "train, summary route": trainer_run(ctx, store, exact=False),
                "train, exact route": trainer_run(ctx, store, exact=True)}
    measured = interleaved(variants, ctx.device, ctx.sizes.repeats)
    compare = {"train, summary route": ["batches only"],
               "train, exact route": ["batches only", "train, summary route"]}
    return rows_from(measured, dict.fromkeys(variants, ctx.tokens), compare)


def step_training_online(ctx: Context) -> list[dict]:
    """The backbone forward of every online micro-batch vs online training (exact route) on them."""
    online = OnlineFeatures(ctx.backbone, ctx.examples, batch_tokens=ctx.sizes.batch_tokens)
    variants = {"online batches only": lambda: iterate(online, ctx),
                "train online": trainer_run(ctx, online, exact=True)}
    measured = interleaved(variants, ctx.device, ctx.sizes.repeats)
    return rows_from(measured, dict.fromkeys(variants, ctx.tokens), {"train online": ["online batches only"]})


def step_scoring(ctx: Context) -> list[dict]:
    """Letter and choice scoring of synthetic questions: uncalibrated only vs uncalibrated and the ATS head."""
    letters, choices = synthetic_questions(ctx.sizes, ctx.backbone.vocab_size)
    plain = {"uncalibrated": Uncalibrated()}
    both = {**plain, "ats": randomised_calibrator(ctx.backbone, "transformer")}
    variants = {"letters, uncalibrated": lambda: score_letters(ctx.backbone, plain, letters),
                "letters, + ats": lambda: score_letters(ctx.backbone, both, letters),
                "choices, uncalibrated": lambda: score_choices(ctx.backbone, plain, choices),
                "choices, + ats": lambda: score_choices(ctx.backbone, both, choices)}
    letter_tokens = sum(len(item.ids) for item in letters)
    choice_tokens = sum(len(item.context) * 4 + sum(map(len, item.choices)) for item in choices)
    tokens = {name: letter_tokens if name.startswith("letters") else choice_tokens for name in variants}
    measured = interleaved(variants, ctx.device, ctx.sizes.repeats)
    compare = {"letters, + ats": ["letters, uncalibrated"], "choices, + ats": ["choices, uncalibrated"]}
    return rows_from(measured, tokens, compare)


def step_answers(ctx: Context) -> list[dict]:
    """The default route of `ats train` (its calibrator learns from the model's own answers): plain `generate` of the
    task's prompts vs the answer set (greedy answers by the generation core, one scoring forward, probe layers
    captured), then Thermometer trained on those answers (one epoch) and the correctness probe fitted on them."""
    task = SyntheticQA(ctx.sizes, ctx.backbone.vocab_size)
    _, prompt_ids = task.prompts(ctx.backbone.tokenizer)
    layers = candidate_layers(len(decoder_layers(ctx.backbone.model)))
    n, batch = ctx.sizes.answer_tokens, ctx.sizes.answer_batch
    held: dict[str, AnswerSet] = {}

    def answers() -> AnswerSet:
        held["answers"] = build_answer_set(ctx.backbone, task, batch_size=batch, probe_layers=tuple(layers),
                                           progress=False)
        return held["answers"]

    def plain() -> int:
        return sum(plain_generate_ids(ctx.backbone, prompt_ids[i:i + batch], n) for i in range(0, len(prompt_ids), batch))

    def trained(kind: str) -> Callable[[], object]:  # `ats train`'s own call, as its defaults make it (one epoch)
        config = TrainingConfig(loss_type=DEFAULT_ANSWER_LOSS, epochs=1, batch_size=4)

        def train() -> object:
            held[kind] = train_spec(ctx.backbone, [held["answers"]], AnswerPool(), kind=kind, tokens=False,
                                    training=config, method=DEFAULT_ANSWER_METHOD)
            return held[kind]

        return train

    measured = interleaved({"plain generate": plain, "answers + probe layers": answers}, ctx.device,
                           ctx.sizes.repeats)
    measured.update(interleaved({"train thermometer": trained("thermometer"), "fit probe": trained("probe")},
                                ctx.device, ctx.sizes.repeats))
    losses = [step["loss"] for step in held["thermometer"].training_history_["steps"]]
    if not losses or not all(math.isfinite(loss) for loss in losses):
        raise RuntimeError(f"Thermometer's training on the answers gave losses {losses[:4]}")
    if not bool(torch.isfinite(held["probe"].weight).all()):
        raise RuntimeError("the probe fitted on the answers has weights that are not finite")
    questions = len(prompt_ids)  # training and fitting: no tokens/s (they read each question's stored states)
    tokens = {"plain generate": questions * n, "answers + probe layers": questions * n, "train thermometer": 0,
              "fit probe": 0}
    return rows_from(measured, tokens, {"answers + probe layers": ["plain generate"]})


def plain_generate(backbone: Backbone, prompts: list[str], new_tokens: int) -> int:
    """Plain greedy `generate` of exactly `new_tokens` tokens per prompt; returns the tokens generated."""
    ids, mask, _ = encode_prompts(backbone, prompts)
    return generate_exactly(backbone, ids, mask, new_tokens)


def plain_generate_ids(backbone: Backbone, prompts: list[list[int]], new_tokens: int) -> int:
    """`plain_generate` of prompts given as token ids (left-padded)."""
    enc = backbone.tokenizer.pad({"input_ids": prompts}, padding_side="left", return_tensors="pt")
    return generate_exactly(backbone, enc["input_ids"].to(backbone.device), enc["attention_mask"].to(backbone.device),
                            new_tokens)


def generate_exactly(backbone: Backbone, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int) -> int:
    """Greedy `generate` of exactly `new_tokens` tokens after each row of `ids` (B, P); the tokens generated."""
    sequences = backbone.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                                        min_new_tokens=new_tokens, do_sample=False,
                                        pad_token_id=backbone.tokenizer.pad_token_id)
    return int(sequences[:, ids.shape[1]:].numel())


def random_thermometer(backbone: Backbone) -> Thermometer:
    """Thermometer (`ats train`'s default) with its seeded initial weights, as if fitted: its cost (one temperature
    per prompt from the prompt's last hidden state, kept across the steps) does not depend on them."""
    thermometer = Thermometer(hidden_size=backbone.hidden_size, seed=0)
    thermometer.fitted = True
    return thermometer


def step_decoding(ctx: Context) -> list[dict]:
    """Plain `generate` vs `generate_calibrated` at each decoding batch size: the ATS head (its KV cache),
    Thermometer (one temperature per prompt) and a correctness probe (three layers captured during decoding; its
    P(correct) computed on the CPU)."""
    methods = {"calibrated": randomised_calibrator(ctx.backbone, "transformer"),
               "thermometer": random_thermometer(ctx.backbone), "probe": random_probe(ctx.backbone)}
    n = ctx.sizes.new_tokens
    variants, tokens, compare = {}, {}, {}
    for b in ctx.sizes.decode_batches:
        prompts = synthetic_prompts(b, ctx.sizes.prompt_tokens, ctx.backbone.vocab_size, seed=b)
        variants[f"plain, batch {b}"] = lambda p=prompts: plain_generate(ctx.backbone, p, n)
        for name, method in methods.items():
            variants[f"{name}, batch {b}"] = lambda p=prompts, m=method: _generated(generate_calibrated(
                ctx.backbone, m, p, max_new_tokens=n, min_new_tokens=n))
            tokens[f"{name}, batch {b}"] = b * n
            compare[f"{name}, batch {b}"] = [f"plain, batch {b}"]
        tokens[f"plain, batch {b}"] = b * n
    measured = interleaved(variants, ctx.device, ctx.sizes.repeats)
    return rows_from(measured, tokens, compare)


def _generated(outputs: list) -> list:
    """`generate_calibrated`'s outputs, checked to carry an answer confidence (a probability, not NaN)."""
    bad = [o.answer_confidence for o in outputs if not 0 <= o.answer_confidence <= 1]
    if bad:
        raise RuntimeError(f"generate_calibrated gave answer confidences outside [0, 1]: {bad[:3]}")
    return outputs


STEP_FUNCTIONS: dict[str, Callable[[Context], list[dict]]] = {
    "extraction": step_extraction, "training_cached": step_training_cached,
    "training_online": step_training_online, "scoring": step_scoring, "answers": step_answers,
    "decoding": step_decoding,
}


