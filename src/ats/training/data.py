"""Instruction data for training the calibration head: Alpaca-form records -> token ids with response-only labels.

Sources: a local `.json` (list) or `.jsonl` file of `{instruction, input, output}` records, the names
`alpaca_gpt4` / `alpaca_cleaned` (read from `ATS_DATA_DIR` when set, else from the Hub), or any Hub dataset id.

The prompt is rendered with the tokenizer's chat template when it has one, otherwise with the plain Alpaca template
below. Labels are set only on the response: `labels[t]` is the id of token `t+1` when that token belongs to the
response, and -100 elsewhere (the prompt is context, not a prediction target).
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from ..config import ConfigMixin, option
from ..errors import ATSError
from ..io import read_json, read_jsonl
from ..model.labels import IGNORE_INDEX
from ..sources import data_dir, local_file

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

# name -> (file under ATS_DATA_DIR, Hub id)
KNOWN_SOURCES = {
    "alpaca_gpt4": ("alpaca_gpt4/alpaca_gpt4_1k.json", "vicgalle/alpaca-gpt4"),
    "alpaca_cleaned": ("alpaca_cleaned/alpaca_cleaned.jsonl", "yahma/alpaca-cleaned"),
}

PLAIN_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n"
PLAIN_TEMPLATE_WITH_INPUT = "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"


@dataclass
class DataConfig(ConfigMixin):
    """Which instruction data, how it is cut, split and stored as features."""

    source: str = option("alpaca_gpt4", "alpaca_gpt4, alpaca_cleaned, a .json/.jsonl file of "
                         "{instruction,input,output}, or a Hub id", flag="--data")
    limit: int | None = option(None, "use a seeded random subset of this many examples", unset="all", low=1)
    max_length: int = option(512, "tokens per example (prompt + response); longer ones are cut", low=2)
    pack: int | None = option(None, "pack examples end to end into sequences of up to this many tokens, so the head "
                              "sees the positions of long task prompts (e.g. 2048 for 5-shot MMLU)", unset="off",
                              low=2)
    val_fraction: float = option(0.1, "held-out fraction (token-level validation)", low=0.0, high=1.0,
                                 low_open=True, high_open=True)
    seed: int = option(0, "seed of the subset and the split", cli=False)
    batch_tokens: int = option(8192, "tokens per extraction forward pass", low=1, result=False)
    feature_dtype: str = option("float16", "dtype of cached hidden states", cli=False,
                                choices=("float16", "bfloat16", "float32"))
    shard_sequences: int = option(256, "sequences per feature shard", cli=False, low=1)


@dataclass(frozen=True)
class Instruction:
    """One Alpaca record: the instruction, an optional input ("" when absent) and the reference output."""

    instruction: str
    input: str
    output: str


def _check_record(record, where: str) -> Instruction:
    if not isinstance(record, dict):
        raise ATSError(f"{where}: expected an object with instruction/input/output, got {type(record).__name__}")
    values = {}
    for key in ("instruction", "input", "output"):
        value = record.get(key, "" if key == "input" else None)
        if value is None:
            raise ATSError(f"{where}: missing field {key!r}")
        if not isinstance(value, str):
            raise ATSError(f"{where}: field {key!r} must be a string, got {type(value).__name__} {value!r:.60}")
        values[key] = value
    if not values["output"].strip():
        raise ATSError(f"{where}: field 'output' is empty (nothing to calibrate on)")
    if not values["instruction"].strip():
        raise ATSError(f"{where}: field 'instruction' is empty")
    return Instruction(**values)


def read_instruction_file(path: str | Path) -> list[Instruction]:
    """Read a `.json` list or a `.jsonl` file of Alpaca records, with file/line in every error.

    Args:
        path: the file; `.jsonl` is read line by line, anything else as one JSON list.

    Returns:
        The records, in file order.

    Raises:
        ATSError: if the file is missing, not valid JSON, not a list, empty, or a record lacks a non-empty
            instruction or output, or has a non-string field.
    """
    path = Path(path)
    if not path.is_file():
        raise ATSError(f"{path}: file not found")
    records: list[Instruction] = []
    if path.suffix == ".jsonl":
        records = [_check_record(obj, f"{path}:{lineno}") for lineno, obj in read_jsonl(path)]
    else:
        data = read_json(path)
        if not isinstance(data, list):
            raise ATSError(f"{path}: expected a JSON list of records, got {type(data).__name__}")
        records = [_check_record(obj, f"{path}: record {i}") for i, obj in enumerate(data)]
    if not records:
        raise ATSError(f"{path}: no records")
    return records


def load_instructions(source: str = "alpaca_gpt4", *, limit: int | None = None, seed: int = 0) -> list[Instruction]:
    """Load instruction data from a file, a known name (local when ATS_DATA_DIR is set) or a Hub dataset id.

    Args:
        source: a `.json` / `.jsonl` path, a name in `KNOWN_SOURCES`, or a Hub dataset id (its "train" split).
        limit: keep a seeded random subset of this many records.
        seed: the seed of the subset.

    Returns:
        The records.

    Raises:
        ATSError: if a file is missing or invalid, or a record is malformed.
    """
    path = Path(source)
    if path.suffix in (".json", ".jsonl") or path.is_file():
        records = read_instruction_file(path)
    elif source in KNOWN_SOURCES and data_dir() is not None:
        records = read_instruction_file(local_file(KNOWN_SOURCES[source][0]))
    else:
        hub_id = KNOWN_SOURCES.get(source, (None, source))[1]
        from datasets import load_dataset

        dataset = load_dataset(hub_id, split="train")
        records = [_check_record(dict(r), f"{hub_id}: row {i}") for i, r in enumerate(dataset)]
    if limit is not None and limit < len(records):
        records = random.Random(seed).sample(records, limit)
    return records


def render_prompt(tokenizer: PreTrainedTokenizerBase, example: Instruction) -> tuple[str, str]:
    """(prompt text, response text): the chat template when the tokenizer has one, else the plain template.

    Args:
        tokenizer: the backbone's tokenizer.
        example: the record; its input, if not blank, follows the instruction.

    Returns:
        (prompt, response); with the plain template the response ends with the EOS token.
    """
    user = example.instruction if not example.input.strip() else f"{example.instruction}\n\n{example.input}"
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": user}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages + [{"role": "assistant", "content": example.output}],
                                             tokenize=False)
        if full.startswith(prompt):
            return prompt, full[len(prompt):].rstrip("\n")
    template = PLAIN_TEMPLATE_WITH_INPUT if example.input.strip() else PLAIN_TEMPLATE
    prompt = template.format(instruction=example.instruction, input=example.input)
    return prompt, example.output + (tokenizer.eos_token or "")


@dataclass
class TokenizedExample:
    """One example as token ids, with next-token labels on the response only."""

    input_ids: list[int]
    labels: list[int]  # labels[t] = input_ids[t + 1] on response positions, IGNORE_INDEX elsewhere


@dataclass
class TokenizeStats:
    """Counts of what tokenization kept, cut and dropped (dropped_indices: positions in the input list)."""

    examples: int = 0
    truncated: int = 0  # kept, response cut at max_length
    dropped: int = 0  # prompt alone filled max_length: no response token left
    response_tokens: int = 0
    dropped_indices: list[int] = field(default_factory=list)

    def summary(self) -> str:
        """The counts as one line, for the log.

        Returns:
            "N examples, M response tokens; a truncated at max_length, b dropped (prompt fills max_length)".
        """
        return (f"{self.examples} examples, {self.response_tokens} response tokens; "
                f"{self.truncated} truncated at max_length, {self.dropped} dropped (prompt fills max_length)")


def tokenize_example(tokenizer: PreTrainedTokenizerBase, example: Instruction, max_length: int
                     ) -> tuple[TokenizedExample | None, bool]:
    """Tokenize one example; returns (example or None if no response token fits, truncated?).

    Args:
        tokenizer: the backbone's tokenizer; special tokens are added to the prompt unless it has a chat template.
        example: the record.
        max_length: the most tokens kept (prompt + response).

    Returns:
        (the tokenized example, or None when the prompt fills `max_length`; whether the ids were cut).
    """
    prompt, response = render_prompt(tokenizer, example)
    chat = bool(getattr(tokenizer, "chat_template", None))
    prompt_ids = tokenizer(prompt, add_special_tokens=not chat).input_ids
    response_ids = tokenizer(response, add_special_tokens=False).input_ids
    ids = prompt_ids + response_ids
    truncated = len(ids) > max_length
    ids = ids[:max_length]
    n_prompt = len(prompt_ids)
    if n_prompt >= len(ids):
        return None, truncated
    labels = [IGNORE_INDEX] * len(ids)
    for t in range(n_prompt - 1, len(ids) - 1):
        labels[t] = ids[t + 1]
    return TokenizedExample(input_ids=ids, labels=labels), truncated


def tokenize_instructions(tokenizer: PreTrainedTokenizerBase, examples: list[Instruction], *, max_length: int = 512
                          ) -> tuple[list[TokenizedExample], TokenizeStats]:
    """Tokenize all examples; truncation and drops are counted, never silent.

    Args:
        tokenizer: the backbone's tokenizer.
        examples: the records.
        max_length: the most tokens per example.

    Returns:
        (the kept examples, in order; the counts).

    Raises:
        ATSError: if `max_length` < 2 or no example keeps a response token.
    """
    if max_length < 2:
        raise ATSError(f"max_length must be at least 2, got {max_length}")
    stats = TokenizeStats()
    out = []
    for i, example in enumerate(examples):
        tokenized, truncated = tokenize_example(tokenizer, example, max_length)
        stats.truncated += int(truncated and tokenized is not None)
        if tokenized is None:
            stats.dropped += 1
            stats.dropped_indices.append(i)
            continue
        stats.examples += 1
        stats.response_tokens += sum(label != IGNORE_INDEX for label in tokenized.labels)
        out.append(tokenized)
    if not out:
        raise ATSError(f"no example left after tokenization with max_length={max_length} ({stats.summary()})")
    return out, stats


def train_val_split(items: list, *, val_fraction: float = 0.1, seed: int = 0) -> tuple[list, list]:
    """A seeded random split; the validation part gets at least one item.

    Args:
        items: what to split (at least 2).
        val_fraction: the validation share, in (0, 1); rounded, at least one item.
        seed: the seed of the split.

    Returns:
        (train, val), each in the original order.

    Raises:
        ATSError: if `val_fraction` is not in (0, 1) or there are fewer than 2 items.
    """
    if not 0 < val_fraction < 1:
        raise ATSError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if len(items) < 2:
        raise ATSError(f"need at least 2 examples to split off a validation set, got {len(items)}")
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    n_val = max(1, round(len(items) * val_fraction))
    val = [items[i] for i in sorted(order[:n_val])]
    train = [items[i] for i in sorted(order[n_val:])]
    return train, val


def prepare_examples(tokenizer: PreTrainedTokenizerBase, config: DataConfig | None = None
                     ) -> tuple[list[TokenizedExample], list[TokenizedExample], dict]:
    """Tokenized (train, val) examples and the description of the data stored beside their features.

    Args:
        tokenizer: the backbone's tokenizer.
        config: the data options; default `DataConfig()`.

    Returns:
        (train examples, val examples, packed when `config.pack` is set; {"data_source", "max_length", "pack",
        "truncated", "dropped"}).

    Raises:
        ATSError: if the data cannot be read or too little is left to split.
    """
    config = config or DataConfig()
    records = load_instructions(config.source, limit=config.limit, seed=config.seed)
    examples, stats = tokenize_instructions(tokenizer, records, max_length=config.max_length)
    logger.info("instruction data %s: %s", config.source, stats.summary())
    train, val = train_val_split(examples, val_fraction=config.val_fraction, seed=config.seed)
    if config.pack:
        train, val = pack_examples(train, config.pack), pack_examples(val, config.pack)
    meta = {"data_source": config.source, "max_length": config.max_length, "pack": config.pack,
            "truncated": stats.truncated, "dropped": stats.dropped}
    return train, val, meta


def pack_examples(examples: list[TokenizedExample], length: int) -> list[TokenizedExample]:
    """Examples joined end to end, in order, into sequences of at most `length` tokens (an example longer than
    `length` stays alone). Each keeps its own labels: the last position of an example predicts nothing (its next
    token starts another example), so no label crosses a boundary; the backbone sees the earlier examples as
    context, as a few-shot prompt shows earlier questions.

    Args:
        examples: the examples, in order.
        length: the most tokens per packed sequence.

    Returns:
        The packed sequences.
    """
    packed: list[TokenizedExample] = []
    ids: list[int] = []
    labels: list[int] = []
    for example in examples:
        if ids and len(ids) + len(example.input_ids) > length:
            packed.append(TokenizedExample(input_ids=ids, labels=labels))
            ids, labels = [], []
        ids = ids + example.input_ids
        labels = labels + example.labels
    if ids:
        packed.append(TokenizedExample(input_ids=ids, labels=labels))
    return packed
