"""Advantage estimators (rewards and group ids → advantages), reward shapers and selectors, with their registries.

Every method is a pure function — ``grpo(rewards, group, *, hyper-parameters)`` — that stays importable and
callable as it is (``rolloutopt.advantages.grpo``). For trainers whose configs hold strings, each family also
has a registry, all of one shape (:class:`~rolloutopt.registry.MethodRegistry`, with ``get``, ``entry``,
``names`` and ``register``):

- :data:`REGISTRY`, the **advantage estimators**, also reached through this module's :func:`get`,
  :func:`entry`, :func:`names` and :func:`register`. Every entry is called the same way,
  ``get(name)(rewards, group, **inputs) -> AdvantageOutput``, with ``rewards [B]`` (``[B, K]`` for the
  multi-reward estimators, whose ``reward_dims`` is ``"B K"``);
- :data:`SHAPERS`, the **reward shapers**: ``SHAPERS.get(name)(**inputs)`` returns shaped rewards (a result with
  ``.rewards [B]`` and ``.metrics``) to feed an estimator;
- :data:`SELECTORS`, the **token and sample selectors**: ``SELECTORS.get(name)(**inputs)`` returns loss weights
  or masks for the policy loss.

``get(name)`` returns a callable :class:`~rolloutopt.registry.Method` (an :class:`Estimator` for estimators)
whose ``requires`` are the inputs the method cannot run without and ``accepts`` the optional ones it consumes,
with ``reference`` (arXiv id, authors' code, trainers) and ``experimental`` (why it is partly reconstructed, or
None). *Inputs* are the per-rollout and per-token tensors — ``mask``, ``logp``, ``ref_logp``, ``entropy``,
``prior``, ``valid``, ``advantages``, ``correct``, ``invalid``, ``is_flawed``, ``lengths``, ``answers``, ... —
and every other keyword of a function is a *hyper-parameter* that passes through unchanged. A call checks the
inputs: a missing required one, one the method does not consume (the message names the methods that would use
it) and an unknown keyword each raise an :class:`~rolloutopt.errors.InputError` naming it, and an experimental
method needs ``experimental=True``. ``allow_unused=True`` drops inputs the method does not consume, for adapters
that pass everything they have.

Which family each method belongs to follows from what it maps to what:

- ``ace`` and ``xrpo_sharpen`` are **estimators**: from rewards they compute GRPO advantages and reshape them
  with a log-likelihood statistic (``logp``, and ``ref_logp`` for ACE). They also take precomputed
  ``advantages=`` with ``rewards=None`` to reshape another estimator's output, which keeps the estimator call.
- ``drpo`` is an **estimator**: from correctness rewards it returns DRPO's exact per-sequence gradient
  coefficients as advantages (``logp`` and ``mask`` are inputs), which :func:`rolloutopt.losses.policy_loss`
  consumes like any other advantages.
- ``dler_normalise`` is an **estimator**: group-mean centring then batch whitening of the rewards, GRPO's
  place in DLER's recipe (its companion :func:`truncation_penalty` is the shaper).
- ``latent_mask`` is an **estimator**: GRPO over the valid rollouts of each group, invalid ones (truncated at
  ``max_len`` by the response ``mask``, its required input, or flagged ``invalid``) getting advantage 0 and
  weight 0. It changes the baseline, not only which rows train, so it cannot run after another estimator.
- ``v05`` is an **estimator**: the reward minus a baseline fused from the group mean and a value model's
  ``prior`` (a required input).
- ``d3s`` is a **selector**: it takes advantages already computed (``advantages``, ``entropy``, ``mask``) and
  returns them unchanged with the rollouts and tokens to keep (``weight``, ``token_mask``). ``nat_weights`` is
  a selector too (token subsampling with Horvitz–Thompson weights, from the ``mask`` alone).
- ``fapo_penalty``, ``truncation_penalty`` and ``dare_rewards`` are **shapers**: they return rewards
  (``ShapedRewards``, ``DAREOutput``), not advantages.

``drpo_trust_penalty`` is a loss term (a scalar to add to the loss), and :func:`to_tokens` and
:func:`d3s_schedule` are helpers; they are not registered.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Literal

from rolloutopt.advantages._base import REGISTRY, SELECTORS, SHAPERS, AdvantageOutput, Estimator, ShapedRewards
from rolloutopt.advantages.ace import ace
from rolloutopt.advantages.d3s import D3SOutput, d3s, d3s_schedule
from rolloutopt.advantages.dare import DAREOutput, dare_rewards
from rolloutopt.advantages.dler import dler_normalise, truncation_penalty
from rolloutopt.advantages.drpo import drpo, drpo_trust_penalty
from rolloutopt.advantages.fapo import fapo_penalty
from rolloutopt.advantages.gdpo import gd2po, gdpo
from rolloutopt.advantages.latent import latent_mask
from rolloutopt.advantages.median import gapo, mc_grpo
from rolloutopt.advantages.nat import TokenSubsample, nat_weights
from rolloutopt.advantages.reference import dr_grpo, grpo, reinforce_pp_baseline, rloo, to_tokens
from rolloutopt.advantages.v05 import V05Output, v05
from rolloutopt.advantages.xrpo import xrpo_sharpen
from rolloutopt.registry import Entry

__all__ = [
    "REGISTRY",
    "SELECTORS",
    "SHAPERS",
    "AdvantageOutput",
    "D3SOutput",
    "DAREOutput",
    "Estimator",
    "ShapedRewards",
    "TokenSubsample",
    "V05Output",
    "ace",
    "d3s",
    "d3s_schedule",
    "dare_rewards",
    "dler_normalise",
    "dr_grpo",
    "drpo",
    "drpo_trust_penalty",
    "entry",
    "fapo_penalty",
    "gapo",
    "gd2po",
    "gdpo",
    "get",
    "grpo",
    "latent_mask",
    "mc_grpo",
    "names",
    "nat_weights",
    "register",
    "reinforce_pp_baseline",
    "rloo",
    "to_tokens",
    "truncation_penalty",
    "v05",
    "xrpo_sharpen",
]


def get(name: str) -> Estimator:
    """The advantage estimator registered as ``name``, callable as ``get(name)(rewards, group, **inputs)``.

    An unknown name raises an :class:`~rolloutopt.errors.InputError` listing the registered estimators (reward
    shapers and selectors are in :data:`SHAPERS` and :data:`SELECTORS`).
    """
    return REGISTRY.get(name)


def entry(name: str) -> Entry[Estimator]:
    """The :class:`~rolloutopt.registry.Entry` of the estimator ``name``: ``requires``, ``accepts``, ``reference``,
    ``experimental``."""
    return REGISTRY.entry(name)


def names() -> list[str]:
    """Names of every registered advantage estimator, sorted."""
    return REGISTRY.names()


def register(
    name: str,
    fn: Callable[..., Any],
    *,
    requires: Iterable[str] | None = None,
    accepts: Iterable[str] | None = None,
    reference: str | None = None,
    experimental: str | None = None,
    reward_dims: Literal["B", "B K"] | None = None,
    overwrite: bool = False,
) -> Estimator:
    """Register ``fn(rewards, group, ..., *, hyper-parameters) -> AdvantageOutput`` as the estimator ``name``.

    Args:
        name: the registry name (snake_case of the function name).
        fn: the function; its first two positional parameters must be ``rewards`` and ``group``.
        requires: the inputs beyond ``rewards`` and ``group`` it cannot run without (e.g. ``("mask",)``).
        accepts: the optional inputs it consumes when given (e.g. ``("valid",)``).
        reference: where the method comes from (arXiv id, authors' code, trainers).
        experimental: why it is partly reconstructed (calls then need ``experimental=True``), or None.
        reward_dims: ``"B"`` (default) or ``"B K"`` for ``K`` reward components per rollout.
        overwrite: replace an estimator already registered under ``name``.

    Returns:
        the :class:`Estimator` that :func:`get` now returns for ``name``. Registering the same function with
        the same declarations again is a no-op; a different one under a taken name raises unless ``overwrite``.
    """
    extra: dict[str, Any] = {} if reward_dims is None else {"reward_dims": reward_dims}
    return REGISTRY.register(
        name,
        fn,
        requires=requires,
        accepts=accepts,
        reference=reference,
        experimental=experimental,
        overwrite=overwrite,
        **extra,
    )
