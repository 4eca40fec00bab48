"""Test doubles shared by several test files: calibrators with a known, hand-checkable effect; a tiny byte-level BPE
tokenizer with a chat template built here (`make_tiny_tokenizer`, no embedded model needed); the tiny random Llama
most tests run on (`make_tiny_backbone`) with an ATS head away from identity (`calibrator_for`); and small data files
in every layout `ats.sources` reads through ATS_DATA_DIR (`write_tiny_data`)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ats.calibrators.ats import ATSCalibrator, ATSConfig
from ats.calibrators.base import Calibrator
from ats.model.backbone import Backbone
from ats.model.heads import HeadConfig
from ats.model.labels import IGNORE_INDEX
from ats.training.answers import AnswerSet


class HalfTemperature(Calibrator):
    """Logits / 2: softer confidences, same argmax."""

    name = "half"

    def fit(self, chunks):
        return self

    def calibrate(self, logits, hidden=None, *, attention_mask=None, index=None):
        return logits / 2


class SquareConfidence(Calibrator):
    """A binning-style calibrator: maps a top-1 confidence c to c**2."""

    name = "square"
    maps_confidence = True

    def fit(self, chunks):
        return self

    def calibrate_confidence(self, confidence):
        return confidence ** 2


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# SmolLM2's chat template (ChatML with a default system turn), so prompts and label masks look like the real model's.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")


def make_tiny_tokenizer(vocab_size: int = 49152):
    """A byte-level BPE tokenizer trained here on the tiny data's text (every byte is a token, so any text round-trips;
    " A" ... " Z" after "Answer:" are single tokens, as letter scoring needs), with SmolLM2's special tokens, chat
    template and vocabulary size: the ~700 trained tokens are followed by filler words (" w700", " w701", ...) that
    no text encodes to but a model can emit, so a random model's logits spread as over a real vocabulary.
    Deterministic: the same corpus and trainer give the same vocabulary and merges."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, min_frequency=2, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(tiny_corpus(), trainer)
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    vocab.update({f"\u0120w{i}": i for i in range(len(vocab), vocab_size)})  # "\u0120" is the byte-level space
    tok = Tokenizer.from_str(json.dumps(spec))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token="<|endoftext|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def make_tiny_backbone(tokenizer, *, hidden_size: int = 64, layers: int = 2, seed: int = 0,
                       name: str = "tiny-llama", tie_word_embeddings: bool = True,
                       output_scale: float = 8.0) -> Backbone:
    """A random Llama with `tokenizer`'s vocabulary, small enough for millisecond forward passes (the global RNG is
    left as it was). Tied embeddings make it repeat its input; untied with `output_scale` about 60 it writes varied
    text with top-1 probabilities of 0.3-0.9."""
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
        tie_word_embeddings=tie_word_embeddings, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    # Sharpen the random model a little so that its top-1 confidence is not uniformly tiny.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(output_scale)
    return Backbone(model=model, tokenizer=tokenizer, name=name, revision=f"seed{seed}")


def calibrator_for(backbone, head_type: str = "transformer", seed: int = 0) -> ATSCalibrator:
    """A head away from identity: random final projection, so tau varies by token (about -1..1)."""
    torch.manual_seed(seed)
    calibrator = ATSCalibrator.for_backbone(backbone, head_type=head_type)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        proj = calibrator.head.proj
        proj.weight.copy_(0.1 * torch.randn(proj.weight.shape, generator=g))
        proj.bias.fill_(0.1)
    calibrator.head.eval()
    return calibrator


def perturbed_ats(backbone, std: float = 0.3, seed: int = 0):
    """A real ATS calibrator whose head's final projection is random (normal, `std`), so tau varies by token."""
    import torch

    from ats.calibrators.ats import ATSCalibrator

    ats = ATSCalibrator.for_backbone(backbone)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in ats.head.proj.parameters():
            p.normal_(0, std)
    return ats


