"""Load test for `pmx serve`, and the comparison with an onnxruntime app, over HTTP.

K concurrent clients (threads, spread over client processes so the client's own Python
is not the limit) each keep one connection and send binary infer requests (the Open
Inference Protocol's binary tensor extension) for a fixed count or time; every answer is
checked against the model run locally. Reports requests/s, images/s, p50/p99 latency
and errors, and names the CPU.

    # against a server you started: pmx serve example.pmx --workers 2
    python tools/bench_serve.py --url 127.0.0.1:8000 --model example --check example.pmx \\
        --clients 8 --seconds 10

    # the table of docs/serving.md: starts each server in turn on a free port, same load
    python tools/bench_serve.py --compare --pmx example.pmx --onnx example.onnx --seconds 10

    # example.onnx, the example CNN exported by torch (the test extra has torch and onnx)
    python tools/bench_serve.py --export-onnx example.onnx

The clients run on the same machine as the server and take CPU from it, alike for every
server compared; on a shared host, compare configurations measured in one sitting.
"""

import argparse
import datetime
import http.client
import json
import multiprocessing
import os
import pathlib
import platform
import signal
import socket
import subprocess
import sys
import threading
import time

import numpy as np

TOOLS = pathlib.Path(__file__).resolve().parent
EXAMPLE = TOOLS / "example"
READY_TIMEOUT = 120


# --- the input ---------------------------------------------------------------------------------


def model_input(shape, kind, rows):
    """A fixed random input of `shape` (dims that may change: `rows`); FP32 inputs only."""
    if kind not in ("FP32", "tensor(float)"):
        raise SystemExit(f"this bench sends float32 inputs; the model's input is {kind}")
    dims = [rows if d in (None, -1) else d for d in shape]
    return np.random.default_rng(0).random(dims, dtype=np.float32)


def served_input_name(url, model):
    return _metadata(url, model)["inputs"][0]["name"]


def input_from_metadata(url, model, rows):
    """(input name, input) of a served model of one FP32 input, from its metadata."""
    metadata = _metadata(url, model)
    if len(metadata["inputs"]) != 1:
        raise SystemExit(f"this bench sends one input; {model} takes {len(metadata['inputs'])}")
    [node] = metadata["inputs"]
    return node["name"], model_input(node["shape"], node["datatype"], rows)


def _metadata(url, model):
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("GET", f"/v2/models/{model}")
        response = conn.getresponse()
        metadata = json.loads(response.read())
    finally:
        conn.close()
    if response.status != 200:
        raise SystemExit(f"GET /v2/models/{model}: {response.status} {metadata}")
    return metadata


def expected_output(path, input_name, x):
    from pmx.runtime import InferenceSession

    return InferenceSession(path, num_threads=1).run(None, {input_name: x})[0]


# --- one load run ---------------------------------------------------------------------------


def request_bytes(input_name, x):
    header = json.dumps(
        {
            "inputs": [
                {
                    "name": input_name,
                    "datatype": "FP32",
                    "shape": list(x.shape),
                    "parameters": {"binary_data_size": x.nbytes},
                }
            ],
            "parameters": {"binary_data_output": True},
        }
    ).encode()
    return header + x.tobytes(), {"Inference-Header-Content-Length": str(len(header))}


def first_output(data, length):
    """The first output of a binary response, as float32."""
    header = json.loads(data[:length])
    output = header["outputs"][0]
    size = output["parameters"]["binary_data_size"]
    return np.frombuffer(data[length : length + size], "<f4").reshape(output["shape"])


def client_thread(url, path, body, headers, expected, stop_at, quota, results):
    """Send requests on one connection until `stop_at` (monotonic) or `quota` requests;
    append (latency seconds or None for an error, error text) to results."""
    host, port = url.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    sent = 0
    while sent < quota and time.monotonic() < stop_at:
        sent += 1
        start = time.perf_counter()
        try:
            conn.request("POST", path, body=body, headers=headers)
            response = conn.getresponse()
            data = response.read()
        except (OSError, http.client.HTTPException) as e:
            results.append((None, repr(e)))
            conn.close()
            conn = http.client.HTTPConnection(host, int(port), timeout=60)
            continue
        latency = time.perf_counter() - start
        if response.status != 200:
            results.append((None, f"{response.status}: {data[:200]!r}"))
            continue
        results.append((latency, None) if expected is None else checked(latency, data, response, expected))
    conn.close()


