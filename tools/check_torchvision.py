"""Compile real torchvision models with pmx and compare them with torch.

Run in the torchvision venv (torch + torchvision + pnnx, pmx installed editable):

    python tools/check_torchvision.py [--models resnet18,googlenet] [--batch 1]

Each model is built with random weights (weights=None, fixed seed; random batch-norm
statistics; zero-initialized heads made non-zero), exported with pnnx at Bx3x224x224
(exports are cached in /tmp/tv_exports/<model>_b<B>, so re-runs only recompile; delete
a folder after changing how its model is built), compiled, run, and compared with torch
(max|pmx - torch| / max|torch| <= 1e-4). Errors are caught per model; a markdown table
is printed at the end. Exit status 1 when a CNN-family model fails.
"""

import argparse
import contextlib
import io
import os
import pathlib
import sys
import time
import traceback

import numpy as np

CNN = [
    "resnet18",
    "mobilenet_v2",
    "mobilenet_v3_small",
    "mobilenet_v3_large",
    "shufflenet_v2_x1_0",
    "squeezenet1_1",
    "densenet121",
    "googlenet",
    "efficientnet_b0",
    "regnet_x_400mf",
    "regnet_y_400mf",
]
# Need attention, layer norm, roll and resampling besides the CNN ops.
OTHER = ["vit_b_16", "swin_t", "convnext_tiny", "lraspp_mobilenet_v3_large"]
TOL = 1e-4
EXPORT_ROOT = pathlib.Path("/tmp/tv_exports")


def build(name):
    import torch
    import torchvision

    torch.manual_seed(0)
    if name == "lraspp_mobilenet_v3_large":
        model = torchvision.models.segmentation.lraspp_mobilenet_v3_large(weights=None, weights_backbone=None)
    elif name == "googlenet":
        model = torchvision.models.googlenet(weights=None, aux_logits=False, init_weights=True)
    elif name == "inception_v3":
        model = torchvision.models.inception_v3(weights=None, aux_logits=False, init_weights=True)
    else:
        model = torchvision.models.get_model(name, weights=None)
    _randomize_batchnorm(model)
    _unzero_heads(model)
    return model.eval()


def _unzero_heads(model):
    """ViT zero-initializes its classifier, which would make every output 0 and the
    comparison vacuous."""
    import torch

    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d)) and not m.weight.any():
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.02)


def _randomize_batchnorm(model):
    """Fresh BN layers are identities (mean 0, var 1); random statistics make the check
    exercise batch-norm folding."""
    import torch

    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) * 0.5 + 0.75)


def traceable(name, model):
    """Segmentation models return a dict; pnnx traces tensors only."""
    import torch

    if name != "lraspp_mobilenet_v3_large":
        return model

    class Out(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x):
            return self.m(x)["out"]

    return Out(model).eval()


def export(name, model, x):
    """pnnx export into EXPORT_ROOT/name (skipped when the files are already there)."""
    import pnnx
    import torch

    d = EXPORT_ROOT / f"{name}_b{x.shape[0]}"
    prefix = d / "model"
    if (d / "model.pnnx.param").exists() and (d / "model.pnnx.bin").exists():
        return str(prefix)
    d.mkdir(parents=True, exist_ok=True)
    cwd = os.getcwd()
    try:
        os.chdir(d)  # pnnx writes side files into the working directory
        with torch.no_grad(), contextlib.redirect_stdout(io.StringIO()):
            pnnx.export(model, str(d / "model.pt"), (x,))
    except SyntaxError:
        # pnnx re-imports the model_pnnx.py it generated, which is invalid Python when
        # module names contain '-' (RegNet's block1-0); the .param/.bin are fine.
        pass
    finally:
        os.chdir(cwd)
    if not (d / "model.pnnx.param").exists() or not (d / "model.pnnx.bin").exists():
        raise RuntimeError("pnnx wrote no .pnnx.param/.pnnx.bin")
    return str(prefix)


def timed(fn, seconds=0.6, least=5, most=60):
    """Median ms of fn() over `least` to `most` runs, about `seconds` of them, after
    warm-up runs (at least 3, about a fifth as long): the statistic tools/bench.py
    reports, where this used to take the best of 3 runs after one warm-up."""
    start = time.perf_counter()
    warm = 0
    while warm < 3 or time.perf_counter() - start < seconds / 5:
        fn()
        warm += 1
    times = []
    start = time.perf_counter()
    while len(times) < least or (len(times) < most and time.perf_counter() - start < seconds):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return float(np.median(times)) * 1000


def check(name, batch=1):
    import torch

    from pmx.compiler.driver import compile_model
    from pmx.runtime import InferenceSession

    row = dict(model=name, ops="", compile="", status="", err="", pmx_ms="", torch_ms="")
    stage = "build"
    try:
        model = traceable(name, build(name))
        x = torch.rand(batch, 3, 224, 224, generator=torch.Generator().manual_seed(2)) * 2 - 1
        stage = "export"
        prefix = export(name, model, x)
        stage = "compile"
        out_path = f"{prefix}.pmx"
        t = time.perf_counter()
        res = compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", out_path)
        row["compile"] = f"{time.perf_counter() - t:.2f}"
        row["ops"] = f"{res.ops_in} -> {res.ops_out}"
        stage = "run"
        sess = InferenceSession(out_path)
        feed = {sess.get_inputs()[0].name: x.numpy()}
        got = sess.run(None, feed)[0]
        with torch.no_grad():
            want = model(x)
        want = want.numpy()
        if got.shape != want.shape:
            raise AssertionError(f"output shape {got.shape} != torch {want.shape}")
        err = float(np.abs(got.astype(np.float64) - want).max() / max(np.abs(want).max(), 1e-12))
        row["err"] = f"{err:.2e}"
        row["status"] = "ok" if err <= TOL else f"MISMATCH (> {TOL})"
        row["pmx_ms"] = f"{timed(lambda: sess.run(None, feed)):.1f}"
        with torch.no_grad():
            row["torch_ms"] = f"{timed(lambda: model(x)):.1f}"
    except Exception as e:  # keep going: one row per model
        msg = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
        row["status"] = f"{stage} error: {msg[:300]}"
        if os.environ.get("PMX_TV_TRACEBACK"):
            traceback.print_exc()
    return row


def table(rows):
    lines = [
        "| model | pnnx ops -> pmx nodes | compile s | status | rel err | pmx ms | torch ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['ops']} | {r['compile']} | {r['status']} | {r['err']} | {r['pmx_ms']} | {r['torch_ms']} |"
        )
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help="comma-separated torchvision model names (default: all)")
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args(argv)
    names = args.models.split(",") if args.models else CNN + OTHER
    rows = []
    for name in names:
        row = check(name.strip(), args.batch)
        print(f"{row['model']}: {row['status']} {row['err']}", file=sys.stderr, flush=True)
        rows.append(row)
    print(table(rows))
    # timings are only comparable on an idle machine; say how busy this one was
    print(
        f"\n(load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; times are medians of 5-60 runs after warm-up, eager torch)"
    )
    cnn_failed = [r["model"] for r in rows if r["model"] in CNN and r["status"] != "ok"]
    return 1 if cnn_failed else 0


if __name__ == "__main__":
    sys.exit(main())
