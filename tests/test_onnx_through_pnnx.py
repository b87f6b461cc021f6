"""ONNX models made here with the onnx package's helpers (no downloads), converted by pnnx
(`pnnx model.onnx`, pnnx's ONNX import writes spellings torch exports never do), compiled
and run by pmx, and compared with onnxruntime on the same model and inputs. Each case is
one where pmx once answered wrongly, refused a right graph, or wrote a file it then
refused."""

import subprocess

import numpy as np
import onnx
import onnxruntime
import pnnx
from onnx import TensorProto, helper, numpy_helper

from pmx.compiler.driver import compile_model
from pmx.runtime import InferenceSession

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64


def value(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def constant(name, array):
    return numpy_helper.from_array(np.asarray(array), name)


def onnx_model(path, nodes, inputs, outputs, initializers=(), opset=18):
    graph = helper.make_graph(nodes, path.stem, inputs, outputs, initializer=list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def through_pnnx(onnx_path, feeds, **compile_options):
    """pmx's outputs and onnxruntime's on `feeds`, after `pnnx model.onnx` and
    `pmx compile` (which checks the file it writes with the loader)."""
    codes = {"int64": "i64", "int32": "i32", "float32": ""}
    shapes = ",".join("[" + ",".join(map(str, a.shape)) + "]" + codes[a.dtype.name] for a in feeds.values())
    done = subprocess.run(
        [pnnx.EXEC_PATH, onnx_path.name, f"inputshape={shapes}"],
        cwd=onnx_path.parent,
        capture_output=True,
        text=True,
        timeout=300,
    )
    prefix = onnx_path.with_suffix("")
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    compile_model(f"{prefix}.pnnx.param", f"{prefix}.pnnx.bin", f"{prefix}.pmx", **compile_options)
    sess = InferenceSession(f"{prefix}.pmx")
    got = sess.run(None, dict(zip([a.name for a in sess.get_inputs()], feeds.values())))
    want = onnxruntime.InferenceSession(str(onnx_path), providers=["CPUExecutionProvider"]).run(None, feeds)
    return got, want


def assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, g.dtype, w.shape, w.dtype)
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)


def test_a_number_first_comparison(tmp_path):
    """Less(2.0, x): pnnx writes `torch.lt input=2.0 $other=x` (ONNX's Shrink and
    ThresholdedRelu bodies)."""
    path = onnx_model(
        tmp_path / "less.onnx",
        [helper.make_node("Less", ["c", "x"], ["y"])],
        [value("x", FLOAT, [3, 4])],
        [value("y", TensorProto.BOOL, [3, 4])],
        [constant("c", np.float32(2.0))],
    )
    x = np.linspace(-4, 4, 12, dtype=np.float32).reshape(3, 4)
    assert_same(*through_pnnx(path, {"x": x}))


def test_constant_of_shape_follows_the_shape_values(tmp_path):
    """ConstantOfShape: `torch.ones $size=s`, the size read from the input's values when
    the model runs, not the shape pnnx recorded from its own placeholder."""
    path = onnx_model(
        tmp_path / "cos.onnx",
        [helper.make_node("ConstantOfShape", ["s"], ["y"], value=constant("v", np.array([1.0], np.float32)))],
        [value("s", INT64, [3])],
        [value("y", FLOAT, ["a", "b", "c"])],
    )
    for shape in ([4, 3, 2], [1, 5, 0]):
        assert_same(*through_pnnx(path, {"s": np.array(shape, np.int64)}))


def test_layer_norm_with_its_mean_and_inverse_std(tmp_path):
    rng = np.random.default_rng(0)
    path = onnx_model(
        tmp_path / "ln.onnx",
        [helper.make_node("LayerNormalization", ["x", "w", "b"], ["y", "mean", "rstd"], axis=-1, epsilon=1e-5)],
        [value("x", FLOAT, [2, 3, 4])],
        [value("y", FLOAT, [2, 3, 4]), value("mean", FLOAT, [2, 3, 1]), value("rstd", FLOAT, [2, 3, 1])],
        [constant("w", rng.random(4, np.float32)), constant("b", rng.random(4, np.float32))],
    )
    assert_same(*through_pnnx(path, {"x": rng.standard_normal((2, 3, 4)).astype(np.float32)}))