def checked(latency, data, response, expected):
    """(latency, None) when the answer holds the expected output, else (None, what is wrong)."""
    try:
        got = first_output(data, int(response.getheader("Inference-Header-Content-Length")))
    except (TypeError, ValueError, KeyError) as e:
        return None, f"not a binary answer ({type(e).__name__}: {e}): {data[:200]!r}"
    if got.shape != expected.shape:
        return None, f"wrong output shape {list(got.shape)}, expected {list(expected.shape)}"
    if not np.allclose(got, expected, rtol=1e-4, atol=1e-5):
        return None, f"wrong output: max error {np.abs(got - expected).max():.3g}"
    return latency, None


def client_process(args):
    """One client process: `threads` client threads; the results of all of them."""
    url, path, body, headers, expected, seconds, quota, threads = args
    stop_at = time.monotonic() + seconds
    results = []
    workers = [
        threading.Thread(target=client_thread, args=(url, path, body, headers, expected, stop_at, quota, results))
        for _ in range(threads)
    ]
    for t in workers:
        t.start()
    for t in workers:
        t.join()
    return results


def run_load(url, model, input_name, x, expected, clients, seconds, requests, client_processes):
    """(seconds taken, [(latency or None, error)]) of one load run."""
    body, headers = request_bytes(input_name, x)
    processes = max(1, min(client_processes, clients))
    per_process = [clients // processes + (1 if k < clients % processes else 0) for k in range(processes)]
    quota = max(1, requests // clients) if requests else 1 << 62
    path = f"/v2/models/{model}/infer"
    jobs = [(url, path, body, headers, expected, seconds, quota, n) for n in per_process]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        start = time.perf_counter()
        results = [r for part in pool.map(client_process, jobs) for r in part]
        taken = time.perf_counter() - start
    return taken, results


def summarize(label, clients, rows, taken, results):
    latencies = np.array([r[0] for r in results if r[0] is not None])
    errors = [r[1] for r in results if r[0] is None]
    done = len(latencies)
    return {
        "server": label,
        "clients": clients,
        "rows": rows,
        "requests": done,
        "errors": len(errors),
        "first_error": errors[0] if errors else "",
        "requests_per_s": done / taken,
        "images_per_s": done * rows / taken,
        "p50_ms": float(np.percentile(latencies, 50) * 1e3) if done else float("nan"),
        "p99_ms": float(np.percentile(latencies, 99) * 1e3) if done else float("nan"),
    }


# --- servers ----------------------------------------------------------------------------------


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url, process):
    host, port = url.rsplit(":", 1)
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"the server exited with {process.returncode} before it was ready")
        try:
            conn = http.client.HTTPConnection(host, int(port), timeout=5)
            conn.request("GET", "/v2/health/ready")
            if conn.getresponse().status == 200:
                return
        except OSError:
            pass
        finally:
            conn.close()
        time.sleep(0.1)
    raise SystemExit(f"the server at {url} was not ready within {READY_TIMEOUT} s")


def stop(process):
    process.send_signal(signal.SIGTERM)
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def tree_cpu_seconds(pid):
    """CPU seconds (user + system) used so far by process `pid` and its descendants alive
    now (Linux /proc; None elsewhere). The server's cost per request, which a busy host
    changes far less than it changes requests/s."""
    ticks = os.sysconf("SC_CLK_TCK")
    stats = {}
    for entry in pathlib.Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            stats[int(entry.name)] = (int(fields[1]), int(fields[11]) + int(fields[12]))  # ppid, utime + stime
    if pid not in stats:
        return None
    tree, total = {pid}, 0
    changed = True
    while changed:
        changed = False
        for child, (parent, _) in stats.items():
            if parent in tree and child not in tree:
                tree.add(child)
                changed = True
    for member in tree:
        total += stats[member][1]
    return total / ticks


