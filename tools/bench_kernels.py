"""Kernel-level GEMM throughput: pmx's matmul-heavy kernels against the plain GEMM numpy
reaches on the same shapes.

    python tools/bench_kernels.py                  # every row
    python tools/bench_kernels.py --only linear,attention --runs 41

Each pmx row builds its kernel as the runtime binds it, registry.get(op).make(node, inputs,
outputs, ctx), every row over one pool of the default thread count: outputs preallocated
as arena views would be, weights read-only as the mmap's views are. The callable is what
gets timed, as an InferenceSession's run() calls it: bound with
BLAS on one thread (run it with OPENBLAS_NUM_THREADS=1 for pmx's own GEMM splits) and the
kernel splitting its work over pmx's threads. The reference is np.matmul(a, b, out=c) with BLAS on its default
threads, over C-contiguous float32 operands with the same M, N, K and batch; for kernels that need
more than one GEMM (attention: QK^T and PV; conv: the GEMM after im2col, also for the
Winograd rows, which count the direct conv's FLOPs) the reference is
the sum of those GEMMs; a depthwise conv's reference is the batched GEMV (C, 1, k*k) @
(C, k*k, positions) its lowering runs. Both sides count the same FLOPs (2 M N K per GEMM), so bias,
activation epilogues, softmax and im2col are overhead the pmx side pays. The attention
kernel does not include the projections: a compiled nn.MultiheadAttention runs them as
the linear rows (qkv, out_proj).

Timing: pmx and reference are sampled in alternating rounds (so drifting load from other
jobs hits both alike), each round after a warm-up of WARMUP_S (longer than OpenBLAS's idle
threads spin after a multi-threaded call, so the reference's threads are asleep when pmx
runs, as in an InferenceSession); a sample is the mean over enough back-to-back calls to last
--sample-ms (short, so a stall from another process spoils few samples); the table shows
the median of --runs samples (--stat min: the fastest sample, for a machine where other
jobs stall BLAS's threads so often that medians measure the stalls). BLAS threads are
whatever the environment gives (OPENBLAS_NUM_THREADS, default = one per core). The
header and footer give the load and Linux's CPU pressure (share of the last 10 s in which
runnable tasks waited for a core): a table taken under pressure over a few percent is
noise.
"""

import argparse
import math
import os
import platform
import time
from dataclasses import dataclass, field

import numpy as np

from pmx.compiler.canon.activation import gelu_expr
from pmx.runtime.kernels.bind import BindContext
from pmx.runtime.kernels.registry import get
from pmx.runtime.kernels.winograd import transform_weights

ROUNDS = 3
WARMUP_S = 0.2


@dataclass
class Node:
    """What a kernel factory reads from a node."""

    op: str
    attrs: dict = field(default_factory=dict)
    expr: str = ""
    variant: str = ""
    name: str = "bench"


@dataclass
class Case:
    group: str  # linear | matmul | attention | conv | depthwise
    label: str
    node: Node
    inputs: list  # arrays; weights are made read-only
    gemms: list  # [(a_shape, b_shape)] the reference multiplies


RNG = np.random.default_rng(0)


def rand(*shape, scale=1.0):
    return RNG.standard_normal(shape, dtype=np.float32) * np.float32(scale)


def weight(*shape):
    """Read-only as the mmap's views are; [out, *fan_in] scaled by 1/sqrt(fan-in) as torch
    initializes layers (a bias keeps unit scale), so outputs stay near unit variance, the
    range activations and softmax see in a trained model (elementwise timings depend on
    it: exp and erfc of huge arguments take slower paths)."""
    w = rand(*shape, scale=1 / math.sqrt(math.prod(shape[1:])))
    w.flags.writeable = False
    return w


def linear(label, x_shape, n_out, expr=""):
    *lead, k = x_shape
    m = math.prod(lead)
    node = Node("linear", expr=expr)
    inputs = [rand(*x_shape), weight(n_out, k), weight(n_out)]
    return Case("linear", label, node, inputs, [((m, k), (k, n_out))])


def matmul(label, a_shape, b_shape):
    inputs = [rand(*a_shape), rand(*b_shape)]
    return Case("matmul", label, Node("matmul"), inputs, [(a_shape, b_shape)])


def vit_mha(label, n, length, embed, heads):
    """nn.MultiheadAttention(batch_first=True) as compiled: one packed qkv input, with
    1/sqrt(head_dim) folded into the q projection."""
    d = embed // heads
    qkv = rand(n, length, 3 * embed)
    qkv[..., :embed] /= math.sqrt(d)
    attrs = dict(
        heads=heads,
        seq_axis=1,
        scale=1.0,
        causal=0,
        masks=(),
        mask_roles=(),
        weights="none",
        masked_rows="nan",
        packed="qkv",
    )
    gemms = attention_gemms(n * heads, length, d)
    return Case("attention", label, Node("attention", attrs), [qkv], gemms)


