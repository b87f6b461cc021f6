"""conv_transpose kernels (see the registry docstring in __init__.py for the kernel contract)."""

import numpy as np  # noqa: F401

from pmx.runtime.kernels import register  # noqa: F401
