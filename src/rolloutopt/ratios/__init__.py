"""Ratios and trust regions: log-probs → importance ratios, clipped or gated per-token policy terms.

Stage configs (frozen dataclasses) for :func:`rolloutopt.losses.policy_loss`: ratio constructions
(:class:`TokenRatio`, :class:`GSPORatio`) and trust regions (:class:`PPOClip`, :class:`CISPO`, :class:`SAPO`),
each beside the pure function it wraps.
"""

from __future__ import annotations

from rolloutopt.ratios.reference import (
    CISPO,
    SAPO,
    GSPORatio,
    PPOClip,
    TokenRatio,
    TrustOutput,
    cispo_weight,
    gspo_token_log_ratio,
    log_ratio,
    ppo_clip_loss,
    sapo_gate,
    sequence_log_ratio,
)

__all__ = [
    "CISPO",
    "SAPO",
    "GSPORatio",
    "PPOClip",
    "TokenRatio",
    "TrustOutput",
    "cispo_weight",
    "gspo_token_log_ratio",
    "log_ratio",
    "ppo_clip_loss",
    "sapo_gate",
    "sequence_log_ratio",
]