# --- tiny data: every layout read through ATS_DATA_DIR (see ../shared/data/README.md), written by the tests ----------
@torch.no_grad()
def hand_token_metrics(store, backbone, calibrator=None):
    """Top-1 confidence and correctness of every response token of a feature store (with `calibrator`'s scale), from the
    stored hidden states by plain torch."""
    conf, correct = [], []
    for hidden, labels in store.sequences():
        keep = labels != IGNORE_INDEX
        z = hidden.float() @ backbone.output_weight.float().T  # (T, V)
        if calibrator is not None:
            z = z * calibrator.scale(calibrator.log_scale(hidden.float()[None]))[0][:, None]
        p = torch.softmax(z.double(), -1)[keep]
        conf.append(p.max(-1).values.numpy())
        correct.append((z[keep].argmax(-1) == labels[keep]).numpy())
    return np.concatenate(conf), np.concatenate(correct)



def planted_answers(n: int, hidden_size: int, seed: int) -> AnswerSet:
    """Letter-scored answers whose correctness is the sign of the first hidden unit at the answer position, with the
    same uncalibrated confidence everywhere (so nothing but h tells right from wrong)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n * 3, hidden_size, generator=g)  # rows of 3 tokens
    right = hidden[2::3, 0] > 0  # (n,)
    return AnswerSet(kind="letters", tensors={
        "hidden": hidden, "row_offsets": torch.arange(0, 3 * n + 1, 3), "row_question": torch.arange(n),
        "pos_row": torch.arange(n), "pos_in_row": torch.full((n,), 2), "pos_target": torch.full((n,), -1),
        "letter_logits": torch.tensor([[2.0, 0.0, 0.0]]).repeat(n, 1),
        "answer": torch.where(right, 0, 1), "n_choices": torch.full((n,), 3)}, meta={"task": {"name": "planted"}})


def fresh_ats(head_type: str, hidden_size: int) -> ATSCalibrator:
    """An ATS head of `head_type` at its seeded initialisation (identity for the zero-initialised output)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return ATSCalibrator(ATSConfig(head=HeadConfig(head_type=head_type, hidden_size=hidden_size),
                                       hidden_size=hidden_size))


CAPITALS = [("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid"), ("Germany", "Berlin"), ("Japan", "Tokyo"),
            ("Egypt", "Cairo"), ("Peru", "Lima"), ("Kenya", "Nairobi"), ("Canada", "Ottawa"), ("Chile", "Santiago"),
            ("Norway", "Oslo"), ("Greece", "Athens"), ("Cuba", "Havana"), ("Ireland", "Dublin"),
            ("Poland", "Warsaw"), ("Austria", "Vienna"), ("Portugal", "Lisbon"), ("Sweden", "Stockholm"),
            ("Finland", "Helsinki"), ("Denmark", "Copenhagen")]
COLOURS = ["red", "blue", "green", "yellow", "black", "white", "orange", "purple"]
# the subjects of `ats demo --size tiny` (experiment.QUICK_SUBJECTS) and one more
MMLU_SUBJECTS = ("abstract_algebra", "anatomy", "astronomy", "college_biology", "high_school_biology",
                 "high_school_geography", "high_school_us_history", "marketing", "nutrition", "philosophy",
                 "world_religions")
POOL_MC = ("sciq", "social_iqa", "boolq", "winogrande")
CORPUS_SUBJECTS = ("anatomy", "astronomy", "high_school_biology")  # fixed: the tokenizer is trained on them


def tiny_instructions(n: int = 48) -> list[dict]:
    """n Alpaca-form records {instruction, input, output}: capitals, sums and colours (every third with an input)."""
    rows = []
    for i in range(n):
        country, capital = CAPITALS[i % len(CAPITALS)]
        a, b = i + 2, 3 * i + 1
        kind = i % 3
        if kind == 0:
            rows.append({"instruction": f"What is the capital of {country}?", "input": "",
                         "output": f"The capital of {country} is {capital}. It is a large city."})
        elif kind == 1:
            rows.append({"instruction": "Add the two numbers.", "input": f"{a} and {b}",
                         "output": f"{a} plus {b} is {a + b}."})
        else:
            colour = COLOURS[i % len(COLOURS)]
            rows.append({"instruction": f"Write a short sentence about a {colour} bird.", "input": "",
                         "output": f"The {colour} bird sings in the tree every morning, and the sky is clear."})
    return rows


