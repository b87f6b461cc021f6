"""tune (`pmx compile --tune`): time each node's candidate kernels on this machine and
store the fastest as the node's variant.

Candidates come from the kernel families (conv: gemm / depthwise lowering, each with and
without the split over threads; elementwise: numpy / numexpr backends, numpy with and
without the split). Each candidate is bound exactly as the runtime binds it, on private
buffers of the node's planned shapes (constants are the real weights, other inputs
seeded random data), warmed up, then timed; the median of TUNE_REPEATS runs decides.
A candidate that raises is skipped. Nodes with one candidate are left to the rule in
choose_kernels. The threads are the runtime's default (the cores this process may use),
so tune on the machine the model will run on.

Without --tune this pass does nothing: the rule in choose_kernels picks.
"""

import time

import numpy as np

from pmx.runtime import parallel
from pmx.runtime.kernels import conv, elementwise, get

TUNE_REPEATS = 7
TUNE_WARMUP = 2


def candidates(node):
    if node.op == "conv" and len(node.inputs) > 1 and node.inputs[1] is not None:
        return conv.variants(node, node.inputs[1].shape)
    if node.op == "elementwise":
        return elementwise.variants(node)
    return []


def tune(graph) -> bool:
    if not getattr(graph, "tune", False):
        return False
    report = graph.tune_report = []
    rng = np.random.default_rng(0)
    with parallel.blas_single_threaded():
        for node in graph.nodes:
            options = candidates(node)
            if len(options) < 2:
                continue
            times = {v: _time_variant(node, v, rng) for v in options}
            times = {v: t for v, t in times.items() if t is not None}
            if times:
                chosen = min(times, key=times.get)
                report.append((node, node.variant, chosen, times))
                node.variant = chosen
    return False


def _operands(node, rng):
    ins = []
    for v in node.inputs:
        if v is None:
            ins.append(None)
        elif v.is_constant:
            ins.append(np.asarray(v.data))
        elif np.dtype(v.dtype).kind == "f":
            ins.append(rng.standard_normal(v.shape).astype(v.dtype))
        else:
            ins.append(np.zeros(v.shape, v.dtype))  # indices: 0 is valid for any gather
    outs = [np.empty(v.shape, v.dtype) for v in node.outputs]
    return ins, outs


def _time_variant(node, variant, rng):
    before = node.variant
    node.variant = variant
    try:
        ins, outs = _operands(node, rng)
        run = get(node.op).make(node, ins, outs)
        if run is None:
            return None
        with np.errstate(all="ignore"):
            for _ in range(TUNE_WARMUP):
                run()
            samples = []
            for _ in range(TUNE_REPEATS):
                t0 = time.perf_counter()
                run()
                samples.append(time.perf_counter() - t0)
        return float(np.median(samples))
    except Exception:  # noqa: BLE001 - a candidate that cannot run is not chosen
        return None
    finally:
        node.variant = before


def format_report(report, limit=None):
    """Rows 'node  op  rule -> chosen  candidate ms ...' for the CLI, biggest gains first."""
    rows = []
    for node, rule, chosen, times in report:
        gain = times.get(rule, times[chosen]) - times[chosen]
        cands = "  ".join(f"{v}={t * 1e3:.3f}" for v, t in sorted(times.items(), key=lambda kv: kv[1]))
        rows.append((gain, f"  {node.name[:32]:32} {node.op:12} {rule or '-':>10} -> {chosen:12} {cands}"))
    rows.sort(key=lambda r: -r[0])
    return [r for _, r in rows[:limit]]
