"""The baseline tools/bench_serve.py compares `pmx serve` with: the onnxruntime server
people write today, a Starlette app that answers the Open Inference Protocol's infer
endpoint with binary tensors, running each request with InferenceSession.run in the
thread pool, under uvicorn with --workers processes. No batching, no metrics, no checks
beyond what a hand-written app does.

    python tools/serve_onnxruntime_app.py model.onnx --port 8001 --workers 2 [--threads 1]

With --workers above 1 it patches around a uvicorn bug that would add ~40 ms to every
keep-alive request (keep_tcp_nodelay); --stock-uvicorn measures uvicorn as it ships.

GET /v2/health/ready answers 200, GET /v2/models/{any name} the model's metadata; POST
/v2/models/{any name}/infer takes one tensor per input with parameters.binary_data_size
and answers every output in binary.
"""

import argparse
import json
import os
import socket

import numpy as np
import onnxruntime as ort
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

# the settings reach the workers uvicorn spawns through the environment, as such apps do
MODEL_VARIABLE = "ORT_APP_MODEL"
THREADS_VARIABLE = "ORT_APP_THREADS"

DTYPES = {"FP32": np.float32, "FP64": np.float64, "INT64": np.int64, "INT32": np.int32, "BOOL": np.bool_}
DATATYPES = {np.dtype(v).name: k for k, v in DTYPES.items()}
ORT_DATATYPES = {"tensor(float)": "FP32", "tensor(double)": "FP64", "tensor(int64)": "INT64", "tensor(int32)": "INT32"}


def create_app():
    options = ort.SessionOptions()
    options.intra_op_num_threads = int(os.environ.get(THREADS_VARIABLE, "1"))
    options.inter_op_num_threads = 1
    session = ort.InferenceSession(os.environ[MODEL_VARIABLE], options, providers=["CPUExecutionProvider"])

    async def ready(request: Request):
        return JSONResponse({"ready": True})

    async def metadata(request: Request):
        def describe(node):
            shape = [d if isinstance(d, int) else -1 for d in node.shape]
            return {"name": node.name, "datatype": ORT_DATATYPES[node.type], "shape": shape}

        return JSONResponse(
            {
                "name": request.path_params["model"],
                "inputs": [describe(n) for n in session.get_inputs()],
                "outputs": [describe(n) for n in session.get_outputs()],
            }
        )

    async def infer(request: Request):
        body = await request.body()
        length = int(request.headers["inference-header-content-length"])
        header = json.loads(body[:length])
        feed, offset = {}, length
        for tensor in header["inputs"]:
            size = tensor["parameters"]["binary_data_size"]
            data = np.frombuffer(
                body, DTYPES[tensor["datatype"]], size // np.dtype(DTYPES[tensor["datatype"]]).itemsize, offset
            )
            feed[tensor["name"]] = data.reshape(tensor["shape"])
            offset += size
        names = [o.name for o in session.get_outputs()]
        outputs = await run_in_threadpool(session.run, names, feed)
        described = [
            {
                "name": name,
                "datatype": DATATYPES[out.dtype.name],
                "shape": list(out.shape),
                "parameters": {"binary_data_size": out.nbytes},
            }
            for name, out in zip(names, outputs)
        ]
        head = json.dumps({"model_name": request.path_params["model"], "outputs": described}).encode()
        return Response(
            b"".join([head, *(np.ascontiguousarray(o).tobytes() for o in outputs)]),
            media_type="application/octet-stream",
            headers={"Inference-Header-Content-Length": str(len(head))},
        )

    routes = [
        Route("/v2/health/ready", ready),
        Route("/v2/models/{model}", metadata),
        Route("/v2/models/{model}/infer", infer, methods=["POST"]),
    ]
    return Starlette(routes=routes)


def keep_tcp_nodelay(uvicorn):
    """Work around uvicorn's --workers path leaving Nagle's algorithm on (uvicorn issue
    #3149, open in 0.54): its listening socket has proto 0, accepted sockets inherit it,
    and asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, so each
    keep-alive response waits ~40 ms for the client's delayed ACK. The socket is wrapped
    again with its protocol named. `pmx serve` binds its own socket with the protocol
    getaddrinfo gives, so it needs no such patch."""
    bind_socket = uvicorn.Config.bind_socket

    def bind_socket_naming_tcp(config):
        sock = bind_socket(config)
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return sock
        return socket.socket(sock.family, sock.type, socket.IPPROTO_TCP, fileno=sock.detach())

    uvicorn.Config.bind_socket = bind_socket_naming_tcp


def main():
    import uvicorn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="the .onnx file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--threads", type=int, default=1, help="onnxruntime intra-op threads per worker")
    parser.add_argument(
        "--stock-uvicorn",
        action="store_true",
        help="run --workers N as uvicorn does, without the TCP_NODELAY workaround (see keep_tcp_nodelay)",
    )
    args = parser.parse_args()
    if args.workers > 1 and not args.stock_uvicorn:
        keep_tcp_nodelay(uvicorn)
    os.environ[MODEL_VARIABLE] = os.path.abspath(args.model)
    os.environ[THREADS_VARIABLE] = str(args.threads)
    uvicorn.run(
        "serve_onnxruntime_app:create_app",
        factory=True,
        host=args.host,
        port=args.port,
        workers=args.workers,
        app_dir=os.path.dirname(os.path.abspath(__file__)),
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
