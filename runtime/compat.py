"""onnxruntime's API beyond run(): model metadata, execution providers, profiling traces.

Kept apart from session.py so the InferenceSession only calls into it: an InferenceSession asks for its
metadata record, checks the providers it was given, and, when profiling is enabled,
hands each node's timing to a Profiler that writes a Chrome trace.
"""

from __future__ import annotations

import json
import os
import threading
import time
import warnings

from pmx.runtime.errors import PmxInputError
from pmx.runtime.record import FrozenRecord

CPU_PROVIDER = "CPUExecutionProvider"


class ModelMetadata(FrozenRecord):
    """Same fields as onnxruntime.ModelMetadata. producer_name is "pmx" (the runtime that
    reads the file; producer_version the pmx that wrote it), graph_name the stem of the
    .param file the model was compiled from, custom_metadata_map what `pmx compile --meta
    KEY=VALUE` stored. A .pmx file has no domain, description or model version: those
    read as "" and 0, as onnxruntime reports them for an ONNX file without them."""

    __slots__ = ("producer_name", "producer_version", "graph_name", "graph_description", "domain", "description",
                 "version", "custom_metadata_map")

    def __init__(self, producer_name, producer_version, graph_name, graph_description, domain, description, version,
                 custom_metadata_map):
        for f, v in zip(self.__slots__, (producer_name, producer_version, graph_name, graph_description, domain,
                                         description, version, custom_metadata_map)):
            object.__setattr__(self, f, v)


def model_metadata(model) -> ModelMetadata:
    name, _, version = (model.producer or "").partition(" ")
    graph = os.path.basename(model.source or "").removesuffix(".param").removesuffix(".pnnx")
    return ModelMetadata(producer_name=name or "pmx", producer_version=version, graph_name=graph,
                         graph_description="", domain="", description="", version=0,
                         custom_metadata_map=dict(model.metadata))


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
            warnings.warn(f"Specified provider {name!r} is not available in pmx, which runs on the CPU only; "
                          f"running with {CPU_PROVIDER!r}", UserWarning, stacklevel=3)


class Profiler:
    """Collects one complete event ("ph": "X") per node per run, plus one per run, and
    writes them as a Chrome trace (chrome://tracing, Perfetto) like onnxruntime's
    end_profiling(): times in microseconds from the InferenceSession's start of profiling."""

    def __init__(self, prefix):
        self.prefix = prefix or "pmx_profile"
        self.start = time.perf_counter()
        self.started_at = time.localtime()
        self.events = []  # list.append is atomic: runs on several threads may add at once
        self.pid = os.getpid()

    def _us(self, t):
        return round((t - self.start) * 1e6, 3)

    def node(self, node, t0, t1, shapes):
        self.events.append({"name": node.name, "cat": "Node", "ph": "X", "ts": self._us(t0),
                            "dur": round((t1 - t0) * 1e6, 3), "pid": self.pid, "tid": threading.get_ident(),
                            "op": node.op, "args": {"op_name": node.op, "variant": node.variant,
                                                    "output_shapes": shapes}})

    def run(self, t0, t1):
        self.events.append({"name": "model_run", "cat": "Session", "ph": "X", "ts": self._us(t0),
                            "dur": round((t1 - t0) * 1e6, 3), "pid": self.pid, "tid": threading.get_ident()})

    def write(self):
        """Write the trace to <prefix>_<local time>.json (a numbered suffix if that exists)
        and return its path."""
        stamp = time.strftime("%Y-%m-%d_%H-%M-%S", self.started_at)
        path = f"{self.prefix}_{stamp}.json"
        k = 1
        while os.path.exists(path):
            path = f"{self.prefix}_{stamp}_{k}.json"
            k += 1
        try:
            with open(path, "w") as f:
                json.dump({"traceEvents": list(self.events), "displayTimeUnit": "ms"}, f)
        except OSError as e:
            raise PmxInputError(f"cannot write the profile {path} (profile_file_prefix): {e.strerror or e}") from None
        return path
