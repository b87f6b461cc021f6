"""onnxruntime's InferenceSession behaviours beyond run(): model bytes, model metadata,
providers, run(None / []), profiling, and which error a failure raises."""

import json
import pathlib
import struct
import warnings

import numpy as np
import pytest
from helpers import recompute_crcs

from pmx.compiler import compile_model
from pmx.runtime import (
    InferenceSession,
    PmxError,
    PmxFormatError,
    PmxInputError,
    PmxInternalError,
    SessionOptions,
    flatbuffer_reader,
)
from pmx.runtime import fileformat as ff
from pmx.runtime import header as pmx_header
from pmx.schema import pmx_generated as fb

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "tools" / "example"
X = np.load(EXAMPLE / "cnn_input.npy")
EXPECTED = np.load(EXAMPLE / "cnn_expected.npy")  # torch's output for X
META = {"author": "Ada", "license": "CC-BY-4.0", "note": "ünïcode = ok; a=b"}


def _close_to_torch(y):
    return np.abs(y - EXPECTED).max() / np.abs(EXPECTED).max() <= 1e-4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("ort")
    plain, meta = d / "plain.pmx", d / "meta.pmx"
    compile_model(str(EXAMPLE / "cnn.pnnx.param"), output=str(plain))
    compile_model(str(EXAMPLE / "cnn.pnnx.param"), output=str(meta), metadata=META)
    return plain, meta


def _header(data):
    pre = ff.unpack_preamble(data[: ff.PREAMBLE_SIZE])
    return pre, data[pre["header_offset"] : pre["header_offset"] + pre["header_size"]]


# --- bytes ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [bytes, bytearray, memoryview])
def test_session_from_bytes_runs_like_the_file(models, kind):
    plain, _ = models
    sess = InferenceSession(kind(plain.read_bytes()))
    [y] = sess.run(None, {"in0": X})
    assert _close_to_torch(y)
    assert [a.name for a in sess.get_inputs()] == [a.name for a in InferenceSession(str(plain)).get_inputs()]


def test_bytes_are_verified_like_a_file(models):
    plain, _ = models
    data = bytearray(plain.read_bytes())
    data[10] ^= 0xFF  # inside the preamble: its checksum no longer matches
    with pytest.raises(PmxFormatError, match="preamble checksum"):
        InferenceSession(bytes(data))
    with pytest.raises(PmxFormatError, match=r"shorter than the 64-byte preamble.*content"):
        InferenceSession(b"model.pmx")  # bytes are content, never a path
    with pytest.raises(PmxFormatError, match="truncated or padded"):
        InferenceSession(plain.read_bytes()[:-64])
    data = bytearray(plain.read_bytes())
    data[-1] ^= 0x01  # in the data section: only the checksum check sees it
    with pytest.raises(PmxFormatError, match="data checksum mismatch"):
        InferenceSession(bytes(data), verify=True)


def test_weights_from_a_bytearray_do_not_follow_later_changes(models):
    plain, _ = models
    data = bytearray(plain.read_bytes())
    sess = InferenceSession(data)
    pre, _ = _header(bytes(data))
    data[pre["data_offset"] :] = bytes(len(data) - pre["data_offset"])  # zero every weight
    [y] = sess.run(None, {"in0": X})
    assert _close_to_torch(y)


def test_session_refuses_other_types():
    with pytest.raises(PmxInputError, match=r"path to a .pmx file or its bytes"):
        InferenceSession(42)


# --- metadata ------------------------------------------------------------------------


def test_modelmeta_round_trip(models):
    _, meta = models
    m = InferenceSession(str(meta)).get_modelmeta()
    assert m.custom_metadata_map == META
    assert list(m.custom_metadata_map) == list(META)  # in the order given
    assert m.producer_name == "pmx" and m.graph_name == "cnn"
    for field in ("domain", "description", "graph_description"):
        assert getattr(m, field) == ""
    assert m.version == 0
    from pmx.runtime import __version__

    assert m.producer_version == __version__