def configurations(args):
    """[(label, command without --port)] of --compare."""
    pmx = [sys.executable, "-m", "pmx.runtime.serve", args.pmx, "--name", "model", "-q"]
    threads = ["--threads", str(args.threads)]
    configs = [
        ("pmx serve --workers 2", [*pmx, "--workers", "2", *threads]),
        ("pmx serve --workers 2 --max-wait-ms 0", [*pmx, "--workers", "2", "--max-wait-ms", "0", *threads]),
        ("pmx serve --workers 2 --max-batch-size 1", [*pmx, "--workers", "2", "--max-batch-size", "1", *threads]),
        ("pmx serve --workers 1", [*pmx, "--workers", "1", *threads]),
    ]
    if args.onnx:
        app = [sys.executable, str(TOOLS / "serve_onnxruntime_app.py"), args.onnx, *threads]
        configs += [
            ("onnxruntime app --workers 2", [*app, "--workers", "2"]),
            ("onnxruntime app --workers 1", [*app, "--workers", "1"]),
        ]
        if args.stock_uvicorn:
            configs.append(("onnxruntime app --workers 2, stock uvicorn", [*app, "--workers", "2", "--stock-uvicorn"]))
    return configs


def compare(args, input_name, x, expected):
    """One row per configuration: the median of its rounds, which are interleaved (every
    configuration once, then again) so a noisy neighbour hits them alike."""
    measured = {label: [] for label, _ in configurations(args)}
    for round_number in range(args.rounds):
        for label, command in configurations(args):
            row = measure(label, command, args, input_name, x, expected)
            measured[label].append(row)
            print(
                f"  round {round_number + 1}: {label}: {row['requests_per_s']:.0f} requests/s",
                file=sys.stderr,
                flush=True,
            )
    return [median_row(rows) for rows in measured.values()]


def measure(label, command, args, input_name, x, expected):
    """Start the server, warm it up, load it, stop it: its summary row."""
    port = free_port()
    url = f"127.0.0.1:{port}"
    process = subprocess.Popen([*command, "--port", str(port)], stdin=subprocess.DEVNULL)
    try:
        wait_ready(url, process)
        input_name = served_input_name(url, "model")  # an ONNX export may name it otherwise
        warm_up = min(2.0, args.seconds)
        run_load(url, "model", input_name, x, expected, args.clients, warm_up, 0, args.client_processes)
        cpu_before = tree_cpu_seconds(process.pid)
        taken, results = run_load(
            url, "model", input_name, x, expected, args.clients, args.seconds, args.requests, args.client_processes
        )
        cpu_after = tree_cpu_seconds(process.pid)
    finally:
        stop(process)
    row = summarize(label, args.clients, x.shape[0], taken, results)
    if cpu_before is not None and cpu_after is not None and row["requests"]:
        row["cpu_ms_per_request"] = (cpu_after - cpu_before) * 1e3 / row["requests"]
    return row


def median_row(rows):
    row = dict(rows[0])
    for key in ("requests_per_s", "images_per_s", "p50_ms", "p99_ms", "cpu_ms_per_request"):
        row[key] = float(np.median([r.get(key, float("nan")) for r in rows]))
    row["requests"] = sum(r["requests"] for r in rows)
    row["errors"] = sum(r["errors"] for r in rows)
    row["first_error"] = next((r["first_error"] for r in rows if r["first_error"]), "")
    return row


# --- the report --------------------------------------------------------------------------------


