"""Arena planning: greedy by size over buffer lifetimes, as TFLite's arena planner.

A buffer is (size in bytes, first step, last step), steps being positions in the stored
execution order (graph inputs at step -1, graph outputs alive to the last step). Buffers
go in order of size, largest first (ties: earlier first step, then index, so the plan is
deterministic); each takes the smallest gap between buffers already placed that are
alive at an overlapping time, or the end of them. Offsets are 64-byte aligned.

The compiler plans the shape a model was compiled for and stores it; the runtime calls
the same function to re-plan other input shapes. `check_plan` is the planner's checker.
"""

ALIGN = 64


def _aligned(n):
    return (n + ALIGN - 1) // ALIGN * ALIGN


def plan_arena(buffers):
    """buffers: list of (size, first, last). Returns (offsets list, arena size)."""
    order = sorted(range(len(buffers)), key=lambda i: (-buffers[i][0], buffers[i][1], i))
    offsets = [0] * len(buffers)
    placed = []  # (offset, end, first, last)
    arena = 0
    for i in order:
        size, first, last = buffers[i]
        need = _aligned(max(size, 1))
        live = sorted((o, e) for o, e, f, l in placed if f <= last and first <= l)
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
        for j in items[a_pos + 1:]:
            if offsets[j] >= offsets[i] + si:
                break
            sj, fj, lj = buffers[j]
            if si and sj and fi <= lj and fj <= li:
                raise AssertionError(
                    f"buffers {i} [{offsets[i]}, +{si}) steps {fi}..{li} and {j} [{offsets[j]}, +{sj}) steps {fj}..{lj} overlap")


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