def test_file_without_metadata_loads_with_an_empty_map(models):
    """Files compiled without --meta do not carry the field at all, as files written
    before it existed: they load, and read as no metadata."""
    plain, _ = models
    _, header = _header(plain.read_bytes())
    assert fb.Model.GetRootAs(header, 0).MetadataIsNone()
    assert InferenceSession(str(plain)).get_modelmeta().custom_metadata_map == {}


def test_a_runtime_that_predates_metadata_reads_a_file_with_it(models, monkeypatch):
    """A reader that knows no metadata field (the loader's Model layout without it, as it
    was) loads and runs a file that has one: the field is optional and last."""

    plain, meta = models
    pre, header = _header(meta.read_bytes())
    assert fb.Model.GetRootAs(header, 0).MetadataLength() == len(META)
    assert pre["version"] == _header(plain.read_bytes())[0]["version"]  # no format version bump
    old = flatbuffer_reader.Layout("Model", **{k: v for k, v in pmx_header.MODEL_ACCESSORS.items() if k != "metadata"})
    monkeypatch.setattr(pmx_header, "_MODEL", old)
    monkeypatch.setattr(pmx_header, "_read_metadata", lambda r, m: {})
    [y] = InferenceSession(str(meta)).run(None, {"in0": X})
    assert _close_to_torch(y)


def test_damaged_metadata_is_a_format_error(models):
    """A metadata string whose length word points past the header, or a key stored twice,
    is refused by the verifier like any other string (checksums recomputed, as a forger
    would: otherwise the header's checksum refuses it first)."""
    _, meta = models
    data = bytearray(meta.read_bytes())
    pre, header = _header(bytes(data))
    at = pre["header_offset"] + header.index(META["license"].encode()) - 4
    assert struct.unpack_from("<I", data, at)[0] == len(META["license"])
    struct.pack_into("<I", data, at, 0x7FFFFFF0)
    with pytest.raises(PmxFormatError, match="metadata"):
        InferenceSession(recompute_crcs(data))
    data = bytearray(meta.read_bytes())
    at = pre["header_offset"] + header.index(b"license")
    data[at : at + 7] = b"author\0"
    struct.pack_into("<I", data, at - 4, 6)  # the key "license" now reads "author"
    with pytest.raises(PmxFormatError, match="metadata key 'author' appears more than once"):
        InferenceSession(recompute_crcs(data))


def test_metadata_keys_must_be_strings(tmp_path):
    from pmx.runtime import PmxCompileError

    with pytest.raises(PmxCompileError, match="keys and values must be strings"):
        compile_model(str(EXAMPLE / "cnn.pnnx.param"), output=str(tmp_path / "m.pmx"), metadata={"k": 1})


# --- providers, outputs --------------------------------------------------------------


