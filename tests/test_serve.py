"""`pmx serve`: a live server on 127.0.0.1, called with Triton's own client (tritonclient)
and with plain HTTP for requests no client would send.

The oracle is InferenceSession.run on the same input. A request may be batched with
others, and a batched run computes the same rows with other GEMM shapes, so results agree
within float32 rounding, not bit for bit (as in test_batching.py).

Every server is started on port 0 (it prints the port it got), waited for with bounded
loops, and stopped with SIGTERM (killed if it does not stop) in a finally block. No test
asserts a time: the bounds only keep a broken server from hanging the suite.
"""

import asyncio
import concurrent.futures
import gzip
import http.client
import json
import os
import pathlib
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import tritonclient.http as triton
from tritonclient.utils import InferenceServerException

from pmx.compiler.driver import compile_model
from pmx.runtime import InferenceSession, PmxInternalError

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "tools" / "example" / "cnn"
START_TIMEOUT = 120  # seconds: spawned workers import numpy and the server on a busy host
STOP_TIMEOUT = 60
MAX_BODY_MB = 1

# A model of two inputs and four outputs of three datatypes: out0 relu(in0) FP32, out1
# argmax(in0) INT64, out2 in0 > 0 BOOL, out3 in1 + 1 INT64; dim 0 is the batch.
TWO_PARAM = """7767517
10 6
pnnx.Input in0 0 1 x0 #x0=(1,4)f32
pnnx.Input in1 0 1 x1 #x1=(1)i64
F.relu relu 1 1 x0 y0 #x0=(1,4)f32 #y0=(1,4)f32
torch.argmax am 1 1 x0 y1 dim=1 keepdim=False #x0=(1,4)f32 #y1=(1)i64
pnnx.Expression gt 1 1 x0 y2 expr=gt(@0,0.000000e+00) #x0=(1,4)f32 #y2=(1,4)bool
pnnx.Expression inc 1 1 x1 y3 expr=add(@0,1) #x1=(1)i64 #y3=(1)i64
pnnx.Output out0 1 0 y0
pnnx.Output out1 1 0 y1
pnnx.Output out2 1 0 y2
pnnx.Output out3 1 0 y3
"""


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """{name: path}: the example CNN with a dynamic batch ("cnn"), the same with its
    exported shape fixed ("fixed": not batchable), and the two-input model ("two")."""
    from ziputil import write_bin

    out = tmp_path_factory.mktemp("serve")
    param, weights = f"{EXAMPLE}.pnnx.param", f"{EXAMPLE}.pnnx.bin"
    compile_model(param, weights, str(out / "cnn.pmx"))
    compile_model(param, weights, str(out / "fixed.pmx"), auto_batch=False)
    (out / "two.pnnx.param").write_text(TWO_PARAM)
    write_bin(out / "two.pnnx.bin", {})
    compile_model(str(out / "two.pnnx.param"), str(out / "two.pnnx.bin"), str(out / "two.pmx"))
    return {name: str(out / f"{name}.pmx") for name in ("cnn", "fixed", "two")}


@pytest.fixture(scope="module")
def sessions(models):
    return {name: InferenceSession(path, num_threads=1) for name, path in models.items()}


# --- a server process --------------------------------------------------------------------


def pmx_command():
    """The `pmx` console script of the interpreter under test."""
    script = pathlib.Path(sys.executable).with_name("pmx")
    assert script.exists(), f"no pmx console script beside {sys.executable}: pip install -e ."
    return [str(script)]


class Server:
    """A `pmx serve` process on 127.0.0.1 and a free port; its log in a file."""

    def __init__(self, command, args, log_path):
        self.log_path = log_path
        with open(log_path, "wb") as log_file:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                [*command, *args, "--host", "127.0.0.1", "--port", "0"],
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        self.port = None
        self.terminated = False

    def terminate(self):
        self.terminated = True
        self.process.send_signal(signal.SIGTERM)

    def log(self):
        return pathlib.Path(self.log_path).read_text(errors="replace")

    def wait_ready(self):
        """Wait (bounded) for the listening line, then for /v2/health/ready to answer 200."""
        deadline = time.monotonic() + START_TIMEOUT
        while self.port is None:
            found = re.search(r"listening on http://127\.0\.0\.1:(\d+)", self.log())
            if found:
                self.port = int(found.group(1))
            elif self.process.poll() is not None:
                pytest.fail(f"pmx serve exited with {self.process.returncode} before listening:\n{self.log()}")
            elif time.monotonic() > deadline:
                pytest.fail(f"pmx serve did not listen within {START_TIMEOUT} s:\n{self.log()}")
            else:
                time.sleep(0.05)
        while True:
            try:
                status, _, _ = http_request(self.port, "GET", "/v2/health/ready", timeout=5)
                if status == 200:
                    return self
            except OSError:
                pass
            if self.process.poll() is not None:
                pytest.fail(f"pmx serve exited with {self.process.returncode}:\n{self.log()}")
            if time.monotonic() > deadline:
                pytest.fail(f"pmx serve was not ready within {START_TIMEOUT} s:\n{self.log()}")
            time.sleep(0.05)

    @property
    def url(self):
        return f"127.0.0.1:{self.port}"

    def stop(self):
        """SIGTERM, then the exit status (killed after STOP_TIMEOUT: then None)."""
        if self.process.poll() is None and not self.terminated:
            self.terminate()
        try:
            return self.process.wait(timeout=STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=STOP_TIMEOUT)
            return None


