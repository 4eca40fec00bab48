"""Helpers of the vLLM tests (a module of its own name: `from conftest import` would pick whichever test folder's
conftest was imported first): tiny random Llama and Qwen2 model folders, one calibrator of every kind vLLM runs,
their exports, and `run_vllm`: every engine of a test session in one fresh process (`vllm_runner.py`), engines one
after another, so vLLM is imported once and never forked from pytest.

The references are ats's own decoding core (`ats.generation.Decoder`, what `ats generate` and `ats serve` run) on
the same token ids, in float32.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

from ats.calibrators import build_calibrator
from ats.calibrators.ats import ATSCalibrator
from ats.generation.decoder import Decoder, Row
from ats.generation.sampling import SamplingParams
from ats.model.backbone import Backbone

RUNNER = Path(__file__).with_name("vllm_runner.py")
HIDDEN, HEADS, KV_HEADS = 128, 4, 2  # head dim 32: vLLM's CPU attention takes 32, 64, 80, ... (not 16)
SLIDING_WINDOW = 32  # the tiny Mistral's


def tiny_model_folder(root: Path, kind: str, tokenizer, seed: int = 0) -> Path:
    """A random Llama, Qwen2 (biased q/k/v) or Mistral (a sliding window of SLIDING_WINDOW tokens) saved with
    `tokenizer`; an output scale of 60 gives varied greedy text with top-1 probabilities of 0.3-0.9
    (tests/helpers.make_tiny_backbone)."""
    cls, config_cls = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config),
                       "mistral": (MistralForCausalLM, MistralConfig)}[kind]
    extra = {"sliding_window": SLIDING_WINDOW} if kind == "mistral" else {}
    config = config_cls(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                        num_hidden_layers=2, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
                        max_position_embeddings=1024, tie_word_embeddings=False, rms_norm_eps=1e-6,
                        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = cls(config)
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(60.0)
            if kind == "qwen2":
                for layer in model.model.layers:
                    for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                        proj.bias.normal_(0, 0.5)
    folder = root / f"tiny-{kind}"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def perturbed(calibrator: ATSCalibrator, seed: int) -> ATSCalibrator:
    """The head moved away from identity so that tau varies by token (about -0.5..1): random final projection
    (a constant head: one tau of 0.4)."""
    g = torch.Generator().manual_seed(seed)
    head = calibrator.head
    with torch.no_grad():
        if hasattr(head, "proj"):
            head.proj.weight.copy_(0.03 * torch.randn(head.proj.weight.shape, generator=g))
            head.proj.bias.fill_(0.2)
        else:
            head.tau.fill_(0.4 / head.gain)
    head.eval()
    return calibrator


def official_head(folder: Path, seed: int = 0) -> Path:
    """A head in the layout of the paper's released heads (grouped key/value heads, no final norm)."""
    g = torch.Generator().manual_seed(seed)
    d, inter = HIDDEN // HEADS, 256

    def rand(*shape, scale=0.1):
        return torch.randn(*shape, generator=g) * scale

    attn = "transformer.self_attn."
    mlp, norm = "transformer.mlp.", "transformer."
    state = {attn + "q_proj.weight": rand(HIDDEN, HIDDEN), attn + "k_proj.weight": rand(KV_HEADS * d, HIDDEN),
             attn + "v_proj.weight": rand(KV_HEADS * d, HIDDEN), attn + "o_proj.weight": rand(HIDDEN, HIDDEN),
             mlp + "gate_proj.weight": rand(inter, HIDDEN), mlp + "up_proj.weight": rand(inter, HIDDEN),
             mlp + "down_proj.weight": rand(HIDDEN, inter), norm + "input_layernorm.weight": 1 + rand(HIDDEN),
             norm + "post_attention_layernorm.weight": 1 + rand(HIDDEN),
             "linear_head.weight": rand(1, HIDDEN, scale=0.02), "linear_head.bias": torch.tensor([0.3])}
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({
        "calibration_type": "transformer", "in_features": HIDDEN, "intermediate_size": inter,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "feature_key": "hidden_states"}))
    save_file(state, str(folder / "calibration_head.safetensors"), metadata={"format": "pt"})
    return folder


def calibrators(backbone: Backbone, root: Path, names: list[str]) -> dict[str, Path]:
    """Saved calibrators of every kind vLLM runs, each away from identity; name -> folder."""
    V = backbone.vocab_size
    g = torch.Generator().manual_seed(1)
    made = {}
    for name in names:
        folder = root / name
        if name == "official":
            made[name] = official_head(folder)
            continue
        if name in ("transformer", "mlp", "linear"):
            cal = perturbed(ATSCalibrator.for_backbone(backbone, head_type=name, seed=3), seed=4)
        elif name in ("selective-temperature", "selective-linear"):
            head = "constant" if name == "selective-temperature" else "linear"
            cal = perturbed(ATSCalibrator.for_backbone(backbone, head_type=head, method=name, seed=3), seed=5)
        elif name == "temperature":
            cal = build_calibrator("temperature")
            cal.temperature = 0.7
        elif name == "vector":
            cal = build_calibrator("vector")
            cal.scale, cal.bias = 1 + 0.2 * torch.randn(V, generator=g), 0.5 * torch.randn(V, generator=g)
        else:
            raise ValueError(name)
        cal.save_pretrained(folder)
        made[name] = folder
    return made