def test_unknown_provider_warns_and_cpu_is_silent(models):
    plain, _ = models
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        InferenceSession(str(plain), providers=["CPUExecutionProvider"])
        InferenceSession(str(plain), providers=[("CPUExecutionProvider", {})])
    with pytest.warns(UserWarning, match="'CUDAExecutionProvider'.*CPU"):
        sess = InferenceSession(str(plain), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert sess.get_providers() == ["CPUExecutionProvider"]
    with pytest.warns(UserWarning, match="'TensorrtExecutionProvider'"):
        InferenceSession(str(plain), providers=[("TensorrtExecutionProvider", {"device_id": 0})])


def test_run_none_and_empty_list_return_every_output(models):
    plain, _ = models
    sess = InferenceSession(str(plain))
    for names in (None, [], ()):
        outs = sess.run(names, {"in0": X})
        assert len(outs) == len(sess.get_outputs()) == 1 and _close_to_torch(outs[0])


# --- profiling -----------------------------------------------------------------------


def test_profiling_writes_a_chrome_trace(models, tmp_path):
    plain, _ = models
    so = SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(tmp_path / "prof")
    sess = InferenceSession(str(plain), sess_options=so)
    started = sess.get_profiling_start_time_ns()
    for _ in range(2):
        [y] = sess.run(None, {"in0": X})
        assert _close_to_torch(y)
    path = sess.end_profiling()
    assert sess.get_profiling_start_time_ns() == started > 0  # kept after the end, as onnxruntime
    assert pathlib.Path(path).parent == tmp_path and pathlib.Path(path).name.startswith("prof_")
    assert path.endswith(".json")
    trace = json.loads(pathlib.Path(path).read_text())
    events = trace["traceEvents"]
    nodes = [e for e in events if e.get("cat") == "Node"]
    runs = [e for e in events if e.get("cat") == "Session"]
    assert len(runs) == 2
    names = {n.name: n.op for n in sess.model.nodes}
    counts = {}
    for e in nodes:
        assert e["ph"] == "X" and e["dur"] >= 0 and e["ts"] >= 0
        assert names[e["name"]] == e["args"]["op_name"]
        counts[e["name"]] = counts.get(e["name"], 0) + 1
    assert set(counts.values()) == {2}  # each node that runs, once per run
    assert len(counts) >= len(sess.model.nodes) // 2
    first = [e["ts"] for e in nodes[: len(counts)]]
    assert first == sorted(first)  # in execution order
    assert sess.end_profiling() == ""  # profiling stopped, as onnxruntime's does
    sess.run(None, {"in0": X})


def test_run_with_ortvaluevector_fills_the_fetches(models):
    """onnxruntime's lowest-level run: OrtValues in, the caller's fetch list filled."""
    from pmx.runtime import OrtValue

    plain, _ = models
    sess = InferenceSession(str(plain))
    fetches = [None]
    sess.run_with_ortvaluevector(None, ["in0"], [OrtValue.ortvalue_from_numpy(X)], ["out0"], fetches, ["cpu"])
    [value] = fetches
    assert isinstance(value, OrtValue) and _close_to_torch(value.numpy())
    with pytest.raises(PmxInputError, match="CPU only"):
        sess.run_with_ortvaluevector(None, ["in0"], [OrtValue.ortvalue_from_numpy(X)], ["out0"], [], ["cuda"])


def test_end_profiling_without_profiling_is_empty(models):
    plain, _ = models
    assert InferenceSession(str(plain)).end_profiling() == ""


# --- which error --------------------------------------------------------------------


def _last_op(path):
    return InferenceSession(str(path)).model.nodes[-1]


def test_kernel_failure_at_run_is_an_internal_error(models, monkeypatch):
    """A file that passed every check must run: a kernel raising is pmx's own bug,
    named by node, with a request for a bug report."""
    from pmx.runtime.kernels.registry import REGISTRY

    plain, _ = models
    node = _last_op(plain)

    def make(node, ins, outs, ctx):
        return lambda: 1 / 0

    monkeypatch.setattr(REGISTRY[node.op], "make", make)
    sess = InferenceSession(str(plain))
    with pytest.raises(
        PmxInternalError,
        match=rf"node '{node.name}' \({node.op}\) failed at run: ZeroDivisionError.*"
        r"bug in pmx.*report it with the model file",
    ):
        sess.run(None, {"in0": X})
    so = SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = str(plain.parent / "p")
    with pytest.raises(PmxInternalError, match=rf"node '{node.name}'"):
        InferenceSession(str(plain), sess_options=so).run(None, {"in0": X})


def test_kernel_failure_at_bind_is_an_internal_error(models, monkeypatch):
    from pmx.runtime.kernels.registry import REGISTRY

    plain, _ = models
    node = _last_op(plain)

    def make(node, ins, outs, ctx):
        raise KeyError("axis")

    monkeypatch.setattr(REGISTRY[node.op], "make", make)
    with pytest.raises(PmxInternalError, match=rf"node '{node.name}' \({node.op}\) failed at bind: KeyError"):
        InferenceSession(str(plain)).run(None, {"in0": X})


def test_verifier_failures_stay_format_errors(models):
    plain, _ = models
    data = bytearray(plain.read_bytes())
    pre, _ = _header(bytes(data))
    data[pre["header_offset"] + 4 : pre["header_offset"] + 8] = b"XXXX"  # the file identifier
    with pytest.raises(PmxFormatError) as e:
        InferenceSession(bytes(data))
    assert not isinstance(e.value, PmxInternalError)
    assert issubclass(PmxInternalError, PmxError) and not issubclass(PmxInternalError, PmxFormatError)