def start_server(command, args, log_path):
    server = Server(command, args, log_path)
    try:
        return server.wait_ready()
    except BaseException:
        server.stop()
        raise


@pytest.fixture(scope="module")
def server(models, tmp_path_factory):
    """One worker serving all three models, the fixed one named "fixed"."""
    log = tmp_path_factory.mktemp("serve_log") / "server.log"
    args = ["serve", models["cnn"], models["fixed"], models["two"], "--max-body-mb", str(MAX_BODY_MB)]
    s = start_server(pmx_command(), args, log)
    try:
        yield s
    finally:
        status = s.stop()
    assert status == 0, f"pmx serve exited with {status} after SIGTERM:\n{s.log()}"


@pytest.fixture
def client(server):
    c = triton.InferenceServerClient(server.url, connection_timeout=30, network_timeout=60)
    try:
        yield c
    finally:
        c.close()


def http_request(port, method, path, body=None, headers=None, timeout=60):
    """(status, headers, body) of one request on a new connection."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers or {})
        response = conn.getresponse()
        return response.status, dict(response.getheaders()), response.read()
    finally:
        conn.close()


def images(rows, seed):
    return np.random.default_rng(seed).standard_normal((rows, 3, 64, 64)).astype(np.float32)


def triton_input(name, array, binary=True):
    datatype = {"float32": "FP32", "int64": "INT64", "float64": "FP64", "int32": "INT32"}[array.dtype.name]
    tensor = triton.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array, binary_data=binary)
    return tensor


def assert_close(got, want):
    assert got.shape == want.shape and got.dtype == want.dtype, (got.shape, got.dtype, want.shape, want.dtype)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def scrape(port):
    """{(name, labels text): value} of the server's /metrics."""
    status, _, body = http_request(port, "GET", "/metrics")
    assert status == 200
    values = {}
    for line in body.decode().splitlines():
        found = re.match(r"(\w+)(\{[^}]*\})? (\S+)$", line)
        if found:
            values[found.group(1), found.group(2) or ""] = float(found.group(3))
    return values


# --- the command line -------------------------------------------------------------------


def test_pmx_help_does_not_import_the_server():
    """`pmx` and its other commands work without the [serve] extra: building the parser
    imports no web framework."""
    probe = (
        "import sys; from pmx.compiler.cli import build_parser; build_parser(); "
        "print([m for m in ('starlette', 'uvicorn', 'prometheus_client') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["missing.pmx"], "missing.pmx"),
        (["{cnn}", "{cnn}"], "two models are named 'cnn'"),
        (["{cnn}", "--name", "a", "--name", "b"], "2 --name given for 1 models"),
        (["{cnn}", "--name", "no/slash"], "model name 'no/slash'"),
        (["{cnn}", "--host", "999.1.1.1"], "--host"),
    ],
)
def test_startup_errors_exit_1_with_a_message(models, args, message):
    args = [a.format(**models) for a in args]
    out = subprocess.run(
        [*pmx_command(), "serve", *args, "--port", "0"],
        capture_output=True,
        text=True,
        timeout=120,
        stdin=subprocess.DEVNULL,
    )
    assert out.returncode == 1, out.stderr
    assert message in out.stderr, out.stderr


def test_the_listening_socket_says_it_is_tcp():
    """Accepted sockets inherit the listener's proto, and asyncio turns Nagle's algorithm
    off only on sockets whose proto is IPPROTO_TCP: with proto 0 every keep-alive answer
    would wait for the client's delayed ACK (uvicorn's --workers socket, issue #3149)."""
    from pmx.runtime.serve.server import bind_socket

    with bind_socket("127.0.0.1", 0) as sock:
        assert sock.proto == socket.IPPROTO_TCP


