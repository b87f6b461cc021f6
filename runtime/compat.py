"""onnxruntime's API beyond run(): model metadata, execution providers, profiling traces.

Kept apart from session.py so the InferenceSession only calls into it: an InferenceSession asks for its
metadata record, checks the providers it was given, and, when profiling is enabled,
hands each node's timing to a Profiler that writes a Chrome trace.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import time
import warnings

import numpy as np

from pmx.runtime.dtypes import ONNX_ELEMENT_TYPE, ORT_TYPE
from pmx.runtime.errors import PmxInputError
from pmx.runtime.options import checked_value
from pmx.runtime.record import FrozenRecord, set_fields

CPU_PROVIDER = "CPUExecutionProvider"


class ModelMetadata(FrozenRecord):
    """Same fields as onnxruntime.ModelMetadata. producer_name is "pmx" (the runtime that
    reads the file; producer_version the pmx that wrote it), graph_name the stem of the
    .param file the model was compiled from, custom_metadata_map what `pmx compile --meta
    KEY=VALUE` stored. A .pmx file has no domain, description or model version: those
    read as "" and 0, as onnxruntime reports them for an ONNX file without them."""

    __slots__ = (
        "producer_name",
        "producer_version",
        "graph_name",
        "graph_description",
        "domain",
        "description",
        "version",
        "custom_metadata_map",
    )

    def __init__(self, **fields):
        set_fields(self, fields)


def model_metadata(model) -> ModelMetadata:
    name, _, version = (model.producer or "").partition(" ")
    graph = os.path.basename(model.source or "").removesuffix(".param").removesuffix(".pnnx")
    return ModelMetadata(
        producer_name=name or "pmx",
        producer_version=version,
        graph_name=graph,
        graph_description="",
        domain="",
        description="",
        version=0,
        custom_metadata_map=dict(model.metadata),
    )


def check_providers(providers):
    """Warn, as onnxruntime does for a provider it does not have, about any provider but
    the CPU one: the InferenceSession still runs, on the CPU. Entries may be names or (name,
    options) pairs."""
    if providers is None:
        return
    if isinstance(providers, str):
        raise PmxInputError(f"providers must be a list of provider names, not the string {providers!r}")
    for entry in providers:
        name = entry[0] if isinstance(entry, (tuple, list)) and entry else entry
        if name != CPU_PROVIDER:
            warnings.warn(
                f"Specified provider {name!r} is not available in pmx, which runs on the CPU only; "
                f"running with {CPU_PROVIDER!r}",
                UserWarning,
                stacklevel=3,
            )


class Profiler:
    """Collects one complete event ("ph": "X") per node per run, plus one per run, and
    writes them as a Chrome trace (chrome://tracing, Perfetto) like onnxruntime's
    end_profiling(): times in microseconds from the InferenceSession's start of profiling."""

    def __init__(self, prefix):
        self.prefix = prefix or "pmx_profile"
        self.start = time.perf_counter()
        self.start_ns = time.time_ns()
        self.started_at = time.localtime()
        self.events = []  # list.append is atomic: runs on several threads may add at once
        self.pid = os.getpid()

    def _us(self, t):
        return round((t - self.start) * 1e6, 3)

    def node(self, node, t0, t1, shapes):
        self.events.append(
            {
                "name": node.name,
                "cat": "Node",
                "ph": "X",
                "ts": self._us(t0),
                "dur": round((t1 - t0) * 1e6, 3),
                "pid": self.pid,
                "tid": threading.get_ident(),
                "op": node.op,
                "args": {"op_name": node.op, "variant": node.variant, "output_shapes": shapes},
            }
        )

    def run(self, t0, t1):
        self.events.append(
            {
                "name": "model_run",
                "cat": "Session",
                "ph": "X",
                "ts": self._us(t0),
                "dur": round((t1 - t0) * 1e6, 3),
                "pid": self.pid,
                "tid": threading.get_ident(),
            }
        )

    def write(self):
        """Write the trace to <prefix>_<local time>.json (a numbered suffix if that exists)
        and return its path."""
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S", self.started_at)
        path = f"{self.prefix}_{stamp}.json"
        k = 1
        while os.path.exists(path):
            path = f"{self.prefix}_{stamp}_{k}.json"
            k += 1
        import json  # here, not at import: only profiling writes JSON, and json's import costs every start

        try:
            with open(path, "w") as f:
                json.dump({"traceEvents": list(self.events), "displayTimeUnit": "ms"}, f)
        except OSError as e:
            raise PmxInputError(f"cannot write the profile {path} (profile_file_prefix): {e.strerror or e}") from None
        return path


# --- providers and devices ------------------------------------------------------------


def get_available_providers():
    """The execution providers this runtime has: the CPU one."""
    return [CPU_PROVIDER]


def get_all_providers():
    """Every provider this build knows: the CPU one (onnxruntime lists the ones it could
    have been built with; pmx has no other)."""
    return [CPU_PROVIDER]


def get_device():
    return "CPU"


def set_default_logger_severity(severity):
    """Accepted, no effect: pmx logs nothing. The range is onnxruntime's (0 verbose .. 4
    fatal); nothing process-wide changes."""
    _check_log_level("severity", severity, 4)


def set_default_logger_verbosity(verbosity):
    """Accepted, no effect: pmx logs nothing."""
    _check_log_level("verbosity", verbosity, None)


def _check_log_level(what, value, most):
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"logging {what} must be an int, got {type(value).__name__}")
    if value < 0 or (most is not None and value > most):
        raise PmxInputError(
            f"logging {what} {value}: expected 0..{most}" if most else f"logging {what} {value}: expected >= 0"
        )


