"""In-process references for the serving tests: one full forward pass with the calibrator, and helpers that read
the engine's events."""

from __future__ import annotations

import torch

from ats.generation import encode_prompts
from ats.serving.engine import Generated, JobDone, PromptScored


def chat_ids(backbone, prompt: str) -> list[int]:
    """The token ids of `prompt` sent as one user turn through the chat template (as `generate_calibrated` does)."""
    ids, _, _ = encode_prompts(backbone, [prompt])
    return ids[0].tolist()


@torch.no_grad()
def forward(backbone, calibrator, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """From ONE forward pass over `ids` (T,): calibrated and uncalibrated log-softmax (T, V) and tau (T,); row t is
    the distribution of token t + 1. `calibrator` None: uncalibrated (tau 0)."""
    hidden, _ = backbone.forward(torch.tensor([ids]))
    z = backbone.logits(hidden)[0].float()
    if calibrator is None:
        tau = torch.zeros(len(ids))
        q = z
    else:
        tau = calibrator.log_scale(hidden)[0].float()
        q = z * calibrator.scale(tau)[:, None]
    return q.log_softmax(-1), z.log_softmax(-1), tau


def continuation_values(backbone, calibrator, prompt: list[int], tokens: list[int]):
    """(calibrated, uncalibrated, tau) (N,) of `tokens` generated after `prompt`, from one forward pass."""
    logq, logz, tau = forward(backbone, calibrator, prompt + tokens)
    rows = torch.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    target = torch.tensor(tokens)
    return logq[rows, target], logz[rows, target], tau[rows]


def choices(events: list) -> dict[int, dict]:
    """Per choice: token records, text and finish reason, from a job's events (in order)."""
    out: dict[int, dict] = {}
    for event in events:
        if isinstance(event, Generated):
            choice = out.setdefault(event.choice, {"tokens": [], "text": "", "finish": None, "pieces": []})
            choice["tokens"] += event.tokens
            choice["text"] += event.text
            choice["pieces"].append(event.text)
            choice["finish"] = event.finish_reason or choice["finish"]
    return out


def prompt_scores(events: list) -> dict[int, list]:
    return {e.prompt: e.tokens for e in events if isinstance(e, PromptScored)}


def done(events: list) -> bool:
    return bool(events) and isinstance(events[-1], JobDone)
