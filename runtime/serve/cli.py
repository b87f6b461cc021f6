"""`pmx serve`: its arguments, and the command. Importing this module imports neither
the web framework nor uvicorn (they are the [serve] extra), so `pmx --help` and the other
commands work without them; the command says how to install them when they are missing.
"""

import argparse
import importlib.util

from pmx.runtime.cli import EPILOG, common_flags, int_at_least, number_above

DESCRIPTION = """Serve .pmx models over HTTP with the Open Inference Protocol (KServe V2, as Triton's
HTTP/REST API, with the binary tensor data extension): tritonclient and KServe clients call
it as they call Triton. Each model is named by its file stem unless --name gives a name;
concurrent requests to a model whose batch dim can grow run as batches.

endpoints: GET /v2, /v2/health/live, /v2/health/ready, /v2/models/NAME, /v2/models/NAME/ready,
POST /v2/models/NAME/infer (each model path also as /v2/models/NAME/versions/1/...), GET /metrics
(Prometheus). SIGTERM or Ctrl-C: stop accepting, answer the requests already taken, exit 0."""

EXTRA_MODULES = ("starlette", "uvicorn", "prometheus_client")


_positive_number = number_above(0, inclusive=False)
_non_negative_number = number_above(0)


def _port(text):
    value = int_at_least(0)(text)
    if value > 65535:
        raise argparse.ArgumentTypeError(f"expected a port 0..65535, got {value}")
    return value


def add_serve_arguments(s):
    s.add_argument("models", nargs="+", metavar="MODEL.pmx", help="the models to serve")
    s.add_argument(
        "--name",
        action="append",
        metavar="NAME",
        help="the name of a model in URLs (repeat: the i-th --name names the i-th model; default: its file stem)",
    )
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1; 0.0.0.0: all)")
    s.add_argument("--port", type=_port, default=8000, help="port to listen on (default 8000; 0: any free port)")
    s.add_argument(
        "--workers",
        type=int_at_least(1),
        default=1,
        help="worker processes sharing the port (default 1); small models are bound by the GIL, so use one per core",
    )
    s.add_argument(
        "--threads", type=int_at_least(1), default=1, help="intra-op threads per model in each worker (default 1)"
    )
    s.add_argument(
        "--max-batch-size",
        type=int_at_least(1),
        default=32,
        help="the most rows one run takes (default 32; 1: no batching)",
    )
    s.add_argument(
        "--max-wait-ms",
        type=_non_negative_number,
        default=2.0,
        help="how long a request waits for others to join its batch (default 2.0)",
    )
    s.add_argument(
        "--max-body-mb",
        type=_positive_number,
        default=64.0,
        help="largest request body in MiB, after decompression (default 64); larger ones get 413",
    )
    s.add_argument(
        "--shutdown-timeout",
        type=_non_negative_number,
        default=30.0,
        help="seconds a stop waits for requests in flight before closing their connections (default 30)",
    )
    s.add_argument(
        "--log-level",
        choices=("critical", "error", "warning", "info", "debug"),
        default="info",
        help="uvicorn's log level (default info)",
    )
    s.add_argument("--access-log", action="store_true", help="log every request (off by default: it costs throughput)")


def add_serve_command(sub):
    """The serve subcommand, on `sub` (argparse subparsers)."""
    s = sub.add_parser(
        "serve",
        help="serve .pmx models over HTTP (KServe V2 / Triton protocol; needs the [serve] extra)",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_serve_arguments(s)
    common_flags(s)


def serve_command(args):
    """Run `pmx serve` with parsed arguments; the exit status."""
    missing = [m for m in EXTRA_MODULES if importlib.util.find_spec(m) is None]
    if missing:
        import sys

        print(
            f"pmx: error: pmx serve needs the [serve] extra (missing: {', '.join(missing)}): "
            f"pip install 'pnnx-pmx[serve]' (or pip install {' '.join(m.replace('_', '-') for m in missing)})",
            file=sys.stderr,
        )
        return 1
    from pmx.runtime.cli import check_model_arg
    from pmx.runtime.serve.models import model_names
    from pmx.runtime.serve.server import ServeSettings, serve

    for path in args.models:
        check_model_arg(path, "serve")
    settings = ServeSettings(
        models=tuple(model_names(args.models, args.name)),
        host=args.host,
        port=args.port,
        workers=args.workers,
        threads=args.threads,
        max_batch_size=args.max_batch_size,
        max_wait_ms=args.max_wait_ms,
        max_body_bytes=int(args.max_body_mb * (1 << 20)),
        shutdown_timeout=args.shutdown_timeout,
        log_level="warning" if getattr(args, "quiet", False) and args.log_level == "info" else args.log_level,
        access_log=args.access_log,
        quiet=getattr(args, "quiet", False),
    )
    return serve(settings)
