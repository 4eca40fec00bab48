"""The prepared GPU check of issue 24: speed and memory of every step of ats at the paper's scale, on random weights.

    bash scripts/gpu_check.sh                                  # on the GPU machine (bf16, both 7B shapes, < 8 min)
    PYTHONPATH=src python benchmarks/gpu_check.py --tiny --device cpu --out /tmp/gpu_check   # CPU smoke run, < 1 min

It needs only the source tree and torch, transformers, accelerate, safetensors, tqdm, scikit-learn, matplotlib: no
network, no embedded model, no `datasets`, `fastapi` or `uvicorn` (the `ats` modules it imports load none of them).
Two models are built from their configs with random weights directly on the device, one at a time: one shaped like
Llama-2-7B (hidden 4096, 32 layers, 32 heads, intermediate 11008, vocabulary 32,000) and one like Qwen2.5-7B
(hidden 3584, 28 layers, 28 heads / 4 KV heads, intermediate 18944, vocabulary 152,064). Their tokenizer is a
word-level one over the whole vocabulary (`w4 w17 ...`), built in memory; it only supplies pad / eos ids, prompt
encoding and decoding. Calibration numbers from random weights mean nothing; speed and memory do.

Per model, each step against the same step without the head, in the same run (medians of `--repeats` timed runs
after one untimed warm-up, variants interleaved with the order alternating per repeat):

1. extraction: `backbone.forward` only vs `extract_features` without and with the per-token scale summary;
2. cached head training (a FeatureStore with the summary): iterating the batches only vs `train_ats` on the summary
   route and on the exact route (`TrainingConfig(exact_loss=True)`);
3. online head training: iterating `OnlineFeatures` batches (the backbone forward) vs `train_ats` on them;
4. scoring synthetic questions: `score_letters` / `score_choices` with {uncalibrated} vs {uncalibrated, ats};
5. answers, the default route of `ats train` (`SyntheticQA`: TriviaQA's task on random words): plain
   `model.generate` of its prompts vs the answer set (greedy answers by the generation core, one scoring forward,
   the probe layers captured), then Thermometer trained on them and the correctness probe fitted, as `ats train`
   calls each (`train_spec`);
6. decoding at batch 1 and 16: plain `model.generate` vs `generate_calibrated` with the head (its KV cache),
   Thermometer and the probe, tokens/s.

Peak GPU memory (`torch.cuda.max_memory_allocated`, reset before each timed run) is recorded per variant, with the
device, torch and transformers versions. Each step runs in its own try/except: a failure is recorded with the last
line of its traceback and the other steps still run; no step starts after `--budget` seconds. The results
(OUT.json and OUT.md, default benchmarks/results/gpu_check) are rewritten after every step, so a run killed by the
wrapper's time limit still leaves what it measured.

Status: this check has NOT run on a GPU yet (no GPU was lent to the session that wrote it); only the `--tiny` CPU
smoke run (tests/test_gpu_check.py) has. No results file is committed until the GPU run happens.
"""

from __future__ import annotations

import argparse
import gc
import math
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_generation import command_line, random_probe, randomised_calibrator, save_results  # noqa: E402

from ats.calibrators.base import Uncalibrated  # noqa: E402
from ats.calibrators.thermometer import Thermometer  # noqa: E402
from ats.evaluation.answers import build_answer_set  # noqa: E402
from ats.evaluation.tasks.scoring import ChoiceItem, LetterItem, score_choices, score_letters  # noqa: E402
from ats.evaluation.tasks.triviaqa import TriviaQATask  # noqa: E402
from ats.generation import encode_prompts, generate_calibrated  # noqa: E402
from ats.model.backbone import Backbone  # noqa: E402
from ats.model.labels import IGNORE_INDEX  # noqa: E402
from ats.model.layers import candidate_layers, decoder_layers  # noqa: E402
from ats.model.scale_summary import ScaleSummarySpec  # noqa: E402
from ats.padding import pad_batch  # noqa: E402
from ats.training.answers import AnswerSet  # noqa: E402
from ats.training.config import DEFAULT_ANSWER_LOSS, DEFAULT_ANSWER_METHOD, TrainingConfig  # noqa: E402
from ats.training.data import TokenizedExample  # noqa: E402
from ats.training.features import FeatureStore, _token_batches, extract_features, shard_plan  # noqa: E402
from ats.training.online import OnlineFeatures  # noqa: E402
from ats.training.trainer import train_ats  # noqa: E402
from ats.workflows.answer_methods import train_spec  # noqa: E402
from ats.workflows.answer_pool import AnswerPool  # noqa: E402

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "gpu_check"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3; the words w4 .. w{V-1} follow
GIB = 1024 ** 3
STEPS = ("extraction", "training_cached", "training_online", "scoring", "answers", "decoding")


