"""Fused token-level kernels: log-prob and entropy from hidden states without the logits, and a fused loss on logits.

Filled in by the kernels issue. ``triton`` is imported lazily inside this package only.
"""

from __future__ import annotations

from rolloutopt.kernels._backend import BACKENDS, resolve_backend, triton_unavailable_reason

__all__ = ["BACKENDS", "resolve_backend", "triton_unavailable_reason"]