def _mmlu_row(subject: str, i: int) -> dict:
    a, b = i + 1, 2 * i + 3
    right = a + b
    choices = [str(right + d) for d in (-1, 0, 1, 2)]
    shift = i % 4  # rotate so that the answers are not all at one letter
    choices = choices[shift:] + choices[:shift]
    return {"subject": subject, "question": f"In {subject.replace('_', ' ')}, what is {a} plus {b}?",
            "choices": choices, "answer": choices.index(str(right))}


def _trivia_row(i: int) -> dict:
    country, capital = CAPITALS[i % len(CAPITALS)]
    question = f"What is the capital city of {country}?" if i < len(CAPITALS) else \
        f"Which city is the capital of {country} (question {i})?"
    return {"question": question, "question_id": f"tiny_{i}", "question_source": "tests",
            "answer": {"value": capital, "aliases": [capital, f"{capital} City"],
                       "normalized_aliases": [capital.lower(), f"{capital.lower()} city"],
                       "normalized_value": capital.lower(), "type": "WikipediaEntity"}}


def _truthful_rows(n: int) -> list[tuple[str, str, list[str], list[str]]]:
    """(question, best answer, true answers, false answers)."""
    rows = []
    for i in range(n):
        country, capital = CAPITALS[i % len(CAPITALS)]
        wrong = CAPITALS[(i + 1) % len(CAPITALS)][1]
        rows.append((f"What happens if you visit {capital} in {country}?", f"You are in {country}",
                     [f"You are in {country}", f"Nothing special happens in {capital}"],
                     [f"You are in {wrong}", "You turn into a bird"]))
    return rows


