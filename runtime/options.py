"""SessionOptions: per-InferenceSession settings, shaped like onnxruntime.SessionOptions.

    so = SessionOptions()
    so.intra_op_num_threads = 2
    sess = InferenceSession("model.pmx", sess_options=so)

Everything here belongs to the one InferenceSession it is given to; nothing is process-wide.
"""

from __future__ import annotations

import enum
import math
import os

from pmx.runtime.errors import PmxInputError

ALLOW_SPINNING = "session.intra_op.allow_spinning"
# rows per chunk when a large batch runs in chunks (runtime/batch_chunks.py); "0": the
# whole batch in one run
BATCH_CHUNK_ROWS = "pmx.batch_chunk_rows"

# config entries pmx understands (onnxruntime's key, and pmx's own) with what each takes;
# others are stored and ignored, as onnxruntime stores keys it does not know
_KNOWN_ENTRIES = {
    ALLOW_SPINNING: ("one of ['0', '1']", lambda v: v in ("0", "1")),
    BATCH_CHUNK_ROWS: ("a whole number (0: no chunks)", lambda v: v.isascii() and v.isdigit()),
}


class GraphOptimizationLevel(enum.IntEnum):
    """onnxruntime's levels. pmx optimizes when it compiles (`pmx compile --no-opt`,
    `--disable PASS`); a loaded .pmx is already optimized, so the level has no effect."""

    ORT_DISABLE_ALL = 0
    ORT_ENABLE_BASIC = 1
    ORT_ENABLE_EXTENDED = 2
    ORT_ENABLE_LAYOUT = 3
    ORT_ENABLE_ALL = 99


class ExecutionMode(enum.IntEnum):
    """onnxruntime's modes. pmx runs nodes in the compiled order and its threads inside
    each node (README, Threads), so ORT_PARALLEL runs as ORT_SEQUENTIAL."""

    ORT_SEQUENTIAL = 0
    ORT_PARALLEL = 1


class ExecutionOrder(enum.IntEnum):
    """onnxruntime's node orders. pmx's order is fixed by the compiler."""

    DEFAULT = 0
    PRIORITY_BASED = 1
    MEMORY_EFFICIENT = 2


# onnxruntime.SessionOptions' attributes: (default, type). Kept and reported; what each
# does in pmx is in docs/onnxruntime.md
_SESSION_FIELDS = {
    "intra_op_num_threads": (0, int),
    "inter_op_num_threads": (0, int),
    "enable_profiling": (False, bool),
    "profile_file_prefix": ("pmx_profile", str),
    "log_severity_level": (2, int),
    "log_verbosity_level": (0, int),
    "logid": ("", str),
    "graph_optimization_level": (GraphOptimizationLevel.ORT_ENABLE_ALL, GraphOptimizationLevel),
    "execution_mode": (ExecutionMode.ORT_SEQUENTIAL, ExecutionMode),
    "execution_order": (ExecutionOrder.DEFAULT, ExecutionOrder),
    "enable_cpu_mem_arena": (True, bool),
    "enable_mem_pattern": (True, bool),
    "enable_mem_reuse": (True, bool),
    "use_deterministic_compute": (False, bool),
    "optimized_model_filepath": ("", str),
    "use_per_session_threads": (True, bool),
}


def checked_value(owner, name, value, kind):
    """value as an attribute of `kind` may hold, or TypeError as onnxruntime's bindings
    raise for a value of another type (a bool is not taken for an int, nor an int for a
    bool; enum members and their integer values are taken for an enum)."""
    if isinstance(kind, type) and issubclass(kind, enum.IntEnum):
        try:
            return kind(value)
        except (ValueError, TypeError):
            raise TypeError(f"{owner}.{name}: expected one of {[m.name for m in kind]}, got {value!r}") from None
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is not int and isinstance(value, kind):
        return value
    raise TypeError(f"{owner}.{name}: expected {kind.__name__}, got {type(value).__name__} {value!r}")


