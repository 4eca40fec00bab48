"""TriviaQA (rc.nocontext), few-shot greedy generation, confidence = mean calibrated probability of the answer tokens.

Protocol (the paper's reference evaluator, with its defects fixed):

1. Prompt: `n_shots` (5) fixed-seed question/answer pairs from the same file, never among the evaluated questions,
   as "Q: {question}\\nA: {answer}\\n\\n", ending with "Q: {question}\\nA:". Raw completion: chat models get no chat
   template (the few-shot format is the instruction).
2. Greedy generation (`do_sample=False`) of at most 16 new tokens, cut at the first newline (and at end-of-sequence).
3. Correct = exact match after SQuAD normalisation (lowercase, no punctuation, no articles a/an/the, single spaces)
   with any alias (`answer.aliases` + `answer.normalized_aliases`).
4. ONE forward over prompt + answer tokens (the few-shot prefix's KV cache is shared by all questions); each answer
   token's probability under each calibrator's calibrated distribution (hidden state t-1 predicts token t). At least
   one token is scored: for an empty answer, the first generated token. Binning calibrators map each token's
   probability. Confidence = the mean of those probabilities (reference protocol); their product (the sequence
   probability) is returned as the extra array `confidence_product`.

Every calibrator scores the backbone's own greedy answer. ATS and temperature scaling never change the argmax, but
vector scaling can: its own greedy answer could differ, and we still score the backbone's answer under its
distribution, so that all methods judge the same answers.

Data: `ATS_DATA_DIR/triviaqa/validation.jsonl` when ATS_DATA_DIR is set, else the Hub's `mandarjoshi/trivia_qa`
("rc.nocontext", validation).
"""

from __future__ import annotations

import re
import string

import numpy as np
import torch

from ...calibrators.base import Calibrator
from ...errors import ATSError
from ...sources import hub_dataset, local_file
from .base import Task, TaskResult, chunks, progress_bar, read_jsonl
from .scoring import PrefixCache, encode, gather_logits

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = set(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, remove punctuation, remove articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCT)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def exact_match(prediction: str, aliases: list[str]) -> bool:
    pred = normalize_answer(prediction)
    return bool(pred) and any(pred == normalize_answer(a) for a in aliases)


def answer_aliases(row: dict) -> list[str]:
    answer = row["answer"]
    out = list(answer.get("aliases") or []) + list(answer.get("normalized_aliases") or [])
    if answer.get("value"):
        out.append(answer["value"])
    return out


def load_triviaqa() -> list[dict]:
    path = local_file("triviaqa/validation.jsonl")
    rows = read_jsonl(path) if path is not None else [dict(r) for r in
                                                       hub_dataset("mandarjoshi/trivia_qa", "rc.nocontext",
                                                                   "validation")]
    out = []
    for i, r in enumerate(rows):
        try:
            out.append({"question": str(r["question"]).strip(), "value": str(r["answer"]["value"]),
                        "aliases": answer_aliases(r)})
        except (KeyError, TypeError, AttributeError) as err:
            where = path or "mandarjoshi/trivia_qa"
            raise ATSError(f"{where}: row {i + 1}: malformed TriviaQA row ({err!r})") from None
    return out


def few_shot_prefix(shots: list[dict]) -> str:
    return "".join(f"Q: {s['question']}\nA: {s['value']}\n\n" for s in shots)


def render_prompt(shots: list[dict], question: str) -> str:
    return few_shot_prefix(shots) + f"Q: {question}\nA:"


def cut_answer(tokenizer, generated: list[int], stop_ids: set[int]) -> tuple[str, int]:
    """(answer text, number of tokens to score) of a greedy continuation: cut at end-of-sequence and first newline.

    The scored tokens are those whose decoded text holds no newline yet (at least one token).
    """
    tokens = []
    for t in generated:
        if t in stop_ids:
            break
        tokens.append(int(t))
    text = tokenizer.decode(tokens, skip_special_tokens=True)
    answer = text.split("\n")[0].strip()
    n = 0
    for k in range(1, len(tokens) + 1):
        if "\n" in tokenizer.decode(tokens[:k], skip_special_tokens=True):
            break
        n = k
    return answer, max(n, 1)


