"""Arena planning: greedy by size over buffer lifetimes, as TFLite's arena planner.

A buffer is (size in bytes, first step, last step), steps being positions in the stored
execution order (graph inputs at step -1, graph outputs alive to the last step). Buffers
go in order of aligned size, largest first (ties: earlier first step, then index, so the
plan is deterministic); each takes the smallest gap between buffers already placed that are
alive at an overlapping time, or the end of them. Offsets are 64-byte aligned. A few
other placement orders (ORDERINGS) run the same best-fit placement; the smallest arena
wins.

The compiler plans the shape a model was compiled for and stores it; the runtime calls
the same function to re-plan other input shapes. `check_plan` is the planner's checker.
"""

ALIGN = 64


def _aligned(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


# Orderings tried, best arena wins (ties: the first). Greedy by size alone misses easy
# cases (a growing chain puts the first small tensor where the last big one's partner
# should go); placing in order of first step, or of last step, catches those.
ORDERINGS = (
    lambda b, i: (-_aligned(max(b[0], 1)), b[1], i),  # greedy by size (TFLite)
    lambda b, i: (-_aligned(max(b[0], 1)), -b[2], i),  # by size, longest-lived first
    lambda b, i: (b[1], -_aligned(max(b[0], 1)), i),  # by first step (linear scan)
    lambda b, i: (-b[2], -_aligned(max(b[0], 1)), i),  # by last step, backwards
)


def plan_arena(buffers):
    """buffers: list of (size, first, last). Returns (offsets list, arena size)."""
    best = None
    for key in ORDERINGS:
        order = sorted(range(len(buffers)), key=lambda i: key(buffers[i], i))
        offsets, arena = _place(buffers, order)
        if best is None or arena < best[1]:
            best = (offsets, arena)
    return best if best is not None else ([], 0)


def _place(buffers, order):
    """Each buffer in turn takes the smallest gap between already placed buffers alive at
    an overlapping time that fits it, or the end of them."""
    offsets = [0] * len(buffers)
    placed = []  # (offset, end, first, last)
    arena = 0
    for i in order:
        size, first, last = buffers[i]
        need = _aligned(max(size, 1))
        live = sorted((o, e) for o, e, start, end in placed if start <= last and first <= end)
        best, best_gap = None, None
        cursor = 0
        for o, e in live:
            gap = o - cursor
            if gap >= need and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, e)
        if best is None:
            best = cursor
        offsets[i] = best
        placed.append((best, best + need, first, last))
        arena = max(arena, best + need)
    return offsets, arena


def check_plan(buffers, offsets, arena_size):
    """Raise AssertionError naming two buffers that are alive together and share a byte,
    or a buffer outside the arena."""
    items = sorted(range(len(buffers)), key=lambda i: offsets[i])
    for i in range(len(buffers)):
        size = buffers[i][0]
        if offsets[i] < 0 or offsets[i] + size > arena_size:
            raise AssertionError(f"buffer {i} [{offsets[i]}, +{size}) outside arena of {arena_size} bytes")
    for a_pos, i in enumerate(items):
        si, fi, li = buffers[i]
        for j in items[a_pos + 1 :]:
            if offsets[j] >= offsets[i] + si:
                break
            sj, fj, lj = buffers[j]
            if si and sj and fi <= lj and fj <= li:
                raise AssertionError(
                    f"buffers {i} [{offsets[i]}, +{si}) steps {fi}..{li} and "
                    f"{j} [{offsets[j]}, +{sj}) steps {fj}..{lj} overlap"
                )


def lower_bound(buffers):
    """Max over steps of the (aligned) bytes alive at that step: no plan can be smaller."""
    if not buffers:
        return 0
    events = {}
    for size, first, last in buffers:
        events[first] = events.get(first, 0) + _aligned(max(size, 1))
        events[last + 1] = events.get(last + 1, 0) - _aligned(max(size, 1))
    live = peak = 0
    for step in sorted(events):
        live += events[step]
        peak = max(peak, live)
    return peak


def naive_bytes(spans, nbytes):
    """The unplanned sum pmx compile and pmx inspect report: the bytes of every tensor in
    `spans` (from lifetimes(): each non-constant tensor the model takes as an input,
    computes, reads or keeps, views and in-place outputs included), nbytes(t) each,
    unaligned, as if each had a buffer of its own for the whole run: no reuse over time,
    no views, no in-place writes."""
    return sum(nbytes(t) for t in spans)


def lifetimes(steps, graph_inputs, live_to_end, is_constant):
    """{tensor: (first step, last step)} over `steps`, a list of (input ids, output ids)
    in execution order (None inputs are absent ones). Graph inputs start at -1, tensors in
    live_to_end (graph outputs, kept tensors) end at len(steps); constants are skipped.
    The compiler (over Values) and the runtime re-planner (over tensor indices) share it."""
    n = len(steps)
    first, last = {}, {}
    for t in graph_inputs:
        first[t] = last[t] = -1
    for i, (ins, outs) in enumerate(steps):
        for t in outs:
            first.setdefault(t, i)
            last[t] = max(last.get(t, i), i)
        for t in ins:
            if t is not None and not is_constant(t):
                last[t] = max(last.get(t, i), i)
    for t in live_to_end:
        if not is_constant(t):
            last[t] = n
    return {t: (first.get(t, last[t]), last[t]) for t in last}


def root_spans(spans, root_of):
    """{root: (first, last)}: each buffer lives while any tensor it holds (its views,
    slices, in-place outputs) is alive. root_of maps a tensor to its buffer."""
    roots = {}
    for t, (lo, hi) in spans.items():
        r = root_of(t)
        a, b = roots.get(r, (lo, hi))
        roots[r] = (min(a, lo), max(b, hi))
    return roots
