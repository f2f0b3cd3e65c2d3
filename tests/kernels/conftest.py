"""Kernel tests run the Triton kernels on CPU tensors under Triton's interpreter.

``TRITON_INTERPRET`` must be set before ``triton.jit`` decorates a kernel (see docs/methods/kernels.md); the
kernel modules are imported lazily, on the first Triton call, so setting it here, at collection time, is early
enough. ``setdefault`` leaves an explicit ``TRITON_INTERPRET=0`` (e.g. on a GPU runner) alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
