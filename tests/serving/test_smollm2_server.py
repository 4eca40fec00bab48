"""On the real embedded SmolLM2: the server's greedy text is the text `ats generate` prints for the same prompt, and
its calibrated log-probabilities are `generate_calibrated`'s."""

from __future__ import annotations

import math

import openai
import pytest
import torch

from ats.cli.main import main
from ats.generation import generate_calibrated

from helpers import calibrator_for
from server_process import Server

PROMPT = "What is the capital of France?"
NEW_TOKENS = 24


@pytest.mark.slow
def test_smollm2_server_greedy_text_equals_ats_generate(smollm2, tmp_path, capsys, monkeypatch):
    head = tmp_path / "head"
    calibrator = calibrator_for(smollm2, seed=4)
    calibrator.save_pretrained(head)
    server = Server(["--model", "smollm2-135m-instruct", "--calibrator", str(head)], tmp_path / "server.log")
    try:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)
        out = client.chat.completions.create(model="smollm2-135m-instruct", max_tokens=NEW_TOKENS, temperature=0,
                                             logprobs=True, messages=[{"role": "user", "content": PROMPT}])
    finally:
        server.stop()
    monkeypatch.setenv("NO_COLOR", "1")
    capsys.readouterr()
    assert main(["-q", "generate", "--model", "smollm2-135m-instruct", "--calibrator", str(head),
                 "--max-new-tokens", str(NEW_TOKENS), PROMPT]) == 0
    cli_text, summary = capsys.readouterr().out.rsplit("\n\nsequence confidence: ", 1)
    choice = out.choices[0]
    assert choice.message.content == cli_text and len(cli_text) > 10
    assert summary.startswith(f"mean {choice.model_extra['ats']['mean_confidence']:.3f}")
    ref = generate_calibrated(smollm2, calibrator, PROMPT, max_new_tokens=NEW_TOKENS)[0]
    assert ref.text == cli_text
    served = torch.tensor([math.exp(e.logprob) for e in choice.logprobs.content])
    torch.testing.assert_close(served, torch.tensor(ref.confidences), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.tensor(choice.model_extra["ats"]["tau"]), torch.tensor(ref.taus), atol=1e-5,
                               rtol=1e-5)