@dataclass(frozen=True)
class Shape:
    """A model shape built from its config with random weights."""

    name: str
    family: str  # "llama" or "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    max_positions: int
    rope_theta: float
    tie_embeddings: bool = False


SHAPES = (
    Shape("llama-2-7b-shape", "llama", 4096, 32, 32, 32, 11008, 32000, 4096, 10000.0),
    Shape("qwen2.5-7b-shape", "qwen2", 3584, 28, 28, 4, 18944, 152064, 32768, 1000000.0),
)


def tiny_shape(shape: Shape) -> Shape:
    """The same family and name, 2 layers of hidden 64 and a small vocabulary: a CPU smoke run in seconds."""
    return replace(shape, hidden=64, layers=2, heads=4, kv_heads=2 if shape.kv_heads < shape.heads else 4,
                   intermediate=128, vocab=512 if shape.vocab < 100_000 else 1024, max_positions=2048)


@dataclass(frozen=True)
class Sizes:
    """How much work each step does."""

    sequences: int = 16  # extraction and training sequences
    seq_len: int = 512  # the longest sequence; the others step down by 1/32 of it
    prompt_len: int = 64  # tokens before the response in each sequence
    batch_tokens: int = 8192  # padded tokens per extraction forward pass
    micro_batch: int = 2  # training: sequences per forward
    batch: int = 4  # training: sequences per optimizer step (sequences / batch optimizer steps)
    questions: int = 32
    question_tokens: int = 256
    choice_tokens: int = 12
    prompt_tokens: int = 32  # decoding prompts
    new_tokens: int = 64
    decode_batches: tuple[int, ...] = (1, 16)
    answer_questions: int = 32  # the answers step: questions, new tokens per greedy answer, questions per batch
    answer_tokens: int = 16
    answer_batch: int = 8
    repeats: int = 2


TINY_SIZES = Sizes(sequences=8, seq_len=64, prompt_len=16, batch_tokens=1024, micro_batch=2, batch=4, questions=6,
                   question_tokens=32, choice_tokens=4, prompt_tokens=8, new_tokens=8, decode_batches=(1, 4),
                   answer_questions=8, answer_tokens=4, answer_batch=4, repeats=1)


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


