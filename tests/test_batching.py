"""BatchingSession: concurrent requests run as batches, each caller gets its own rows.

The oracle is InferenceSession.run on each request alone. A batched run computes the same
rows with other GEMM shapes, so results agree within float32 rounding, not bit for bit."""

import pathlib
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pmx.compiler.driver import compile_model
from pmx.runtime import BatchingSession, InferenceSession, PmxInputError, PmxRunTerminated, RunOptions

ROOT_EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "tools" / "example" / "cnn"


@pytest.fixture(scope="module")
def dynamic_model(tmp_path_factory):
    """The example CNN with a batch dim of any size, and images of 32 to 96 pixels a side."""
    out = tmp_path_factory.mktemp("batching") / "cnn.pmx"
    dims = {0: (1, -1), 2: (32, 96), 3: (32, 96)}
    compile_model(f"{ROOT_EXAMPLE}.pnnx.param", f"{ROOT_EXAMPLE}.pnnx.bin", str(out), dynamic={"in0": dims})
    return str(out)


@pytest.fixture(scope="module")
def session(dynamic_model):
    return InferenceSession(dynamic_model, num_threads=1)


def images(rows, seed):
    return np.random.default_rng(seed).standard_normal((rows, 3, 64, 64)).astype(np.float32)


def run_concurrently(batching, feeds, output_names=None):
    """Each feed from its own thread, all started together: (outputs, errors) per feed."""
    results, errors = [None] * len(feeds), [None] * len(feeds)
    start = threading.Barrier(len(feeds))

    def request(k):
        start.wait()
        try:
            results[k] = batching.run(output_names, feeds[k])
        except Exception as e:  # recorded for the test to check
            errors[k] = e

    threads = [threading.Thread(target=request, args=(k,)) for k in range(len(feeds))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "a request never returned"
    return results, errors


@settings(max_examples=10)
@given(
    rows=st.lists(st.integers(1, 4), min_size=1, max_size=8),
    max_batch=st.integers(1, 9),
    wait_ms=st.sampled_from([0, 2, 20]),
)
def test_each_caller_gets_its_own_rows(session, rows, max_batch, wait_ms):
    feeds = [{"in0": images(n, seed)} for seed, n in enumerate(rows)]
    with BatchingSession(session, max_batch_size=max_batch, max_wait_ms=wait_ms) as batching:
        results, errors = run_concurrently(batching, feeds)
    assert errors == [None] * len(feeds)
    for feed, got in zip(feeds, results):
        want = session.run(None, feed)
        assert [g.shape for g in got] == [w.shape for w in want]
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_requests_are_batched_and_bounded_by_max_batch_size(session):
    feeds = [{"in0": images(1, seed)} for seed in range(12)]
    runs = []
    with BatchingSession(session, max_batch_size=4, max_wait_ms=200, on_batch=runs.append) as batching:
        run_concurrently(batching, feeds)
        # twelve requests of one row in batches of at most four rows: at least three runs,
        # and fewer than twelve unless no two requests ever met in the queue
        assert 3 <= batching.batches_run <= 12
    assert sum(runs) == 12 and max(runs) <= 4 and len(runs) == batching.batches_run


def test_a_bad_request_fails_alone_with_the_sessions_error(session):
    good = [{"in0": images(1, seed)} for seed in range(4)]
    bad = {"in0": images(1, 9).astype(np.float64)}
    with pytest.raises(PmxInputError) as plain:
        session.run(None, bad)
    with BatchingSession(session, max_batch_size=8, max_wait_ms=50) as batching:
        results, errors = run_concurrently(batching, [*good, bad])
    assert type(errors[-1]) is PmxInputError and str(errors[-1]) == str(plain.value)
    assert errors[:-1] == [None] * 4
    for feed, got in zip(good, results):
        np.testing.assert_allclose(got[0], session.run(None, feed)[0], rtol=1e-5, atol=1e-6)


def test_requests_of_other_shapes_are_never_mixed(session):
    """Other non-batch shapes (a model whose spatial dims may change) run in their own
    batches; each still gets its own result."""
    feeds = [{"in0": images(1, seed)} for seed in range(3)]
    feeds += [{"in0": np.random.default_rng(7).standard_normal((2, 3, 48, 48)).astype(np.float32)}]
    with BatchingSession(session, max_batch_size=8, max_wait_ms=20) as batching:
        results, errors = run_concurrently(batching, feeds, ["out0"])
    assert errors == [None] * 4
    for feed, got in zip(feeds, results):
        np.testing.assert_allclose(got[0], session.run(["out0"], feed)[0], rtol=1e-5, atol=1e-6)


def test_a_model_whose_batch_cannot_grow_is_refused_naming_the_input(tmp_path):
    static = tmp_path / "static.pmx"
    compile_model(f"{ROOT_EXAMPLE}.pnnx.param", f"{ROOT_EXAMPLE}.pnnx.bin", str(static), auto_batch=False)
    with pytest.raises(
        PmxInputError, match=r"input 'in0' of shape \[1, 3, 64, 64\] has a batch dim .* --dynamic in0:0"
    ):
        BatchingSession(str(static))


def test_close_runs_what_is_queued_and_refuses_what_comes_after(session):
    batching = BatchingSession(session, max_batch_size=4, max_wait_ms=100)
    futures = [batching.submit(None, {"in0": images(1, seed)}) for seed in range(6)]
    batching.close()
    assert all(f.done() and f.exception() is None for f in futures)
    with pytest.raises(PmxInputError, match="closed"):
        batching.run(None, {"in0": images(1, 0)})


def test_run_async_and_terminate(session):
    with BatchingSession(session, max_batch_size=4, max_wait_ms=0) as batching:
        done = threading.Event()
        got = {}

        def callback(outputs, user_data, error):
            got.update(outputs=outputs, user_data=user_data, error=error)
            done.set()

        feed = {"in0": images(2, 3)}
        assert batching.run_async(None, feed, callback, "tag") is None
        assert done.wait(timeout=60)
        assert got["error"] == "" and got["user_data"] == "tag"
        np.testing.assert_allclose(got["outputs"][0], session.run(None, feed)[0], rtol=1e-5, atol=1e-6)
        stop = RunOptions()
        stop.terminate = True
        with pytest.raises(PmxRunTerminated):
            batching.run(None, feed, stop)


def test_arguments_are_checked(session, dynamic_model):
    for bad in (0, -1, 1.5, True):
        with pytest.raises(PmxInputError, match="max_batch_size"):
            BatchingSession(session, max_batch_size=bad)
    with pytest.raises(PmxInputError, match="max_wait_ms"):
        BatchingSession(session, max_wait_ms=-1)
    with pytest.raises(PmxInputError, match="sess_options"):
        from pmx.runtime import SessionOptions

        BatchingSession(session, sess_options=SessionOptions())
    with BatchingSession(dynamic_model, max_batch_size=2) as batching:
        with pytest.raises(PmxInputError, match="unknown output"):
            batching.run(["nope"], {"in0": images(1, 0)})