def test_the_server_says_which_http_parser_and_event_loop_it_runs(server, monkeypatch):
    """The [serve] extra (which the test extra takes) installs httptools and uvloop, and
    the server names the parser and loop it hands uvicorn; without them it names uvicorn's
    pure-Python defaults and how to install the others."""
    from pmx.runtime.serve import server as serve_server

    if sys.platform == "linux":
        assert serve_server.http_stack() == ("httptools", "uvloop")
    assert serve_server.http_stack_text(*serve_server.http_stack()) in server.log()
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    assert serve_server.http_stack() == ("h11", "asyncio")
    assert "pip install httptools uvloop" in serve_server.http_stack_text("h11", "asyncio")
    assert "pip install" not in serve_server.http_stack_text("httptools", "uvloop")


# --- metadata and health -------------------------------------------------------------------


def test_health_and_metadata(client):
    assert client.is_server_live()
    assert client.is_server_ready()
    assert client.is_model_ready("cnn")
    assert not client.is_model_ready("nonexistent")
    assert client.get_server_metadata()["extensions"] == ["binary_tensor_data"]
    cnn = client.get_model_metadata("cnn")
    assert cnn["inputs"] == [{"name": "in0", "datatype": "FP32", "shape": [-1, 3, 64, 64]}]
    assert cnn["outputs"] == [{"name": "out0", "datatype": "FP32", "shape": [-1, 10]}]
    assert client.get_model_metadata("fixed")["inputs"][0]["shape"] == [1, 3, 64, 64]
    two = client.get_model_metadata("two", model_version="1")
    assert [(t["name"], t["datatype"], t["shape"]) for t in two["outputs"]] == [
        ("out0", "FP32", [-1, 4]),
        ("out1", "INT64", [-1]),
        ("out2", "BOOL", [-1, 4]),
        ("out3", "INT64", [-1]),
    ]


# --- inference ---------------------------------------------------------------------------------


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_infer_matches_the_session(client, sessions, binary):
    x = images(3, seed=1)
    result = client.infer(
        "cnn",
        [triton_input("in0", x, binary)],
        outputs=[triton.InferRequestedOutput("out0", binary_data=binary)],
        request_id="request-7",
    )
    [want] = sessions["cnn"].run(None, {"in0": x})
    assert_close(result.as_numpy("out0"), want)
    response = result.get_response()
    assert response["id"] == "request-7"
    assert response["model_name"] == "cnn"
    assert ("parameters" in response["outputs"][0]) == binary


def test_requested_outputs_in_their_order_and_datatypes(client, sessions):
    x0 = np.array([[1, -2, 3, 0], [0, 5, -1, 2]], np.float32)
    x1 = np.array([7, 2**62], np.int64)
    want = dict(zip(["out0", "out1", "out2", "out3"], sessions["two"].run(None, {"in0": x0, "in1": x1})))
    result = client.infer(
        "two",
        [triton_input("in0", x0, binary=False), triton_input("in1", x1, binary=True)],
        outputs=[
            triton.InferRequestedOutput("out3", binary_data=False),
            triton.InferRequestedOutput("out2", binary_data=True),
        ],
    )
    assert [o["name"] for o in result.get_response()["outputs"]] == ["out3", "out2"]
    np.testing.assert_array_equal(result.as_numpy("out3"), want["out3"])  # 2**62 + 1 survives JSON
    np.testing.assert_array_equal(result.as_numpy("out2"), want["out2"])
    assert result.as_numpy("out2").dtype == np.bool_

    everything = client.infer("two", [triton_input("in0", x0), triton_input("in1", x1)])  # binary by default
    for name, value in want.items():
        np.testing.assert_array_equal(everything.as_numpy(name), value)


def test_a_model_whose_batch_cannot_grow_serves_one_request_at_a_time(server, sessions):
    c = triton.InferenceServerClient(server.url, concurrency=4, connection_timeout=30, network_timeout=60)
    try:
        feeds = [images(1, seed) for seed in range(8)]
        handles = [c.async_infer("fixed", [triton_input("in0", x)]) for x in feeds]
        for x, handle in zip(feeds, handles):
            assert_close(handle.get_result(timeout=60).as_numpy("out0"), sessions["fixed"].run(None, {"in0": x})[0])
        with pytest.raises(InferenceServerException, match=r"expected shape \[1, 3, 64, 64\], got \[2, 3, 64, 64\]"):
            c.infer("fixed", [triton_input("in0", images(2, 0))])
    finally:
        c.close()