def sdpa(label, n, heads, length, d):
    """F.scaled_dot_product_attention on [N, H, L, d] tensors."""
    attrs = dict(heads=0, scale=1.0 / math.sqrt(d), causal=0, masks=(), masked_rows="zero", gqa=0)
    inputs = [rand(n, heads, length, d) for _ in range(3)]
    gemms = attention_gemms(n * heads, length, d)
    return Case("attention", label, Node("attention", attrs), inputs, gemms)


def attention_gemms(batch, length, d):
    """QK^T and PV."""
    return [((batch, length, d), (batch, d, length)), ((batch, length, length), (batch, length, d))]


def conv(label, cin, size, cout, k, stride=1, pad=None):
    pad = k // 2 if pad is None else pad
    out = (size + 2 * pad - k) // stride + 1
    attrs = dict(stride=(stride, stride), pads=(pad,) * 4, dilation=(1, 1), groups=1, padding_mode="zeros")
    inputs = [rand(1, cin, size, size), weight(cout, cin, k, k), weight(cout)]
    gemms = [((cout, cin * k * k), (cin * k * k, out * out))]
    return Case("conv", label, Node("conv", attrs, variant="gemm"), inputs, gemms)


def winograd(label, cin, size, cout):
    """The same 3x3 conv as Winograd F(2x2, 3x3) (conv_winograd, weights transformed as
    prepack_weights stores them). Its reference is the direct conv's im2col GEMM, so the
    row says how it compares with the GEMM the direct lowering needs (over 100%: faster)."""
    attrs = dict(pads=(1,) * 4)
    u = transform_weights(weight(cout, cin, 3, 3))
    u.flags.writeable = False
    inputs = [rand(1, cin, size, size), u, weight(cout)]
    gemms = [((cout, cin * 9), (cin * 9, size * size))]
    return Case("conv", label, Node("conv_winograd", attrs, variant="winograd"), inputs, gemms)


def depthwise(label, c, size, k, stride=1):
    """A depthwise conv (groups = channels) as MobileNets and EfficientNet have them. Its
    GEMMs are the C GEMVs (1, k*k) @ (k*k, out positions) the depthwise lowering runs
    (over slightly wider rows: see runtime/kernels/conv.py)."""
    pad = k // 2
    out = (size + 2 * pad - k) // stride + 1
    attrs = dict(stride=(stride, stride), pads=(pad,) * 4, dilation=(1, 1), groups=c, padding_mode="zeros")
    inputs = [rand(1, c, size, size), weight(c, 1, k, k), weight(c)]
    gemms = [((c, 1, k * k), (c, k * k, out * out))]
    return Case("depthwise", label, Node("conv", attrs, variant="depthwise"), inputs, gemms)


def cases():
    gelu = gelu_expr()
    return [
        linear("resnet18 fc 1x512->1000", (1, 512), 1000),
        linear("mobilenet_v2 fc 1x1280->1000", (1, 1280), 1000),
        linear("resnet18 fc 8x512->1000", (8, 512), 1000),
        linear("mobilenet_v2 fc 8x1280->1000", (8, 1280), 1000),
        linear("ViT-B/16 qkv 197x768->2304", (1, 197, 768), 2304),
        linear("ViT-B/16 out_proj 197x768->768", (1, 197, 768), 768),
        linear("ViT-B/16 mlp1 197x768->3072 +GELU", (1, 197, 768), 3072, gelu),
        linear("ViT-B/16 mlp2 197x3072->768", (1, 197, 3072), 768),
        matmul("(12,197,64)@(12,64,197)", (12, 197, 64), (12, 64, 197)),
        matmul("(12,197,197)@(12,197,64)", (12, 197, 197), (12, 197, 64)),
        matmul("(512,512)@(512,512)", (512, 512), (512, 512)),
        vit_mha("ViT-B/16 MHA core L=197 E=768 H=12", 1, 197, 768, 12),
        sdpa("SDPA (1,12,197,64)", 1, 12, 197, 64),
        conv("resnet18 64x56x56 3x3 ->64", 64, 56, 64, 3),
        conv("resnet18 128x28x28 3x3 ->128", 128, 28, 128, 3),
        conv("resnet18 256x14x14 3x3 ->256", 256, 14, 256, 3),
        conv("resnet18 512x7x7 3x3 ->512", 512, 7, 512, 3),
        winograd("winograd 64x56x56 3x3 ->64", 64, 56, 64),
        winograd("winograd 128x28x28 3x3 ->128", 128, 28, 128),
        winograd("winograd 256x14x14 3x3 ->256", 256, 14, 256),
        winograd("winograd densenet 128x28x28 3x3 ->32", 128, 28, 32),
        conv("1x1 64x56x56 ->256", 64, 56, 256, 1),
        depthwise("mobilenet_v2 32x112x112 3x3", 32, 112, 3),
        depthwise("mobilenet_v2 96x112x112 3x3 s2", 96, 112, 3, 2),
        depthwise("mobilenet_v2 144x56x56 3x3", 144, 56, 3),
        depthwise("mobilenet_v2 384x14x14 3x3", 384, 14, 3),
        depthwise("mobilenet_v2 960x7x7 3x3", 960, 7, 3),
        depthwise("mobilenet_v3_small 240x14x14 5x5", 240, 14, 5),
        depthwise("mobilenet_v3_small 576x7x7 5x5", 576, 7, 5),
        depthwise("efficientnet_b0 240x28x28 5x5 s2", 240, 28, 5, 2),
        depthwise("efficientnet_b0 1152x7x7 5x5", 1152, 7, 5),
    ]


