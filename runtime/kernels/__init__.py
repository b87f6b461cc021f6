"""Kernels: one family file per group of ops, each registering its ops' factories and
shape rules in the registry (registry.py) when imported. A factory gets the binding's
BindContext (bind.py: shared scratch, persistent buffers, temporaries, worker pool);
common.py holds the helpers the families share.

The families are imported explicitly below, for their registrations; registering a name
twice is an error. Python runs this file before any module of the package, so importing
registry.py (or any family) from anywhere registers every family first. No family
imports this package's namespace: each imports the modules it uses by their full path.
"""

from pmx.runtime.kernels import (  # noqa: F401  (registration side effects)
    attention,
    conv,
    conv_transpose,
    elementwise,
    indexing,
    linalg,
    norm,
    pool,
    recurrent,
    reduce,
    resample,
    sampling,
    shape,
    spectral,
    windows,
    winograd,
)
