"""The playground: a page at `/` for a person to see calibrated confidence, and the two routes it needs beyond the API.

    GET  /                                  the page (static/index.html), and its files under /static/
    GET  /v1/playground                     the served model, every loaded calibrator (its threshold, its record,
                                            its saved evaluation), how to make what is missing, and what the page
                                            cannot show on this server (`unavailable`: none here) and the
                                            served threshold's certified answer format (`certified_format`)
    POST /v1/playground/rescore             the generated tokens' probabilities under another loaded calibrator
                                            (rescored, not regenerated; `rescore.py`)
    GET  /v1/playground/reliability.png     one method's reliability diagram on one task of the saved evaluation

The page is plain HTML, CSS and JavaScript shipped in the package (no CDN, no build step) and is a client of the API:
it streams /v1/chat/completions and reads the `ats` field. `ats serve --engine vllm` serves the same files
(`page_file`) and its own GET /v1/playground (`ats.integrations.vllm.page`), whose `unavailable` the page obeys.
The page's files are open (they hold no data); every route that answers with data needs the API key when the server
has one, and the page asks for it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from fastapi import FastAPI, Query, Response
from fastapi.responses import HTMLResponse
from pydantic import Field, StrictInt

from ..errors import ATSError
from ..evaluation.threshold import CertifiedThreshold
from ..fingerprint import FINGERPRINT_NAME
from ..generation.decoder import eos_ids
from ..io import read_json
from .api_errors import APIError, shutdown_error
from .engine import ShuttingDown
from .rescore import ServedCalibrator, rescore
from .responses import summary
from .saved_evaluation import SavedEvaluation
from .schemas import MAX_TOP_LOGPROBS, APIRequest

STATIC = {"playground.css": "text/css; charset=utf-8", "playground.js": "text/javascript; charset=utf-8"}
PAGE_PATHS = ("/", *(f"/static/{name}" for name in STATIC))  # open without the API key: no data in them
MAX_RESCORE_TOKENS = 4096


@dataclass
class Playground:
    """What the page shows beyond the engine: the loaded calibrators (the served one first) and a saved evaluation.

    calibrators: every calibrator rescoring can use, the served one first (its `calibration` is the engine's).
    evaluation: the saved `ats eval` results, or None.
    model: the `--model` the server loaded, for the commands the page suggests; None: the served model name.
    """

    calibrators: list[ServedCalibrator] = field(default_factory=list)
    evaluation: SavedEvaluation | None = None
    model: str | None = None

    def find(self, calibrator_id: str) -> ServedCalibrator:
        """The calibrator named `calibrator_id`.

        Raises:
            APIError: 404 naming the loaded ones.
        """
        for served in self.calibrators:
            if served.id == calibrator_id:
                return served
        names = ", ".join(repr(c.id) for c in self.calibrators)
        raise APIError(404, f"calibrator {calibrator_id!r} is not loaded; this server has {names}",
                       param="calibrator", code="calibrator_not_found")


class RescoreRequest(APIRequest):
    """POST /v1/playground/rescore: `tokens` (generated ids) after `prompt_tokens` (ids, e.g. from /tokenize),
    scored under `calibrator` (an id from GET /v1/playground)."""

    model: str
    calibrator: str
    prompt_tokens: list[StrictInt] = Field(min_length=1)
    tokens: list[StrictInt] = Field(min_length=1, max_length=MAX_RESCORE_TOKENS)
    top_logprobs: int = Field(0, ge=0, le=MAX_TOP_LOGPROBS)
    ignore_eos: bool = False


def page_file(name: str) -> str:
    """The text of one of the page's files (`index.html` or a STATIC name), from the package; also served by the
    vLLM route's middleware (one page for both servers)."""
    return resources.files("ats.serving").joinpath("static", name).read_text(encoding="utf-8")


def training_record(folder: Path | None) -> dict | None:
    """What a calibrator folder says of its training: its fingerprint (`fingerprint.json`: what it was trained on,
    with which options), or None when the folder has none (fitted by hand, or a downloaded head)."""
    if folder is None or not (folder / FINGERPRINT_NAME).is_file():
        return None
    try:
        return read_json(folder / FINGERPRINT_NAME)
    except ATSError:
        return None


def _eval_command(model: str, folder: Path | None) -> str:
    calibrator = str(folder) if folder is not None else "none"
    return (f"ats eval --model {model} --calibrator {calibrator} --tasks mmlu,triviaqa --bootstrap 1000 --out EVAL; "
            f"then start the server with --eval EVAL")


def _certify_command(model: str, folder: Path | None) -> str | None:
    if folder is None:
        return None  # the model's own probabilities: no folder to hold a threshold
    return f"ats certify --model {model} --calibrator {folder}; then restart the server"


def calibrator_entry(*, id: str, label: str, describe: str, confidence_kind: str, folder: Path | None,
                     threshold: CertifiedThreshold | None, evaluation_method: str | None, model: str) -> dict:
    """One calibrator as the page shows it (GET /v1/playground's `calibrators`, on both servers): what it is and
    changes, its threshold, its training record, its method in the saved evaluation and the commands that make what
    is missing."""
    return {"id": id, "label": label, "describe": describe, "confidence_kind": confidence_kind,
            "folder": None if folder is None else str(folder),
            "threshold": None if threshold is None else threshold.to_dict(), "training": training_record(folder),
            "evaluation_method": evaluation_method, "make_evaluation": _eval_command(model, folder),
            "make_threshold": _certify_command(model, folder)}


def describe_calibrators(playground: Playground, model: str) -> list[dict]:
    """Each loaded calibrator as the page shows it (`calibrator_entry`), the saved evaluation's method that is
    this calibrator found by digest."""
    evaluation = playground.evaluation
    return [calibrator_entry(id=served.id, label=served.calibration.label, describe=served.calibration.describe(),
                             confidence_kind=served.calibration.confidence_kind, folder=served.folder,
                             threshold=served.threshold, model=model,
                             evaluation_method=None if evaluation is None else evaluation.method_of(served.digest))
            for served in playground.calibrators]


def add_playground_routes(app: FastAPI, service, playground: Playground) -> None:
    """The page and its routes (see the module docstring) on `app`, serving `service` (app.Service)."""
    engine, renderer = service.engine, service.renderer
    eos = eos_ids(engine.backbone)

    @app.get("/", include_in_schema=False)
    async def page():
        return HTMLResponse(page_file("index.html"), headers={"Cache-Control": "no-cache"})

    for name, media in STATIC.items():
        def static(name=name, media=media):
            return Response(page_file(name), media_type=media, headers={"Cache-Control": "no-cache"})

        app.add_api_route(f"/static/{name}", static, methods=["GET"], include_in_schema=False)

    @app.get("/v1/playground")
    async def info():
        evaluation = playground.evaluation
        certificate = service.certificate
        return {"model": service.model_name, "engine": "ats", "unavailable": {},
                "certified_format": None if certificate is None else certificate.served.get("format"),
                "max_model_len": engine.max_model_len, "chat": bool(getattr(service.tok, "chat_template", None)),
                "served": playground.calibrators[0].id,
                "calibrators": describe_calibrators(playground, playground.model or service.model_name),
                "evaluation": None if evaluation is None else evaluation.describe()}

    @app.post("/v1/playground/rescore")
    async def rescore_route(body: RescoreRequest):
        service.check_model(body.model)
        served = playground.find(body.calibrator)
        vocab = engine.backbone.vocab_size
        ids = body.prompt_tokens + body.tokens
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise APIError(400, f"tokens: token id {bad[0]} is outside the vocabulary (0..{vocab - 1})",
                           param="tokens")
        if len(ids) > engine.max_model_len:
            raise APIError(400, f"prompt_tokens + tokens: {len(ids)} tokens, over this model's context of "
                                f"{engine.max_model_len}", param="tokens", code="context_length_exceeded")
        work = engine.call(lambda: rescore(engine.backbone, served.calibration, body.prompt_tokens, body.tokens,
                                           k=body.top_logprobs, eos=eos, ignore_eos=body.ignore_eos))
        try:
            records, raw_top = await asyncio.wrap_future(work)
        except ShuttingDown as err:
            raise shutdown_error(str(err)) from None
        info = {"calibrator": served.calibration.label, "confidence_kind": served.calibration.confidence_kind}
        tokens = [{"id": r.token, "text": renderer.token(r.token), "logprob": r.logprob,
                   "uncalibrated_logprob": r.uncalibrated, "confidence": r.confidence, "tau": r.tau,
                   "top": [{"id": i, "text": renderer.token(i), "logprob": lp, "uncalibrated_logprob": raw}
                           for (i, lp), raw in zip(r.top, top)]}
                  for r, top in zip(records, raw_top)]
        return {"calibrator": served.id, "tokens": tokens, "ats": summary(records, info, served.threshold)}

    @app.get("/v1/playground/reliability.png")
    async def reliability(task: str = Query(...), method: str = Query(...)):
        evaluation = playground.evaluation
        if evaluation is None:
            raise APIError(404, "this server has no saved evaluation (start it with --eval EVAL, the folder of "
                                "`ats eval --out EVAL`)", code="not_found")
        try:
            png = await asyncio.to_thread(evaluation.reliability_png, task, method)
        except ATSError as err:
            raise APIError(404, str(err), code="not_found") from None
        return Response(png, media_type="image/png")