# --- run options ------------------------------------------------------------------------

# onnxruntime.RunOptions' attributes: (default, type); run_tag is pmx's name for the run
# in a terminate error (older onnxruntime releases had it)
_RUN_FIELDS = {
    "log_severity_level": (2, int),
    "log_verbosity_level": (0, int),
    "logid": ("", str),
    "run_tag": ("", str),
    "terminate": (False, bool),
    "only_execute_path_to_fetches": (False, bool),
}


class RunOptions:
    """onnxruntime.RunOptions. `terminate` is honoured: a run checks it before each node
    and stops with PmxRunTerminated, so another thread can cancel a long run. run_tag (or
    logid) names the run in that error. pmx always runs only the nodes the requested
    outputs need (only_execute_path_to_fetches); the log levels are kept and have no
    effect (pmx logs nothing). Unknown attributes raise AttributeError."""

    __slots__ = tuple(_RUN_FIELDS) + ("_config",)

    def __init__(self):
        for name, (default, _) in _RUN_FIELDS.items():
            object.__setattr__(self, name, default)
        object.__setattr__(self, "_config", {})

    def __setattr__(self, name, value):
        field = _RUN_FIELDS.get(name)
        if field is None:
            raise AttributeError(f"'RunOptions' object has no attribute {name!r}")
        object.__setattr__(self, name, checked_value("RunOptions", name, value, field[1]))

    def add_active_adapter(self, adapter):
        raise PmxInputError("add_active_adapter: pmx has no LoRA adapters; compile the adapted model instead")

    def add_run_config_entry(self, key: str, value: str) -> None:
        self._config[str(key)] = str(value)

    def get_run_config_entry(self, key: str) -> str:
        if key not in self._config:
            raise PmxInputError(f"run config entry {key!r} is not set")
        return self._config[key]


def check_run_options(run_options):
    """run_options as given (None or a RunOptions); TypeError for anything else, as
    onnxruntime's bindings raise."""
    if run_options is not None and not isinstance(run_options, RunOptions):
        raise TypeError(f"run_options must be a pmx.runtime.RunOptions or None, got {type(run_options).__name__}")
    return run_options


# --- values and bindings ------------------------------------------------------------------


class OrtValue:
    """onnxruntime.OrtValue on the CPU: a numpy array (shared, not copied)."""

    __slots__ = ("_array",)

    def __init__(self, array):
        self._array = array

    @classmethod
    def ortvalue_from_numpy(cls, array, device_type="cpu", device_id=0):
        check_cpu(device_type)
        return cls(np.asarray(array))

    @classmethod
    def ortvalue_from_shape_and_type(cls, shape, element_type, device_type="cpu", device_id=0, **_device):
        """A new tensor of `shape` and `element_type` (a numpy type, or an ONNX
        TensorProto number as onnxruntime takes), zero-filled (onnxruntime leaves it
        uninitialized)."""
        check_cpu(device_type)
        return cls(np.zeros(tuple(shape), _element_dtype(element_type)))

    def numpy(self):
        return self._array

    def data_ptr(self):
        """The address of the first element."""
        return self._array.ctypes.data

    def shape(self):
        return list(self._array.shape)

    def data_type(self):
        return ORT_TYPE.get(self._array.dtype.name, f"tensor({self._array.dtype.name})")

    def element_type(self):
        return self._array.dtype.type

    def device_name(self):
        return "cpu"

    def is_tensor(self):
        return True

    def has_value(self):
        return True


