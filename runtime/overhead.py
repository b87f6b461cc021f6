"""Framework overhead: how much of a run is spent outside the nodes' kernels.

A run's wall time is the nodes' kernel callables (numpy and BLAS calls, the few lines of
Python each kernel runs around them, and any wait for the InferenceSession's worker
threads inside them) plus what the runtime does around them: checking the feed, finding
the binding, copying inputs in and outputs out, the loop itself. The second part is
"framework overhead", as PPLNN reports it.

It is measured per run: each measured run times itself whole and each kernel callable
inside it, and the overhead of that run is the part of its wall time outside them. The
figure is the median over the runs. Pairing the two in one run matters on a noisy host:
a sum of per-node medians taken apart from the runs moved the figure by 10 points from
one measurement to the next. The clock reads around each callable count as overhead,
so the figure errs high. (Python 3.11's profiler gives no events for numpy's ufunc
calls, so the Python inside a kernel callable cannot be told apart from numpy's own
time this way.)
"""

from __future__ import annotations

import statistics
import time

from pmx.runtime.record import FrozenRecord


class Overhead(FrozenRecord):
    """wall_ms: median wall time of the measured runs; kernel_ms: median time inside the
    kernel callables per run; overhead: median over the runs of the fraction of a run's
    wall time spent outside them (0 when runs are nothing but kernels)."""

    __slots__ = ("wall_ms", "kernel_ms", "overhead")

    def __init__(self, wall_ms, kernel_ms, overhead):
        object.__setattr__(self, "wall_ms", wall_ms)
        object.__setattr__(self, "kernel_ms", kernel_ms)
        object.__setattr__(self, "overhead", overhead)


def framework_overhead(session, input_feed, repeat=20) -> Overhead:
    """Overhead of session.run(None, input_feed), after one warm-up run."""
    session.run(None, input_feed)
    walls, inside = [], []
    clock = time.perf_counter
    for _ in range(max(1, repeat)):
        t0 = clock()
        _, kernels = session._run_timing_kernels(input_feed)
        walls.append(clock() - t0)
        inside.append(kernels)
    fractions = [max(0.0, 1.0 - k / w) if w > 0 else 0.0 for w, k in zip(walls, inside)]
    return Overhead(statistics.median(walls) * 1e3, statistics.median(inside) * 1e3, statistics.median(fractions))
