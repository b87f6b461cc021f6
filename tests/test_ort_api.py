"""onnxruntime's Python API beyond run(), through pmx's public API: options that refuse
typos, RunOptions.terminate from another thread, IOBinding with caller-owned buffers,
run_async with a callback, as a future and under asyncio. (The side-by-side comparison
with onnxruntime itself is tests/test_ort_conformance.py.)"""

import asyncio
import copy
import pickle
import threading

import numpy as np
import pytest

import pmx.runtime as rt
from pmx.compiler.driver import compile_model

EXAMPLE = "tools/example/cnn"


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    import pathlib

    root = pathlib.Path(__file__).resolve().parents[1]
    out = tmp_path_factory.mktemp("ort_api") / "cnn.pmx"
    compile_model(str(root / EXAMPLE) + ".pnnx.param", str(root / EXAMPLE) + ".pnnx.bin", str(out))
    sess = rt.InferenceSession(str(out))
    x = np.load(root / "tools" / "example" / "cnn_input.npy")
    return sess, x, sess.run(None, {"in0": x})[0]


def test_session_options_have_onnxruntimes_attributes_and_refuse_others():
    so = rt.SessionOptions()
    for name, value in [
        ("graph_optimization_level", rt.GraphOptimizationLevel.ORT_DISABLE_ALL),
        ("execution_mode", rt.ExecutionMode.ORT_PARALLEL),
        ("enable_cpu_mem_arena", False),
        ("enable_mem_pattern", False),
        ("log_verbosity_level", 1),
        ("logid", "x"),
        ("use_deterministic_compute", True),
        ("optimized_model_filepath", "/tmp/o.onnx"),
        ("execution_order", rt.ExecutionOrder.PRIORITY_BASED),
        ("intra_op_num_threads", 3),
    ]:
        setattr(so, name, value)
        assert getattr(so, name) == value
    with pytest.raises(AttributeError, match="intra_op_num_thread"):
        so.intra_op_num_thread = 1  # the typo onnxruntime refuses too
    for name, bad in [
        ("intra_op_num_threads", "2"),
        ("intra_op_num_threads", True),
        ("enable_profiling", 1),
        ("graph_optimization_level", 7),
    ]:
        with pytest.raises(TypeError):
            setattr(so, name, bad)
    so.add_free_dimension_override_by_name("batch", 4)
    back = pickle.loads(pickle.dumps(so))
    assert (back.intra_op_num_threads, back.execution_order, copy.copy(so).logid) == (
        3,
        rt.ExecutionOrder.PRIORITY_BASED,
        "x",
    )
    with pytest.raises(rt.PmxInputError, match="weights"):
        so.add_initializer("w", None)


def test_run_options_terminate_stops_a_run_started_on_another_thread(model):
    sess, x, _ = model
    ro = rt.RunOptions()
    ro.logid = "job-7"
    ro.terminate = True
    with pytest.raises(rt.PmxRunTerminated, match="job-7"):
        sess.run(None, {"in0": x}, ro)
    with pytest.raises(AttributeError):
        ro.no_such_field = 1
    with pytest.raises(TypeError):
        sess.run(None, {"in0": x}, run_options=object())
    # set from another thread while runs go on: the next node check stops it
    ro = rt.RunOptions()
    stopped = []

    def runs():
        try:
            for _ in range(10_000):
                sess.run(None, {"in0": x}, ro)
        except rt.PmxRunTerminated as e:
            stopped.append(e)

    t = threading.Thread(target=runs)
    t.start()
    ro.terminate = True
    t.join(60)
    assert stopped and not t.is_alive()
    ro.terminate = False
    assert sess.run(None, {"in0": x}, ro)[0].shape == model[2].shape


def test_iobinding_with_caller_buffers_writes_into_them(model):
    sess, x, want = model
    io = sess.io_binding()
    io.bind_input("in0", "cpu", 0, np.float32, list(x.shape), x.ctypes.data)
    out = np.full(want.shape, np.nan, np.float32)
    io.bind_output("out0", "cpu", 0, np.float32, list(out.shape), out.ctypes.data)
    sess.run_with_iobinding(io)
    np.testing.assert_array_equal(out, want)  # written in place, no copy out
    assert io.get_outputs()[0].numpy() is not None and io.get_outputs()[0].shape() == list(want.shape)
    mine = np.zeros_like(want)
    io.bind_output_array("out0", mine)
    sess.run_with_iobinding(io)
    np.testing.assert_array_equal(mine, want)
    io.bind_output_array("out0", np.zeros((1, 2), np.float32))
    with pytest.raises(rt.PmxInputError, match="bound output"):
        sess.run_with_iobinding(io)
    io.clear_binding_outputs()
    io.bind_output("out0")
    sess.run_with_iobinding(io)
    np.testing.assert_array_equal(io.copy_outputs_to_cpu()[0], want)
    with pytest.raises(rt.PmxInputError, match="CPU"):
        io.bind_output("out0", "cuda")


def test_run_async_callback_future_and_asyncio(model):
    sess, x, want = model
    done, got = threading.Event(), {}
    sess.run_async(
        None,
        {"in0": x},
        lambda outs, data, err: (got.update(outs=outs, data=data, err=err), done.set()),
        {"request": 1},
    )
    assert done.wait(60)
    assert got["err"] == "" and got["data"] == {"request": 1}
    np.testing.assert_array_equal(got["outs"][0], want)
    done.clear()
    sess.run_async(None, {"nope": x}, lambda outs, data, err: (got.update(outs=outs, err=err), done.set()), None)
    assert done.wait(60)
    assert got["outs"] is None and "nope" in got["err"]
    np.testing.assert_array_equal(sess.run_async(None, {"in0": x}).result(60)[0], want)

    async def serve():
        return await asyncio.gather(*(asyncio.wrap_future(sess.run_async(None, {"in0": x})) for _ in range(3)))

    for outs in asyncio.run(serve()):
        np.testing.assert_array_equal(outs[0], want)


def test_module_level_members():
    assert rt.get_available_providers() == ["CPUExecutionProvider"] == rt.get_all_providers()
    assert rt.get_device() == "CPU"
    value = rt.OrtValue.ortvalue_from_numpy(np.ones((2, 3), np.float32))
    assert (value.shape(), value.data_type(), value.device_name()) == ([2, 3], "tensor(float)", "cpu")
