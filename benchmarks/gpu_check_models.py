"""The GPU check's models and data (benchmarks/gpu_check.py): random-weight model shapes built from their configs on
the device, a word-level tokenizer over the whole vocabulary, and synthetic sequences, questions and prompts."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import transformers

from ats.evaluation.tasks.scoring import ChoiceItem, LetterItem
from ats.evaluation.tasks.triviaqa import TriviaQATask
from ats.model.backbone import Backbone
from ats.model.labels import IGNORE_INDEX
from ats.training.data import TokenizedExample

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")  # ids 0..3; the words w4 .. w{V-1} follow


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


