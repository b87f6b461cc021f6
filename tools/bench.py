"""Side-by-side benchmark: pmx vs onnxruntime vs ncnn vs torch, one process tree.

    # torchvision models (a separate venv: torch 2.14.1 + torchvision 0.29.1 + onnxruntime + ncnn + pnnx)
    python tools/bench.py --models resnet18,mobilenet_v2 --json bench.json
    # the same, alternating with another checkout's runtime on the same .pmx files
    python tools/bench.py --baseline /tmp/base  # /tmp/base/pmx/{compiler,runtime,schema}
    # built-in small models, any venv with torch + pnnx
    python tools/bench.py --builtin

Each model is exported from torch once (pnnx -> .pnnx.param/.bin for pmx and
.ncnn.param/.bin for ncnn; torch.onnx.export(dynamo=False) for onnxruntime; the traced
TorchScript module pnnx saves for torch) into --cache. Then every contender runs in a
fresh subprocess (so imports, page cache effects and peak RSS are its own) with 2 threads,
and reports: import time, load time, time to first result (import of the runtime + load +
first run; numpy is already imported), steady-state latency (median of --runs runs after
warm-up) and peak RSS. Each contender runs in --rounds such processes (default 3), the
contenders taking turns in an order rotated every round, and each number is the median
over its rounds: on a shared VM a burst of load from elsewhere lasting one process had
moved single samples by 1.5-2.5x (pmx on ResNet-18: 75, 46 and 29 ms in three runs).
Outputs are checked against torch's. Prints a markdown table with ratios to onnxruntime
and writes JSON (with every round's sample). The models are torchvision's untrained ones with
seeded random values where those hold constants (randomize_untrained): ViT's zero
classifier head made its output exactly zero, so its check could not fail.

Workers run with bytecode caching on (PYTHONDONTWRITEBYTECODE removed) after one warm-up
import per contender, as an installed package runs: pip compiles .pyc files at install,
and measuring source compilation would charge pmx (pure Python) ~80 ms that no user pays.
--tune compiles the .pmx files with `pmx compile --tune` (kernels timed on this machine).
"""

import argparse
import json
import os
import pathlib
import platform
import subprocess
import sys
import time

import numpy as np

CONTENDERS = ("pmx", "pmx-baseline", "onnxruntime", "ncnn", "torch")
# pmx-baseline: pmx imported from --baseline DIR (another checkout), on the same .pmx files
TORCHVISION_CNNS = (
    "resnet18",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "shufflenet_v2_x1_0",
    "squeezenet1_1",
    "efficientnet_b0",
    "densenet121",
    "googlenet",
)
TRANSFORMERS = ("vit_b_16", "swin_t")


# --- worker: one contender, one model, fresh process ---------------------------------


