"""lm-evaluation-harness (`--model local-completions`) against a real `ats serve`: a small multiple-choice task from a
YAML that reads a local JSONL file (no Hub); every per-choice log-likelihood equals the in-process calibrated one."""

from __future__ import annotations

import json

import pytest
import torch

from server_process import API_KEY, MODEL_NAME
from serving_reference import forward

QUESTIONS = [
    {"question": "What colour is the sky on a clear day?", "choices": ["blue", "green", "red"], "answer": 0},
    {"question": "How many legs does a spider have?", "choices": ["six", "eight", "ten"], "answer": 1},
    {"question": "Which is a fruit?", "choices": ["carrot", "potato", "apple"], "answer": 2},
    {"question": "What do bees make?", "choices": ["honey", "milk", "silk"], "answer": 0},
]

TASK = """task: ats_serve_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {path}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
"""


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's split of a request into context and continuation tokens (trailing spaces of the context move to
    the continuation; the continuation is what the whole string adds after the context's tokens)."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx):]


@pytest.mark.parametrize("batch_size", [1, 12])  # 12: all 12 requests in one, more rows than the server's batch of 8
def test_lm_eval_local_completions_scores_choices_with_calibrated_logprobs(server, backbone, calibrator, model_dir,
                                                                          tmp_path, monkeypatch, batch_size):
    """With batch_size 12, rows that end at prefill (max_tokens 1) wait beside others: that path once gave each
    choice a second generated token, which lm-eval summed into the continuation's log-likelihood."""
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    data = tmp_path / "mc.jsonl"
    data.write_text("".join(json.dumps(q) + "\n" for q in QUESTIONS))
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "ats_serve_mc.yaml").write_text(TASK.format(path=data))
    monkeypatch.setenv("OPENAI_API_KEY", API_KEY)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    model_args = (f"model={MODEL_NAME},base_url={server.url}/v1/completions,tokenizer={model_dir},"
                  "tokenizer_backend=huggingface,max_retries=1,num_concurrent=2")
    results = lm_eval.simple_evaluate(model="local-completions", model_args=model_args, tasks=["ats_serve_mc"],
                                      task_manager=TaskManager(include_path=str(tmp_path / "tasks")),
                                      log_samples=True, batch_size=batch_size)
    samples = sorted(results["samples"]["ats_serve_mc"], key=lambda s: s["doc_id"])
    assert len(samples) == len(QUESTIONS)
    correct, calibrated_moved = 0, 0
    for sample, question in zip(samples, QUESTIONS):
        served = [resp[0][0] for resp in sample["resps"]]  # (log-likelihood, is_greedy) per choice
        expected, raw = [], []
        for context, continuation in (arg[:2] for arg in sample["arguments"]):
            ctx, cont = encode_pair(backbone.tokenizer, context, continuation)
            logq, logz, _ = forward(backbone, calibrator, ctx + cont)
            rows, target = torch.arange(len(ctx) - 1, len(ctx) + len(cont) - 1), torch.tensor(cont)
            expected.append(logq[rows, target].sum().item())
            raw.append(logz[rows, target].sum().item())
        torch.testing.assert_close(torch.tensor(served), torch.tensor(expected), atol=1e-5, rtol=1e-5)
        calibrated_moved += any(abs(a - b) > 1e-3 for a, b in zip(expected, raw))
        correct += max(range(len(expected)), key=expected.__getitem__) == question["answer"]
    assert calibrated_moved == len(QUESTIONS)  # the served scores are the calibrated ones, not the model's own
    assert results["results"]["ats_serve_mc"]["acc,none"] == pytest.approx(correct / len(QUESTIONS))
