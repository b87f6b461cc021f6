"""The models a server holds: each .pmx opened once per worker process, behind a
BatchingSession when its batch dim can grow, else an InferenceSession that runs one
request at a time. Imports the runtime only, never the web framework."""

from __future__ import annotations

import os
import re

from pmx.runtime import BatchingSession, InferenceSession, PmxInputError, SessionOptions
from pmx.runtime.serve import protocol

# a model name is one URL path segment; these characters need no escaping anywhere
MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*\Z")


class _ObservedSession(InferenceSession):
    """An InferenceSession that tells `on_run` the rows (dim 0) of each run() call: the
    batch-size metric of a model served one request at a time (a BatchingSession tells
    its own runs through on_batch, and does not call run())."""

    def __init__(self, path, sess_options, on_run):
        super().__init__(path, sess_options=sess_options)
        self._on_run = on_run

    def run(self, output_names=None, input_feed=None, run_options=None):
        self._on_run(_rows(input_feed))
        return super().run(output_names, input_feed, run_options)


def _rows(feed):
    for value in (feed or {}).values():
        shape = getattr(value, "shape", ())
        return shape[0] if shape else 1
    return 1


class ServedModel:
    """One model as served: its name, its tensors in the protocol's terms, and submit()."""

    def __init__(self, name, path, session, batching):
        self.name = name
        self.path = path
        self.session = session
        self.batching = batching  # None: the batch dim cannot grow, one request at a time
        self.inputs = _specs(session.get_inputs(), session.model.inputs, session)
        self.outputs = _specs(session.get_outputs(), session.model.outputs, session)
        self.input_specs = {s.name: s for s in self.inputs}
        self.output_names = [s.name for s in self.outputs]

    def submit(self, output_names, feed):
        """A concurrent.futures.Future of the outputs; PmxInputError here, at once, for a
        request the model cannot take (the BatchingSession checks before queuing)."""
        if self.batching is not None:
            return self.batching.submit(output_names, feed)
        return self.session.run_async(output_names, feed)  # one thread: runs queue in order

    def metadata(self):
        return protocol.model_metadata(self.name, self.inputs, self.outputs)

    def describe(self):
        tensors = ", ".join(f"{s.name} {s.datatype} {list(s.shape)}" for s in self.inputs)
        if self.batching is None:
            how = "one request at a time (its batch dim cannot grow: compile it without --static to batch)"
        else:
            how = (
                f"batching up to {self.batching.max_batch_size} rows per run, "
                f"waiting up to {self.batching.max_wait_ms:g} ms for a batch to fill"
            )
        return f"model {self.name!r} from {self.path}: inputs {tensors}; {how}"

    def close(self):
        """Run what is queued, then stop (BatchingSession.close)."""
        if self.batching is not None:
            self.batching.close()


def _specs(node_args, indices, session):
    tensors = session.model.tensors
    try:
        return tuple(protocol.tensor_spec(arg, tensors[i].dtype) for arg, i in zip(node_args, indices))
    except ValueError as e:
        raise PmxInputError(f"{session.model.path}: cannot serve this model: {e}") from None


def open_model(name, path, threads=1, max_batch_size=32, max_wait_ms=2.0, on_run=None):
    """A ServedModel for the .pmx at `path`: `threads` intra-op threads, batched when its
    batch dim can grow. on_run(rows) is called before each model run (metrics)."""
    options = SessionOptions()
    options.intra_op_num_threads = threads
    session = _ObservedSession(path, options, on_run or (lambda rows: None))
    try:
        batching = BatchingSession(
            session, max_batch_size=max_batch_size, max_wait_ms=max_wait_ms, on_batch=on_run or (lambda rows: None)
        )
    except PmxInputError:  # the batch dim cannot grow (the arguments were checked by the CLI)
        batching = None
    return ServedModel(name, path, session, batching)


def model_names(paths, names):
    """[(name, path)]: the i-th of `names` names the i-th model, the rest are named by
    their file stem. PmxInputError for more names than models, a name that is not one URL
    path segment, or two models of one name."""
    names = list(names or ())
    if len(names) > len(paths):
        raise PmxInputError(f"{len(names)} --name given for {len(paths)} models; give at most one per model")
    named = []
    for i, path in enumerate(paths):
        name = names[i] if i < len(names) else _stem(path)
        if not MODEL_NAME.match(name):
            raise PmxInputError(
                f"model name {name!r} (of {path}) must be letters, digits, '_', '.' or '-', starting with a "
                f"letter or digit; name it with --name"
            )
        named.append((name, path))
    seen = set()
    for name, path in named:
        if name in seen:
            raise PmxInputError(f"two models are named {name!r}; name one of them with --name (the {path} one)")
        seen.add(name)
    return named


def _stem(path):
    base = os.path.basename(path)
    return base[: -len(".pmx")] if base.endswith(".pmx") else os.path.splitext(base)[0]