class TriviaQATask(Task):
    """TriviaQA generation; `limit` = a seeded subset of questions (the few-shot examples are never among them)."""

    name = "triviaqa"

    def __init__(self, *, limit: int | None = None, seed: int = 0, n_shots: int = 5, max_new_tokens: int = 16,
                 batch_size: int = 8) -> None:
        self.limit = limit
        self.seed = seed
        self.n_shots = n_shots
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size

    def describe(self) -> dict:
        return {"name": self.name, "limit": self.limit, "seed": self.seed, "n_shots": self.n_shots,
                "max_new_tokens": self.max_new_tokens}

    def load(self) -> tuple[list[dict], list[dict]]:
        """(few-shot examples, evaluated questions)."""
        rows = load_triviaqa()
        if len(rows) <= self.n_shots:
            raise ATSError(f"triviaqa: {len(rows)} questions, not more than n_shots={self.n_shots}")
        order = np.random.default_rng(self.seed).permutation(len(rows))
        shots = [rows[i] for i in order[:self.n_shots]]
        rest = order[self.n_shots:]
        if self.limit is not None:
            rest = rest[:self.limit]
        return shots, [rows[i] for i in sorted(rest)]

    @torch.no_grad()
    def generate(self, backbone, prompts: list[list[int]]) -> list[list[int]]:
        """Greedy continuations (new tokens only) of a batch of prompts, left-padded for generation."""
        tok = backbone.tokenizer
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        kwargs = dict(input_ids=ids.to(backbone.device), attention_mask=mask.to(backbone.device),
                      max_new_tokens=self.max_new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)
        try:  # stop once every answer has reached a newline (the answer is cut there anyway)
            out = backbone.model.generate(**kwargs, stop_strings=["\n"], tokenizer=tok)
        except (TypeError, ValueError, NotImplementedError):  # a model or tokenizer without stop-string support
            out = backbone.model.generate(**kwargs)
        return [row[width:].tolist() for row in out.cpu()]

    def run(self, backbone, calibrators: dict[str, Calibrator], *, progress: bool = True) -> dict[str, TaskResult]:
        tok = backbone.tokenizer
        shots, questions = self.load()
        prefix_text = few_shot_prefix(shots)
        prefix = PrefixCache(backbone, encode(tok, prefix_text, special=True) if prefix_text else [])
        eos = backbone.model.generation_config.eos_token_id
        stop_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
        if tok.eos_token_id is not None:
            stop_ids.add(tok.eos_token_id)
        mean = {m: [] for m in calibrators}
        prod = {m: [] for m in calibrators}
        correct, predictions, n_tokens = [], [], []
        for batch in progress_bar(chunks(questions, self.batch_size), enabled=progress, desc="triviaqa"):
            prompts = [encode(tok, render_prompt(shots, q["question"]), special=True) for q in batch]
            generated = self.generate(backbone, prompts)
            cuts = [cut_answer(tok, g, stop_ids) for g in generated]
            answers = [g[:k] for g, (_, k) in zip(generated, cuts)]
            for q, (text, k) in zip(batch, cuts):
                predictions.append(text)
                correct.append(exact_match(text, q["aliases"]))
                n_tokens.append(k)
            hidden, mask = prefix.forward([p + a for p, a in zip(prompts, answers)])
            K = max(len(a) for a in answers)
            index = torch.tensor([[len(p) - 1 + min(j, len(a) - 1) for j in range(K)]
                                  for p, a in zip(prompts, answers)], device=hidden.device)  # (B, K)
            targets = torch.tensor([[a[min(j, len(a) - 1)] for j in range(K)] for a in answers],
                                   device=hidden.device)
            valid = np.array([[j < len(a) for j in range(K)] for a in answers])
            z = gather_logits(backbone, hidden, index)  # (B, K, V)
            for method, calibrator in calibrators.items():
                q = calibrator.apply(z, hidden, attention_mask=mask, index=index)
                p = torch.softmax(q, dim=-1).gather(2, targets[..., None])[..., 0]  # (B, K)
                p = calibrator.map_confidence(p)
                mean[method].extend((p * valid).sum(1) / valid.sum(1))
                prod[method].extend(np.prod(np.where(valid, p, 1.0), axis=1))
        out = {}
        for method in calibrators:
            out[method] = TaskResult(np.asarray(mean[method]), np.asarray(correct, dtype=bool),
                                     {"confidence_product": np.asarray(prod[method]),
                                      "n_tokens": np.asarray(n_tokens, dtype=np.int64),
                                      "prediction": np.asarray(predictions, dtype=str)})
        return out
