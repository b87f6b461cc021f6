"""Processes of `pmx serve`: one socket, bound here, and uvicorn serving it.

One worker serves in this process. Several workers are processes started with the
"spawn" method (a fork would copy whatever threads are alive): each gets the settings
and the listening socket as Process arguments, opens the models itself (the .pmx is
memory-mapped, so their weights are the same pages in every worker) and runs
uvicorn.Server on the shared socket, where the kernel hands each connection to one of
them. This process only watches: it forwards SIGTERM and SIGINT, starts another worker
for one that dies after it started serving, and removes the metrics directory at exit.

Stopping: SIGTERM (or SIGINT) makes every worker stop accepting connections, answer the
requests it has, close its models and exit; the server then exits 0. A SIGINT during
the stop (a second Ctrl-C) makes the workers stop without waiting. Workers are in
process groups of their own, so a Ctrl-C at a terminal reaches this process alone and
the workers hear it once, from here; a worker whose parent dies stops by itself.
"""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import sys
import tempfile
import threading

from pmx.runtime.errors import PmxInputError
from pmx.runtime.serve import metrics as metrics_module

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclasses.dataclass(frozen=True)
class ServeSettings:
    """Everything a worker needs, sent to it as a Process argument (it pickles)."""

    models: tuple  # ((name, path), ...)
    host: str = "127.0.0.1"
    port: int = 8000
    workers: int = 1
    threads: int = 1
    max_batch_size: int = 32
    max_wait_ms: float = 2.0
    max_body_bytes: int = 64 << 20
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    access_log: bool = False
    quiet: bool = False  # no startup lines (warnings and errors still show)


def say(message):
    """A line on stderr from the server itself (uvicorn's logging is not set up here)."""
    print(f"pmx serve: {message}", file=sys.stderr, flush=True)


def serve(settings):
    """Run the server until it is told to stop; the exit status."""
    announce = (lambda message: None) if settings.quiet else say
    check_models(settings, announce)
    sock = bind_socket(settings.host, settings.port)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    workers = "1 worker" if settings.workers == 1 else f"{settings.workers} worker processes"
    announce(f"listening on http://{shown}:{port} ({workers}, {settings.threads} intra-op thread(s) each)")
    announce(http_stack_text(*http_stack()))
    try:
        if settings.workers == 1:
            return run_worker(settings, sock)
        return Supervisor(settings, sock).run()
    finally:
        sock.close()


def check_models(settings, announce):
    """Open each model once here, so a bad file or name stops the server before any
    worker starts, and say how each is served."""
    from pmx.runtime.serve.models import open_model

    for name, path in settings.models:
        model = open_model(name, path, 1, settings.max_batch_size, settings.max_wait_ms)
        announce(model.describe())
        model.close()


def http_stack():
    """(HTTP parser, event loop) uvicorn serves with: httptools and uvloop, which the
    [serve] extra installs, else its pure-Python h11 and asyncio. Chosen here and passed
    to uvicorn, so what the server says is what it runs."""
    from importlib.util import find_spec

    http = "httptools" if find_spec("httptools") else "h11"
    loop = "uvloop" if sys.platform != "win32" and find_spec("uvloop") else "asyncio"
    return http, loop


def http_stack_text(http, loop):
    text = f"HTTP parser {http}, event loop {loop}"
    if (http, loop) != ("httptools", "uvloop"):
        text += (
            " (pure Python: `pip install httptools uvloop`, which the [serve] extra installs, serves more requests/s)"
        )
    return text


