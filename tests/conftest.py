"""Shared fixtures: pnnx exports cached for the whole test run, and the compare-with-torch helper.

Hypothesis profiles: "repeatable" (the default, in CI and for everyone) draws the same
examples every run, from a fixed seed and no example database, so a red run is a change in
the code, never a lucky draw; `--hypothesis-profile=explore` draws new examples each run,
more of them, for hunting. A failure explore finds is kept as an @example on its test.
"""

import os
import pathlib
import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# too_slow: a busy host makes data generation slow, and that is no failure of the code
settings.register_profile(
    "repeatable",
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile("explore", max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))

sys.path.insert(0, str(pathlib.Path(__file__).parent))


@pytest.fixture(scope="session", autouse=True)
def kernels_read_only_declared_attributes():
    """Every attribute a kernel reads anywhere in the run (compile-time shape rules and
    folding, load, bind, run, the kernel tests) is one its op declares: the loader checks
    only those (runtime/kernels/attr_specs.py)."""
    from attr_reads import record_reads

    from pmx.runtime.kernels.registry import all_kernels

    with record_reads(all_kernels()) as undeclared:
        yield
    assert not undeclared, f"kernels read attributes their ops do not declare: {dict(undeclared)}"


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("pnnx_exports")


@pytest.fixture(scope="session")
def exporter(export_dir):
    """exporter(name, module, inputs) -> path prefix of the pnnx files (cached for the whole test run)."""
    from helpers import export_pnnx

    cache = {}

    def get(name, module, inputs):
        if name not in cache:
            cache[name] = export_pnnx(export_dir / name, module, inputs)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def check_model(exporter, tmp_path_factory):
    """check_model(name, module, inputs, **compile_kwargs): export, compile, run, compare
    with torch; returns (session, pmx outputs, torch outputs)."""
    from helpers import compare_with_torch

    out_dir = tmp_path_factory.mktemp("pmx")

    def check(name, module, inputs, tol=1e-4, **kwargs):
        prefix = exporter(name, module, inputs)
        return compare_with_torch(prefix, module, inputs, out_dir / f"{name}.pmx", tol=tol, **kwargs)

    return check


def rel_error(a, b):
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    scale = max(np.abs(b).max(), 1e-12) if b.size else 1.0
    return float(np.abs(a - b).max() / scale) if b.size else 0.0


# The slow tier: modules whose tests export whole torch modules through pnnx, start Ray or
# Dask clusters, servers or worker processes, or build wheels, and single tests elsewhere
# that export (marked `@pytest.mark.slow` where they stand). `pytest -m "not slow"` runs
# the rest (kernels, IR, rules, loader, CLI on small files); `pytest` runs both.
SLOW_MODULES = {
    "test_batch_chunks",
    "test_batch_engines",  # Ray and Dask clusters
    "test_concurrency",  # worker processes
    "test_dynamic_reshape",
    "test_dynamic_shapes",
    "test_e2e_cnn_blocks",
    "test_e2e_indexing",
    "test_e2e_seq_dense",
    "test_e2e_transformers",
    "test_from_torch",
    "test_graph_forms",
    "test_onnx_through_pnnx",
    "test_packaging",  # wheels
    "test_serve",  # servers
    "test_threads_host",  # busy-host subprocesses
}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.module.__name__.rsplit(".", 1)[-1] in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
