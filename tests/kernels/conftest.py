"""Kernel tests run the Triton kernels on CPU tensors under Triton's interpreter.

``TRITON_INTERPRET`` must be on before ``triton`` is first imported by anything in the process
(``triton.language`` builds its own jitted helpers at import; see docs/methods/kernels.md). The root
``tests/conftest.py`` sets it before any test module is collected; this ``setdefault`` repeats it for runs that
start here. An explicit ``TRITON_INTERPRET=0`` (e.g. on a GPU runner) is left alone.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")