def worker(contender, model_dir, runs, threads):
    d = pathlib.Path(model_dir)
    x = np.load(d / "input.npy")
    t0 = time.perf_counter()
    if contender in ("pmx", "pmx-baseline"):
        from pmx.runtime import InferenceSession

        t1 = time.perf_counter()
        sess = InferenceSession(str(d / "model.pmx"), num_threads=threads)
        t2 = time.perf_counter()
        name = sess.get_inputs()[0].name
        run = lambda: sess.run(None, {name: x})[0]
    elif contender == "onnxruntime":
        import onnxruntime as ort

        t1 = time.perf_counter()
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        sess = ort.InferenceSession(str(d / "model.onnx"), opts, providers=["CPUExecutionProvider"])
        t2 = time.perf_counter()
        name = sess.get_inputs()[0].name
        run = lambda: sess.run(None, {name: x})[0]
    elif contender == "ncnn":
        import ncnn

        t1 = time.perf_counter()
        net = ncnn.Net()
        net.opt.num_threads = threads
        net.opt.use_vulkan_compute = False
        net.load_param(str(d / "model.ncnn.param"))
        net.load_model(str(d / "model.ncnn.bin"))
        t2 = time.perf_counter()
        xin = ncnn.Mat(np.ascontiguousarray(x[0]))

        def run():
            ex = net.create_extractor()
            ex.input("in0", xin)
            _, out = ex.extract("out0")
            return np.array(out)[None]
    elif contender == "torch":
        import torch

        torch.set_num_threads(threads)
        t1 = time.perf_counter()
        mod = torch.jit.load(str(d / "model.pt")).eval()
        t2 = time.perf_counter()
        xt = torch.from_numpy(x)

        def run():
            with torch.no_grad():
                out = mod(xt)
            return (out[0] if isinstance(out, (tuple, list)) else out).numpy()
    else:
        raise SystemExit(f"unknown contender {contender}")
    y = run()
    t3 = time.perf_counter()
    for _ in range(50):  # every contender alike; pmx re-times its thread choice at runs 11-20 and 41-50
        run()
    times = []
    for _ in range(runs):
        s = time.perf_counter()
        run()
        times.append(time.perf_counter() - s)
    np.save(d / f"out_{contender}.npy", np.asarray(y))
    overhead = None
    if contender == "pmx":  # after the timed runs, so they are not disturbed
        from pmx.runtime.overhead import framework_overhead

        overhead = 100 * framework_overhead(sess, {name: x}, repeat=max(5, runs // 2)).overhead
    return dict(
        import_ms=(t1 - t0) * 1e3,
        load_ms=(t2 - t1) * 1e3,
        first_result_ms=(t3 - t0) * 1e3,
        steady_ms=float(np.median(times)) * 1e3,
        peak_rss_mb=peak_rss_mb(),
        overhead_pct=overhead,
    )


def peak_rss_mb():
    """VmHWM (reset at exec, unlike ru_maxrss, which a child inherits from its parent)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return None


def batch_worker(contender, model_dir, batches, runs, threads):
    """Other batch sizes than the compiled one: time of the first run at each new shape
    (pmx: re-plan + bind; onnxruntime: its own first-run cost) and steady throughput."""
    d = pathlib.Path(model_dir)
    x1 = np.load(d / "input.npy")
    if contender in ("pmx", "pmx-baseline"):
        from pmx.runtime import InferenceSession

        sess = InferenceSession(str(d / "model.pmx"), num_threads=threads)
    else:
        import onnxruntime as ort

        opts = ort.SessionOptions()
        opts.intra_op_num_threads = threads
        opts.inter_op_num_threads = 1
        sess = ort.InferenceSession(str(d / "model_dynamic.onnx"), opts, providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    sess.run(None, {name: x1})
    out = {}
    for b in batches:
        x = np.ascontiguousarray(np.repeat(x1, b, axis=0))
        t0 = time.perf_counter()
        sess.run(None, {name: x})
        first = time.perf_counter() - t0
        times = []
        for _ in range(runs):
            t0 = time.perf_counter()
            sess.run(None, {name: x})
            times.append(time.perf_counter() - t0)
        steady = float(np.median(times))
        out[b] = dict(first_ms=first * 1e3, steady_ms=steady * 1e3, images_per_s=b / steady)
    return out


def batch_table(results):
    lines = [
        "| model | batch | pmx first run ms | pmx steady ms | pmx img/s | ort first run ms | ort steady ms | ort img/s | pmx/ort img/s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, per in results.items():
        p, o = per.get("pmx", {}), per.get("onnxruntime", {})
        for b in sorted({int(k) for k in p} | {int(k) for k in o}):
            pr, orr = p.get(b) or p.get(str(b)) or {}, o.get(b) or o.get(str(b)) or {}
            ratio = pr.get("images_per_s", 0) / orr["images_per_s"] if orr.get("images_per_s") else None
            lines.append(
                f"| {model} | {b} | {fmt(pr.get('first_ms'))} | {fmt(pr.get('steady_ms'))} | "
                f"{fmt(pr.get('images_per_s'))} | {fmt(orr.get('first_ms'))} | {fmt(orr.get('steady_ms'))} | "
                f"{fmt(orr.get('images_per_s'))} | {fmt(ratio, 2)} |"
            )
    return "\n".join(lines)


# --- preparation (parent) ---------------------------------------------------------------


def builtin_models():
    import torch.nn as nn
    import torch.nn.functional as F

    class MiniResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, 2, 1, bias=False), nn.BatchNorm2d(32), nn.ReLU())
            self.blocks = nn.ModuleList(
                nn.Sequential(
                    nn.Conv2d(32, 32, 3, 1, 1, bias=False),
                    nn.BatchNorm2d(32),
                    nn.ReLU(),
                    nn.Conv2d(32, 32, 3, 1, 1, bias=False),
                    nn.BatchNorm2d(32),
                )
                for _ in range(3)
            )
            self.fc = nn.Linear(32, 10)

        def forward(self, x):
            x = self.stem(x)
            for b in self.blocks:
                x = F.relu(x + b(x))
            return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))

    class MiniMobileNet(nn.Module):
        def __init__(self):
            super().__init__()
            layers = [nn.Conv2d(3, 16, 3, 2, 1), nn.BatchNorm2d(16), nn.ReLU6()]
            c = 16
            for out, s in ((24, 2), (24, 1), (32, 2), (32, 1)):
                layers += [
                    nn.Conv2d(c, c * 4, 1),
                    nn.BatchNorm2d(c * 4),
                    nn.ReLU6(),
                    nn.Conv2d(c * 4, c * 4, 3, s, 1, groups=c * 4),
                    nn.BatchNorm2d(c * 4),
                    nn.ReLU6(),
                    nn.Conv2d(c * 4, out, 1),
                    nn.BatchNorm2d(out),
                ]
                c = out
            self.features = nn.Sequential(*layers)
            self.fc = nn.Linear(c, 10)

        def forward(self, x):
            return self.fc(F.adaptive_avg_pool2d(self.features(x), 1).flatten(1))

    class LSTM2(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(64, 128, num_layers=2, batch_first=True)
            self.fc = nn.Linear(128, 10)

        def forward(self, x):
            y, _ = self.lstm(x)
            return self.fc(y[:, -1])

    def block(cin, cout):
        return nn.Sequential(
            nn.Conv2d(cin, cout, 3, 1, 1),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1),
            nn.BatchNorm2d(cout),
            nn.ReLU(),
        )

    class UNetSmall(nn.Module):
        def __init__(self):
            super().__init__()
            self.down1, self.down2, self.mid = block(3, 16), block(16, 32), block(32, 64)
            self.up2, self.up1 = block(64 + 32, 32), block(32 + 16, 16)
            self.head = nn.Conv2d(16, 2, 1)

        def forward(self, x):
            d1 = self.down1(x)
            d2 = self.down2(F.max_pool2d(d1, 2))
            m = self.mid(F.max_pool2d(d2, 2))
            u2 = self.up2(torch.cat([F.interpolate(m, scale_factor=2.0, mode="nearest"), d2], 1))
            u1 = self.up1(torch.cat([F.interpolate(u2, scale_factor=2.0, mode="nearest"), d1], 1))
            return self.head(u1)

    def conv_silu(cin, cout, s=1):
        return nn.Sequential(nn.Conv2d(cin, cout, 3, s, 1, bias=False), nn.BatchNorm2d(cout), nn.SiLU())

    class YoloHead(nn.Module):
        """A YOLO-style neck and head: SiLU convs, an upsample, a concat, per-scale outputs."""

        def __init__(self):
            super().__init__()
            self.stem = nn.Sequential(conv_silu(3, 16, 2), conv_silu(16, 32, 2), conv_silu(32, 64, 2))
            self.down = conv_silu(64, 128, 2)
            self.fuse = conv_silu(128 + 64, 64)
            self.out_small, self.out_large = nn.Conv2d(64, 85, 1), nn.Conv2d(128, 85, 1)

        def forward(self, x):
            p3 = self.stem(x)
            p4 = self.down(p3)
            f = self.fuse(torch.cat([F.interpolate(p4, scale_factor=2.0, mode="nearest"), p3], 1))
            return self.out_small(f).sigmoid(), self.out_large(p4).sigmoid()

    class Transformer2(nn.Module):
        """Two pre-norm encoder layers, hidden 256, 4 heads, 32 tokens (a small BERT/GPT body)."""

        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(
                nn.ModuleDict(
                    dict(
                        n1=nn.LayerNorm(256),
                        qkv=nn.Linear(256, 768),
                        proj=nn.Linear(256, 256),
                        n2=nn.LayerNorm(256),
                        fc1=nn.Linear(256, 1024),
                        fc2=nn.Linear(1024, 256),
                    )
                )
                for _ in range(2)
            )

        def forward(self, x):
            b, t, e = x.shape
            for m in self.layers:
                q, k, v = m["qkv"](m["n1"](x)).view(b, t, 3, 4, e // 4).permute(2, 0, 3, 1, 4)
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + m["proj"](a.transpose(1, 2).reshape(b, t, e))
                x = x + m["fc2"](F.gelu(m["fc1"](m["n2"](x))))
            return x

    import torch

    return {
        "mini_resnet": (MiniResNet, (1, 3, 112, 112)),
        "mini_mobilenet": (MiniMobileNet, (1, 3, 112, 112)),
        "lstm2": (LSTM2, (1, 32, 64)),
        "unet_small": (UNetSmall, (1, 3, 128, 128)),
        "yolo_head": (YoloHead, (1, 3, 256, 256)),
        "transformer2": (Transformer2, (1, 32, 256)),
    }


# small models where per-node work is small and framework overhead shows (--small)
SMALL_MODELS = ("mobilenet_v3_small_050", "mnasnet0_5", "lstm2", "unet_small", "yolo_head", "transformer2")


def make_model(name):
    import torch

    torch.manual_seed(0)
    builtins = builtin_models()
    if name in builtins:
        cls, shape = builtins[name]
        return randomize_untrained(cls().eval()), shape
    import torchvision

    kwargs = {"weights": None}
    if name == "mobilenet_v3_small_050":
        name, kwargs["width_mult"] = "mobilenet_v3_small", 0.5
    if name == "googlenet":
        kwargs.update(aux_logits=False, init_weights=True)
    m = getattr(torchvision.models, name)(**kwargs).eval()
    return randomize_untrained(m), (1, 3, 224, 224)


# Bump when make_model's weights change: prepare() then exports again instead of reusing
# files made from other weights.
RECIPE = "2: randomize_untrained"


def randomize_untrained(model):
    """Seeded random values where torchvision's fresh models hold constants: all-zero
    parameters (ViT's classifier head is zero, so its output was exactly zero and the
    output check could not fail; every BatchNorm bias) and BatchNorm's initial statistics
    (mean 0, variance 1, which make the folding of BN into convs nearly the identity)."""
    import torch

    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() and not p.any():
                p.normal_(0.0, 0.02, generator=g)
        for mod in model.modules():
            if isinstance(mod, torch.nn.modules.batchnorm._BatchNorm) and mod.running_mean is not None:
                mod.running_mean.normal_(0.0, 0.1, generator=g)
                mod.running_var.uniform_(0.5, 1.5, generator=g)
    return model


def _has(module):
    import importlib.util

    return importlib.util.find_spec(module) is not None


def prepare(name, cache, tune=False):
    """Export once: pnnx (pmx + ncnn files), ONNX, TorchScript; compile .pmx; torch reference."""
    import contextlib
    import io

    import torch

    d = pathlib.Path(cache) / name
    d.mkdir(parents=True, exist_ok=True)
    stamp = d / "recipe.txt"
    if not stamp.exists() or stamp.read_text() != RECIPE:  # exported from other weights
        for f in d.iterdir():
            if f.is_file() and f.name.startswith("model"):
                f.unlink()
    model, shape = make_model(name)
    x = torch.rand(*shape, generator=torch.Generator().manual_seed(1))
    if not (d / "model.pnnx.param").exists():
        import pnnx

        cwd = os.getcwd()
        os.chdir(d)
        try:
            # no_grad: MHA takes its fast path, so the traces pnnx compares agree (ViT)
            with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
                pnnx.export(model, "model.pt", (x,))
        except SyntaxError:
            pass  # pnnx's generated model_pnnx.py is invalid for names like block1-0 (RegNet)
        finally:
            os.chdir(cwd)
    if _has("onnx"):  # onnxruntime's files; the test venv (--builtin) has no onnx
        if not (d / "model.onnx").exists():
            torch.onnx.export(
                model,
                (x,),
                str(d / "model.onnx"),
                dynamo=False,
                opset_version=17,
                input_names=["input"],
                output_names=["output"],
            )
        if not (d / "model_dynamic.onnx").exists():
            torch.onnx.export(
                model,
                (x,),
                str(d / "model_dynamic.onnx"),
                dynamo=False,
                opset_version=17,
                input_names=["input"],
                output_names=["output"],
                dynamic_axes={"input": {0: "batch"}, "output": {0: "batch"}},
            )
    with torch.no_grad():
        ref = model(x)
    np.save(d / "input.npy", x.numpy())
    np.save(d / "expected.npy", (ref[0] if isinstance(ref, (tuple, list)) else ref).numpy())
    stamp.write_text(RECIPE)
    return d, compile_pmx(d, tune)


def compile_command(d, output="model.pmx"):
    """`pmx compile` of the model in d into d / output, as a command for a fresh process."""
    param, weights = str(d / "model.pnnx.param"), str(d / "model.pnnx.bin")
    return [sys.executable, "-m", "pmx.compiler", param, weights, "-o", str(d / output)]


def compile_pmx(d, tune):
    """`pmx compile` in a fresh process, as a user runs it: --tune must not time kernels
    beside this process's torch, whose idle OpenMP threads spin after every torch call."""
    cmd = compile_command(d) + (["--tune"] if tune else [])
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=worker_env(2), timeout=3600)
    if p.returncode != 0:
        raise RuntimeError(f"pmx compile failed: {p.stdout.strip()[-200:]} {p.stderr.strip()[-200:]}")
    ops = next(line.split() for line in p.stdout.splitlines() if line.strip().startswith("ops"))
    return dict(compile_s=time.perf_counter() - t0, pnnx_ops=int(ops[1]), nodes=int(ops[5]))


BASELINE_PATH = None  # --baseline: where pmx-baseline's `pmx` package lies
PMX_BLAS_THREADS = None  # --pmx-blas-threads: BLAS's threads in pmx's processes


def worker_env(threads, contender=None):
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        OPENBLAS_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        NUMEXPR_MAX_THREADS=str(max(threads, 1)),
    )
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if contender in ("pmx", "pmx-baseline") and PMX_BLAS_THREADS is not None:
        env["OPENBLAS_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(PMX_BLAS_THREADS)
    if contender == "pmx-baseline":
        env["PYTHONPATH"] = os.pathsep.join(p for p in (BASELINE_PATH, env.get("PYTHONPATH")) if p)
    return env


def warm_bytecode(contender, threads):
    """One import in a throwaway process so the measured workers find .pyc files."""
    mod = {
        "pmx": "pmx.runtime",
        "pmx-baseline": "pmx.runtime",
        "onnxruntime": "onnxruntime",
        "ncnn": "ncnn",
        "torch": "torch",
    }[contender]
    subprocess.run(
        [sys.executable, "-c", f"import {mod}"], env=worker_env(threads, contender), capture_output=True, timeout=600
    )


def run_contender(contender, d, runs, threads):
    env = worker_env(threads, contender)
    p = subprocess.run(
        [sys.executable, __file__, "--worker", contender, str(d), "--runs", str(runs), "--threads", str(threads)],
        capture_output=True,
        text=True,
        env=env,
        timeout=1800,
    )
    if p.returncode != 0:
        return dict(error=(p.stderr.strip().splitlines() or ["failed"])[-1][:120])
    result = json.loads(p.stdout.strip().splitlines()[-1])
    expected = np.load(d / "expected.npy")
    got = np.load(d / f"out_{contender}.npy")
    if got.size == expected.size:
        got = got.reshape(expected.shape)
        result["rel_err"] = float(np.abs(got - expected).max() / max(np.abs(expected).max(), 1e-12))
    else:
        result["rel_err"] = None
    return result


METRICS = ("import_ms", "load_ms", "first_result_ms", "steady_ms", "peak_rss_mb", "overhead_pct")


def run_rounds(contenders, d, runs, threads, rounds):
    """Every contender in `rounds` fresh processes, taking turns (round r starts with
    contender r), so no contender always runs right after the same other one."""
    samples = {c: [] for c in contenders}
    for r in range(rounds):
        k = r % len(contenders)
        for c in contenders[k:] + contenders[:k]:
            samples[c].append(run_contender(c, d, runs, threads))
    return {c: median_of_rounds(s) for c, s in samples.items()}


def median_of_rounds(samples):
    """Per metric the median over the rounds; the worst output error of any round. A
    round that failed makes the contender's entry that failure."""
    failed = [s for s in samples if "error" in s]
    if failed:
        return dict(failed[0], failed_rounds=len(failed), rounds=len(samples))
    out = {k: float(np.median([s[k] for s in samples])) for k in METRICS if all(s.get(k) is not None for s in samples)}
    errs = [s["rel_err"] for s in samples if s.get("rel_err") is not None]
    out["rel_err"] = max(errs) if errs else None
    out["rounds"] = samples
    return out


def run_batches(contender, d, batches, runs, threads):
    env = worker_env(threads)
    p = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            contender,
            str(d),
            "--batches",
            batches,
            "--runs",
            str(runs),
            "--threads",
            str(threads),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    if p.returncode != 0:
        return {}
    return {int(k): v for k, v in json.loads(p.stdout.strip().splitlines()[-1]).items()}


def available(contender):
    if contender == "pmx-baseline":
        return BASELINE_PATH is not None
    mod = {"pmx": "pmx.runtime", "onnxruntime": "onnxruntime", "ncnn": "ncnn", "torch": "torch"}[contender]
    try:
        __import__(mod)
        return True
    except ImportError:
        return False


def host_probe():
    """ms of a fixed workload on this process's thread, median of 3: np.exp over 1M
    float32 (compute) and a 32 MB copy (memory). Taken before each model, it shows when
    the host itself ran slow: this shared VM has hours in which everything runs 20-60%
    slower, and a contender's ratios are only comparable within one run."""
    x = np.linspace(-4, 4, 1 << 20, dtype=np.float32)
    big = np.ones(8 << 20, np.float32)
    out, copy = np.empty_like(x), np.empty_like(big)
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(4):
            np.exp(x, out=out)
        np.copyto(copy, big)
        times.append((time.perf_counter() - t0) * 1e3)
    return float(np.median(times))


def cpu_description():
    """CPU model and last-level cache, so tables from different machines are not
    compared as if they came from one (the cloud VMs this ran on differed run to run)."""
    first_cpu = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if not line.strip():
                    break
                key, _, value = line.partition(":")
                first_cpu[key.strip()] = value.strip()
    except OSError:
        return platform.processor()
    text = first_cpu.get("model name", platform.processor())
    if "cpu family" in first_cpu:
        text += f" (family {first_cpu['cpu family']} model {first_cpu.get('model', '?')})"
    try:
        with open("/sys/devices/system/cpu/cpu0/cache/index3/size") as f:
            text += f", L3 {f.read().strip()}"
    except OSError:
        pass
    return text


def versions():
    out = {
        "python": platform.python_version(),
        "machine": f"{platform.machine()} {os.cpu_count()} cpus",
        "cpu": cpu_description(),
    }
    for mod in ("numpy", "numexpr", "torch", "onnxruntime", "ncnn"):
        try:
            out[mod] = __import__(mod).__version__
        except (ImportError, AttributeError):
            pass
    return out


def fmt(v, digits=1):
    return "-" if v is None else f"{v:.{digits}f}"


def table(results):
    lines = [
        "| model | runtime | import ms | load ms | first result ms | steady ms | x ort (steady) | x ort (load) | "
        "x ort (first) | peak RSS MB | rel err | framework overhead % |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for model, per in results.items():
        ort = per.get("onnxruntime", {})
        for c in CONTENDERS:
            r = per.get(c)
            if r is None:
                continue
            if "error" in r:
                lines.append(f"| {model} | {c} | error: {r['error']} ||||||||||")
                continue
            rs = r["steady_ms"] / ort["steady_ms"] if ort.get("steady_ms") else None
            rl = r["load_ms"] / ort["load_ms"] if ort.get("load_ms") else None
            rf = r["first_result_ms"] / ort["first_result_ms"] if ort.get("first_result_ms") else None
            err = f"{r['rel_err']:.1e}" if r.get("rel_err") is not None else "-"
            lines.append(
                f"| {model} | {c} | {fmt(r.get('import_ms'))} | {fmt(r.get('load_ms'))} | {fmt(r.get('first_result_ms'))} | "
                f"{fmt(r.get('steady_ms'), 2)} | {fmt(rs, 2)} | {fmt(rl, 3)} | {fmt(rf, 2)} | "
                f"{fmt(r.get('peak_rss_mb'), 0)} | {err} | {fmt(r.get('overhead_pct'))} |"
            )
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--worker", nargs=2, metavar=("CONTENDER", "DIR"))
    p.add_argument("--models", default=None, help="comma-separated torchvision model names")
    p.add_argument("--builtin", action="store_true", help="only the small built-in models (no torchvision)")
    p.add_argument("--small", action="store_true", help="the small-model set (SMALL_MODELS; needs torchvision)")
    p.add_argument("--contenders", default=",".join(CONTENDERS))
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--rounds", type=int, default=3, help="fresh processes per contender; medians are reported")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", default="/tmp/pmx_bench")
    p.add_argument("--json", default=None)
    p.add_argument("--batches", default=None, help="e.g. 1,8,32: throughput at these batch sizes (pmx vs onnxruntime)")
    p.add_argument(
        "--pmx-blas-threads",
        type=int,
        default=None,
        metavar="N",
        help="OPENBLAS_NUM_THREADS in pmx's processes (default: --threads, as for the others). "
        "It sets numpy's BLAS only: pmx's own BLAS runs at one thread whatever it is, and pmx "
        "splits GEMMs over the session's threads itself",
    )
    p.add_argument(
        "--baseline",
        default=None,
        metavar="DIR",
        help="also run contender pmx-baseline: pmx imported from DIR (a folder holding another "
        "checkout's pmx package), on the same .pmx files, alternating with pmx",
    )
    p.add_argument("--tune", action="store_true", help="compile the .pmx files with pmx compile --tune")
    args = p.parse_args()
    if args.worker and args.batches:
        batches = [int(b) for b in args.batches.split(",")]
        print(json.dumps(batch_worker(args.worker[0], args.worker[1], batches, args.runs, args.threads)))
        return
    if args.worker:
        print(json.dumps(worker(args.worker[0], args.worker[1], args.runs, args.threads)))
        return
    if args.builtin:
        names = list(builtin_models())
    elif args.small:
        names = list(SMALL_MODELS)
    elif args.models:
        names = args.models.split(",")
    else:
        names = list(TORCHVISION_CNNS) + ["vit_b_16"]
    global BASELINE_PATH, PMX_BLAS_THREADS
    BASELINE_PATH, PMX_BLAS_THREADS = args.baseline, args.pmx_blas_threads
    contenders = [c for c in args.contenders.split(",") if available(c)]
    for c in contenders:
        warm_bytecode(c, args.threads)
    results, meta, probes = {}, {}, {}
    for name in names:
        probes[name] = host_probe()
        try:
            d, info = prepare(name, args.cache, tune=args.tune)
        except Exception as e:  # report and go on with the next model
            results[name] = {"pmx": {"error": f"prepare: {type(e).__name__}: {str(e)[:100]}"}}
            continue
        meta[name] = info
        if args.batches:
            results[name] = {
                c: run_batches(c, d, args.batches, args.runs, args.threads)
                for c in contenders
                if c in ("pmx", "onnxruntime")
            }
        else:
            results[name] = run_rounds(contenders, d, args.runs, args.threads, args.rounds)
        print(f"{name}: done", file=sys.stderr)
    blas = "" if args.pmx_blas_threads is None else f" · pmx with BLAS on {args.pmx_blas_threads} thread(s)"
    print(
        f"\n{time.strftime('%Y-%m-%d')} · {' · '.join(f'{k} {v}' for k, v in versions().items())} · {args.threads} threads"
        + blas
        + ("" if args.batches else f" · medians of {args.rounds} fresh processes per contender")
        + "\n"
    )
    print(batch_table(results) if args.batches else table(results))
    print("\nhost probe before each model (host_probe, ms): " + ", ".join(f"{k} {v:.1f}" for k, v in probes.items()))
    if args.json:
        pathlib.Path(args.json).write_text(
            json.dumps(dict(versions=versions(), compile=meta, host_probe_ms=probes, results=results), indent=1)
        )


if __name__ == "__main__":
    main()
