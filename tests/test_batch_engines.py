"""Batch inference beyond one process: InferenceSessions and Predictors pickle by path, and run on
real local Ray and Dask clusters (both installed by CI: no skip when they are missing)."""

import concurrent.futures
import multiprocessing
import os
import pathlib
import pickle
import re
import shutil
import subprocess
import sys
import uuid

import numpy as np
import pytest

from pmx.compiler.driver import compile_model
from pmx.runtime import InferenceSession, PmxInputError, Predictor, SessionOptions

EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "tools" / "example"
ROWS = 1000


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The example CNN (in0 [N,3,64,64] -> out0 [N,10]) compiled with a dynamic batch, a
    fixed batch of 1 and a fixed batch of 2."""
    d = tmp_path_factory.mktemp("batch_engines")
    param, weights = EXAMPLE / "cnn.pnnx.param", EXAMPLE / "cnn.pnnx.bin"
    compile_model(str(param), str(weights), str(d / "dyn.pmx"))
    compile_model(str(param), str(weights), str(d / "fix1.pmx"), auto_batch=False)
    two = d / "cnn2.pnnx.param"
    two.write_text(re.sub(r"(#\d+=\()1,", r"\g<1>2,", param.read_text()))
    compile_model(str(two), str(weights), str(d / "fix2.pmx"), auto_batch=False)
    return {k: str(d / f"{k}.pmx") for k in ("dyn", "fix1", "fix2")}


def images(n, seed=0):
    return np.random.default_rng(seed).random((n, 3, 64, 64), dtype=np.float32)


def row_by_row(path, x):
    """The plain loop: one run per row."""
    sess = InferenceSession(path)
    return np.concatenate([sess.run(None, {"in0": x[i : i + 1]})[0] for i in range(len(x))])


# --- Predictor ------------------------------------------------------------------------


def test_predictor_fixed_batch_runs_in_slices(models):
    x = images(7)
    assert InferenceSession(models["fix1"]).get_inputs()[0].shape[0] == 1
    out = Predictor(models["fix1"])({"in0": x})
    assert list(out) == ["out0"]
    assert np.array_equal(out["out0"], row_by_row(models["fix1"], x))


def test_predictor_refuses_a_batch_not_a_multiple_of_the_fixed_batch(models):
    p = Predictor(models["fix2"])
    x = images(6)
    sess = InferenceSession(models["fix2"])
    want = np.concatenate([sess.run(None, {"in0": x[i : i + 2]})[0] for i in range(0, 6, 2)])
    assert np.array_equal(p({"in0": x})["out0"], want)
    with pytest.raises(PmxInputError, match="fixed at 2: a batch must hold a multiple of 2 rows, got 5"):
        p({"in0": x[:5]})


def test_predictor_dynamic_batch_whole_or_in_chunks(models):
    x = images(10)
    sess = InferenceSession(models["dyn"])
    assert sess.get_inputs()[0].shape[0] is None
    assert np.array_equal(Predictor(models["dyn"])({"in0": x})["out0"], sess.run(None, {"in0": x})[0])
    want = np.concatenate([sess.run(None, {"in0": x[i : i + 4]})[0] for i in range(0, 10, 4)])
    assert np.array_equal(Predictor(models["dyn"], max_batch=4)({"in0": x})["out0"], want)
    with pytest.raises(PmxInputError, match="max_batch"):
        Predictor(models["dyn"], max_batch=0)


def test_predictor_columns_outputs_and_conversions(models):
    x = images(3)
    want = row_by_row(models["fix1"], x)
    p = Predictor(models["fix1"], outputs=["out0"], columns={"image": "in0"})
    out = p({"image": x, "id": np.arange(3)})  # other columns are ignored
    assert list(out) == ["out0"] and np.array_equal(out["out0"], want)
    with pytest.raises(PmxInputError, match=r"no column 'image'.*columns=\{column: input\}"):
        p({"in0": x})
    with pytest.raises(PmxInputError, match=r"expected dtype float32, got float64 \(convert with \.astype"):
        p({"image": x.astype(np.float64)})
    rows = np.empty(3, dtype=object)  # what Ray hands over for a column of per-row arrays
    for i in range(3):
        rows[i] = x[i]
    assert np.array_equal(p({"image": rows})["out0"], want)
    assert np.array_equal(p({"image": [r.tolist() for r in x]})["out0"], want)
    rows[1] = x[1].astype(np.float64)
    with pytest.raises(PmxInputError, match="a row has dtype float64"):
        p({"image": rows})
    empty = p({"image": x[:0]})["out0"]
    assert empty.shape == (0, 10) and empty.dtype == np.float32
    with pytest.raises(PmxInputError, match="unknown output"):
        Predictor(models["fix1"], outputs=["nope"])
    with pytest.raises(PmxInputError, match="unknown input"):
        Predictor(models["fix1"], columns={"image": "nope"})


def test_shared_predictor_is_one_per_process_and_settings(models):
    so = SessionOptions()
    so.intra_op_num_threads = 1
    a = Predictor.shared(models["dyn"], sess_options=so)
    same = SessionOptions()
    same.intra_op_num_threads = 1
    assert Predictor.shared(models["dyn"], sess_options=same) is a
    assert Predictor.shared(models["dyn"]) is not a
    assert Predictor.shared(models["dyn"], max_batch=3) is not a


# --- pickling -------------------------------------------------------------------------


def test_session_pickles_by_path(models):
    so = SessionOptions()
    so.intra_op_num_threads = 3
    sess = InferenceSession(models["dyn"], so, verify=True)
    blob = pickle.dumps(sess)
    assert len(blob) < 4096  # the path and settings, not the weights
    back = pickle.loads(blob)
    x = images(4)
    assert np.array_equal(back.run(None, {"in0": x})[0], sess.run(None, {"in0": x})[0])
    assert back.get_session_options().intra_op_num_threads == 3
    assert back.get_inputs() == sess.get_inputs()


def test_predictor_pickles_with_its_settings(models):
    p = Predictor(models["dyn"], columns={"image": "in0"}, max_batch=3)
    back = pickle.loads(pickle.dumps(p))
    x = images(7)
    assert back.max_batch == 3 and back.columns == {"image": "in0"}
    assert np.array_equal(back({"image": x})["out0"], p({"image": x})["out0"])


def test_pickle_relative_path_resolves_where_it_was_opened(models, monkeypatch):
    monkeypatch.chdir(os.path.dirname(models["dyn"]))
    blob = pickle.dumps(InferenceSession("dyn.pmx"))
    monkeypatch.chdir("/")
    assert pickle.loads(blob).get_inputs()[0].name == "in0"


def test_unpickle_needs_the_file_at_that_path(models, tmp_path):
    path = tmp_path / "moved.pmx"
    shutil.copy(models["dyn"], path)
    blobs = [pickle.dumps(InferenceSession(str(path))), pickle.dumps(Predictor(str(path)))]
    path.rename(tmp_path / "elsewhere.pmx")
    for blob in blobs:
        with pytest.raises(PmxInputError, match="must exist at that path on the receiving machine"):
            pickle.loads(blob)


def test_unpickle_refuses_another_file_at_that_path(models, tmp_path):
    path = tmp_path / "model.pmx"
    shutil.copy(models["dyn"], path)
    blob = pickle.dumps(InferenceSession(str(path)))
    shutil.copy(models["fix1"], path)
    with pytest.raises(PmxInputError, match="not the one that was pickled"):
        pickle.loads(blob)


def test_session_from_bytes_pickles_its_bytes(models, tmp_path):
    content = pathlib.Path(models["dyn"]).read_bytes()
    sess = InferenceSession(content)
    blob = pickle.dumps(Predictor(sess))
    assert len(blob) > len(content)  # the model travels with it: no file needed on the other side
    x = images(3)
    assert np.array_equal(pickle.loads(blob)({"in0": x})["out0"], sess.run(None, {"in0": x})[0])


CHILD = """
import pickle, sys
import numpy as np
sess, predictor, x = pickle.load(open(sys.argv[1], "rb"))
np.save(sys.argv[2], sess.run(None, {"in0": x})[0])
np.save(sys.argv[3], predictor({"in0": x})["out0"])
print(sess.get_session_options().intra_op_num_threads, predictor.session.get_session_options().intra_op_num_threads)
"""


def test_unpickle_in_a_fresh_process_resolves_threads_there(models, tmp_path):
    """An InferenceSession with default options takes the receiving process's OMP_NUM_THREADS; one
    given a thread count keeps it."""
    so = SessionOptions()
    so.intra_op_num_threads = 2
    sess, predictor, x = InferenceSession(models["dyn"]), Predictor(models["fix1"], sess_options=so), images(5)
    (tmp_path / "in.pkl").write_bytes(pickle.dumps((sess, predictor, x)))
    env = dict(os.environ, OMP_NUM_THREADS="3")
    a, b = tmp_path / "a.npy", tmp_path / "b.npy"
    done = subprocess.run(
        [sys.executable, "-c", CHILD, str(tmp_path / "in.pkl"), str(a), str(b)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["3", "2"]
    # the same bits as an InferenceSession with the thread count it resolved there (a
    # different count may split GEMMs differently: README, Threads)
    assert np.array_equal(np.load(a), InferenceSession(models["dyn"], num_threads=3).run(None, {"in0": x})[0])
    assert np.array_equal(np.load(b), row_by_row(models["fix1"], x))


def test_spawned_process_pool(models):
    sess, predictor, x = InferenceSession(models["dyn"]), Predictor(models["fix1"]), images(6)
    with concurrent.futures.ProcessPoolExecutor(2, mp_context=multiprocessing.get_context("spawn")) as pool:
        by_session = pool.submit(sess.run, None, {"in0": x})
        by_predictor = [pool.submit(predictor, {"in0": x[i : i + 3]}) for i in (0, 3)]
        assert np.array_equal(by_session.result(timeout=120)[0], sess.run(None, {"in0": x})[0])
        got = np.concatenate([f.result(timeout=120)["out0"] for f in by_predictor])
    assert np.array_equal(got, row_by_row(models["fix1"], x))


def test_import_loads_neither_ray_nor_dask():
    code = "import sys, pmx.runtime; print(sorted(m for m in ('ray', 'dask', 'distributed') if m in sys.modules))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- real local clusters --------------------------------------------------------------


class Probe(Predictor):
    """A Predictor that also reports, per row, the process, the instance (made once per
    open of the file) and the thread count its InferenceSession resolved."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.token = uuid.uuid4().hex

    def __call__(self, batch):
        out = super().__call__(batch)
        n = len(out["out0"])
        out["pid"] = np.full(n, os.getpid())
        out["token"] = np.array([self.token] * n)
        out["threads"] = np.full(n, self.session.get_session_options().intra_op_num_threads)
        return out


