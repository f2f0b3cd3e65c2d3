"""Backend choice for the fused kernels: ``"auto" | "torch" | "triton"``, with errors that say why.

Triton is imported here lazily, never at ``import rolloutopt`` time (that import stays light). The Triton path runs on
CUDA tensors, or on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1`` — that is how CPU CI tests the
kernels). The variable must be set before ``triton`` is first imported by anything in the process (verl, Liger and
``torch.compile`` import it too): ``triton.language`` builds its own jitted helpers at import, and with the
interpreter switched on later a launch fails with "Cannot call @triton.jit'd outside of the scope of a kernel".
``"auto"`` picks Triton for CUDA tensors when it is importable, the chunked torch path otherwise.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from rolloutopt._validation import choice
from rolloutopt.errors import InputError

__all__ = ["BACKENDS", "interpreting", "resolve_backend", "triton_unavailable_reason"]

BACKENDS = ("auto", "torch", "triton")


def interpreting() -> bool:
    """Whether Triton's CPU interpreter is on (``TRITON_INTERPRET=1`` in the environment)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def triton_unavailable_reason(device: torch.device) -> str | None:
    """``None`` when the Triton backend can run on ``device``; otherwise why not, in words."""
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed (pip install 'rolloutopt[kernels]')"
    if device.type == "cuda":
        return None
    if interpreting():
        return None if device.type == "cpu" else f"the Triton interpreter runs on CPU tensors, not {device.type}"
    return f"tensors are on {device.type}; Triton needs CUDA tensors, or TRITON_INTERPRET=1 for CPU tensors"


def resolve_backend(backend: str, device: torch.device) -> str:
    """The backend to run: ``"torch"`` or ``"triton"``; a forced ``"triton"`` that cannot run raises and says why."""
    choice(backend, "backend", BACKENDS)
    reason = triton_unavailable_reason(device)
    if backend == "auto":
        return "triton" if reason is None and device.type == "cuda" else "torch"
    if backend == "triton" and reason is not None:
        raise InputError(
            "backend", "a backend that can run here", f"'triton', but {reason}", "pass backend='torch' or 'auto'"
        )
    return backend
