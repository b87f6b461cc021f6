"""Framework overhead: how much of a run is spent outside the nodes' kernels.

A run's wall time is the nodes' kernel callables (numpy and BLAS calls and the few lines
of Python each kernel runs around them) plus what the runtime does around them: checking
the feed, finding the binding, copying inputs in and outputs out, the loop itself. The
second part is "framework overhead", as PPLNN reports it. Kernel time is the sum of each
node's median time (InferenceSession.profile); wall time the median of as many plain
runs. (Python 3.11's profiler gives no events for numpy's ufunc calls, so the Python
inside a kernel callable cannot be told apart from numpy's own time this way.)
"""

from __future__ import annotations

import statistics
import time

from pmx.runtime.record import FrozenRecord


class Overhead(FrozenRecord):
    """wall_ms: median run() time; kernel_ms: the sum of the nodes' median times;
    overhead = 1 - kernel_ms / wall_ms (0 when runs are nothing but kernels)."""

    __slots__ = ("wall_ms", "kernel_ms", "overhead")

    def __init__(self, wall_ms, kernel_ms):
        object.__setattr__(self, "wall_ms", wall_ms)
        object.__setattr__(self, "kernel_ms", kernel_ms)
        object.__setattr__(self, "overhead", max(0.0, 1.0 - kernel_ms / wall_ms) if wall_ms > 0 else 0.0)


def framework_overhead(session, input_feed, repeat=20) -> Overhead:
    """Overhead of session.run(None, input_feed), after one warm-up run."""
    session.run(None, input_feed)
    walls = []
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        session.run(None, input_feed)
        walls.append(time.perf_counter() - t0)
    kernel_ms = sum(row["ms"] for row in session.profile(input_feed, repeat=max(1, repeat)))
    return Overhead(statistics.median(walls) * 1e3, kernel_ms)