def reference(backbone: Backbone, calibrator, prompts: list[list[int]], max_tokens: int, top: int) -> list[dict]:
    """What ats's decoding core gives for the prompts, greedy, batched: per prompt the tokens, per generated token
    {id: calibrated logprob} of the chosen and top tokens, per prompt token (after the first) the same, and the
    largest factor the calibrator put on a logit there ("scale": exp(tau) of a head, 1 / T (Thermometer's, read at
    the prompt's end), max |a| of vector scaling, 1 uncalibrated)."""
    rows = [Row(ids, i, backbone.tokenizer, max_tokens=max_tokens, sampling=SamplingParams(temperature=0),
                top_logprobs=top, ignore_eos=True, score_prompt=True) for i, ids in enumerate(prompts)]
    Decoder(backbone, calibrator).run(rows)

    def entry(record) -> dict[int, float]:
        return {**{token: lp for token, lp in record.top}, record.token: record.logprob}

    def scale(records, ids) -> float:
        taus = [r.tau for r in records if r.tau is not None]
        if taus:
            return math.exp(max(taus))
        if calibrator is None:
            return 1.0
        if calibrator.name == "temperature":
            return 1.0 / calibrator.temperature
        if calibrator.prompt_hidden:  # Thermometer: 1/T read at the prompt's last token
            hidden, _ = backbone.forward(torch.tensor([ids]))
            return float(1.0 / calibrator.temperature(hidden[:, -1])[0])
        return float(calibrator.scale.abs().max())  # vector scaling

    return [{"tokens": [r.token for r in row.records], "logprobs": [entry(r) for r in row.records],
             "prompt_logprobs": [None] + [entry(r) for r in row.prompt_scores[1:]],
             "scale": scale(row.records + row.prompt_scores[1:], ids)} for row, ids in zip(rows, prompts)]


def max_difference(got: dict, want: dict, keys=("logprobs", "prompt_logprobs")) -> float:
    """The largest |logprob difference| over generated and prompt tokens; the same tokens and the same top-k sets
    are asserted on the way."""
    assert got["tokens"] == want["tokens"], "greedy text differs"
    worst = 0.0
    for key in keys:
        assert len(got[key]) == len(want[key])
        for g, w in zip(got[key], want[key]):
            if w is None:
                assert g is None
                continue
            assert set(g) == set(w), f"{key}: other top tokens {sorted(g)} vs {sorted(w)}"
            worst = max(worst, max(abs(g[t] - w[t]) for t in w))
    return worst


def prompt_drift(got: list[dict], want: list[dict], prompts: list[list[int]]) -> float:
    """The largest |logprob difference| of the prompt tokens themselves between two engines' outputs for `prompts`
    (teacher-forced: the same tokens in both, whatever bfloat16 does to the greedy text)."""
    worst = 0.0
    for g, w, ids in zip(got, want, prompts):
        for i in range(1, len(ids)):
            worst = max(worst, abs(g["prompt_logprobs"][i][ids[i]] - w["prompt_logprobs"][i][ids[i]]))
    return worst


def run_vllm(jobs: list[dict], work: Path, *, env: dict | None = None, timeout: int = 900) -> list[dict]:
    """Run the jobs (`vllm_runner.py`) in one fresh process; their outputs with token ids as ints."""
    jobs_path, out_path = work / "jobs.json", work / "out.json"
    jobs_path.write_text(json.dumps(jobs))
    proc = subprocess.run([sys.executable, str(RUNNER), str(jobs_path), str(out_path)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    if proc.returncode != 0:
        raise AssertionError(f"vLLM runner failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    results = json.loads(out_path.read_text())
    for result in results:
        for outputs in result["rounds"]:
            if isinstance(outputs, dict):  # {"error": ...}: a refused round
                continue
            for output in outputs:
                for key in ("logprobs", "prompt_logprobs"):
                    if output[key] is not None:
                        output[key] = [None if e is None else {int(k): v for k, v in e.items()} for e in output[key]]
    return results


@contextlib.contextmanager
def ats_serve_vllm(argv: list[str], env: dict, log_path: Path, timeout: float = 600):
    """`python -m ats serve --engine vllm ARGV --port PORT` started, healthy, then stopped; yields its base URL."""
    with ats_serve_vllm_process(argv, env, log_path, timeout) as (url, _):
        yield url


@contextlib.contextmanager
def ats_serve_vllm_process(argv: list[str], env: dict, log_path: Path, timeout: float = 600):
    """As `ats_serve_vllm`, yielding (base URL, the server's process)."""
    import httpx

    sys.path.insert(0, str(Path(__file__).parents[1] / "serving"))
    from server_process import free_port

    port = free_port()
    log = log_path.open("w")
    server = subprocess.Popen([sys.executable, "-m", "ats", "serve", "--engine", "vllm", *argv, "--port", str(port)],
                              stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert server.poll() is None, log_path.read_text()[-4000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "vLLM server not up"
            time.sleep(1)
        yield f"http://127.0.0.1:{port}", server
    finally:
        if server.poll() is None:
            server.terminate()
        server.wait(timeout=60)
        log.close()
