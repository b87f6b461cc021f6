"""SessionOptions: per-InferenceSession settings, shaped like onnxruntime.SessionOptions.

    so = SessionOptions()
    so.intra_op_num_threads = 2
    sess = InferenceSession("model.pmx", sess_options=so)

Everything here belongs to the one InferenceSession it is given to; nothing is process-wide.
"""

from __future__ import annotations

import math
import os

from pmx.runtime.errors import PmxInputError

ALLOW_SPINNING = "session.intra_op.allow_spinning"

# config entries pmx understands (onnxruntime's keys); others are stored and ignored, as
# onnxruntime stores keys it does not know
_KNOWN_ENTRIES = {ALLOW_SPINNING: ("0", "1")}


class SessionOptions:
    """Per-InferenceSession settings.

    intra_op_num_threads: threads one run uses (0 = default: OMP_NUM_THREADS when set, as
        torch and numexpr read it, else the cores this process may run on, capped by its
        cgroup CPU quota; see default_thread_count).
    inter_op_num_threads: accepted for compatibility; pmx runs nodes in one stored order.
    enable_profiling / profile_file_prefix: per-node timings written as a Chrome trace by
        InferenceSession.end_profiling().
    Config entry "session.intra_op.allow_spinning" ("0" or "1"): accepted as onnxruntime
        accepts it; pmx's worker threads always sleep while they wait, never spin.
    """

    def __init__(self):
        self.intra_op_num_threads = 0
        self.inter_op_num_threads = 0
        self.enable_profiling = False
        self.profile_file_prefix = "pmx_profile"
        self.log_severity_level = 2
        self._config = {}

    def add_session_config_entry(self, key: str, value: str) -> None:
        allowed = _KNOWN_ENTRIES.get(key)
        if allowed is not None and str(value) not in allowed:
            raise PmxInputError(f"config entry {key!r}: expected one of {list(allowed)}, got {value!r}")
        self._config[str(key)] = str(value)

    def get_session_config_entry(self, key: str) -> str:
        if key not in self._config:
            raise PmxInputError(f"config entry {key!r} is not set")
        return self._config[key]


def default_thread_count() -> int:
    """Threads an InferenceSession runs with when none are asked for.

    - OMP_NUM_THREADS set to a positive integer wins, as torch and numexpr read it.
    - Otherwise the cores this process may run on (its CPU affinity), capped by the cgroup CPU
      quota rounded up (1.5 CPUs -> 2, 0.5 -> 1), as Go, Java and .NET size their default
      pools: threads beyond a container's quota are throttled, not run.
    """
    n = _omp_num_threads()
    if n is not None:
        return n
    n = _usable_cores()
    limit = cgroup_cpu_limit()
    return n if limit is None else min(n, max(1, math.ceil(limit)))


def _omp_num_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    try:
        n = int(value.split(",")[0])  # a nested-parallelism list: its outer level is ours
    except ValueError:
        return None
    return n if n > 0 else None


def _usable_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup",
                     root: str = "/sys/fs/cgroup") -> float | None:
    """The CPUs this process's cgroups allow (quota / period, e.g. 1.5), or None for no limit.

    cgroup v2 (the "0::" line of proc_cgroup) is read from cpu.max, v1 (the line whose
    controllers hold "cpu") from cpu.cfs_quota_us and cpu.cfs_period_us, in the process's
    cgroup and each ancestor up to the mount root: limits nest, so the smallest counts, and a
    container that shows its host path still finds its own limit at the mount root. Anything
    missing, unreadable or malformed counts as no limit: this only sizes a default.
    """
    limits = []
    for hierarchy, controllers, path in _cgroup_lines(proc_cgroup):
        if hierarchy == "0" and not controllers:
            limits += [_v2_limit(d) for d in _self_and_ancestors(root, path)]
        elif "cpu" in controllers.split(","):
            # the mount's name varies by distribution; where both exist they are one hierarchy
            for name in dict.fromkeys((controllers, "cpu,cpuacct", "cpu")):
                mount = os.path.join(root, name)
                limits += [_v1_limit(d) for d in _self_and_ancestors(mount, path)]
    return min((x for x in limits if x is not None), default=None)


def _cgroup_lines(proc_cgroup: str):
    for line in (_read(proc_cgroup) or "").splitlines():
        fields = line.split(":", 2)
        if len(fields) == 3:
            yield fields


def _self_and_ancestors(base: str, cgroup_path: str):
    # ".." would climb out of base into files that are no cgroup's
    parts = [p for p in cgroup_path.split("/") if p not in ("", ".", "..")]
    for i in range(len(parts), -1, -1):
        yield os.path.join(base, *parts[:i])


def _v2_limit(directory: str) -> float | None:
    fields = (_read(os.path.join(directory, "cpu.max")) or "").split()
    return _cpus(*fields) if len(fields) == 2 else None


def _v1_limit(directory: str) -> float | None:
    quota = _read(os.path.join(directory, "cpu.cfs_quota_us"))
    period = _read(os.path.join(directory, "cpu.cfs_period_us"))
    return _cpus(quota, period)


def _cpus(quota, period) -> float | None:
    """quota / period, or None where either is not a positive integer ("max", -1: no limit)."""
    try:
        quota, period = int(quota), int(period)
    except (TypeError, ValueError):
        return None
    return quota / period if quota > 0 and period > 0 else None


def _read(path: str) -> str | None:
    try:
        # surrogateescape: a cgroup path in another encoding still names its directory
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read(1 << 16)  # a bound keeps a wrong path (a device, say) cheap
    except (OSError, ValueError):  # ValueError: a NUL in the path
        return None


def resolve_thread_count(sess_options, num_threads) -> int:
    """The thread count an InferenceSession runs with: num_threads= if given, else the options'
    intra_op_num_threads if non-zero, else default_thread_count()."""
    n = num_threads
    if n is None and sess_options is not None:
        n = getattr(sess_options, "intra_op_num_threads", 0) or None
    if n is None:
        return default_thread_count()
    try:
        n = int(n)
    except (TypeError, ValueError):
        raise PmxInputError(f"thread count must be an integer >= 1, got {n!r}") from None
    if n < 1:
        raise PmxInputError(f"thread count must be an integer >= 1, got {n}")
    return n
