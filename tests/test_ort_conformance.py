"""The same user-level onnxruntime script, run against onnxruntime (on the .onnx torch
exports) and against pmx (on the .pmx compiled from pnnx's export of the same module).
Member by member: the same outputs (within 1e-4), the same result types, the same
exception classes, except the differences listed in DIFFERENCES (docs/onnxruntime.md says
why for each). Needs onnxruntime and onnx (test extra)."""

import threading

import numpy as np
import pytest

from pmx.compiler.driver import compile_model

ort = pytest.importorskip("onnxruntime")

# record key -> why pmx differs from onnxruntime there (each also in docs/onnxruntime.md)
DIFFERENCES = {
    "error terminate": "pmx raises PmxRunTerminated (a PmxError); onnxruntime its Fail",
    "error wrong dtype": "pmx raises PmxInputError (a ValueError); onnxruntime its InvalidArgument",
    "all providers": "onnxruntime lists every provider it knows; pmx has the CPU one only",
    "error logger severity": "pmx raises PmxInputError (a ValueError); onnxruntime a RuntimeError",
}


def modules():
    import torch
    import torch.nn as nn

    class Cnn(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.dw = nn.Conv2d(8, 8, 3, padding=1, groups=8)
            self.fc = nn.Linear(8, 5)

        def forward(self, x):
            y = torch.relu(self.dw(torch.relu(self.conv(x))))
            return self.fc(y.mean((2, 3)))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 4)

        def forward(self, x):
            return torch.softmax(self.b(torch.tanh(self.a(x))), dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(16, 48)

        def forward(self, x):
            q, k, v = self.qkv(x).chunk(3, dim=-1)
            w = torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1)
            return w @ v

    return {"cnn": (Cnn(), (1, 3, 16, 16)), "mlp": (Mlp(), (2, 16)), "attention": (Attention(), (1, 6, 16))}


@pytest.fixture(scope="module")
def models(exporter, tmp_path_factory):
    import torch

    d = tmp_path_factory.mktemp("ort_conformance")
    built = {}
    for name, (module, shape) in modules().items():
        module = module.eval()
        x = torch.rand(*shape, generator=torch.Generator().manual_seed(0))
        prefix = exporter(f"ort_conformance_{name}", module, (x,))
        compile_model(prefix + ".pnnx.param", prefix + ".pnnx.bin", str(d / f"{name}.pmx"), auto_batch=False)
        torch.onnx.export(
            module, (x,), str(d / f"{name}.onnx"), dynamo=False, input_names=["input"], output_names=["output"]
        )
        built[name] = (str(d / f"{name}.onnx"), str(d / f"{name}.pmx"), x.numpy())
    return built


def error_of(fn):
    """The class name of what fn() raises (its first base outside the runtime's own
    classes: ValueError, TypeError, AttributeError), or None."""
    try:
        fn()
    except Exception as e:  # the class is what is compared
        builtin = next((c for c in type(e).__mro__ if c.__module__ == "builtins"), Exception)
        return builtin.__name__
    return None


