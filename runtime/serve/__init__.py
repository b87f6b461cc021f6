"""pmx.runtime.serve: `pmx serve`, an Open Inference Protocol (KServe V2 / Triton HTTP)
server for .pmx models. Needs the [serve] extra (starlette, uvicorn, prometheus-client).

    pmx serve model.pmx --workers 2          # or: python -m pmx.runtime.serve model.pmx

To run the app under a server of your own, build it from opened models:

    from pmx.runtime.serve.app import create_app
    from pmx.runtime.serve.metrics import Metrics
    from pmx.runtime.serve.models import open_model

    metrics = Metrics(["cnn"])
    app = create_app([open_model("cnn", "cnn.pmx", on_run=metrics.batch_observer("cnn"))], 64 << 20, metrics)

This package imports the runtime only, never the compiler; this module imports nothing,
so `pmx --help` works without the extra.
"""
