"""The ASGI application of `pmx serve`: the Open Inference Protocol's HTTP endpoints over
the models one worker process holds.

    GET  /v2                               server metadata
    GET  /v2/health/live, /v2/health/ready
    GET  /v2/models/{name}[/versions/1]    model metadata
    GET  /v2/models/{name}[/versions/1]/ready
    POST /v2/models/{name}[/versions/1]/infer
    GET  /metrics                          Prometheus

Every refusal is `{"error": "..."}` with a 4xx status naming what was wrong; a bug of
pmx's own is a 500 with its message. No request can stop the worker: the infer handler
turns every exception into a response. The model runs off the event loop (the
BatchingSession's thread, or the InferenceSession's run_async thread), so the loop keeps
taking requests while a batch runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
import zlib

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pmx.runtime import PmxError, PmxInputError, PmxInternalError, PmxResourceError, PmxRunTerminated
from pmx.runtime.serve import protocol
from pmx.runtime.serve.metrics import UNKNOWN_MODEL
from pmx.runtime.serve.protocol import RequestError, bad_request
from pmx.runtime.version import __version__

log = logging.getLogger("uvicorn.error")  # uvicorn's own error log: one stream, one format

MIB = 1 << 20


class ServerState:
    """What the handlers share within one worker: the models, the limits, the metrics,
    and counts of inference requests received and answered (reported at shutdown)."""

    def __init__(self, models, max_body_bytes, metrics):
        self.models = {m.name: m for m in models}
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics
        self.received = 0
        self.answered = 0


def create_app(models, max_body_bytes, metrics, on_started=None):
    """The Starlette app over `models` (ServedModels, opened by the caller). Leaving the
    app's lifespan (the server's shutdown, after in-flight requests are answered) runs
    what the models still hold and closes them. on_started() is called once serving."""
    state = ServerState(models, max_body_bytes, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if on_started is not None:
            on_started()
        yield
        for model in state.models.values():
            model.close()
        log.info(
            "pmx serve: worker %d stopped: %d inference requests received, %d answered",
            os.getpid(),
            state.received,
            state.answered,
        )

    model_routes = []
    for prefix in ("/v2/models/{model}", "/v2/models/{model}/versions/{version}"):
        model_routes += [
            Route(prefix, model_metadata),
            Route(prefix + "/ready", model_ready),
            Route(prefix + "/infer", infer, methods=["POST"]),
        ]
    routes = [
        Route("/v2", server_metadata),
        Route("/v2/health/live", live),
        Route("/v2/health/ready", ready),
        *model_routes,
        Route("/metrics", metrics_endpoint),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)
    app.state.pmx = state
    return app


def error_response(status, message, headers=None):
    return Response(protocol.error_body(message), status_code=status, headers=headers, media_type="application/json")


async def http_error(request, exc):
    """Starlette's own refusals (no such route, wrong method) in the protocol's error form."""
    if exc.status_code == 404:
        message = f"no endpoint at {request.url.path}; the protocol's endpoints are under /v2"
    elif exc.status_code == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
    else:
        message = str(exc.detail)
    return error_response(exc.status_code, message, getattr(exc, "headers", None))  # 405's Allow


# --- metadata and health ----------------------------------------------------------------


def _state(request):
    return request.app.state.pmx


async def server_metadata(request):
    return JSONResponse({"name": "pmx", "version": __version__, "extensions": ["binary_tensor_data"]})


async def live(request):
    return JSONResponse({"live": True})


async def ready(request):
    # the models are open before the server takes its first connection
    return JSONResponse({"ready": True})


def _model_of(request):
    """The ServedModel a /v2/models/... path names; RequestError 404 for another name or
    a version other than the one a .pmx file is."""
    state = _state(request)
    name = request.path_params["model"]
    model = state.models.get(name)
    if model is None:
        raise RequestError(404, f"model {name!r} is not served here; the models are {sorted(state.models)}")
    version = request.path_params.get("version", protocol.MODEL_VERSION)
    if version != protocol.MODEL_VERSION:
        raise RequestError(
            404, f"model {name!r} has no version {version!r}; its one version is {protocol.MODEL_VERSION!r}"
        )
    return model


async def model_metadata(request):
    try:
        return JSONResponse(_model_of(request).metadata())
    except RequestError as e:
        return error_response(e.status, e.message)


async def model_ready(request):
    try:
        model = _model_of(request)
    except RequestError as e:
        return error_response(e.status, e.message)
    return JSONResponse({"name": model.name, "ready": True})


async def metrics_endpoint(request):
    body, content_type = _state(request).metrics.exposition()
    return Response(body, media_type=content_type)


# --- inference ------------------------------------------------------------------------------


async def infer(request):
    state = _state(request)
    started = time.perf_counter()
    state.received += 1
    label = request.path_params["model"] if request.path_params["model"] in state.models else UNKNOWN_MODEL
    try:
        response = await _infer(request, state)
    except RequestError as e:
        response = error_response(e.status, e.message)
    except ClientDisconnect:
        response = error_response(400, "the client closed the connection before sending the whole body")
    except Exception as e:  # a bug of the server's own: answer it, log it, keep serving
        log.exception("pmx serve: internal error in an infer request")
        response = error_response(500, f"internal error in pmx serve: {type(e).__name__}: {e}")
    state.metrics.observe_request(label, response.status_code, time.perf_counter() - started)
    state.answered += 1
    return response


async def _infer(request, state):
    model = _model_of(request)
    body = await read_body(request, state.max_body_bytes)
    body = decode_body(body, request.headers.get("content-encoding"), state.max_body_bytes)
    parsed = protocol.parse_infer_request(
        body, request.headers.get("inference-header-content-length"), model.input_specs
    )
    names = parsed.output_names or model.output_names
    outputs = await _run(model, state.metrics, names, parsed.feed)
    content, header_length = protocol.encode_infer_response(model.name, parsed, names, outputs)
    if header_length is None:
        return Response(content, media_type="application/json")
    return Response(
        content,
        media_type="application/octet-stream",
        headers={"Inference-Header-Content-Length": str(header_length)},
    )


async def _run(model, metrics, names, feed):
    """The model's outputs for one request, awaited off the event loop; a PmxError as the
    RequestError of its kind."""
    depth = metrics.queue_depth.labels(model.name)
    depth.inc()
    try:
        return await asyncio.wrap_future(model.submit(names, feed))
    except PmxError as e:
        raise RequestError(status_of(e), str(e)) from None
    finally:
        depth.dec()


def status_of(error):
    """The HTTP status of a PmxError a run raised: the request's fault is a 400, pmx's a 500."""
    if isinstance(error, (PmxInputError, PmxResourceError, PmxRunTerminated)):
        return 400
    if isinstance(error, PmxInternalError):
        return 500
    return 500  # PmxFormatError and the like: the file, which the server chose, not the request


async def read_body(request, limit):
    """The request body, refused with 413 past `limit` bytes: at once when Content-Length
    says so, else as soon as the chunks received pass it (uvicorn reads and drops the
    rest, so the client can read the answer)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isascii() and declared.isdigit() and int(declared) > limit:
        raise _too_large(f"{int(declared)} bytes", limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(f"more than {limit} bytes", limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(what, limit):
    return RequestError(
        413,
        f"the request body is {what}, over the server's limit of {limit} bytes ({limit / MIB:g} MiB, --max-body-mb)",
    )


def decode_body(body, encoding, limit):
    """The body with its Content-Encoding (gzip or deflate, as tritonclient sends them)
    undone, refused with 413 when it inflates past `limit` bytes."""
    if encoding is None or encoding.strip().lower() in ("", "identity"):
        return body
    kind = encoding.strip().lower()
    if kind not in ("gzip", "deflate"):
        raise RequestError(415, f"Content-Encoding {encoding!r} is not supported; send gzip, deflate or none")
    inflater = zlib.decompressobj(16 + zlib.MAX_WBITS if kind == "gzip" else zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, limit + 1)
        if len(out) > limit or inflater.unconsumed_tail:
            raise _too_large(f"more than {limit} bytes once decompressed", limit)
        if not inflater.eof:
            raise bad_request(f"the {kind} body is truncated")
    except zlib.error as e:
        raise bad_request(f"the body is not valid {kind} data: {e}") from None
    return out