def check_cpu(device_type):
    """A device name, or an onnxruntime OrtDevice (whose device_type() is 0 for the CPU):
    the CPU only."""
    if hasattr(device_type, "device_type"):
        device_type = "cpu" if device_type.device_type() == 0 else device_type.device_type()
    if str(device_type).lower() != "cpu":
        raise PmxInputError(f"device {device_type!r}: pmx runs on the CPU only ('cpu')")


def _element_dtype(element_type):
    if isinstance(element_type, int) and not isinstance(element_type, bool):
        if element_type not in ONNX_ELEMENT_TYPE:
            raise PmxInputError(
                f"element type {element_type}: pmx takes the ONNX TensorProto types {sorted(ONNX_ELEMENT_TYPE)} "
                f"or numpy types"
            )
        return np.dtype(ONNX_ELEMENT_TYPE[element_type])
    try:
        return np.dtype(element_type)
    except TypeError:
        raise PmxInputError(
            f"element type {element_type!r}: expected a numpy type or an ONNX TensorProto number"
        ) from None


def array_at(buffer_ptr, element_type, shape):
    """A numpy array over memory the caller owns (onnxruntime's bind_input/bind_output
    with a buffer pointer): the caller keeps it alive and large enough, as with
    onnxruntime."""
    dtype = np.dtype(element_type)
    count = math.prod(shape)
    if not isinstance(buffer_ptr, int) or buffer_ptr <= 0:
        raise PmxInputError(f"buffer_ptr must be a positive integer address, got {buffer_ptr!r}")
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(buffer_ptr)
    return np.frombuffer(raw, dtype, count).reshape(shape)


class IOBinding:
    """onnxruntime.IOBinding for the CPU: inputs bound once and reused by every
    run_with_iobinding; outputs either allocated by the run (get_outputs,
    copy_outputs_to_cpu) or written into memory the caller bound (bind_output with a
    buffer, or bind_output_array with an array), which saves the copy out."""

    def __init__(self, session):
        self._session = session
        self._inputs = {}
        self._outputs = {}  # name -> caller's array, or None: allocated by the run
        self._results = []

    def bind_cpu_input(self, name, arr_on_cpu):
        self._inputs[name] = arr_on_cpu

    def bind_input(self, name, device_type, device_id, element_type, shape, buffer_ptr):
        check_cpu(device_type)
        self._inputs[name] = array_at(buffer_ptr, element_type, tuple(shape))

    def bind_ortvalue_input(self, name, ortvalue):
        self._inputs[name] = ortvalue.numpy()

    def bind_output(self, name, device_type="cpu", device_id=0, element_type=None, shape=None, buffer_ptr=None):
        check_cpu(device_type)
        if buffer_ptr is None:
            self._outputs[name] = None
            return
        if element_type is None or shape is None:
            raise PmxInputError(f"bind_output({name!r}): a buffer_ptr needs element_type and shape")
        self._outputs[name] = array_at(buffer_ptr, element_type, tuple(shape))

    def bind_output_array(self, name, array):
        """pmx's shorthand for bind_output with array's buffer: the run writes into it."""
        if not isinstance(array, np.ndarray) or not array.flags.writeable:
            raise PmxInputError(f"bind_output_array({name!r}): expected a writeable numpy array")
        self._outputs[name] = array

    def bind_ortvalue_output(self, name, ortvalue):
        self._outputs[name] = ortvalue.numpy()

    def clear_binding_inputs(self):
        self._inputs = {}

    def clear_binding_outputs(self):
        self._outputs = {}
        self._results = []

    def synchronize_inputs(self):
        """Nothing to wait for on the CPU."""

    def synchronize_outputs(self):
        """Nothing to wait for on the CPU."""

    def get_outputs(self):
        return [OrtValue(a) for a in self._results]

    get_outputs_as_ortvaluevector = get_outputs

    def copy_outputs_to_cpu(self):
        return [np.array(a, copy=True) for a in self._results]

    def run(self, run_options=None):
        """What InferenceSession.run_with_iobinding does."""
        names = list(self._outputs) or None
        into = [self._outputs[n] for n in names] if names else None
        self._results = self._session.run_into(names, self._inputs, into, run_options)