class SessionOptions:
    """Per-InferenceSession settings, with every attribute of onnxruntime.SessionOptions.

    intra_op_num_threads: threads one run uses (0 = default: OMP_NUM_THREADS when set, as
        torch and numexpr read it, else the cores this process may run on, capped by its
        cgroup CPU quota; see default_thread_count).
    enable_profiling / profile_file_prefix: per-node timings written as a Chrome trace by
        InferenceSession.end_profiling().
    The others are accepted, kept and have no effect (docs/onnxruntime.md says why for
    each). An attribute onnxruntime does not have is refused with AttributeError, as
    onnxruntime refuses it, so a typo (intra_op_num_thread) cannot pass unnoticed.
    Config entry "session.intra_op.allow_spinning" ("0" or "1"): accepted as onnxruntime
        accepts it; pmx's worker threads always sleep while they wait, never spin.
    """

    __slots__ = tuple(_SESSION_FIELDS) + ("_config", "_free_dimensions")

    def __init__(self):
        for name, (default, _) in _SESSION_FIELDS.items():
            object.__setattr__(self, name, default)
        object.__setattr__(self, "_config", {})
        object.__setattr__(self, "_free_dimensions", {})

    def __setattr__(self, name, value):
        field = _SESSION_FIELDS.get(name)
        if field is None and name not in ("_config", "_free_dimensions"):
            raise AttributeError(f"'SessionOptions' object has no attribute {name!r}")
        object.__setattr__(
            self, name, value if field is None else checked_value("SessionOptions", name, value, field[1])
        )

    def __copy__(self):
        new = SessionOptions()
        for name in _SESSION_FIELDS:
            object.__setattr__(new, name, getattr(self, name))
        object.__setattr__(new, "_config", dict(self._config))
        object.__setattr__(new, "_free_dimensions", dict(self._free_dimensions))
        return new

    def __getstate__(self):
        return {name: getattr(self, name) for name in self.__slots__}

    def __setstate__(self, state):
        for name, value in state.items():
            object.__setattr__(self, name, value)

    def add_session_config_entry(self, key: str, value: str) -> None:
        known = _KNOWN_ENTRIES.get(key)
        if known is not None and not known[1](str(value)):
            raise PmxInputError(f"config entry {key!r}: expected {known[0]}, got {value!r}")
        self._config[str(key)] = str(value)

    def get_session_config_entry(self, key: str) -> str:
        if key not in self._config:
            raise PmxInputError(f"config entry {key!r} is not set")
        return self._config[key]

    def add_free_dimension_override_by_name(self, dim_name: str, dim_value: int) -> None:
        """Kept, no effect: pmx plans memory for each input shape when it first runs."""
        self._free_dimensions[str(dim_name)] = checked_value("SessionOptions", "dim_value", dim_value, int)

    def add_free_dimension_override_by_denotation(self, dim_denotation: str, dim_value: int) -> None:
        """Kept, no effect, as add_free_dimension_override_by_name."""
        self._free_dimensions[str(dim_denotation)] = checked_value("SessionOptions", "dim_value", dim_value, int)

    def add_initializer(self, name, value):
        raise PmxInputError(
            f"add_initializer({name!r}): a .pmx file holds its weights; compile the model with the weights you want"
        )

    def add_external_initializers(self, names, values):
        raise PmxInputError(
            "add_external_initializers: a .pmx file holds its weights; compile the model with the weights you want"
        )

    def add_provider(self, provider_name, provider_options=None):
        """Warns for any provider but the CPU one, as InferenceSession(providers=) does."""
        from pmx.runtime.compat import check_providers

        check_providers([provider_name])

    def has_providers(self):
        return False

    def set_load_cancellation_flag(self, value):
        """Kept, no effect: loading a .pmx takes milliseconds."""

    def register_custom_ops_library(self, library_path):
        raise PmxInputError(f"register_custom_ops_library({library_path!r}): pmx runs no native custom operators")


# default_thread_count() in a help line's words
DEFAULT_THREADS_TEXT = "OMP_NUM_THREADS when set, else the cores this process may use, capped by a cgroup CPU quota"


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


def cgroup_cpu_limit(proc_cgroup: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> float | None:
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
    """The thread count an InferenceSession runs with: num_threads= if given and non-zero,
    else the options' intra_op_num_threads if non-zero, else default_thread_count().
    num_threads= is a shortcut for intra_op_num_threads, so 0 means the default in both."""
    n = None if type(num_threads) is int and num_threads == 0 else num_threads
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