def check_workers(pids, tokens, threads, want_threads):
    """Two worker processes, each opened the file once and ran with want_threads."""
    opened = {}
    for pid, token in zip(pids.tolist(), tokens.tolist()):
        opened.setdefault(pid, set()).add(token)
    assert len(opened) == 2, opened
    assert all(len(t) == 1 for t in opened.values()), opened
    assert set(threads.tolist()) == {want_threads}


def test_ray_data_map_batches(models, monkeypatch):
    """The docs' Ray Data example, with Probe in place of Predictor."""
    for name in list(os.environ):  # ray.init sets variables (OMP_NUM_THREADS) in this process too
        monkeypatch.setenv(name, os.environ[name])
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    import ray
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import this test file
    x = images(ROWS)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    try:
        ray.data.DataContext.get_current().execution_options.preserve_order = True
        ds = ray.data.from_numpy(np.array_split(x, 10))  # one column, "data"; 10 blocks
        out = ds.map_batches(
            Probe,
            fn_constructor_kwargs={"path": models["dyn"], "columns": {"data": "in0"}},
            compute=ray.data.ActorPoolStrategy(size=2),  # two actors, each opens the file once
            num_cpus=1,  # per actor: Ray sets OMP_NUM_THREADS=1 there, and pmx runs 1 thread
            batch_size=100,
            batch_format="numpy",
        )
        batches = list(out.iter_batches(batch_size=None, batch_format="numpy"))
    finally:
        ray.shutdown()
    got = {k: np.concatenate([b[k] for b in batches]) for k in ("out0", "pid", "token", "threads")}
    sess = InferenceSession(models["dyn"], num_threads=1)  # as each actor's
    want = np.concatenate([sess.run(None, {"in0": x[i : i + 100]})[0] for i in range(0, ROWS, 100)])
    assert got["out0"].shape == (ROWS, 10) and np.array_equal(got["out0"], want)
    check_workers(got["pid"], got["token"], got["threads"], want_threads=1)