def bind(case, ctx):
    """The kernel callable, made as the runtime makes it (over ctx's pool)."""
    kernel = get(case.node.op)
    specs = kernel.infer(case.node, [x.shape for x in case.inputs], [x.dtype for x in case.inputs])
    outputs = [np.empty(shape, dtype) for shape, dtype in specs]
    return kernel.make(case.node, case.inputs, outputs, ctx)


def reference(case):
    """The GEMMs numpy runs for the same work, each into a preallocated output."""
    calls = []
    for a_shape, b_shape in case.gemms:
        a, b = rand(*a_shape), rand(*b_shape)
        batch = np.broadcast_shapes(a_shape[:-2], b_shape[:-2])
        c = np.empty(batch + (a_shape[-2], b_shape[-1]), np.float32)
        calls.append((a, b, c))

    def run():
        for a, b, c in calls:
            np.matmul(a, b, out=c)

    return run


def flops(case):
    total = 0
    for a_shape, b_shape in case.gemms:
        batch = math.prod(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]))
        total += 2 * batch * a_shape[-2] * a_shape[-1] * b_shape[-1]
    return total


def calls_per_sample(fn, sample_s):
    t0 = time.perf_counter()
    fn()
    one = max(time.perf_counter() - t0, 1e-7)
    return max(1, round(sample_s / one))


def sample(fn, calls):
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls


def samples(fn, n, sample_s):
    warm_end = time.perf_counter() + WARMUP_S
    while time.perf_counter() < warm_end:
        fn()
    calls = calls_per_sample(fn, sample_s)
    return [sample(fn, calls) for _ in range(n)]


def measure(pmx, ref, runs, sample_s, stat=np.median):
    """Seconds per call of the pmx kernel (as an InferenceSession's run() calls it)
    and of the reference (BLAS on its default threads): `stat` over `runs` samples each."""
    pmx_samples, ref_samples = [], []
    for _ in range(ROUNDS):
        pmx_samples += samples(pmx, max(1, runs // ROUNDS), sample_s)
        ref_samples += samples(ref, max(1, runs // ROUNDS), sample_s)
    return float(stat(pmx_samples)), float(stat(ref_samples))


def machine_load():
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    try:
        with open("/proc/pressure/cpu") as f:
            pressure = f.readline().split()[1].removeprefix("avg10=") + "%"
    except OSError:
        pressure = "n/a"
    return f"load average {load}, CPU pressure (10 s) {pressure}"


def header(args, ctx):
    threads = os.environ.get("OPENBLAS_NUM_THREADS") or f"default ({os.cpu_count()} cores)"
    return (
        f"numpy {np.__version__}, {platform.machine()} {os.cpu_count()} cores, "
        f"BLAS threads: {threads}, {machine_load()}\n"
        f"{args.stat} of {args.runs} samples per side and row, in {ROUNDS} alternating rounds "
        f"after warm-ups, each sample the mean of back-to-back calls lasting "
        f"~{args.sample_ms:g} ms; pmx as in an InferenceSession's run() (pmx splits over "
        f"{ctx.threads} threads), numpy with BLAS's own threads; float32; GFLOP/s "
        f"count 2*M*N*K per GEMM on both sides\n"
    )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=99, help="samples per side and row")
    p.add_argument("--sample-ms", type=float, default=1.0, help="length of one sample")
    p.add_argument("--stat", choices=("median", "min"), default="median", help="statistic over the samples")
    p.add_argument("--only", default="", help="comma-separated groups: linear,matmul,attention,conv,depthwise")
    args = p.parse_args()
    groups = set(filter(None, args.only.split(",")))
    ctx = BindContext()
    print(header(args, ctx))
    print("| op | shape | pmx ms | numpy GEMM ms | GFLOP/s pmx | GFLOP/s numpy | pmx/numpy throughput % |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for case in cases():
        if groups and case.group not in groups:
            continue
        with np.errstate(all="ignore"):
            pmx_s, ref_s = measure(
                bind(case, ctx), reference(case), args.runs, args.sample_ms / 1e3, getattr(np, args.stat)
            )
        gflop = flops(case) / 1e9
        print(
            f"| {case.group} | {case.label} | {pmx_s * 1e3:.3f} | {ref_s * 1e3:.3f} "
            f"| {gflop / pmx_s:.1f} | {gflop / ref_s:.1f} | {100 * ref_s / pmx_s:.0f} |",
            flush=True,
        )
    print(f"\nafter: {machine_load()}")


if __name__ == "__main__":
    main()