def cpu_name():
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def print_table(rows, args):
    print(
        f"{datetime.date.today()}, {cpu_name()}, {os.cpu_count()} logical CPUs, Python {platform.python_version()}; "
        f"{args.clients} clients in {min(args.client_processes, args.clients)} processes on the same host, "
        f"{args.rows} image(s) per request, binary tensors, {args.threads} intra-op thread(s) per worker"
        + (f"; median of {args.rounds} interleaved rounds of {args.seconds:g} s" if args.compare else "")
    )
    print()
    # requests, errors: all rounds; server CPU: all its processes, per answered request
    print("| server | requests | errors | requests/s | images/s | p50 ms | p99 ms | server CPU ms/request |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        cpu = r.get("cpu_ms_per_request", float("nan"))
        print(
            f"| {r['server']} | {r['requests']} | {r['errors']} | {r['requests_per_s']:.0f} | "
            f"{r['images_per_s']:.0f} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
            f"{'n/a' if cpu != cpu else f'{cpu:.2f}'} |"
        )
    for r in rows:
        if r["errors"]:
            print(f"\n{r['server']}: first error: {r['first_error']}")


def export_onnx(path):
    """The example CNN as ONNX with a dynamic batch, from the model tools/export_example.py
    builds, checked against the output torch recorded for the shipped input."""
    import torch
    import torch.nn as nn

    sys.path.insert(0, str(TOOLS))
    import export_example

    torch.manual_seed(0)  # as export_example.main builds it
    model = export_example.ExampleCNN().eval()
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.2)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    x = torch.from_numpy(np.load(EXAMPLE / "cnn_input.npy"))
    torch.onnx.export(
        model,
        (x,),
        path,
        input_names=["in0"],
        output_names=["out0"],
        dynamic_axes={"in0": {0: "batch"}, "out0": {0: "batch"}},
        dynamo=False,
    )
    import onnxruntime as ort

    [got] = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"in0": x.numpy()})
    error = float(np.abs(got - np.load(EXAMPLE / "cnn_expected.npy")).max())
    if error > 1e-5:
        raise SystemExit(f"{path}: the export does not match tools/example/cnn_expected.npy (max error {error:.3g})")
    print(f"wrote {path} (matches tools/example/cnn_expected.npy, max error {error:.2g})")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", help="host:port of a running server")
    parser.add_argument("--model", default="example", help="the model's name on that server")
    parser.add_argument("--check", metavar="M.pmx", help="check every answer against this .pmx run locally")
    parser.add_argument("--compare", action="store_true", help="start each server of the comparison in turn")
    parser.add_argument("--pmx", help="--compare: the .pmx to serve")
    parser.add_argument("--onnx", help="--compare: the same model as .onnx for the onnxruntime app")
    parser.add_argument("--export-onnx", metavar="PATH", help="write the example CNN as ONNX and exit")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients (default 8)")
    parser.add_argument("--client-processes", type=int, default=2, help="processes the clients run in (default 2)")
    parser.add_argument("--seconds", type=float, default=10.0, help="how long each load runs (default 10)")
    parser.add_argument("--requests", type=int, default=0, help="stop after this many requests (default: no limit)")
    parser.add_argument("--rows", type=int, default=1, help="images per request (default 1)")
    parser.add_argument("--threads", type=int, default=1, help="--compare: intra-op threads per worker (default 1)")
    parser.add_argument(
        "--stock-uvicorn",
        action="store_true",
        help="--compare: also run the onnxruntime app under uvicorn's --workers as shipped (its ~40 ms TCP_NODELAY bug)",
    )
    parser.add_argument("--rounds", type=int, default=3, help="--compare: interleaved rounds, median shown (default 3)")
    args = parser.parse_args()
    if args.export_onnx:
        export_onnx(args.export_onnx)
        return
    if args.compare:
        if not args.pmx:
            parser.error("--compare needs --pmx (and --onnx for the onnxruntime app)")
        from pmx.runtime import InferenceSession

        [node] = InferenceSession(args.pmx).get_inputs()
        name, x = node.name, model_input(node.shape, node.type, args.rows)
        rows = compare(args, name, x, expected_output(args.pmx, name, x))
    else:
        if not args.url:
            parser.error("give --url of a running server, or --compare")
        name, x = input_from_metadata(args.url, args.model, args.rows)
        expected = expected_output(args.check, name, x) if args.check else None
        taken, results = run_load(
            args.url, args.model, name, x, expected, args.clients, args.seconds, args.requests, args.client_processes
        )
        rows = [summarize(f"{args.url} {args.model}", args.clients, args.rows, taken, results)]
    print_table(rows, args)


if __name__ == "__main__":
    main()
