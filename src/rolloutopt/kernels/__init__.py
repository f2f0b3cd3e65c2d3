"""Fused token-level kernels: log-prob and entropy of the sampled tokens, from hidden states or from logits.

- :func:`token_logprobs` — ``(hidden [N, d], weight [V, d], targets [N]) -> (logp [N], entropy [N])``, never
  materialising ``[N, V]`` (online log-sum-exp over vocabulary chunks, recomputing backward);
- :func:`logits_logprobs` — ``(logits [B, T, V] | [N, V], targets) -> (logp, entropy)`` in one pass per row,
  ``dlogits`` written in place in the backward.

Each has a chunked torch backend (the CPU default) and a Triton backend (CUDA; on CPU under
``TRITON_INTERPRET=1``), chosen with ``backend="auto" | "torch" | "triton"`` (:func:`resolve_backend`).
``triton`` is imported lazily, only when the Triton backend runs. The kernels sit directly above the core and
import nothing else from rolloutopt: objectives are composed on their outputs in :mod:`rolloutopt.losses`
(:func:`rolloutopt.losses.fused_policy_loss` is :func:`logits_logprobs` followed by ``policy_loss``).
"""

from __future__ import annotations

from rolloutopt.kernels._backend import BACKENDS, resolve_backend, triton_unavailable_reason
from rolloutopt.kernels.logits_logprobs import logits_logprobs, resolve_logits_backend, torch_chunk_rows
from rolloutopt.kernels.token_logprobs import token_logprobs

__all__ = [
    "BACKENDS",
    "logits_logprobs",
    "resolve_backend",
    "resolve_logits_backend",
    "token_logprobs",
    "torch_chunk_rows",
    "triton_unavailable_reason",
]
