"""SessionOptions: per-InferenceSession settings, shaped like onnxruntime.SessionOptions.

    so = SessionOptions()
    so.intra_op_num_threads = 2
    sess = InferenceSession("model.pmx", sess_options=so)

Everything here belongs to the one InferenceSession it is given to; nothing is process-wide.
"""

from __future__ import annotations

import os

from pmx.runtime.errors import PmxInputError

ALLOW_SPINNING = "session.intra_op.allow_spinning"

# config entries pmx understands (onnxruntime's keys); others are stored and ignored, as
# onnxruntime stores keys it does not know
_KNOWN_ENTRIES = {ALLOW_SPINNING: ("0", "1")}


class SessionOptions:
    """Per-InferenceSession settings.

    intra_op_num_threads: threads one run uses (0 = default: OMP_NUM_THREADS when set, as
        torch and numexpr read it, else the cores this process may run on).
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
    """OMP_NUM_THREADS when set to a positive integer, else the cores this process may use."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value:
        try:
            n = int(value.split(",")[0])
            if n > 0:
                return n
        except ValueError:
            pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


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