def user_script(rt, path, x):
    """Ordinary onnxruntime code. Returns {what: value} to compare across runtimes."""
    record = {}
    so = rt.SessionOptions()
    so.intra_op_num_threads = 2  # onnxruntime runs run_async on its intra-op pool: at least 2
    so.inter_op_num_threads = 1
    so.graph_optimization_level = rt.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.execution_mode = rt.ExecutionMode.ORT_SEQUENTIAL
    so.log_severity_level = 3
    so.enable_mem_pattern = True
    so.enable_cpu_mem_arena = True
    so.use_deterministic_compute = True
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    record["error unknown option"] = error_of(lambda: setattr(so, "intra_op_num_thread", 1))
    record["error option type"] = error_of(lambda: setattr(so, "intra_op_num_threads", "1"))
    sess = rt.InferenceSession(path, sess_options=so, providers=["CPUExecutionProvider"])
    record["providers"] = sess.get_providers()
    record["available providers"] = "CPUExecutionProvider" in rt.get_available_providers()
    record["all providers"] = rt.get_all_providers()
    record["device"] = rt.get_device()
    record["provider options"] = sess.get_provider_options()
    record["overridable initializers"] = sess.get_overridable_initializers()
    record["threads"] = sess.get_session_options().intra_op_num_threads
    record["profiling start type"] = type(sess.get_profiling_start_time_ns()).__name__
    record["end profiling"] = sess.end_profiling()
    record["profiling start after end"] = sess.get_profiling_start_time_ns()
    meta = sess.get_modelmeta()
    record["meta fields"] = [
        type(getattr(meta, f)).__name__
        for f in ("producer_name", "graph_name", "domain", "description", "version", "custom_metadata_map")
    ]
    inp, out = sess.get_inputs()[0], sess.get_outputs()[0]
    record["input"] = (inp.shape, inp.type)
    record["output type"] = out.type
    feed = {inp.name: x}
    record["run"] = sess.run(None, feed)
    ro = rt.RunOptions()
    ro.log_severity_level = 3
    ro.logid = "conformance"
    record["run with options"] = sess.run([out.name], feed, ro)
    io = sess.io_binding()
    io.bind_cpu_input(inp.name, x)
    io.bind_output(out.name)
    sess.run_with_iobinding(io)
    record["iobinding copy"] = io.copy_outputs_to_cpu()
    record["iobinding values"] = [v.numpy() for v in io.get_outputs()]
    io.clear_binding_inputs()
    io.clear_binding_outputs()
    value = rt.OrtValue.ortvalue_from_numpy(x)
    record["ort values"] = [v.numpy() for v in sess.run_with_ort_values([out.name], {inp.name: value})]
    record["data pointer"] = value.data_ptr() == x.ctypes.data
    empty = rt.OrtValue.ortvalue_from_shape_and_type([2, 3], np.float32)
    record["value from shape and type"] = (empty.shape(), empty.data_type())
    rt.set_default_logger_severity(3)
    record["error logger severity"] = error_of(lambda: rt.set_default_logger_severity(7))
    done, got = threading.Event(), {}

    def callback(outputs, user_data, error):
        got.update(outputs=outputs, user_data=user_data, error=error)
        done.set()

    sess.run_async(None, feed, callback, "token")
    assert done.wait(60)
    record["async"] = (got["outputs"], got["user_data"], got["error"])
    stop = rt.RunOptions()
    stop.terminate = True
    record["error terminate"] = type(_raised(lambda: sess.run(None, feed, stop))).__name__
    record["error run options type"] = error_of(lambda: sess.run(None, feed, object()))
    record["error missing input"] = error_of(lambda: sess.run(None, {}))
    record["error wrong dtype"] = error_of(lambda: sess.run(None, {inp.name: x.astype(np.float64)}))
    record["error unknown run option"] = error_of(lambda: setattr(ro, "no_such_option", 1))
    return record


def _raised(fn):
    try:
        fn()
    except Exception as e:  # returned for comparison
        return e
    return None


def same(a, b):
    """Equal, or arrays (also inside lists and tuples) within 1e-4 of the same dtype."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and np.allclose(a, b, rtol=1e-4, atol=1e-5)
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("name", ["cnn", "mlp", "attention"])
def test_the_same_onnxruntime_script_runs_on_pmx(models, name):
    import pmx.runtime as pmx_rt

    onnx_path, pmx_path, x = models[name]
    want = user_script(ort, onnx_path, x)
    got = user_script(pmx_rt, pmx_path, x)
    assert set(got) == set(want)
    differing = sorted(k for k in want if not same(got[k], want[k]))
    assert differing == sorted(k for k in DIFFERENCES if k in want), {k: (got[k], want[k]) for k in differing}
    assert got["error terminate"] == "PmxRunTerminated"