def bind_socket(host, port):
    """A listening TCP socket on host:port (port 0: any free port); PmxInputError naming
    the address when it cannot be had."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as e:
        raise PmxInputError(f"cannot resolve --host {host!r}: {e.strerror}") from None
    # proto from getaddrinfo (IPPROTO_TCP), not 0: accepted sockets inherit it, and asyncio
    # turns Nagle's algorithm off (TCP_NODELAY) only on sockets that say they are TCP;
    # with 0 every keep-alive response would wait ~40 ms for the client's delayed ACK
    # (uvicorn's own --workers socket has this bug: uvicorn issue #3149)
    sock = socket.socket(family, kind, proto or socket.IPPROTO_TCP)  # 0 on some systems
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # restart at once after a stop
    try:
        sock.bind(address)
    except OSError as e:
        sock.close()
        raise PmxInputError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.listen(2048)
    return sock


# --- a worker ---------------------------------------------------------------------------


def run_worker(settings, sock, multiprocess_metrics=False, on_started=None):
    """Serve on `sock` until SIGTERM or SIGINT; 0 after a graceful stop."""
    # uvicorn handles SIGTERM/SIGINT while it serves and, once stopped, raises the signal
    # again for the handler found before it: this one, so a graceful stop exits 0. A
    # signal before uvicorn serves (while the models open) means: do not start.
    stop_requested = threading.Event()
    for signum in STOP_SIGNALS:
        signal.signal(signum, lambda *_: stop_requested.set())
    import uvicorn

    from pmx.runtime.serve.app import create_app
    from pmx.runtime.serve.metrics import Metrics
    from pmx.runtime.serve.models import open_model

    metrics = Metrics([name for name, _ in settings.models], multiprocess=multiprocess_metrics)
    models = [
        open_model(
            name,
            path,
            settings.threads,
            settings.max_batch_size,
            settings.max_wait_ms,
            on_run=metrics.batch_observer(name),
        )
        for name, path in settings.models
    ]
    app = create_app(models, settings.max_body_bytes, metrics, on_started=on_started)
    http, loop = http_stack()
    config = uvicorn.Config(
        app,
        http=http,
        loop=loop,
        log_level=settings.log_level,
        access_log=settings.access_log,
        lifespan="on",
        timeout_graceful_shutdown=settings.shutdown_timeout,
    )
    if stop_requested.is_set():
        for model in models:
            model.close()
        return 0
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def worker_process_main(settings, sock, started, metrics_dir):
    """The target of a worker process (spawned, so this runs in a fresh interpreter)."""
    os.setpgid(0, 0)  # a terminal's Ctrl-C goes to the parent, which forwards one signal
    os.environ[metrics_module.MULTIPROCESS_DIR_VARIABLE] = metrics_dir  # read when prometheus_client loads
    _stop_when_parent_dies()
    sys.exit(run_worker(settings, sock, multiprocess_metrics=True, on_started=started.set))


def _stop_when_parent_dies():
    parent = multiprocessing.parent_process()

    def watch():
        parent.join()  # returns when the parent process has exited
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="pmx-serve-parent-watch", daemon=True).start()


# --- the parent of several workers -----------------------------------------------------------


class Supervisor:
    """Starts the worker processes and watches them until they have all stopped."""

    def __init__(self, settings, sock):
        self.settings = settings
        self.sock = sock
        self.context = multiprocessing.get_context("spawn")
        self.workers = {}  # sentinel -> (process, started event)
        self.stopping = False
        self.failed = False

    def run(self):
        self.metrics_dir = tempfile.mkdtemp(prefix="pmx-serve-metrics-")
        previous = {signum: signal.signal(signum, self._on_signal) for signum in STOP_SIGNALS}
        try:
            for _ in range(self.settings.workers):
                if not self.stopping:
                    self._start_worker()
            while self.workers:
                self._reap(multiprocessing.connection.wait(list(self.workers), timeout=1.0))
            return 1 if self.failed else 0
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)
            self._kill_all()
            shutil.rmtree(self.metrics_dir, ignore_errors=True)

    def _start_worker(self):
        started = self.context.Event()
        process = self.context.Process(
            target=worker_process_main,
            args=(self.settings, self.sock, started, self.metrics_dir),
            name="pmx-serve-worker",
        )
        process.start()
        self.workers[process.sentinel] = (process, started)
        if not self.settings.quiet:
            say(f"worker {process.pid} started")
        if self.stopping:  # a signal came while it started, before it was in self.workers
            self._stop_all(signal.SIGTERM)

    def _reap(self, ended):
        for sentinel in ended:
            process, started = self.workers.pop(sentinel)
            process.join()
            metrics_module.forget_worker(process.pid, self.metrics_dir)
            code = process.exitcode
            if self.stopping:
                if code not in (0, -signal.SIGTERM):  # SIGTERM: stopped before it installed its handlers
                    say(f"worker {process.pid} exited with status {code} while stopping")
                    self.failed = True
            elif not started.is_set():
                say(f"worker {process.pid} exited with status {code} before it started serving; stopping")
                self.failed = True
                self._stop_all(signal.SIGTERM)
            else:  # a crash (a signal, a fault in native code): no request ever ends a worker
                say(f"worker {process.pid} exited with status {code}; starting another")
                self._start_worker()

    def _on_signal(self, signum, frame):
        # the first signal stops the workers gracefully; a SIGINT after it (a second
        # Ctrl-C) makes them stop at once, as uvicorn takes a SIGINT during a stop
        forward = signum if self.stopping else signal.SIGTERM
        self._stop_all(forward)

    def _stop_all(self, signum):
        self.stopping = True
        for process, _ in self.workers.values():
            # an exited worker not yet reaped is a zombie: its pid is not reused yet
            with contextlib.suppress(ProcessLookupError):
                os.kill(process.pid, signum)

    def _kill_all(self):
        """Workers still alive when this process leaves (an exception here): stop them."""
        for process, _ in self.workers.values():
            if process.is_alive():
                process.kill()
                process.join(timeout=10)
