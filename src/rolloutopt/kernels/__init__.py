"""Fused token-level kernels: log-prob and entropy from hidden states without the logits, and a fused loss on logits.

- :func:`token_logprobs` — ``(hidden [N, d], weight [V, d], targets [N]) -> (logp [N], entropy [N])``, never
  materialising ``[N, V]`` (online log-sum-exp over vocabulary chunks, recomputing backward);
- :func:`fused_policy_loss` — the token-level objective of a preset from logits ``[N, V]`` / ``[B, T, V]`` in one
  pass per row, ``dlogits`` written in place in the backward.

Each has a chunked torch backend (the CPU default) and a Triton backend (CUDA; on CPU under
``TRITON_INTERPRET=1``), chosen with ``backend="auto" | "torch" | "triton"`` (:func:`resolve_backend`).
``triton`` is imported lazily, only when the Triton backend runs. ``fused_policy_loss`` is the one kernel that
composes with a layer above (it aggregates with :mod:`rolloutopt.losses` and takes its stage configs).
"""

from __future__ import annotations

from rolloutopt.kernels._backend import BACKENDS, resolve_backend, triton_unavailable_reason
from rolloutopt.kernels.fused_loss import FUSED_PRESETS, FusedLossOutput, fused_policy_loss
from rolloutopt.kernels.token_logprobs import token_logprobs

__all__ = [
    "BACKENDS",
    "FUSED_PRESETS",
    "FusedLossOutput",
    "fused_policy_loss",
    "resolve_backend",
    "token_logprobs",
    "triton_unavailable_reason",
]