def test_concurrent_clients_each_get_their_own_rows(server, sessions):
    requests = 32
    rows = [1 + k % 3 for k in range(requests)]
    feeds = [images(n, seed) for seed, n in enumerate(rows)]
    before = scrape(server.port)
    c = triton.InferenceServerClient(server.url, concurrency=8, connection_timeout=30, network_timeout=60)
    try:
        handles = [c.async_infer("cnn", [triton_input("in0", x)]) for x in feeds]
        results = [h.get_result(timeout=60) for h in handles]
    finally:
        c.close()
    for x, result in zip(feeds, results):
        assert_close(result.as_numpy("out0"), sessions["cnn"].run(None, {"in0": x})[0])
    after = scrape(server.port)

    def delta(name):
        key = (name, '{model="cnn"}')
        return after.get(key, 0) - before.get(key, 0)

    assert delta("pmx_inference_requests_total") == requests
    assert delta("pmx_inference_batch_size_sum") == sum(rows)  # every row ran, in one batch or another
    assert 1 <= delta("pmx_inference_batch_size_count") <= requests
    assert after[("pmx_inference_queue_depth", '{model="cnn"}')] == 0


def test_gzip_request_and_response(client, sessions):
    x = images(1, 5)
    result = client.infer(
        "cnn",
        [triton_input("in0", x)],
        request_compression_algorithm="gzip",
        response_compression_algorithm="gzip",
    )
    assert_close(result.as_numpy("out0"), sessions["cnn"].run(None, {"in0": x})[0])


# --- errors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("model", "name", "array", "status", "message"),
    [
        ("nonexistent", "in0", images(1, 0), "404", "model 'nonexistent' is not served here"),
        ("cnn", "in0", images(1, 0).astype(np.float64), "400", "the model takes datatype FP32, the request says FP64"),
        ("cnn", "in0", np.zeros((1, 3, 32, 32), np.float32), "400", r"expected shape \[1.., 3, 64, 64\]"),
        ("cnn", "image", images(1, 0), "400", "the model has no input 'image'; its inputs are \\['in0'\\]"),
    ],
    ids=["model", "datatype", "shape", "input-name"],
)
def test_tritonclient_sees_each_error(client, model, name, array, status, message):
    with pytest.raises(InferenceServerException, match=message) as caught:
        client.infer(model, [triton_input(name, array)])
    assert caught.value.status() == status


def test_unknown_requested_output(client):
    with pytest.raises(InferenceServerException, match="unknown output 'logits'") as caught:
        client.infer("cnn", [triton_input("in0", images(1, 0))], outputs=[triton.InferRequestedOutput("logits")])
    assert caught.value.status() == "400"


def infer_body(inputs, outputs=None, **extra):
    """A JSON infer request's bytes."""
    doc = {"inputs": inputs, **extra}
    if outputs is not None:
        doc["outputs"] = outputs
    return json.dumps(doc).encode()


GOOD_INPUT = {"name": "in0", "datatype": "FP32", "shape": [1, 3, 64, 64], "data": [0.5] * (3 * 64 * 64)}
IMAGE_BYTES = 3 * 64 * 64 * 4


def binary_request(header_extra=None, payload=None, declared_size=IMAGE_BYTES, header_length=None):
    """(body, headers) of a binary request for the CNN, with parts made wrong on purpose."""
    entry = {"name": "in0", "datatype": "FP32", "shape": [1, 3, 64, 64]}
    entry["parameters"] = {"binary_data_size": declared_size}
    header = json.dumps({"inputs": [entry], **(header_extra or {})}).encode()
    payload = np.zeros(IMAGE_BYTES, np.uint8).tobytes() if payload is None else payload
    length = str(len(header)) if header_length is None else header_length
    return header + payload, {"Inference-Header-Content-Length": length}


def chunks(total, size=64 << 10):
    sent = 0
    while sent < total:
        yield b" " * min(size, total - sent)
        sent += size


