"""`ats export --engine vllm` and `ats serve --engine vllm` as a user runs them: the folder, one-line refusals with
exit status 2 before anything is written, and (slow) vLLM's OpenAI server answering the openai client with the
calibrated logprobs of ats's decoding core."""

from __future__ import annotations

import json
import math
import os

import httpx
import pytest
import torch
from test_vllm_abstain import CERTIFIED

from ats.calibrators import build_calibrator, load_calibrator
from ats.cli.main import main
from ats.generation.api import encode_prompts
from ats.integrations.vllm import CONFIG_KEY
from ats.integrations.vllm.abstain import AnswerDecider

from conftest import ats_serve_vllm, calibrators, max_difference, reference
from helpers import write_certificate


def test_export_command_writes_the_folder(tiny_models, tmp_path, capsys):
    folder, backbone = tiny_models["llama"]
    head = calibrators(backbone, tmp_path, ["linear"])["linear"]
    assert main(["export", "--engine", "vllm", "--model", str(folder), "--calibrator", str(head),
                 str(tmp_path / "out")]) == 0
    record = json.loads((tmp_path / "out" / "config.json").read_text())[CONFIG_KEY]
    assert record["method"] == "ats" and record["base_architecture"] == "LlamaForCausalLM"
    assert str(tmp_path / "out") in capsys.readouterr().out


def test_export_and_serve_refuse_in_one_line(tiny_models, tmp_path, capsys):
    folder, _ = tiny_models["llama"]
    histogram = build_calibrator("histogram").fit(lambda: iter([(torch.randn(64, 8), torch.randint(0, 8, (64,)))]))
    histogram.save_pretrained(tmp_path / "histogram")
    cases = [(["export", "--model", str(folder), "--calibrator", str(tmp_path / "histogram"), str(tmp_path / "o")],
              "maps the top-1 confidence, not the logits"),
             (["export", "--model", str(tmp_path / "missing"), "--calibrator", "none", str(tmp_path / "o")],
              "no such file or folder"),
             (["serve", "--model", str(folder), "--calibrator", "none", "--", "--enforce-eager"],
              "options after -- go to vLLM's server; add --engine vllm"),
             (["serve", "--engine", "vllm", "--model", str(folder), "--calibrator", "none", "--threads", "2"],
              "--threads: an option of ats's own engine")]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("ats: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_serve_engine_vllm_answers_the_openai_client_with_calibrated_logprobs(tiny_models, tmp_path):
    from openai import OpenAI

    folder, backbone = tiny_models["llama"]
    head = calibrators(backbone, tmp_path, ["transformer"])["transformer"]
    write_certificate(head, CERTIFIED, load_calibrator(head), backbone)
    # no VLLM_CPU_* settings and no --gpu-memory-utilization: ats serve's CPU defaults start it on this machine
    env = {key: value for key, value in os.environ.items() if not key.startswith("VLLM_CPU_")}
    env["ATS_CACHE"] = str(tmp_path / "cache")
    argv = ["--model", str(folder), "--calibrator", str(head), "--served-model-name", "tiny", "--max-model-len", "512",
            "--", "--enforce-eager"]
    with ats_serve_vllm(argv, env, tmp_path / "server.log") as url:
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        prompt = "The capital of France is"
        out = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                             max_tokens=8, temperature=0, logprobs=True, top_logprobs=5,
                                             extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        bare = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                              max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        wizard = httpx.post(f"{url}/v1/chat/completions", timeout=30,
                            json={"model": "tiny", "messages": [{"role": "wizard", "content": prompt}]})
    (export,) = (tmp_path / "cache" / "vllm").iterdir()  # the export, made on the fly under the cache
    tokens = out.choices[0].logprobs.content
    ids = encode_prompts(backbone, [prompt])[0][0].tolist()
    (want,) = reference(backbone, load_calibrator(head), [ids], 8, 5)

    def token_id(token: str) -> int:  # "token_id:123" (return_tokens_as_token_ids)
        return int(token.split(":")[1])

    got = {"tokens": [token_id(t.token) for t in tokens],
           "logprobs": [{token_id(a.token): a.logprob for a in [t, *t.top_logprobs]} for t in tokens]}
    assert max_difference(got, want, keys=("logprobs",)) <= 1e-3
    # the client's answer-or-abstain decision: the mean calibrated probability of the 8 tokens (cut by the length
    # limit, so all count), from ats's own decoding core, against the threshold the export carries
    confidence = sum(math.exp(step[token]) for step, token in zip(want["logprobs"], want["tokens"])) / 8
    decision = AnswerDecider.from_export(export).decide(out.choices[0])
    assert decision["answer_confidence"] == pytest.approx(confidence, abs=1e-4)
    assert decision == {**CERTIFIED.decide(decision["answer_confidence"]),
                        "answer_confidence": decision["answer_confidence"]}
    # the server's own `ats` field is that decision, also when the client asked for no logprobs (none returned)
    assert out.choices[0].model_dump()["ats"] == decision
    assert bare.choices[0].model_dump()["ats"] == decision and bare.choices[0].logprobs is None
    # a role ats serve refuses: its 400 (vLLM alone answers 200 and generates)
    assert wizard.status_code == 400
    assert wizard.json()["error"]["message"].startswith("messages.0.role: Input should be 'system'")
    log = (tmp_path / "server.log").read_text()
    for setting in ("VLLM_CPU_NUM_OF_RESERVED_CPU=0", "VLLM_CPU_OMP_THREADS_BIND=", "VLLM_CPU_KVCACHE_SPACE=1"):
        assert f"vLLM on CPU: {setting}" in log