def test_gemm_with_a_row_bias(tmp_path):
    """Gemm with transB and C of shape (1, N): `F.linear` with a (1, N) bias, which
    broadcasts as torch's does."""
    rng = np.random.default_rng(1)
    path = onnx_model(
        tmp_path / "gemm.onnx",
        [helper.make_node("Gemm", ["x", "w", "c"], ["y"], transB=1)],
        [value("x", FLOAT, [3, 6])],
        [value("y", FLOAT, [3, 4])],
        [constant("w", rng.random((4, 6), np.float32)), constant("c", rng.random((1, 4), np.float32))],
    )
    assert_same(*through_pnnx(path, {"x": rng.standard_normal((3, 6)).astype(np.float32)}))


def test_logsumexp_over_no_elements_is_minus_infinity(tmp_path):
    path = onnx_model(
        tmp_path / "lse.onnx",
        [helper.make_node("ReduceLogSumExp", ["x", "axes"], ["y"], keepdims=1)],
        [value("x", FLOAT, [2, 0, 4])],
        [value("y", FLOAT, [2, 1, 4])],
        [constant("axes", np.array([1], np.int64))],
    )
    got, want = through_pnnx(path, {"x": np.zeros((2, 0, 4), np.float32)})
    assert np.all(want[0] == -np.inf)
    assert_same(got, want)


def test_einsum_with_the_empty_equation(tmp_path):
    """Einsum '' on a 0-d input is the input."""
    path = onnx_model(
        tmp_path / "einsum.onnx",
        [helper.make_node("Einsum", ["x"], ["y"], equation="")],
        [value("x", FLOAT, [])],
        [value("y", FLOAT, [])],
        opset=12,
    )
    # pnnx records no shape or dtype for a 0-d input: the compile is told them
    assert_same(*through_pnnx(path, {"x": np.array(1.5, np.float32)}, shape="in0=", dtype="in0=float32"))


def test_a_window_of_a_length_read_from_the_input(tmp_path):
    """ONNX's HannWindow function body: Range up to a 0-d input's value, then elementwise
    math on the result: `torch.arange $end=<tensor>` whose output, sized at run time, an
    elementwise node reads. The 0-d input has no dtype in pnnx's .param: it is given."""
    path = onnx_model(
        tmp_path / "hann.onnx",
        [
            helper.make_node("Cast", ["n"], ["nf"], to=FLOAT),
            helper.make_node("Range", ["zero", "nf", "one"], ["k"]),
            helper.make_node("Mul", ["k", "two_pi"], ["angle"]),
            helper.make_node("Div", ["angle", "nf"], ["phase"]),
            helper.make_node("Cos", ["phase"], ["c"]),
            helper.make_node("Mul", ["c", "half"], ["hc"]),
            helper.make_node("Sub", ["half", "hc"], ["y"]),
        ],
        [value("n", TensorProto.INT32, [])],
        [value("y", FLOAT, ["n"])],
        [
            constant("zero", np.float32(0)),
            constant("one", np.float32(1)),
            constant("two_pi", np.float32(2 * np.pi)),
            constant("half", np.float32(0.5)),
        ],
    )
    for n in (10, 3):
        assert_same(*through_pnnx(path, {"n": np.array(n, np.int32)}, shape="in0=", dtype="in0=int32"))


def test_grid_sample_with_onnx_mode_names(tmp_path):
    """GridSample's modes as ONNX names them ('linear', 'cubic'), which pnnx writes into
    `F.grid_sample` as they are."""
    rng = np.random.default_rng(2)
    for mode in ("linear", "cubic"):
        path = onnx_model(
            tmp_path / f"grid_{mode}.onnx",
            [helper.make_node("GridSample", ["x", "g"], ["y"], mode=mode, align_corners=0)],
            [value("x", FLOAT, [1, 2, 5, 6]), value("g", FLOAT, [1, 3, 4, 2])],
            [value("y", FLOAT, [1, 2, 3, 4])],
            opset=20,
        )
        feeds = {
            "x": rng.standard_normal((1, 2, 5, 6)).astype(np.float32),
            "g": rng.uniform(-1.1, 1.1, (1, 3, 4, 2)).astype(np.float32),
        }
        assert_same(*through_pnnx(path, feeds))


def test_tile_with_repeats_read_from_an_input(tmp_path):
    """Tile whose repeats are an input: `torch.tile $dims=<tensor>`, its output sized
    from the repeats' values when the model runs."""
    path = onnx_model(
        tmp_path / "tile.onnx",
        [helper.make_node("Tile", ["x", "r"], ["y"])],
        [value("x", FLOAT, [2, 3]), value("r", INT64, [2])],
        [value("y", FLOAT, ["a", "b"])],
    )
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    for reps in ([2, 1], [1, 3], [0, 2]):
        assert_same(*through_pnnx(path, {"x": x, "r": np.array(reps, np.int64)}))