MALFORMED = [
    # (id, path, body, headers, status, words the error names)
    ("not-json", "/v2/models/cnn/infer", b"{not json", {}, 400, "malformed JSON"),
    ("not-utf8", "/v2/models/cnn/infer", b"\xff\xfe\xfa", {}, 400, "not UTF-8 JSON"),
    ("json-list", "/v2/models/cnn/infer", b"[1, 2]", {}, 400, "must be a JSON object, got a list"),
    ("no-inputs", "/v2/models/cnn/infer", b"{}", {}, 400, "'inputs' must be a non-empty list"),
    ("deep-json", "/v2/models/cnn/infer", b"[" * 100000 + b"]" * 100000, {}, 400, "malformed JSON"),
    ("id-number", "/v2/models/cnn/infer", infer_body([GOOD_INPUT], id=7), {}, 400, "'id' must be a string"),
    (
        "unknown-datatype",
        "/v2/models/cnn/infer",
        infer_body([{**GOOD_INPUT, "datatype": "FP8"}]),
        {},
        400,
        "unknown datatype 'FP8'",
    ),
    (
        "bytes-datatype",
        "/v2/models/cnn/infer",
        infer_body([{**GOOD_INPUT, "datatype": "BYTES"}]),
        {},
        400,
        "the model takes datatype FP32, the request says BYTES",
    ),
    (
        "shape-not-list",
        "/v2/models/cnn/infer",
        infer_body([{**GOOD_INPUT, "shape": "1x3x64x64"}]),
        {},
        400,
        "'shape' must be a list of integers",
    ),
    (
        "negative-dim",
        "/v2/models/cnn/infer",
        infer_body([{**GOOD_INPUT, "shape": [-1, 3, 64, 64]}]),
        {},
        400,
        "negative dim",
    ),
    (
        "data-count",
        "/v2/models/cnn/infer",
        infer_body([{**GOOD_INPUT, "data": [1.0] * 5}]),
        {},
        400,
        "holds 12288 values, 'data' has 5",
    ),
    (
        "data-strings",
        "/v2/models/cnn/infer",
        infer_body([{**GOOD_INPUT, "data": ["a"] * (3 * 64 * 64)}]),
        {},
        400,
        "FP32 data must be numbers, got strings",
    ),
    (
        "data-ragged",
        "/v2/models/cnn/infer",
        infer_body([{**GOOD_INPUT, "data": [[1.0, 2.0], [3.0]]}]),
        {},
        400,
        "'data' must be a list of numbers",
    ),
    (
        "int-gets-float",
        "/v2/models/two/infer",
        infer_body(
            [
                {"name": "in0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
                {"name": "in1", "datatype": "INT64", "shape": [1], "data": [1.5]},
            ]
        ),
        {},
        400,
        "INT64 data must be integers, got non-integers",
    ),
    (
        "int-out-of-range",
        "/v2/models/two/infer",
        infer_body(
            [
                {"name": "in0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
                {"name": "in1", "datatype": "INT64", "shape": [1], "data": [2**63]},
            ]
        ),
        {},
        400,
        "INT64 holds",
    ),
    (
        "missing-input",
        "/v2/models/two/infer",
        infer_body([{"name": "in0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]}]),
        {},
        400,
        "missing input(s) ['in1']",
    ),
    (
        "batch-dims-differ",
        "/v2/models/two/infer",
        infer_body(
            [
                {"name": "in0", "datatype": "FP32", "shape": [1, 4], "data": [1, 2, 3, 4]},
                {"name": "in1", "datatype": "INT64", "shape": [2], "data": [1, 2]},
            ]
        ),
        {},
        400,
        "share their batch dim",
    ),
    ("duplicate-input", "/v2/models/cnn/infer", infer_body([GOOD_INPUT, GOOD_INPUT]), {}, 400, "given twice"),
    ("unknown-input", "/v2/models/cnn/infer", infer_body([{**GOOD_INPUT, "name": "x"}]), {}, 400, "no input 'x'"),
    (
        "no-data",
        "/v2/models/cnn/infer",
        infer_body([{k: v for k, v in GOOD_INPUT.items() if k != "data"}]),
        {},
        400,
        "has neither 'data' nor parameters.binary_data_size",
    ),
    (
        "unknown-output",
        "/v2/models/cnn/infer",
        infer_body([GOOD_INPUT], outputs=[{"name": "logits"}]),
        {},
        400,
        "unknown output 'logits'",
    ),
    (
        "classification",
        "/v2/models/cnn/infer",
        infer_body([GOOD_INPUT], outputs=[{"name": "out0", "parameters": {"classification": 3}}]),
        {},
        400,
        "classification extension is not supported",
    ),
    (
        "shared-memory",
        "/v2/models/cnn/infer",
        infer_body([{**GOOD_INPUT, "parameters": {"shared_memory_region": "r"}}]),
        {},
        400,
        "shared memory is not supported",
    ),
    ("unknown-model", "/v2/models/resnet/infer", infer_body([GOOD_INPUT]), {}, 404, "model 'resnet' is not served"),
    (
        "unknown-version",
        "/v2/models/cnn/versions/2/infer",
        infer_body([GOOD_INPUT]),
        {},
        404,
        "has no version '2'",
    ),
    ("header-length-text", "/v2/models/cnn/infer", *binary_request(header_length="many"), 400, "must be a byte count"),
    (
        "header-length-sup2",
        "/v2/models/cnn/infer",
        *binary_request(header_length="\u00b2"),
        400,
        "must be a byte count",
    ),
    (
        "header-length-past-end",
        "/v2/models/cnn/infer",
        *binary_request(header_length="99999999"),
        400,
        "but the request body has only",
    ),
    (
        "binary-short",
        "/v2/models/cnn/infer",
        *binary_request(payload=b"\0" * 100),
        400,
        "run past the end of the binary section",
    ),
    (
        "binary-long",
        "/v2/models/cnn/infer",
        *binary_request(payload=b"\0" * (IMAGE_BYTES + 4)),
        400,
        f"binary section after the inference header is {IMAGE_BYTES + 4} bytes",
    ),
    (
        "binary-size-vs-shape",
        "/v2/models/cnn/infer",
        *binary_request(declared_size=100, payload=b"\0" * 100),
        400,
        f"needs {IMAGE_BYTES} bytes, binary_data_size says 100",
    ),
    (
        "binary-without-header",
        "/v2/models/cnn/infer",
        binary_request()[0],
        {},
        400,
        "needs the Inference-Header-Content-Length header",
    ),
    (
        "binary-output-flag",
        "/v2/models/cnn/infer",
        infer_body([GOOD_INPUT], parameters={"binary_data_output": "yes"}),
        {},
        400,
        "binary_data_output must be true or false",
    ),
    (
        "too-large",
        "/v2/models/cnn/infer",
        b" " * ((MAX_BODY_MB << 20) + 1),
        {},
        413,
        "over the server's limit",
    ),
    ("too-large-chunked", "/v2/models/cnn/infer", "chunked", {}, 413, "over the server's limit"),
    (
        "gzip-bomb",
        "/v2/models/cnn/infer",
        gzip.compress(b" " * (4 * (MAX_BODY_MB << 20))),
        {"Content-Encoding": "gzip"},
        413,
        "once decompressed",
    ),
    ("gzip-garbage", "/v2/models/cnn/infer", b"not gzip", {"Content-Encoding": "gzip"}, 400, "not valid gzip"),
    ("brotli", "/v2/models/cnn/infer", b"{}", {"Content-Encoding": "br"}, 415, "Content-Encoding 'br'"),
    ("get-infer", "GET /v2/models/cnn/infer", None, {}, 405, "GET is not allowed"),
    ("no-route", "GET /v2/nothing", None, {}, 404, "no endpoint at /v2/nothing"),
    ("metadata-unknown", "GET /v2/models/resnet", None, {}, 404, "model 'resnet' is not served"),
]


@pytest.mark.parametrize(
    ("path", "body", "headers", "status", "message"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_request_gets_a_4xx_naming_the_fault(server, sessions, path, body, headers, status, message):
    method, _, path = path.rpartition(" ")
    method = method or "POST"
    if body == "chunked":  # no Content-Length: the server counts the chunks as they come
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=60)
        try:
            conn.request("POST", path, body=chunks((MAX_BODY_MB << 20) + 1), encode_chunked=True)
            response = conn.getresponse()
            got_status, got_headers, got_body = response.status, dict(response.getheaders()), response.read()
        finally:
            conn.close()
    else:
        got_status, got_headers, got_body = http_request(server.port, method, path, body, headers)
    assert got_status == status, got_body[:500]
    assert got_headers.get("content-type") == "application/json"
    error = json.loads(got_body)["error"]
    assert message in error, error
    # and the server still answers a good request
    good = infer_body([GOOD_INPUT])
    ok_status, _, ok_body = http_request(server.port, "POST", "/v2/models/cnn/infer", good)
    assert ok_status == 200, ok_body[:500]
    [want] = sessions["cnn"].run(None, {"in0": np.full((1, 3, 64, 64), 0.5, np.float32)})
    assert_close(np.array(json.loads(ok_body)["outputs"][0]["data"], np.float32).reshape(1, 10), want)


def test_binary_output_by_hand(server, sessions):
    """The binary extension as the protocol's text has it, without tritonclient: the JSON
    header's length in a header, the output's bytes after it."""
    x = images(1, 3)
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "in0",
                    "datatype": "FP32",
                    "shape": [1, 3, 64, 64],
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "out0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    status, headers, body = http_request(
        server.port,
        "POST",
        "/v2/models/cnn/infer",
        header + x.tobytes(),
        {"Inference-Header-Content-Length": str(len(header))},
    )
    assert status == 200, body[:300]
    length = int(headers["inference-header-content-length"])
    [output] = json.loads(body[:length])["outputs"]
    assert output["parameters"]["binary_data_size"] == 40 == len(body) - length
    assert_close(np.frombuffer(body[length:], "<f4").reshape(1, 10), sessions["cnn"].run(None, {"in0": x})[0])


def test_metrics(server):
    http_request(server.port, "POST", "/v2/models/cnn/infer", b"{not json")
    http_request(server.port, "POST", "/v2/models/resnet/infer", b"{}")
    values = scrape(server.port)
    assert values[("pmx_inference_errors_total", '{model="cnn",status="400"}')] >= 1
    assert values[("pmx_inference_errors_total", '{model="(unknown)",status="404"}')] >= 1
    for name in ("pmx_inference_request_seconds_count", "pmx_inference_batch_size_count", "pmx_inference_queue_depth"):
        for model in ("cnn", "fixed", "two"):
            assert (name, f'{{model="{model}"}}') in values, (name, model)


# --- an internal error, in-process ----------------------------------------------------------------


def asgi_request(app, method, path, body=b""):
    """(status, body) of one request to an ASGI app, called in-process."""

    async def call():
        scope = {
            "type": "http",
            "asgi": {"version": "3.0"},
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "root_path": "",
            "headers": [(b"content-length", str(len(body)).encode())],
            "client": ("127.0.0.1", 1),
            "server": ("127.0.0.1", 80),
        }
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive():
            return messages.pop(0) if messages else {"type": "http.disconnect"}

        sent = []

        async def send(message):
            sent.append(message)

        await app(scope, receive, send)
        return sent[0]["status"], b"".join(m.get("body", b"") for m in sent[1:])

    return asyncio.run(call())


def failing(error):
    future = concurrent.futures.Future()
    future.set_exception(error)
    return future


def test_a_pmx_bug_is_a_500_with_its_message_and_the_app_keeps_serving(models, sessions):
    from pmx.runtime.serve.app import create_app
    from pmx.runtime.serve.metrics import Metrics
    from pmx.runtime.serve.models import open_model

    metrics = Metrics(["two"])
    model = open_model("two", models["two"], on_run=metrics.batch_observer("two"))
    app = create_app([model], 1 << 20, metrics)
    x0 = {"name": "in0", "datatype": "FP32", "shape": [1, 4], "data": [1, -1, 2, 0]}
    x1 = {"name": "in1", "datatype": "INT64", "shape": [1], "data": [41]}
    body = infer_body([x0, x1], outputs=[{"name": "out3"}])
    real_submit = model.submit
    try:
        model.submit = lambda names, feed: failing(PmxInternalError("node 'relu' (relu) failed at run: boom"))
        status, answer = asgi_request(app, "POST", "/v2/models/two/infer", body)
        assert status == 500
        assert "node 'relu' (relu) failed at run: boom" in json.loads(answer)["error"]

        def broken(names, feed):
            raise RuntimeError("a bug of the server's own")

        model.submit = broken
        status, answer = asgi_request(app, "POST", "/v2/models/two/infer", body)
        assert status == 500
        assert "RuntimeError: a bug of the server's own" in json.loads(answer)["error"]

        model.submit = real_submit
        status, answer = asgi_request(app, "POST", "/v2/models/two/infer", body)
        assert status == 200, answer
        assert json.loads(answer)["outputs"][0]["data"] == [42]
    finally:
        model.close()
    assert metrics.registry.get_sample_value("pmx_inference_errors_total", {"model": "two", "status": "500"}) == 2


# --- several workers ---------------------------------------------------------------------------


def serve_module_command():
    return [sys.executable, "-m", "pmx.runtime.serve"]


@pytest.fixture(scope="module")
def two_workers(models, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve_workers") / "server.log"
    s = start_server(serve_module_command(), [models["cnn"], "--workers", "2"], log)
    try:
        yield s
    finally:
        status = s.stop()
    assert status == 0, f"pmx serve --workers 2 exited with {status} after SIGTERM:\n{s.log()}"


def test_metrics_add_up_across_workers(two_workers):
    """Each request on a new connection, so the kernel hands them to either worker; the
    count any worker reports is the server's."""
    before = scrape(two_workers.port).get(("pmx_inference_requests_total", '{model="cnn"}'), 0)
    for _ in range(10):
        status, _, body = http_request(two_workers.port, "POST", "/v2/models/cnn/infer", infer_body([GOOD_INPUT]))
        assert status == 200, body[:300]
    for _ in range(3):  # whichever worker answers the scrape
        after = scrape(two_workers.port)[("pmx_inference_requests_total", '{model="cnn"}')]
        assert after - before == 10


def test_a_worker_that_dies_is_replaced(two_workers):
    pids = [int(p) for p in re.findall(r"worker (\d+) started", two_workers.log())]
    assert len(pids) == 2, two_workers.log()
    os.kill(pids[0], signal.SIGKILL)
    deadline = time.monotonic() + START_TIMEOUT
    while f"worker {pids[0]} exited with status -9; starting another" not in two_workers.log():
        assert time.monotonic() < deadline, two_workers.log()
        time.sleep(0.05)
    for _ in range(6):  # whichever worker takes them, each is answered
        status, _, body = http_request(two_workers.port, "POST", "/v2/models/cnn/infer", infer_body([GOOD_INPUT]))
        assert status == 200, body[:300]
    assert len(re.findall(r"worker (\d+) started", two_workers.log())) == 3


def binary_infer(x):
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": "in0",
                    "datatype": "FP32",
                    "shape": list(x.shape),
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "outputs": [{"name": "out0", "parameters": {"binary_data": True}}],
        }
    ).encode()
    return header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def test_sigterm_under_load_answers_every_accepted_request(models, sessions, tmp_path):
    """Clients keep sending until the server goes away. Every request a worker took is
    answered (its count of received and answered requests agree, and add up to the
    answers the clients got), every answer is right, and the server exits 0."""
    server = start_server(serve_module_command(), [models["cnn"], "--workers", "2"], tmp_path / "server.log")
    # both workers serving before the load: one still starting when SIGTERM comes stops
    # before it serves, takes no request and says nothing of requests (as it should)
    deadline = time.monotonic() + START_TIMEOUT
    while server.log().count("Application startup complete.") < 2:
        assert time.monotonic() < deadline, f"two workers did not start serving:\n{server.log()}"
        time.sleep(0.05)
    x = images(2, 11)
    [want] = sessions["cnn"].run(None, {"in0": x})
    body, headers = binary_infer(x)
    clients, most_per_client = 4, 2000
    answers = [[] for _ in range(clients)]  # per client: the status of each answer
    wrong = []
    terminated = threading.Event()
    unexpected = []

    def client(k):
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=STOP_TIMEOUT)
        try:
            for _ in range(most_per_client):
                try:
                    conn.request("POST", "/v2/models/cnn/infer", body=body, headers=headers)
                    response = conn.getresponse()
                    data = response.read()
                except (OSError, http.client.HTTPException) as e:
                    if not terminated.is_set():
                        unexpected.append(repr(e))
                    return  # the server is going away: this request was not taken
                answers[k].append(response.status)
                if response.status != 200:
                    wrong.append(data[:300])
                    continue
                length = int(response.getheader("Inference-Header-Content-Length"))
                got = np.frombuffer(data[length:], "<f4").reshape(2, 10)
                if not np.allclose(got, want, rtol=1e-5, atol=1e-6):
                    wrong.append("wrong output")
        finally:
            conn.close()

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    status = None
    try:
        for t in threads:
            t.start()
        deadline = time.monotonic() + START_TIMEOUT
        while min(len(a) for a in answers) < 3 and any(t.is_alive() for t in threads):
            assert time.monotonic() < deadline, "clients got no answers"
            time.sleep(0.01)
        terminated.set()
        server.terminate()
        for t in threads:
            t.join(timeout=STOP_TIMEOUT)
        assert not any(t.is_alive() for t in threads), "a client never got an answer or an error"
    finally:
        terminated.set()
        status = server.stop()
    log = server.log()
    assert status == 0, log
    assert not unexpected, unexpected
    assert not wrong, wrong[:3]
    stopped = [
        tuple(map(int, m)) for m in re.findall(r"stopped: (\d+) inference requests received, (\d+) answered", log)
    ]
    assert len(stopped) == 2, log
    assert all(received == answered for received, answered in stopped), stopped
    assert sum(answered for _, answered in stopped) == sum(len(a) for a in answers)