# --- models and data --------------------------------------------------------------------------------------------------
def word_tokenizer(vocab: int):
    """A word-level tokenizer over the whole vocabulary: ids 0..3 are pad, bos, eos, unk; id i >= 4 is `w{i}`."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    words.update({f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab)})
    core = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def model_config(shape: Shape, dtype: torch.dtype):
    """The transformers config of `shape` (Llama or Qwen2), special ids 0 / 1 / 2."""
    common = dict(vocab_size=shape.vocab, hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                  num_hidden_layers=shape.layers, num_attention_heads=shape.heads, num_key_value_heads=shape.kv_heads,
                  max_position_embeddings=shape.max_positions, rope_theta=shape.rope_theta,
                  tie_word_embeddings=shape.tie_embeddings, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if shape.family == "llama":
        config = transformers.LlamaConfig(rms_norm_eps=1e-5, **common)
    else:
        config = transformers.Qwen2Config(rms_norm_eps=1e-6, **common)
    setattr(config, "dtype" if hasattr(config, "dtype") else "torch_dtype", dtype)
    return config


def build_backbone(shape: Shape, device: torch.device, dtype: torch.dtype) -> Backbone:
    """A random-weight model of `shape`, created directly on `device` in `dtype`, as a Backbone."""
    config = model_config(shape, dtype)
    cls = transformers.LlamaForCausalLM if shape.family == "llama" else transformers.Qwen2ForCausalLM
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(config)
    finally:
        torch.set_default_dtype(previous)
    # no `.to(dtype)`: as in from_pretrained, the rotary inverse frequencies stay float32
    return Backbone(model=model, tokenizer=word_tokenizer(shape.vocab), name=shape.name, revision="random-init")


def random_ids(n: int, vocab: int, generator: torch.Generator) -> list[int]:
    """`n` ordinary token ids (no special token)."""
    return torch.randint(len(SPECIAL_TOKENS), vocab, (n,), generator=generator).tolist()


def synthetic_examples(sizes: Sizes, vocab: int, seed: int = 0) -> list[TokenizedExample]:
    """Random sequences from `seq_len` tokens down, the response after `prompt_len` tokens labelled."""
    g = torch.Generator().manual_seed(seed)
    step = max(1, sizes.seq_len // 32)
    examples = []
    for i in range(sizes.sequences):
        ids = random_ids(max(sizes.prompt_len + 2, sizes.seq_len - i * step), vocab, g)
        labels = [ids[t + 1] if sizes.prompt_len - 1 <= t < len(ids) - 1 else IGNORE_INDEX for t in range(len(ids))]
        examples.append(TokenizedExample(input_ids=ids, labels=labels))
    return examples


def synthetic_questions(sizes: Sizes, vocab: int, seed: int = 1) -> tuple[list[LetterItem], list[ChoiceItem]]:
    """Random multiple-choice questions (4 options): letter items and choice-likelihood items."""
    g = torch.Generator().manual_seed(seed)
    letters = random_ids(4, vocab, g)
    letter_items, choice_items = [], []
    for _ in range(sizes.questions):
        answer = int(torch.randint(4, (1,), generator=g))
        letter_items.append(LetterItem(ids=random_ids(sizes.question_tokens, vocab, g), letters=letters,
                                       answer=answer))
        choices = [random_ids(sizes.choice_tokens + k, vocab, g) for k in range(4)]
        choice_items.append(ChoiceItem(context=random_ids(sizes.question_tokens // 2, vocab, g), choices=choices,
                                       answer=answer))
    return letter_items, choice_items


class SyntheticQA(TriviaQATask):
    """TriviaQA's generation task (few-shot "Q:/A:" prompts, greedy answers by the generation core, one scoring
    forward) on questions of random words. Its judge calls every other answer right: random weights answer nothing
    right, and a fit needs both kinds."""

    name = "synthetic_qa"

    def __init__(self, sizes: Sizes, vocab: int, *, seed: int = 3, n_shots: int = 2) -> None:
        super().__init__(n_shots=n_shots, max_new_tokens=sizes.answer_tokens, batch_size=sizes.answer_batch)
        g = torch.Generator().manual_seed(seed)
        words = lambda n: " ".join(f"w{i}" for i in random_ids(n, vocab, g))  # noqa: E731
        self._rows = [{"question": words(sizes.prompt_tokens), "value": words(2), "aliases": []}
                      for _ in range(sizes.answer_questions + n_shots)]

    def rows(self) -> list[dict]:
        return self._rows

    def judge_answers(self, texts: list[str]) -> tuple[list[bool], dict]:
        return [i % 2 == 0 for i in range(len(texts))], {}


def synthetic_prompts(count: int, tokens: int, vocab: int, seed: int = 2) -> list[str]:
    """`count` prompts of `tokens` random words each (the word tokenizer's text)."""
    g = torch.Generator().manual_seed(seed)
    return [" ".join(f"w{i}" for i in random_ids(tokens, vocab, g)) for _ in range(count)]


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


# --- the run ----------------------------------------------------------------------------------------------------------
class Run:
    """The results of one run, written after every step; progress lines with UTC timestamps."""

    def __init__(self, args: argparse.Namespace, sizes: Sizes, shapes: list[Shape], command: str) -> None:
        self.args, self.sizes, self.out = args, sizes, Path(args.out)
        self.device = torch.device(args.device)
        self.start = time.perf_counter()
        self.result = {"title": "CPU smoke run (tiny models), not GPU results" if args.tiny else "GPU check",
                       "command": command, "started": now(), "tiny": args.tiny, "dtype": args.dtype,
                       "machine": device_info(self.device), "sizes": asdict(sizes),
                       "models": {s.name: {"shape": asdict(s)} for s in shapes}, "steps": [],
                       "wall_seconds": None}

    def elapsed(self) -> float:
        """Seconds since the run started."""
        return time.perf_counter() - self.start

    def log(self, message: str) -> None:
        """One progress line: UTC time, seconds since the start, the message."""
        print(f"[{now()} +{self.elapsed():6.1f}s] {message}", flush=True)

    def record(self, model: str, step: str, status: str, rows: list[dict], seconds: float, error: str = "") -> None:
        """Add one step's outcome and rewrite the results files."""
        entry = {"model": model, "step": step, "status": status, "seconds": seconds, "rows": rows}
        if error:
            entry["error"] = error
        self.result["steps"].append(entry)
        self.save()

    def save(self) -> None:
        """Write OUT.json and OUT.md (the markdown keeps notes below its `<!-- notes -->` marker)."""
        self.result["wall_seconds"] = self.elapsed()
        save_results(self.out, self.result, markdown(self.result))

    def attempt(self, model: str, step: str, fn: Callable[[], list[dict]]) -> bool:
        """Run one step unless the budget is spent; a failure is recorded with its traceback's last line."""
        if self.elapsed() > self.args.budget:
            self.log(f"{model} {step}: skipped, the {self.args.budget:.0f} s budget is spent")
            self.record(model, step, "skipped", [], 0.0, error=f"time budget of {self.args.budget:.0f} s spent")
            return False
        self.log(f"{model} {step} ...")
        start = time.perf_counter()
        try:
            rows = fn()
        except Exception:  # noqa: BLE001 - one failing step must not stop the others
            traceback.print_exc()
            error = traceback.format_exc().strip().splitlines()[-1]
            free_memory(self.device)
            self.log(f"{model} {step}: FAILED: {error}")
            self.record(model, step, "failed", [], time.perf_counter() - start, error=error)
            return False
        for row in rows:
            ratios = ", ".join(f"{v:.2f}x {k}" for k, v in row["ratios"].items())
            speed = f"{row['tokens_per_s']:10.0f} tok/s" if row["tokens"] else " " * 16
            self.log(f"  {row['variant']:24s} {row['seconds']:8.3f} s {speed}"
                     + (f"  {ratios}" if ratios else "") + (f"  peak {row['peak_gib']:.1f} GiB"
                                                            if row["peak_gib"] is not None else ""))
        self.record(model, step, "ok", rows, time.perf_counter() - start)
        return True

    def model(self, shape: Shape, dtype: torch.dtype) -> None:
        """Build one model, run every step on it, free it."""
        info = self.result["models"][shape.name]
        holder: dict[str, Backbone] = {}

        def build() -> list[dict]:
            seconds, peak = timed(lambda: holder.setdefault("backbone", build_backbone(shape, self.device, dtype)),
                                  self.device)
            params = sum(p.numel() for p in holder["backbone"].model.parameters())
            info.update(parameters=params, build_seconds=seconds, weights_gib=params * dtype.itemsize / GIB)
            return [{"variant": "build random weights", "seconds": seconds, "runs": [seconds], "peak_gib": peak,
                     "tokens": 0, "tokens_per_s": 0.0, "ratios": {}}]

        if not self.attempt(shape.name, "build", build):
            for step in self.args.steps:
                self.record(shape.name, step, "skipped", [], 0.0, error="the model was not built")
            return
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as workdir:
            self.steps(Context(backbone=holder.pop("backbone"), sizes=self.sizes, device=self.device,
                               workdir=Path(workdir), examples=synthetic_examples(self.sizes, shape.vocab),
                               summary=ScaleSummarySpec()))
        free_memory(self.device)

    def steps(self, ctx: Context) -> None:
        """Every chosen step on one model (the model is freed when `ctx` goes)."""
        for step in self.args.steps:
            self.attempt(ctx.backbone.name, step, lambda s=step: STEP_FUNCTIONS[s](ctx))


def now() -> str:
    """The UTC time, to the second."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


# --- the report -------------------------------------------------------------------------------------------------------
def markdown(result: dict) -> str:
    """The results page: what ran where, then one table row per measured variant."""
    m = result["machine"]
    lines = [f"# {result['title']}", "", f"Command: `{result['command']}`", "",
             f"Device: {m['name']} ({m['device']}); torch {m['torch']} (CUDA {m['cuda']}), transformers "
             f"{m['transformers']}, Python {m['python']}. Started {result['started']} UTC, "
             f"{result['wall_seconds']:.0f} s in all. Weights {result['dtype']}, random (speed and memory only; "
             f"calibration numbers from random weights mean nothing).", "",
             "Sizes: " + ", ".join(f"{k} {v}" for k, v in result["sizes"].items()) + ".", "", "Models:", ""]
    for name, info in result["models"].items():
        s = info["shape"]
        built = (f", {info['parameters'] / 1e6:,.1f}M parameters ({info['weights_gib']:.2f} GiB), built in "
                 f"{info['build_seconds']:.1f} s" if "parameters" in info else ", not built")
        lines.append(f"- {name}: {s['family']}, hidden {s['hidden']}, {s['layers']} layers, {s['heads']} heads / "
                     f"{s['kv_heads']} KV heads, intermediate {s['intermediate']}, vocabulary {s['vocab']}{built}")
    lines += ["", "Times are medians over the repeats after one warm-up; ratios divide a variant's time by the named "
              "variant's (the same step without the head, or the other loss route). Peak memory: "
              "`torch.cuda.max_memory_allocated` of the variant's runs (weights included).", "",
              "| model | step | status | variant | time (s) | tokens/s | time ratios | peak memory (GiB) |",
              "|---|---|---|---|---:|---:|---|---:|"]
    for entry in result["steps"]:
        if not entry["rows"]:
            lines.append(f"| {entry['model']} | {entry['step']} | {entry['status']}: {entry.get('error', '')} "
                         f"| | | | | |")
        for row in entry["rows"]:
            ratios = "; ".join(f"{v:.2f}x {k}" for k, v in row["ratios"].items())
            peak = "-" if row["peak_gib"] is None else f"{row['peak_gib']:.1f}"
            speed = f"{row['tokens_per_s']:.0f}" if row["tokens"] else "-"
            lines.append(f"| {entry['model']} | {entry['step']} | {entry['status']} | {row['variant']} | "
                         f"{row['seconds']:.3f} | {speed} | {ratios} | {peak} |")
    return "\n".join(lines) + "\n"


# --- the command line -------------------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The options; `--tiny` switches the defaults of dtype and sizes to the CPU smoke run's."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tiny", action="store_true", help="2-layer hidden-64 models, float32, small sizes (CPU smoke)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="the models' dtype (default bfloat16; float32 with --tiny)")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="writes OUT.json and OUT.md (a suffix is replaced)")
    p.add_argument("--models", default=",".join(s.name for s in SHAPES), help="comma-separated shape names")
    p.add_argument("--steps", default=",".join(STEPS), help="comma-separated steps, of " + ", ".join(STEPS))
    p.add_argument("--repeats", type=int, default=None, help="timed runs per variant (default 2; 1 with --tiny)")
    p.add_argument("--budget", type=float, default=420.0, help="no step starts after this many seconds")
    args = p.parse_args(argv)
    args.dtype = args.dtype or ("float32" if args.tiny else "bfloat16")
    args.steps = [s for s in args.steps.split(",") if s]
    unknown = [s for s in args.steps if s not in STEP_FUNCTIONS]
    names = [m for m in args.models.split(",") if m]
    unknown += [m for m in names if m not in {s.name for s in SHAPES}]
    if unknown:
        p.error(f"unknown steps or models: {unknown}")
    args.models = names
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every step on every model; returns 1 if a step failed or was skipped, else 0."""
    args = parse_args(argv)
    sizes = TINY_SIZES if args.tiny else Sizes()
    if args.repeats is not None:
        sizes = replace(sizes, repeats=args.repeats)
    shapes = [tiny_shape(s) if args.tiny else s for s in SHAPES if s.name in args.models]
    run = Run(args, sizes, shapes, command_line(argv))
    run.log(f"device {run.result['machine']['name']}, torch {torch.__version__}, transformers "
            f"{transformers.__version__}, {args.dtype}; results -> {Path(args.out).with_suffix('.md')}")
    dtype = getattr(torch, args.dtype)
    for shape in shapes:
        run.model(shape, dtype)
    run.save()
    bad = [f"{e['model']} {e['step']}" for e in run.result["steps"] if e["status"] != "ok"]
    run.log(f"done in {run.elapsed():.0f} s; " + (f"not ok: {', '.join(bad)}" if bad else "every step ok"))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
