"""What ats's layer in vLLM's server costs (`ats serve --engine vllm`'s ASGI middleware), timed alone.

Whole servers do not resolve it: in `bench_vllm.py --arms bare:ats,served:ats,...` the server started first is 4-10%
slower than the others whichever it is (results/vllm_layer.md), while two servers started one after the other differ
by 1-2%. Here the middleware runs in this process, on vLLM-shaped chat answers of N tokens with logprobs, plain
and streamed one token per event (then the usage chunk and `[DONE]`), from a stand-in app that answers at once, so
that the time is the layer's and the app's alone:

    app        the stand-in alone (the floor)
    checks     ATSMiddleware without an export: the request checks (roles, Unicode) and the shutdown guard
    decisions  ATSMiddleware on an export with a certified threshold, as `ats serve --engine vllm` runs it: also
               the answer's decision, the certified-format fields and the monitor's count, each event rewritten

The export is of --model with a transformer head (random weights; timing does not depend on them) and a threshold
certified on made-up answers (`tests/helpers.certified_copy`). Per cell: the median over --repeats of the mean
time of --requests requests, one after another on one thread, in microseconds per request and per generated token.

    python benchmarks/bench_vllm_layer.py                 # -> results/vllm_layer_cpu.md and .json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

from bench_generation import command_line, load_average, preamble, randomised_calibrator, run_info, save_results

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from ats.integrations.vllm.export import export_for_vllm
from ats.integrations.vllm.middleware import _replay
from ats.model.backbone import load_backbone

from helpers import certified_copy  # noqa: E402  (a threshold certified on made-up answers, saved as ats certify does)

LAYERS = ("app", "checks", "decisions")
MODES = ("plain", "stream")


def entry(i: int) -> dict:
    """One token's logprobs entry as vLLM's chat API writes it."""
    return {"token": f" w{i}", "logprob": -0.05 * (i % 7), "bytes": [32, 119, 48 + i % 10], "top_logprobs": []}


def plain_body(tokens: int) -> bytes:
    """A vLLM chat completion of `tokens` tokens with their logprobs."""
    return json.dumps({
        "id": "chatcmpl-0", "object": "chat.completion", "created": 0, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(f" w{i}" for i in range(tokens)),
                                             "refusal": None, "tool_calls": [], "reasoning_content": None},
                     "logprobs": {"content": [entry(i) for i in range(tokens)]}, "finish_reason": "length",
                     "stop_reason": None, "token_ids": None}],
        "usage": {"prompt_tokens": 20, "total_tokens": 20 + tokens, "completion_tokens": tokens},
        "prompt_logprobs": None, "prompt_token_ids": None, "kv_transfer_params": None}).encode()


def stream_events(tokens: int) -> list[bytes]:
    """A vLLM chat stream of `tokens` tokens: one event per token (the last finishes the choice), usage, [DONE]."""
    def chunk(choices: list, usage=None) -> bytes:
        data = {"id": "chatcmpl-0", "object": "chat.completion.chunk", "created": 0, "model": "m",
                "choices": choices, **({"usage": usage} if usage else {})}
        return b"data: " + json.dumps(data).encode() + b"\n\n"

    events = [chunk([{"index": 0, "delta": {"content": f" w{i}"}, "logprobs": {"content": [entry(i)]},
                      "finish_reason": "length" if i == tokens - 1 else None, "stop_reason": None,
                      "token_ids": None}]) for i in range(tokens)]
    usage = {"prompt_tokens": 20, "total_tokens": 20 + tokens, "completion_tokens": tokens}
    return events + [chunk([], usage), b"data: [DONE]\n\n"]


def stand_in(body: bytes | None, events: list[bytes] | None):
    """An ASGI app answering every request at once: `body` as a JSON response, or `events` as a stream."""
    async def app(scope, receive, send) -> None:
        await receive()
        kind = b"text/event-stream" if events is not None else b"application/json"
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", kind)]})
        for event in events or []:
            await send({"type": "http.response.body", "body": event, "more_body": True})
        await send({"type": "http.response.body", "body": body or b"", "more_body": False})

    return app


async def time_requests(app, request: bytes, count: int) -> float:
    """Mean seconds per request of `app` over `count` requests, one after another."""
    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(request)).encode())],
             "app": SimpleNamespace(state=SimpleNamespace(engine_client=SimpleNamespace(errored=False)))}

    async def send(message) -> None:
        pass

    async def connected() -> dict:  # the client stays: no disconnect while the response goes out
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    start = time.perf_counter()
    for _ in range(count):
        await app(scope, _replay(request, connected), send)
    return (time.perf_counter() - start) / count


def make_export(model: str, work: Path) -> Path:
    """An export of `model` with a random transformer head and a certified threshold."""
    backbone = load_backbone(model)
    calibrator = randomised_calibrator(backbone, "transformer")
    calibrator.save_pretrained(work / "head")
    certified_copy(work / "head", work / "certified", calibrator, backbone, seed=0)
    return export_for_vllm(model, work / "certified", work / "export")


def layered(layer: str, app, export: Path):
    """`app` behind the layer: itself, the middleware checking only, or the middleware deciding from `export`."""
    from ats.integrations.vllm.middleware import EXPORT_ENV, ATSMiddleware

    if layer == "app":
        return app
    os.environ.pop(EXPORT_ENV, None)
    if layer == "decisions":
        os.environ[EXPORT_ENV] = str(export)
    return ATSMiddleware(app)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--tokens", default="16,64,256", help="answer lengths")
    p.add_argument("--requests", type=int, default=200, help="requests per timed run")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", default=str(Path(__file__).parent / "results" / "vllm_layer_cpu"))
    args = p.parse_args(argv)
    lengths = [int(t) for t in args.tokens.split(",") if t]
    load_start = load_average()
    export = make_export(args.model, Path(tempfile.mkdtemp(prefix="ats-bench-layer-")))
    rows = []
    for mode in MODES:
        for tokens in lengths:
            request = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Name a colour."}],
                                  "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "logprobs": True,
                                  "stream": mode == "stream"}).encode()
            app = stand_in(plain_body(tokens), None) if mode == "plain" else stand_in(None, stream_events(tokens))
            apps = {layer: layered(layer, app, export) for layer in LAYERS}
            times = {layer: [] for layer in LAYERS}
            for repeat in range(args.repeats + 1):  # the first round warms up, untimed
                for layer in LAYERS[repeat % len(LAYERS):] + LAYERS[:repeat % len(LAYERS)]:
                    seconds = asyncio.run(time_requests(apps[layer], request, args.requests))
                    if repeat:
                        times[layer].append(seconds)
            us = {layer: 1e6 * statistics.median(times[layer]) for layer in LAYERS}
            rows.append({"mode": mode, "tokens": tokens, "us_per_request": us, "runs_s": times})
            print(f"{mode:6s} {tokens:4d} tokens: " + "  ".join(f"{k} {v:8.1f} us" for k, v in us.items()),
                  file=sys.stderr, flush=True)
    result = {**run_info(command_line(argv), 1, load_start, load_average()), "model": args.model,
              "requests": args.requests, "repeats": args.repeats, "rows": rows}
    table = format_table(rows)
    save_results(Path(args.out), result, "\n".join([
        *preamble(result, "What ats's layer in vLLM's server costs, timed alone", "1 (one event loop)"),
        f"Model {args.model} (its export: a random transformer head, a certified threshold); {args.requests} "
        f"requests per timed run, median of {args.repeats} runs, layers interleaved in rotating order. "
        "Microseconds of this process per request; the last two columns are the layer's own cost (a column less "
        "the app's) per generated token.", "", table, ""]))
    print(table)
    return 0


def format_table(rows: list[dict]) -> str:
    lines = ["| answer | tokens | " + " | ".join(f"{layer} (us)" for layer in LAYERS)
             + " | checks - app (us/token) | decisions - app (us/token) |", "|---|---:|" + "---:|" * (len(LAYERS) + 2)]
    for row in rows:
        us, n = row["us_per_request"], row["tokens"]
        lines.append(f"| {row['mode']} | {n} | " + " | ".join(f"{us[layer]:.0f}" for layer in LAYERS)
                     + f" | {(us['checks'] - us['app']) / n:.1f} | {(us['decisions'] - us['app']) / n:.1f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
