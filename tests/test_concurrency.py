"""One InferenceSession shared by many threads, and one file shared by many processes.

Each thread gets its own binding (arena, tensor views, kernel callables with their
scratch buffers) through threading.local; weights are the shared read-only mmap. So
concurrent runs must give bit-identical results to sequential runs, each thread must
have its own arena, and a thread's arena must be freed when the thread ends.
"""

import gc
import multiprocessing
import pathlib
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from pmx.compiler.driver import compile_model
from pmx.runtime import InferenceSession

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "tools" / "example" / "cnn"
THREADS = 8
RUNS_PER_THREAD = 12


def mixed_module():
    """Convs with fused activations, a fused elementwise region (GELU), pooling, views,
    concat, linear and softmax: kernels with scratch buffers that would corrupt each
    other if threads shared them. (torch is imported here, not at module level, so the
    spawned children of the multi-process test import this file without it.)"""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.c1 = nn.Conv2d(3, 16, 3, padding=1)
            self.c2 = nn.Conv2d(16, 16, 3, padding=2, dilation=2, groups=4)
            self.fc = nn.Linear(16 * 8 * 8, 32)
            self.out = nn.Linear(64, 10)

        def forward(self, x):
            y = F.gelu(self.c1(x))
            y = F.max_pool2d(y + torch.tanh(self.c2(y)), 2)
            z = self.fc(torch.flatten(y, 1))
            return F.softmax(self.out(torch.cat([z, torch.sigmoid(z) * z], 1)), dim=1)

    return Mixed(), (torch.rand(1, 3, 16, 16),)


@pytest.fixture(scope="module")
def models(exporter, tmp_path_factory):
    d = tmp_path_factory.mktemp("concurrency")
    compile_model(str(EXAMPLE) + ".pnnx.param", str(EXAMPLE) + ".pnnx.bin", str(d / "cnn.pmx"))
    prefix = exporter("concurrency_mixed", *mixed_module())
    compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(d / "mixed.pmx"))
    return {"cnn": str(d / "cnn.pmx"), "mixed": str(d / "mixed.pmx")}


def feeds(sess, n, seed=0):
    rng = np.random.default_rng(seed)
    arg = sess.get_inputs()[0]
    return [
        {arg.name: rng.standard_normal([d if d is not None else 1 for d in arg.shape]).astype(np.float32)}
        for _ in range(n)
    ]


@pytest.mark.parametrize("name", ["cnn", "mixed"])
def test_threads_match_sequential_bit_for_bit(models, name):
    sess = InferenceSession(models[name])
    inputs = feeds(sess, THREADS)
    want = [sess.run(None, f) for f in inputs]  # sequential, main thread
    barrier = threading.Barrier(THREADS)
    mismatches = []
    errors = []

    def worker(k):
        try:
            barrier.wait()
            for r in range(RUNS_PER_THREAD):
                i = (k + r) % THREADS  # every thread runs every input, in a different order
                got = sess.run(None, inputs[i])
                for g, w in zip(got, want[i]):
                    if g.shape != w.shape or g.tobytes() != w.tobytes():
                        mismatches.append((k, r, i))
        except Exception as e:  # reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert not mismatches, f"{len(mismatches)} of {THREADS * RUNS_PER_THREAD} runs differ, first {mismatches[:5]}"
    # and the sequential results are still what they were
    assert all(a.tobytes() == b.tobytes() for f, w in zip(inputs, want) for a, b in zip(sess.run(None, f), w))


def test_each_thread_has_its_own_arena(models):
    sess = InferenceSession(models["mixed"])
    (feed,) = feeds(sess, 1)
    sess.run(None, feed)
    addresses = {sess._binding().arena.ctypes.data}
    lock = threading.Lock()
    barrier = threading.Barrier(THREADS)

    def worker():
        sess.run(None, feed)
        with lock:
            addresses.add(sess._binding().arena.ctypes.data)
        barrier.wait()  # keep every thread (and its arena) alive until all have reported

    threads = [threading.Thread(target=worker) for _ in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(addresses) == THREADS + 1
    # weights are shared: every binding reads the same mmap'd constant arrays
    for i, arr in sess.model.constants.items():
        assert sess._binding().views[i] is arr


def test_arenas_are_released_with_their_threads(models):
    sess = InferenceSession(models["mixed"])
    (feed,) = feeds(sess, 1)
    refs = []

    def worker():
        sess.run(None, feed)
        refs.append(weakref.ref(sess._binding()))

    for _ in range(20):  # 20 short-lived threads, one after the other
        t = threading.Thread(target=worker)
        t.start()
        t.join(timeout=60)
    gc.collect()
    alive = sum(r() is not None for r in refs)
    assert alive == 0, f"{alive} of {len(refs)} bindings outlived their threads"


def test_thread_pool_holds_one_arena_per_worker(models):
    """A pool reuses its threads, so 80 tasks on 4 workers build at most 4 bindings;
    they go away when the pool shuts down."""
    sess = InferenceSession(models["cnn"])
    inputs = feeds(sess, 4)
    want = [sess.run(None, f) for f in inputs]
    bindings = {}
    lock = threading.Lock()

    def task(i):
        got = sess.run(None, inputs[i % 4])
        b = sess._binding()
        with lock:
            bindings[id(b)] = weakref.ref(b)
        return all(g.tobytes() == w.tobytes() for g, w in zip(got, want[i % 4]))

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert all(pool.map(task, range(80)))
        assert len(bindings) <= 4
    gc.collect()
    assert sum(r() is not None for r in bindings.values()) == 0


def _run_in_child(path, x):
    sess = InferenceSession(path, verify=True)
    return [y.tobytes() for y in sess.run(None, {sess.get_inputs()[0].name: x})]


def test_processes_share_the_file_and_agree(models):
    """4 spawned processes load the same file (its weight pages are shared through the
    page cache; tools/measure_shared_memory.py measures that) and compute the same bytes
    as this process."""
    path = models["mixed"]
    sess = InferenceSession(path)
    (feed,) = feeds(sess, 1, seed=7)
    x = next(iter(feed.values()))
    want = [y.tobytes() for y in sess.run(None, feed)]
    ctx = multiprocessing.get_context("spawn")
    with ctx.Pool(4) as pool:
        results = pool.starmap(_run_in_child, [(path, x)] * 4)
    diffs = [float(np.abs(np.frombuffer(r[0], np.float32) - np.frombuffer(want[0], np.float32)).max()) for r in results]
    assert all(r == want for r in results), f"children differ from this process by {diffs}"
