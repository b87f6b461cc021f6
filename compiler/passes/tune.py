"""tune (`pmx compile --tune`): time each node's candidate kernels on this machine and
store the fastest as the node's variant.

Candidates come from the kernel families (conv: gemm / depthwise / Winograd lowering,
Winograd timed on the weights prepack_weights will store; elementwise: numpy / numexpr
backends). Each candidate is bound exactly as the runtime binds it, on private
buffers of the node's planned shapes (constants are the real weights, other inputs
seeded random data), warmed up, then timed in alternating rounds; the median of
TUNE_ROUNDS x TUNE_REPEATS runs decides, and the rule's choice stays unless another
candidate beats it by more than TUNE_MARGIN, overall and in every round.
A candidate that raises is skipped. Nodes with one candidate are left to the rule in
choose_kernels. The threads are the runtime's default (the cores this process may use),
so tune on the machine the model will run on.

Without --tune this pass does nothing: the rule in choose_kernels picks.

Whether a node splits over the threads is not a candidate: the kernels' size thresholds
decide (GEMM_SPLIT_MIN_MACS, DEPTHWISE_SPLIT_MIN_ELEMENTS). Timed alone, a node's split
often looked slower than one thread (ShuffleNetV2's 24->58 1x1 conv at 56x56), while
inside the model the same split was faster: there its input was just written by a split
producer, half in each core's cache. Tune chose one thread for 36 of ShuffleNetV2's 56
nodes and 11 of SqueezeNet's 26, and whole runs got slower than when tune chose among
lowerings only, on all seven models measured (docs/performance.md, "Kernel measurements").
"""

import time

import numpy as np

from pmx.compiler.passes.prepack_weights import WINOGRAD, packed, winograd_applies
from pmx.runtime.kernels.bind import BindContext
from pmx.runtime.kernels.registry import get

TUNE_MARGIN = 0.05  # a candidate must beat the rule's choice by more than this
TUNE_ROUNDS = 3
TUNE_REPEATS = 3
TUNE_WARMUP = 2


def candidates(node):
    """The variants to time: those the op's kernel offers (registry `variants`), and
    Winograd where it applies (a variant the compiler makes by repacking the weights)."""
    offer = get(node.op).variants
    if offer is None:
        return []
    found = list(offer(node, [None if v is None else v.shape for v in node.inputs]))
    return found + [WINOGRAD] if winograd_applies(node) else found


def tune(graph, ctx):
    if not ctx.options.tune:
        return
    report = ctx.tune_report
    rng = np.random.default_rng(0)
    bind = BindContext()  # one pool of the default thread count for every candidate
    for node in graph.nodes:
        options = candidates(node)
        if len(options) < 2:
            continue
        times, rounds = _time_candidates(node, options, rng, bind)
        if times:
            chosen = _choose(times, node.variant, rounds)
            report.append((node, node.variant, chosen, times, rounds))
            node.variant = chosen


def _choose(times, rule, rounds=None):
    """The fastest candidate, unless the rule's own choice is within TUNE_MARGIN of it
    overall or in any one round (`rounds`: per candidate, its median in each round): on a
    shared machine a burst of load can make one candidate look faster for a while, and
    the rule's choice is the measured default. A candidate replaces it only by winning
    by the margin every time it was compared."""
    best = min(times, key=times.get)
    if rule not in times or best == rule:
        return best

    def beats(t_best, t_rule):
        return t_best * (1 + TUNE_MARGIN) < t_rule

    if not beats(times[best], times[rule]):
        return rule
    if rounds and not all(beats(b, r) for b, r in zip(rounds[best], rounds[rule])):
        return rule
    return best


def _time_candidates(node, options, rng, bind):
    """({variant: median seconds}, {variant: [median seconds of each round]}). Candidates
    are timed in alternating rounds, so a burst of load from elsewhere lands on all of
    them rather than on one."""
    runs = {v: _bind(node, v, rng, bind) for v in options}
    runs = {v: r for v, r in runs.items() if r is not None}
    samples = {v: [] for v in runs}
    rounds = {v: [] for v in runs}
    with np.errstate(all="ignore"):
        for _ in range(TUNE_WARMUP):
            for run in runs.values():
                run()
        for _ in range(TUNE_ROUNDS):
            for v, run in runs.items():
                this_round = []
                for _ in range(TUNE_REPEATS):
                    t0 = time.perf_counter()
                    run()
                    this_round.append(time.perf_counter() - t0)
                samples[v] += this_round
                rounds[v].append(float(np.median(this_round)))
    return {v: float(np.median(s)) for v, s in samples.items()}, rounds


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


def _bind(node, variant, rng, bind):
    """The kernel callable for `node` with `variant`, on private buffers; None when this
    candidate cannot run here (it raised at bind or on a first call)."""
    before = node.variant
    node.variant = variant
    try:
        ins, outs = _operands(node, rng)
        op = node.op
        if len(ins) > 1 and ins[1] is not None:  # the weight as prepack_weights will store it
            op, ins[1] = packed(node, variant, ins[1])
        run = get(op).make(node, ins, outs, bind.begin_node())
        if run is not None:
            with np.errstate(all="ignore"):
                run()
        return run
    except Exception:  # a candidate that cannot run is not chosen
        return None
    finally:
        node.variant = before


def format_report(report, limit=None):
    """Rows 'node  op  rule -> chosen  candidate ms ...' for the CLI, biggest gains first."""
    rows = []
    for node, rule, chosen, times, _ in report:
        gain = times.get(rule, times[chosen]) - times[chosen]
        cands = "  ".join(f"{v}={t * 1e3:.3f}" for v, t in sorted(times.items(), key=lambda kv: kv[1]))
        rows.append((gain, f"  {node.name[:32]:32} {node.op:12} {rule or '-':>10} -> {chosen:12} {cands}"))
    rows.sort(key=lambda r: -r[0])
    return [r for _, r in rows[:limit]]