def test_dask_local_cluster(models):
    """The docs' Dask example, with a tally of the rows each worker's Predictor ran."""
    import dask.array as da
    import distributed

    x = images(ROWS, seed=1)
    path = models["dyn"]
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster,
        distributed.Client(cluster) as client,
    ):

        def predict(block):
            p = Predictor.shared(path)  # one per worker process, made by its first block
            p.rows = getattr(p, "rows", 0) + len(block)  # the tally (not in the docs)
            return p({"in0": block})["out0"]

        def report():
            p = Predictor.shared(path)
            return os.getpid(), getattr(p, "rows", 0), p.session.get_session_options().intra_op_num_threads

        scores = da.from_array(x, chunks=(100, 3, 64, 64)).map_blocks(
            predict, dtype=np.float32, chunks=(100, 10), drop_axis=[2, 3]
        )
        y = scores.compute()
        reports = list(client.run(report).values())
    sess = InferenceSession(path, num_threads=1)  # as each worker's
    want = np.concatenate([sess.run(None, {"in0": x[i : i + 100]})[0] for i in range(0, ROWS, 100)])
    assert y.shape == (ROWS, 10) and np.array_equal(y, want)
    assert len({pid for pid, *_ in reports}) == 2
    assert sum(rows for _, rows, _ in reports) == ROWS, reports  # every block ran on its worker's one Predictor
    assert all(rows > 0 for _, rows, _ in reports), reports
    assert [threads for *_, threads in reports] == [1, 1]  # Dask's nanny sets OMP_NUM_THREADS=1 in each worker
