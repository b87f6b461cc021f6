"""OpenBLAS's idle-thread timeout, as pmx sets it (runtime/__init__.py before numpy
loads, runtime/parallel.py afterwards). Imports nothing but the standard library:
runtime/__init__.py uses it before numpy is loaded.

OpenBLAS reads OPENBLAS_THREAD_TIMEOUT into a static as it loads and whenever
openblas_read_env() is called, and a thread pool takes its timeout from that static when
it starts. pmx sets the variable for one such read and removes it again, so the
environment that child processes inherit is the caller's.
"""

import contextlib
import os

# 2^4 cycles: idle pool threads sleep at once instead of spinning ~0.1 s (2^28 cycles,
# OpenBLAS's default) on the core a pmx worker needs
SHORT_TIMEOUT = 4


def user_set_timeout() -> bool:
    """Whether you set OpenBLAS's timeout yourself: pmx then leaves it alone."""
    return "OPENBLAS_THREAD_TIMEOUT" in os.environ or "GOTO_THREAD_TIMEOUT" in os.environ


@contextlib.contextmanager
def short_timeout():
    """OPENBLAS_THREAD_TIMEOUT=SHORT_TIMEOUT for what OpenBLAS reads inside, then removed."""
    os.environ["OPENBLAS_THREAD_TIMEOUT"] = str(SHORT_TIMEOUT)
    try:
        yield
    finally:
        del os.environ["OPENBLAS_THREAD_TIMEOUT"]