def write_tiny_data(root: Path, *, instructions: int = 48, mmlu_test: int = 6, trivia: int = 1024,
                    truthful: int = 12, pool: int = 12) -> Path:
    """Small files in every layout ATS_DATA_DIR holds (Alpaca-GPT4, Alpaca-cleaned, MMLU dev (5 per subject) /
    validation / test, TriviaQA, TruthfulQA MC and CSV, the QA pool); returns `root`."""
    root = Path(root)
    for folder in ("alpaca_gpt4", "alpaca_cleaned", "mmlu", "triviaqa", "truthfulqa", "qa_pool"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    records = tiny_instructions(instructions)
    (root / "alpaca_gpt4" / "alpaca_gpt4_1k.json").write_text(json.dumps(records, indent=1))
    (root / "alpaca_cleaned" / "alpaca_cleaned.jsonl").write_text(
        "".join(json.dumps(r) + "\n" for r in reversed(records)))
    sizes = {"dev": 5, "validation": 4, "test": mmlu_test}
    for split, n in sizes.items():
        offset = {"dev": 0, "validation": 100, "test": 200}[split]
        rows = [_mmlu_row(s, offset + i) for s in MMLU_SUBJECTS for i in range(n)]
        (root / "mmlu" / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "triviaqa" / "validation.jsonl").write_text(
        "".join(json.dumps(_trivia_row(i)) + "\n" for i in range(trivia)))
    truthful_rows = _truthful_rows(truthful)
    mc = [{"question": q, "mc1_targets": {t[0]: 1, **{f: 0 for f in false}},
           "mc2_targets": {**{a: 1 for a in t}, **{f: 0 for f in false}}} for q, _, t, false in truthful_rows]
    (root / "truthfulqa" / "mc_task.json").write_text(json.dumps(mc, indent=1))
    with open(root / "truthfulqa" / "TruthfulQA.csv", "w", encoding="utf-8-sig", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["Type", "Category", "Question", "Best Answer", "Correct Answers", "Incorrect Answers",
                         "Source"])
        for q, best, true, false in truthful_rows:
            writer.writerow(["Adversarial", "Misconceptions", q, best, "; ".join(true), "; ".join(false), "tests"])
    nq = [{"question": f"who lives in {capital.lower()}", "answers": [f"people of {country}", country]}
          for country, capital in CAPITALS[:pool]]
    (root / "qa_pool" / "nq_open.jsonl").write_text("".join(json.dumps(r) + "\n" for r in nq))
    for k, name in enumerate(POOL_MC):
        rows = []
        for i in range(pool):
            country, capital = CAPITALS[(i + k) % len(CAPITALS)]
            choices = [capital, CAPITALS[(i + k + 3) % len(CAPITALS)][1]] if name in ("boolq", "winogrande") else \
                [capital, CAPITALS[(i + k + 3) % len(CAPITALS)][1], COLOURS[i % len(COLOURS)]]
            answer = i % len(choices)
            choices = choices[-answer:] + choices[:-answer] if answer else choices  # the capital moves to `answer`
            rows.append({"question": f"({name}) Which city is in {country}?", "choices": choices, "answer": answer})
        (root / "qa_pool" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def tiny_corpus() -> list[str]:
    """The text the tiny tokenizer is trained on: the tiny data's sentences, prompt scaffolding and letter answers."""
    lines = [f"{r['instruction']} {r['input']} {r['output']}" for r in tiny_instructions(48)]
    lines += [r["question"] + " " + " ".join(r["choices"]) for r in (_mmlu_row(s, i) for s in CORPUS_SUBJECTS
                                                                     for i in range(12))]
    lines += [f"Q: {r['question']}\nA: {r['answer']['value']}" for r in map(_trivia_row, range(20))]
    lines += [f"{q} {best}" for q, best, _, _ in _truthful_rows(20)]
    lines += [f"Answer: {chr(ord('A') + i)}\n" for i in range(26)] * 3
    lines += ["The following are multiple choice questions (with answers) about anatomy.\n\n"] * 3
    lines += ["<|im_start|>system\nYou are a helpful assistant<|im_end|>\n<|im_start|>user\nHello<|im_end|>\n"] * 3
    lines += list(PROSE) * 2
    return lines


# everyday sentences (among them the prompts the generation and serving tests send), so that their words are tokens
PROSE = ("The capital of France is Paris, and Rome is the capital of Italy.",
         "Write a short poem about the sea and the wind, please.", "Write one word about the sea and the wind:",
         "Hi! Hello world, this is a test.", "Once upon a time there was a quick brown fox.",
         "The quick brown fox jumps over the lazy dog.", "What colour is the sky on a clear day?",
         "How many legs does a spider have? What do bees make? Which is a fruit? List three colours.",
         "What is 2 + 2? Answer with one number.", "Calibration is about knowing what you know.",
         "Question: what is the answer? Answer: the answer is yes, no, true or false.",
         "Pick a color, pick a word, pick a letter or pick a thing.")


def write_certificate(folder: Path, threshold, calibrator, backbone) -> Path:
    """`threshold` (a CertifiedThreshold) saved in `folder` as `ats certify` saves it, with what it certifies: the
    served format, `calibrator`'s digest (None: none) and `backbone`'s identity; returns the file."""
    from ats.evaluation.served import answer_format
    from ats.evaluation.threshold import THRESHOLD_NAME, backbone_identity
    from ats.io import write_json

    served = {"format": answer_format(backbone), "backbone": backbone_identity(backbone),
              "calibrator": None if calibrator is None else calibrator.digest()}
    path = Path(folder) / THRESHOLD_NAME
    write_json(path, {"threshold": threshold.to_dict(), "served": served, "sets": [], "tasks": {}, "fingerprint": {}})
    return path


def certified_copy(folder: Path, to: Path, calibrator, backbone, *, seed: int) -> Path:
    """A copy of the calibrator folder `folder` at `to` with a threshold certified (target risk 0.3, delta 0.1) on
    2000 made-up answers (seeded), saved as `ats certify` saves it for `calibrator` and `backbone`; returns `to`."""
    import shutil

    from ats.evaluation.threshold import certify_threshold

    shutil.copytree(folder, to)
    rng = np.random.default_rng(seed)
    conf = rng.uniform(size=2000)
    threshold = certify_threshold(conf, rng.uniform(size=2000) < conf, target_risk=0.3, delta=0.1)
    write_certificate(to, threshold, calibrator, backbone)
    return to


def random_thermometer(hidden_size: int, seed: int, *, mlp_hidden: int = 16):
    """A Thermometer away from identity (network weights 0.5 x N(0, 1), seeded), marked fitted: one temperature per
    prompt that varies from prompt to prompt (also benchmarks/bench_vllm.py's, at the default width)."""
    from ats.calibrators.thermometer import Thermometer

    thermometer = Thermometer(hidden_size=hidden_size, mlp_hidden=mlp_hidden)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in thermometer.net.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))
    thermometer.fitted = True
    return thermometer
