"""verl integration: every rolloutopt loss preset and advantage estimator under ``rolloutopt_<name>`` in verl.

Registration (``docs/integrations/verl.md``). Once this module is imported in a process where verl is
(being) imported, every loss preset of :func:`rolloutopt.losses.names` is in verl's ``POLICY_LOSS_REGISTRY``
as ``rolloutopt_<name>`` (:func:`make_policy_loss_fn`) and every estimator of
:func:`rolloutopt.advantages.names` is in ``ADV_ESTIMATOR_REGISTRY`` as ``rolloutopt_<name>``
(:func:`make_advantage_fn`). verl reaches it in every process (driver and Ray workers) through

1. the ``verl.plugins`` entry point that rolloutopt declares (verl ≥ 0.9.1 loads it on ``import verl``);
2. ``VERL_USE_EXTERNAL_MODULES=rolloutopt.integrations.verl`` (older verl, e.g. 0.8.x);
3. an explicit ``import rolloutopt.integrations.verl`` (or :func:`register`).

Importing this module never imports verl by itself (``import rolloutopt`` and a walk over its modules stay
light): when verl is not imported yet, a post-import hook registers the names as soon as
``verl.trainer.ppo.core_algos`` is imported. verl swallows plug-in errors at DEBUG level, so every
registration failure is logged here at ERROR level on the ``"rolloutopt"`` logger.

Selected with ``actor_rollout_ref.actor.policy_loss.loss_mode=rolloutopt_<preset>`` and
``algorithm.adv_estimator=rolloutopt_<estimator>``; extra loss hyper-parameters go through
``RolloutOptPolicyLossConfig`` (``policy_loss._target_=rolloutopt.integrations.verl.RolloutOptPolicyLossConfig``),
extra estimator hyper-parameters under ``+algorithm.rolloutopt.<estimator>.<keyword>=...``. The page
``docs/integrations/verl.md`` lists, per preset, the verl fields read.
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import ModuleType
from typing import Any

import torch
from jaxtyping import Shaped
from torch import Tensor

import rolloutopt.advantages as _advantages
import rolloutopt.losses as _losses
from rolloutopt.advantages import Estimator, to_tokens
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.losses import Denominators, declared_inputs, policy_loss
from rolloutopt.ratios import CISPO, DPPO, OPSM, SAPO, GSPORatio, M2POClip, M2POMask, PPOClip
from rolloutopt.typing import BoolBT, FloatBT, Scalar

__all__ = [
    "FUSED_ENV",
    "PREFIX",
    "RolloutOptPolicyLossConfig",  # noqa: F822 - defined on first access (module __getattr__), it subclasses verl
    "make_advantage_fn",
    "make_policy_loss_fn",
    "policy_loss_kwargs",
    "register",
    "use_token_logprobs",
    "verl_metrics",
]

PREFIX = "rolloutopt_"
"""Every name registered in verl is ``PREFIX + <rolloutopt name>`` (built-ins such as ``grpo`` stay verl's)."""

logger = logging.getLogger("rolloutopt")

_CORE_ALGOS = "verl.trainer.ppo.core_algos"
_VERL_AGG_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
_M2PO_PAIRS = ("old_current", "behav_old")

# rolloutopt metric -> verl's own key where the two mean the same thing (verl/trainer/ppo/core_algos.py)
_VERL_METRIC_KEYS = {
    "clipfrac": "actor/pg_clipfrac",
    "approx_kl": "actor/ppo_kl",
    "dual_clip_frac": "actor/pg_clipfrac_lower",
    "dppo_masked_frac": "actor/pg_clipfrac",  # verl's dppo_tv / dppo_kl: fraction of invalid tokens
    "dppo_ratio_capped_frac": "actor/pg_clipfrac_lower",  # verl's dppo: fraction with r > clip_ratio_c
}
# verl's ppo_loss logs actor/pg_loss itself (with SUM aggregation under global batch info)
_DROPPED_METRICS = frozenset({"pg_loss"})

# Inputs a preset may require that verl's loss call (verl/workers/utils/losses.py::ppo_loss) cannot pass.
_UNAVAILABLE = {
    "behav_logp": (
        "rollout-engine log-probs, which verl's policy-loss call does not pass (old_log_prob is the proximal "
        "recompute, or the rollout log-probs themselves in bypass mode)",
        "for TIS / IcePop use verl's rollout correction (algorithm.rollout_correction.rollout_is=token, "
        "rollout_is_threshold=2.0 or '0.5_5.0'): its rollout_is_weights are applied by every rolloutopt_* loss, "
        "e.g. loss_mode=rolloutopt_dapo; for M2PO use rolloutopt_m2po (RolloutOptPolicyLossConfig.m2po_pair="
        "'old_current') or rolloutopt_m2po_clip; otherwise call rolloutopt.losses.get(...) with behav_logp=... "
        "from your own training loop",
    ),
    "versions": (
        "the policy version of every token, which verl's policy-loss call does not pass",
        "call rolloutopt.losses.get(...) with versions=... from your own training loop",
    ),
    "topk_logp": (
        "top-K log-probs of the current and rollout policies, which verl's policy-loss call does not pass",
        "use rolloutopt_dppo_tv or rolloutopt_dppo_kl, or call rolloutopt.losses.get(...) with topk_logp=... "
        "and topk_behav_logp=... from your own training loop",
    ),
    "confidence": (
        "a per-sequence confidence, which verl's policy-loss call does not pass",
        "call rolloutopt.losses.get(...) with confidence=... from your own training loop",
    ),
}
_UNAVAILABLE["topk_behav_logp"] = _UNAVAILABLE["topk_logp"]

# advantage-estimator inputs that verl may pass under another name (kwargs of compute_advantage)
_ADV_ALIASES = {"logp": ("logp", "old_log_probs"), "ref_logp": ("ref_logp", "ref_log_prob")}


# ----------------------------------------------------------------------------------------------- config access


def _get(obj: Any, key: str, default: Any = None) -> Any:
    """``obj.key`` for verl's dataclass configs (``BaseConfig``), OmegaConf ``DictConfig`` and dicts."""
    if obj is None:
        return default
    if isinstance(obj, Mapping):
        try:
            return obj.get(key, default)
        except (AttributeError, KeyError):
            return default
    return getattr(obj, key, default)


def _plain(x: Any) -> Any:
    """OmegaConf containers → dicts and tuples (without importing omegaconf)."""
    if isinstance(x, Mapping):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, Sequence) and not isinstance(x, (str, bytes)):
        return tuple(_plain(v) for v in x)
    return x


def _number(x: Any, name: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise InputError(name, "a finite number", repr(x), f"set {name} in the verl config")
    return float(x)


def _clip_bounds(config: Any) -> tuple[float, float]:
    """verl's ``clip_ratio_low``/``clip_ratio_high``, each falling back to ``clip_ratio`` when None (as verl)."""
    base = _get(config, "clip_ratio", 0.2)
    low = _get(config, "clip_ratio_low", None)
    high = _get(config, "clip_ratio_high", None)
    return (
        _number(base if low is None else low, "actor.clip_ratio_low"),
        _number(base if high is None else high, "actor.clip_ratio_high"),
    )


# ----------------------------------------------------------------------------------------------- loss adapter


def _extra(config: Any) -> dict[str, Any]:
    """RolloutOptPolicyLossConfig's fields, from ``config.policy_loss`` or their defaults when absent."""
    pl = _get(config, "policy_loss", None)
    values = {k: _get(pl, k, v) for k, v in _EXTRA_DEFAULTS.items()}
    _check_extra(**values)
    return values


def _check_extra(
    *, dual_clip: Any, m2po_tau: Any, m2po_pair: Any, opsm_delta: Any, experimental: Any, where: str = "policy_loss"
) -> None:
    if not isinstance(dual_clip, bool):
        raise InputError(f"{where}.dual_clip", "a bool", repr(dual_clip), "set true or false")
    if isinstance(m2po_tau, bool) or not isinstance(m2po_tau, (int, float)) or not 0 < m2po_tau < math.inf:
        raise InputError(f"{where}.m2po_tau", "a number > 0", repr(m2po_tau), "use M2PO's default 0.04")
    if m2po_pair not in _M2PO_PAIRS:
        raise InputError(f"{where}.m2po_pair", f"one of {_M2PO_PAIRS}", repr(m2po_pair), "use 'old_current' under verl")
    if isinstance(opsm_delta, bool) or not isinstance(opsm_delta, (int, float)) or not 0 <= opsm_delta < math.inf:
        raise InputError(f"{where}.opsm_delta", "a number >= 0", repr(opsm_delta), "use OPSM's default 1e-4")
    if not isinstance(experimental, bool):
        raise InputError(f"{where}.experimental", "a bool", repr(experimental), "set true or false")


def _trust(trust: Any, ratio: Any, config: Any, extra: dict[str, Any]) -> Any:
    """The preset's trust region with the hyper-parameters verl's config names taken from it."""
    if isinstance(trust, PPOClip):
        low, high = _clip_bounds(config)
        dual: float | None = None
        # verl's vanilla always applies the dual clip (clip_ratio_c); its gspo (a sequence ratio) never does
        if extra["dual_clip"] and not isinstance(ratio, GSPORatio):
            dual = _number(_get(config, "clip_ratio_c", 3.0), "actor.clip_ratio_c")
        return PPOClip(low=low, high=high, dual=dual)
    if isinstance(trust, CISPO):
        low, high = _clip_bounds(config)
        return replace(trust, low=low, high=high)
    if isinstance(trust, SAPO):
        return SAPO(
            tau_pos=_number(_get(config, "tau_pos", trust.tau_pos), "actor.tau_pos"),
            tau_neg=_number(_get(config, "tau_neg", trust.tau_neg), "actor.tau_neg"),
        )
    if isinstance(trust, DPPO) and trust.divergence in ("tv", "kl"):
        low, high = _clip_bounds(config)
        c = _number(_get(config, "clip_ratio_c", trust.c), "actor.clip_ratio_c")
        return replace(trust, low=low, high=high, c=c)
    if isinstance(trust, M2POMask):
        return replace(trust, tau=float(extra["m2po_tau"]), pair=extra["m2po_pair"])
    if isinstance(trust, M2POClip):
        return replace(trust, tau=float(extra["m2po_tau"]))
    return trust


def _correction(correction: Any, extra: dict[str, Any]) -> Any:
    if isinstance(correction, OPSM):
        return replace(correction, delta=float(extra["opsm_delta"]))
    if isinstance(correction, Sequence):
        return tuple(_correction(c, extra) for c in correction)
    return correction


_STAGE_KEYS = ("ratio", "trust", "correction", "proximal", "kl", "entropy_coef", "agg")


def _needs(kwargs: dict[str, Any]) -> tuple[list[str], tuple[str, ...]]:
    """The inputs the objective requires once the verl wiring is applied (``agg=loss_agg_mode``, M2PO's
    ``pair``, ...) that the keywords do not supply, and all it requires (derived from its stages)."""
    requires, _ = declared_inputs(**{k: kwargs[k] for k in _STAGE_KEYS if k in kwargs})
    return [n for n in requires if kwargs.get(n) is None], requires


def _global_batch(config: Any, loss_agg_mode: str, response_mask: BoolBT) -> dict[str, Any]:
    """``config.global_batch_info`` → ``denominators`` and ``max_len`` (verl's ``agg_loss`` keywords)."""
    info = _get(config, "global_batch_info", None) or {}
    dp = info.get("dp_size", 1)
    dp_size = 1 if dp is None else int(dp)
    tokens = info.get("batch_num_tokens")
    sequences = info.get("global_batch_size")
    if dp_size > 1:
        if loss_agg_mode == "token-mean" and tokens is None:
            raise InputError(
                "config.global_batch_info['batch_num_tokens']",
                "the global number of loss tokens when dp_size > 1 (verl's agg_loss raises too)",
                "None",
                "let verl's ppo_loss fill global_batch_info, or pass the global count",
            )
        if loss_agg_mode.startswith("seq-mean") and sequences is None:
            raise InputError(
                "config.global_batch_info['global_batch_size']",
                "the global number of sequences when dp_size > 1 (verl's agg_loss raises too)",
                "None",
                "let verl's ppo_loss fill global_batch_info, or pass the global count",
            )
    out: dict[str, Any] = {"denominators": Denominators(tokens=tokens, sequences=sequences, world_size=dp_size)}
    if loss_agg_mode == "seq-mean-token-sum-norm":
        scale = info.get("loss_scale_factor") or _get(config, "loss_scale_factor", None)
        out["max_len"] = int(scale) if scale else int(response_mask.shape[-1])
    return out


def policy_loss_kwargs(name: str, config: Any, loss_agg_mode: str, response_mask: BoolBT) -> dict[str, Any]:
    r"""The :func:`~rolloutopt.losses.policy_loss` keywords that ``rolloutopt_<name>`` uses for a verl config.

    The preset's bound configuration, with the hyper-parameters that verl's config already names taken from
    verl rather than from the preset (``docs/integrations/verl.md`` has the table):

    - :class:`~rolloutopt.ratios.PPOClip`: ``low=clip_ratio_low``, ``high=clip_ratio_high`` (each falling back to
      ``clip_ratio`` when None, as verl), ``dual=clip_ratio_c`` unless the ratio is
      :class:`~rolloutopt.ratios.GSPORatio` (verl's ``gspo`` has no dual clip) or
      ``policy_loss.dual_clip`` is False;
    - :class:`~rolloutopt.ratios.CISPO`: ``low``/``high`` from ``clip_ratio_low``/``clip_ratio_high``;
    - :class:`~rolloutopt.ratios.SAPO`: ``tau_pos``, ``tau_neg``;
    - :class:`~rolloutopt.ratios.DPPO` (``tv``/``kl``): thresholds ``clip_ratio_low/high``, truncation
      ``c=clip_ratio_c``;
    - M2PO's ``tau`` (and ``pair``), OPSM's ``delta``: from ``RolloutOptPolicyLossConfig``;
    - ``agg=loss_agg_mode``; ``config.global_batch_info`` → ``denominators=Denominators(tokens=batch_num_tokens,
      sequences=global_batch_size, world_size=dp_size)`` and, for ``seq-mean-token-sum-norm``,
      ``max_len=loss_scale_factor`` or the mask width (verl's ``agg_loss``).

    ``config=None`` keeps the preset's own stage hyper-parameters (only ``agg`` and ``max_len`` are set).

    Args:
        name: a rolloutopt loss preset name (without the prefix).
        config: verl's ``ActorConfig`` (or any mapping with its fields), or None.
        loss_agg_mode: verl's aggregation mode.
        response_mask: ``[B, T]``; its width is the default Dr.GRPO constant.

    Raises:
        InputError: unknown preset, an aggregation mode verl does not have, an experimental preset without
            ``policy_loss.experimental=true``, or a bad ``RolloutOptPolicyLossConfig`` value.
    """
    preset = _losses.get(name)
    if loss_agg_mode not in _VERL_AGG_MODES:
        raise InputError(
            "loss_agg_mode", f"one of verl's modes {_VERL_AGG_MODES}", repr(loss_agg_mode), "fix actor.loss_agg_mode"
        )
    kw = dict(preset.config)
    extra = _extra(config)
    if preset.experimental is not None and not extra["experimental"]:
        raise InputError(
            "actor_rollout_ref.actor.policy_loss.experimental",
            f"true for the {name!r} preset: {preset.experimental}",
            "false (or a plain PolicyLossConfig)",
            "set policy_loss._target_=rolloutopt.integrations.verl.RolloutOptPolicyLossConfig and "
            "+actor_rollout_ref.actor.policy_loss.experimental=true to acknowledge the reconstruction",
        )
    if config is not None:
        kw["trust"] = _trust(kw.get("trust"), kw.get("ratio"), config, extra)
        if kw.get("correction") is not None:
            kw["correction"] = _correction(kw["correction"], extra)
    kw["agg"] = loss_agg_mode
    kw.update(_global_batch(config, loss_agg_mode, response_mask))
    return kw


def verl_metrics(metrics: Mapping[str, Shaped[Tensor, ""]]) -> dict[str, float]:
    """rolloutopt's 0-d metric tensors → verl's ``dict[str, float]`` under ``actor/<name>``, in one host sync.

    verl's own keys are used where the quantities coincide: ``clipfrac`` → ``actor/pg_clipfrac``,
    ``approx_kl`` → ``actor/ppo_kl``, ``dual_clip_frac`` → ``actor/pg_clipfrac_lower`` (DPPO:
    ``dppo_masked_frac`` / ``dppo_ratio_capped_frac``). ``pg_loss`` is left out: verl's ``ppo_loss`` logs
    ``actor/pg_loss`` itself. The adapter is the trainer boundary, so this is where the single sync happens
    (verl's ``Metric`` would call ``.item()`` once per 0-d tensor).
    """
    keys = [k for k in metrics if k not in _DROPPED_METRICS]
    if not keys:
        return {}
    values = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys]).tolist()
    return {_VERL_METRIC_KEYS.get(k, f"actor/{k}"): float(v) for k, v in zip(keys, values, strict=True)}


PolicyLossFn = Callable[..., tuple[Scalar, dict[str, float]]]
"""verl's policy-loss signature: ``(loss, metrics)``, a 0-d loss and float metrics."""
AdvantageFn = Callable[..., tuple[FloatBT, FloatBT]]
"""verl's advantage-estimator signature: ``(advantages [bs, T], returns [bs, T])``."""
_LOSS_FNS: dict[str, PolicyLossFn] = {}
_ADV_FNS: dict[str, AdvantageFn] = {}


def make_policy_loss_fn(name: str) -> PolicyLossFn:
    r"""The verl policy loss ``rolloutopt_<name>``: rolloutopt's preset ``name`` behind verl's exact signature.

    .. math::
        \mathcal L = \operatorname{agg}_{\texttt{loss\_agg\_mode}}\big(w_{i,t}\,
                     L^{trust}(r_{i,t}, A_{i,t})\big), \qquad r = \exp(\ell^\theta - \ell^{old}),

    i.e. :func:`~rolloutopt.losses.policy_loss` with the preset's stages, verl's hyper-parameters
    (:func:`policy_loss_kwargs`) and :math:`w` = verl's ``rollout_is_weights`` (times the preset's own
    correction weight). References: the preset's (``rolloutopt.losses.get(name).reference``); verl's plug-in
    contract (``register_policy_loss`` in ``verl/trainer/ppo/core_algos.py``; ``docs/integrations/verl.md``).

    The returned function is ``fn(old_log_prob, log_prob, advantages, response_mask,
    loss_agg_mode="token-mean", config=None, rollout_is_weights=None) -> (loss, metrics)``, called
    keyword-only by ``verl/workers/utils/losses.py::ppo_loss``: ``old_log_prob``, ``log_prob``,
    ``advantages``, ``response_mask`` are ``[bs, T]`` (``log_prob`` carries the gradient),
    ``rollout_is_weights`` is ``[bs, T]`` detached or None; ``loss`` is the aggregated scalar (global
    denominators from ``config.global_batch_info``), ``metrics`` a ``dict[str, float]`` (:func:`verl_metrics`).
    Created once per name (the same object on every call, so re-registration is a no-op).

    Edge cases: all-masked rows add nothing; an empty batch gives 0. A preset that needs inputs verl's loss
    call cannot pass (``behav_logp``, ``versions``, top-K log-probs, ``confidence``) is registered all the same
    and raises an :class:`~rolloutopt.errors.InputError` on call, naming the input and the alternative.
    """
    fn = _LOSS_FNS.get(name)
    if fn is not None:
        return fn
    _losses.get(name)  # an unknown name raises here, not at the first training step

    def rolloutopt_policy_loss(
        old_log_prob: Tensor,
        log_prob: Tensor,
        advantages: Tensor,
        response_mask: Tensor,
        loss_agg_mode: str = "token-mean",
        config: Any = None,
        rollout_is_weights: Tensor | None = None,
    ) -> tuple[Tensor, dict[str, float]]:
        kw = policy_loss_kwargs(name, config, loss_agg_mode, response_mask)
        needs, requires = _needs(kw)
        if needs:
            what, fix = _UNAVAILABLE.get(needs[0], (f"the input {needs[0]}", "call the preset directly"))
            raise InputError(
                needs[0],
                f"{what} (the {name!r} preset requires {', '.join(requires)} under this verl config)",
                f"loss_mode={PREFIX}{name} under verl",
                fix,
            )
        # No allow_unused: everything verl hands over is consumed by every configuration. rollout_is_weights
        # (is_weights) and the global denominators are always accepted, and policy_loss_kwargs passes max_len only
        # with agg="seq-mean-token-sum-norm"; an input a stage requires and verl lacks raised above.
        out = policy_loss(log_prob, old_log_prob, advantages, response_mask, is_weights=rollout_is_weights, **kw)
        return out.loss, verl_metrics(out.metrics)

    rolloutopt_policy_loss.__name__ = rolloutopt_policy_loss.__qualname__ = f"{PREFIX}{name}"
    rolloutopt_policy_loss.__doc__ = f"rolloutopt's {name!r} loss preset behind verl's policy-loss signature."
    rolloutopt_policy_loss.__rolloutopt_name__ = name  # type: ignore[attr-defined]
    _LOSS_FNS[name] = rolloutopt_policy_loss
    return rolloutopt_policy_loss


# ----------------------------------------------------------------------------------------------- advantages


def _adv_hyper(config: Any, name: str, estimator: Estimator) -> dict[str, Any]:
    """``algorithm.rolloutopt.<name>`` as keyword arguments, checked against the estimator's hyper-parameters."""
    section = _get(_get(config, "rolloutopt", None), name, None)
    hyper = {} if section is None else _plain(section)
    if not isinstance(hyper, dict):
        raise InputError(
            f"algorithm.rolloutopt.{name}",
            "a mapping of keyword arguments",
            repr(hyper),
            f"set +algorithm.rolloutopt.{name}.<keyword>=<value>",
        )
    for key in hyper:
        if key not in estimator.hyper and key != "experimental":
            raise InputError(
                f"algorithm.rolloutopt.{name}.{key}",
                f"a hyper-parameter of rolloutopt.advantages.{name}: {', '.join(estimator.hyper) or 'none'} "
                "(or experimental)",
                repr(key),
                "remove it or fix its spelling (inputs such as mask come from verl's batch, not from the config)",
            )
    if name == "grpo" and "scale" not in hyper and _get(config, "norm_adv_by_std_in_grpo", True) is False:
        hyper["scale"] = None  # verl's own switch for GRPO without the std (Dr.GRPO's advantage)
    return hyper


def _not_an_estimator(name: str, estimator: Estimator) -> tuple[str, str, str] | None:
    """Why ``rolloutopt.advantages.<name>`` can never serve as a verl estimator, or None when it can."""
    if estimator.reward_dims == "B K":
        return (
            "an estimator of one reward per rollout",
            f"rolloutopt.advantages.{name}, which needs per-component rewards [B, K]; verl passes one summed "
            "reward per rollout to rolloutopt_* estimators (components reach only its own 'gdpo')",
            f"use verl's algorithm.adv_estimator=gdpo, or call rolloutopt.advantages.{name} yourself",
        )
    return None


def make_advantage_fn(name: str) -> AdvantageFn:
    r"""The verl advantage estimator ``rolloutopt_<name>``: rolloutopt's estimator ``name`` behind verl's signature.

    .. math::
        R_i = \sum_t r^{tok}_{i,t}, \qquad A = f(R, \text{group}), \qquad
        A_{i,t} = A_i\, w_i\, m_{i,t}, \qquad \text{returns} = A

    with :math:`f` = ``rolloutopt.advantages.get(name)``, groups from verl's ``index`` (uid strings,
    :meth:`~rolloutopt.groups.Groups.from_labels`), :math:`w` the estimator's per-sequence weight (0 for a
    rollout it excludes: its advantage is 0, it still counts in verl's denominators) and :math:`m` the
    response mask (:func:`~rolloutopt.advantages.to_tokens`). Returns equal advantages, as verl's GRPO.
    References: the estimator's docstring; verl's contract (``get_adv_estimator_fn(name)(**adv_kwargs)`` in
    ``verl/trainer/ppo/ray_trainer.py`` ``compute_advantage``; ``docs/integrations/verl.md``).

    The returned function is ``fn(token_level_rewards, response_mask, index=None, config=None, **kwargs) ->
    (advantages [bs, T], returns [bs, T])``, run under ``torch.no_grad()``:
    ``token_level_rewards`` ``[bs, T]``, ``response_mask`` ``[bs, T]``, ``index`` a 1-d object array of uid
    strings, ``config`` verl's ``algorithm`` config. Extra keyword hyper-parameters come from
    ``config.rolloutopt.<name>`` (``+algorithm.rolloutopt.mc_grpo.eps=1e-3``; a key that is not one of the
    estimator's hyper-parameters raises; ``experimental=true`` acknowledges an experimental estimator);
    ``algorithm.norm_adv_by_std_in_grpo=false`` gives ``rolloutopt_grpo`` ``scale=None``, as verl's GRPO.

    Inputs follow the estimator's declarations (``rolloutopt.advantages.entry(name).requires`` and
    ``.accepts``): ``mask`` is the response mask, and a ``max_len`` hyper-parameter (DRPO, Latent-GRPO's
    truncation rule) defaults to the padded response width, which verl pads to ``rollout.response_length``.
    Any other declared input is taken from ``kwargs`` (same name, or ``old_log_probs`` for ``logp`` and
    ``ref_log_prob`` for ``ref_logp``); verl's ``compute_advantage`` passes such tensors only to its own
    estimators, so an estimator that requires one (``ace``, ``xrpo_sharpen`` and ``drpo`` need ``logp``,
    ``v05`` needs ``prior``) raises an :class:`~rolloutopt.errors.InputError` naming it unless a customised
    trainer supplies it. Estimators of per-component rewards ``[B, K]`` (``gdpo``, ``gd2po``) raise on call.
    Reward shapers and selectors are not estimators and are not registered with verl. Created once per name.

    Edge cases: as the estimator's (singleton groups, all-equal rewards); all-masked rows get advantage 0 at
    every token but count in their group, as in verl.
    """
    fn = _ADV_FNS.get(name)
    if fn is not None:
        return fn
    estimator = _advantages.get(name)
    problem = _not_an_estimator(name, estimator)

    def rolloutopt_advantage(
        token_level_rewards: Tensor,
        response_mask: Tensor,
        index: Any = None,
        config: Any = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor]:
        if problem is not None:
            raise InputError(f"algorithm.adv_estimator={PREFIX}{name}", problem[0], problem[1], problem[2])
        if index is None:
            raise InputError(
                "index",
                "the uid of every rollout (verl passes non_tensor_batch['uid'])",
                "None",
                "keep the 'uid' field in the batch (verl's trainers set it for grouped rollouts)",
            )
        with torch.no_grad():
            rewards = token_level_rewards.sum(-1)
            groups = Groups.from_labels(index, device=rewards.device)
            inputs: dict[str, Any] = {}
            for p in (*estimator.requires, *estimator.accepts):
                if p == "mask":
                    inputs[p] = response_mask
                    continue
                value = next((kwargs[a] for a in _ADV_ALIASES.get(p, (p,)) if kwargs.get(a) is not None), None)
                if value is not None:
                    inputs[p] = value
                elif p in estimator.requires:
                    passed = sorted(["token_level_rewards", "response_mask", "index", "config", *kwargs])
                    raise InputError(
                        p,
                        f"the input {p!r}, required by rolloutopt.advantages.{name}",
                        f"verl's compute_advantage passed only {passed}",
                        f"verl does not give {p} to advantage estimators; call rolloutopt.advantages.{name} "
                        "yourself, or use an estimator that needs only rewards, groups and the response mask",
                    )
            hyper = _adv_hyper(config, name, estimator)
            if "max_len" in estimator.hyper and "max_len" not in hyper:
                hyper["max_len"] = int(response_mask.shape[-1])  # verl pads responses to rollout.response_length
            missing = [h for h in estimator.hyper_required if h not in hyper]
            if missing:
                raise InputError(
                    f"algorithm.rolloutopt.{name}.{missing[0]}",
                    f"a value for the required keyword {missing[0]!r} of rolloutopt.advantages.{name}",
                    "nothing",
                    f"set +algorithm.rolloutopt.{name}.{missing[0]}=...",
                )
            out = estimator(rewards, groups, **inputs, **hyper)
            adv = out.advantages
            weight = out.weight.to(adv.dtype)
            adv = adv * (weight if adv.dim() == 1 else weight[:, None])
            tok = to_tokens(adv, response_mask).to(token_level_rewards.dtype)
        return tok, tok

    rolloutopt_advantage.__name__ = rolloutopt_advantage.__qualname__ = f"{PREFIX}{name}"
    rolloutopt_advantage.__doc__ = f"rolloutopt's {name!r} advantage estimator behind verl's estimator signature."
    rolloutopt_advantage.__rolloutopt_name__ = name  # type: ignore[attr-defined]
    _ADV_FNS[name] = rolloutopt_advantage
    return rolloutopt_advantage


# ----------------------------------------------------------------------------------------------- registration


def register() -> list[str]:
    """Register every loss preset and advantage estimator in verl's registries as ``rolloutopt_<name>``.

    Imports verl (``verl.trainer.ppo.core_algos``). Idempotent: the adapters are created once per name, so a
    second call re-binds the same objects (verl's ``register_adv_est`` accepts that); a name verl already
    binds to another function of ours (after a module reload) is rebound. A name bound to a function that is
    not rolloutopt's is left alone. Every failure is logged at ERROR level on the ``"rolloutopt"`` logger
    (verl's plug-in loader hides exceptions at DEBUG level) and the remaining names are still registered.

    Returns:
        the verl names registered (``rolloutopt_<name>``), losses first.
    """
    from verl.trainer.ppo import core_algos

    done: list[str] = []
    for name in _losses.names():
        key = PREFIX + name
        try:
            core_algos.register_policy_loss(key)(make_policy_loss_fn(name))
            done.append(key)
        except Exception:
            logger.exception("rolloutopt: could not register the verl policy loss %r", key)
    registry = core_algos.ADV_ESTIMATOR_REGISTRY
    for name in _advantages.names():
        key = PREFIX + name
        try:
            fn = make_advantage_fn(name)
            current = registry.get(key)
            if current is not None and current is not fn:
                if getattr(current, "__rolloutopt_name__", None) != name:
                    raise InputError(
                        "name", f"{key!r} free or bound to rolloutopt", f"bound to {current!r}", "rename the other one"
                    )
                registry[key] = fn  # ours from an earlier import of this module (reload)
            core_algos.register_adv_est(key)(fn)
            done.append(key)
        except Exception:
            logger.exception("rolloutopt: could not register the verl advantage estimator %r", key)
    return done


FUSED_ENV = "ROLLOUTOPT_VERL_FUSED"
"""Set to ``1`` (in every process, e.g. through Ray's ``runtime_env``) to route verl's fused kernels through
:func:`rolloutopt.kernels.token_logprobs` when the plug-in registers (see :func:`use_token_logprobs`)."""


@functools.cache
def _fused_class(original: Any) -> type:
    """A subclass of verl's ``FusedLinearForPPO`` whose ``"torch"`` backend is :func:`token_logprobs`."""

    class RolloutOptFusedLinearForPPO(original):  # type: ignore[misc]
        """verl's ``FusedLinearForPPO`` with the ``"torch"`` backend computed by rolloutopt's ``token_logprobs``
        (Triton on CUDA, chunked torch elsewhere; recomputing backward; exact entropy gradient). ``"liger"`` is
        verl's own."""

        def forward(
            self, hidden_states: Tensor, vocab_weights: Tensor, input_ids: Tensor, temperature: float = 1.0
        ) -> tuple[Tensor, Tensor]:
            if self.impl_backend != "torch":
                return original.forward(self, hidden_states, vocab_weights, input_ids, temperature)  # type: ignore[no-any-return]
            from rolloutopt.kernels.token_logprobs import token_logprobs

            shape = input_ids.shape
            logp, entropy = token_logprobs(
                hidden_states.reshape(-1, hidden_states.shape[-1]).to(vocab_weights.dtype),
                vocab_weights,
                input_ids.reshape(-1).long(),
                temperature=float(temperature),
            )
            if entropy is None:
                raise RuntimeError("token_logprobs returned no entropy")
            return logp.reshape(shape), entropy.reshape(shape)

    return RolloutOptFusedLinearForPPO


def use_token_logprobs(enable: bool = True) -> None:
    """Route verl's fused log-prob path through :func:`rolloutopt.kernels.token_logprobs` (or back).

    verl computes log-probs and entropies from hidden states when ``actor_rollout_ref.model.use_fused_kernels=True``
    with ``fused_kernel_options.impl_backend=torch``: its patched model forwards build
    ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` at every call. This replaces that class by a
    subclass whose ``"torch"`` backend is rolloutopt's kernel (same signature, same outputs), so verl's actor,
    losses and configs are unchanged. Per process: set :data:`FUSED_ENV` ``=1`` so that the plug-in does it in
    verl's Ray workers too. Imports verl.
    """
    tf: Any = importlib.import_module("verl.utils.experimental.torch_functional")
    original = getattr(tf, "_rolloutopt_original_fused", tf.FusedLinearForPPO)
    tf._rolloutopt_original_fused = original
    tf.FusedLinearForPPO = _fused_class(original) if enable else original


def _register_logged() -> None:
    if os.environ.get(FUSED_ENV, "0") not in ("", "0"):
        try:
            use_token_logprobs()
        except Exception:
            logger.exception("rolloutopt: routing verl's fused kernels through token_logprobs failed")
    try:
        register()
    except Exception:
        logger.exception("rolloutopt: registering rolloutopt's losses and estimators in verl failed")
        raise


class _AfterCoreAlgos(importlib.abc.MetaPathFinder):
    """Registers rolloutopt's names right after ``verl.trainer.ppo.core_algos`` is imported (post-import hook)."""

    def find_spec(
        self, fullname: str, path: Iterable[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        # path: a package's __path__, which for a namespace package is a _NamespacePath (iterable, not a Sequence)
        if fullname != _CORE_ALGOS:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)  # type: ignore[arg-type]  # typeshed says Sequence
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_register(module: ModuleType) -> None:
            exec_module(module)
            _remove_hook()
            try:
                register()
            except Exception:
                logger.exception("rolloutopt: registering rolloutopt's losses and estimators in verl failed")

        loader.exec_module = exec_then_register  # type: ignore[method-assign]
        return spec


_HOOK = _AfterCoreAlgos()


def _remove_hook() -> None:
    if _HOOK in sys.meta_path:
        sys.meta_path.remove(_HOOK)


# ----------------------------------------------------------------------------------------------- PolicyLossConfig

_EXTRA_DEFAULTS: dict[str, Any] = {
    "dual_clip": True,  # verl's vanilla: the dual clip is always on (clip_ratio_c)
    "m2po_tau": 0.04,  # M2PO arXiv 2510.01161 and AReaL's m2_threshold
    "m2po_pair": "old_current",  # the pair verl can compute (no rollout log-probs in its loss call)
    "opsm_delta": 1e-4,  # DeepSeek-V3.2 OPSM / slime --opsm-delta
    "experimental": False,
}

_CONFIG_CLASS: list[type[Any]] = []


def _config_class() -> type[Any]:
    """Define ``RolloutOptPolicyLossConfig`` (a subclass of verl's ``PolicyLossConfig``) on first use."""
    if _CONFIG_CLASS:
        return _CONFIG_CLASS[0]
    from verl.workers.config import PolicyLossConfig

    @dataclass
    class RolloutOptPolicyLossConfig(PolicyLossConfig):
        """verl's ``PolicyLossConfig`` with the extra hyper-parameters of rolloutopt's loss presets.

        verl rejects unknown keys under ``policy_loss``; point its target here instead::

            actor_rollout_ref.actor.policy_loss._target_=rolloutopt.integrations.verl.RolloutOptPolicyLossConfig
            actor_rollout_ref.actor.policy_loss.loss_mode=rolloutopt_m2po
            +actor_rollout_ref.actor.policy_loss.m2po_tau=0.04

        Attributes:
            dual_clip: PPO-clip presets apply verl's dual clip ``clip_ratio_c`` (True, verl's ``vanilla``) or
                none (False: rolloutopt's ``grpo``/``dapo``/``dr_grpo`` presets as published).
            m2po_tau: M2PO's second-moment budget τ (``m2po``, ``m2po_clip``); default 0.04 (arXiv 2510.01161).
            m2po_pair: log-ratio whose second moment ``m2po`` bounds: ``"old_current"`` (proximal vs current,
                the default under verl, which passes no rollout log-probs to the loss) or ``"behav_old"``
                (the paper's, needs rollout log-probs: raises under verl).
            opsm_delta: OPSM's threshold δ on the mean log(behaviour / current) of a negative-advantage
                sequence (``opsm``); default 1e-4 (DeepSeek-V3.2 arXiv 2512.02556, slime).
            experimental: acknowledge a preset's reconstructed part (``pnpo``, ``sat``, ``tbpo``,
                ``dppo_predictive``); False makes them raise.
        """

        _target_: str = "rolloutopt.integrations.verl.RolloutOptPolicyLossConfig"
        dual_clip: bool = True
        m2po_tau: float = 0.04
        m2po_pair: str = "old_current"
        opsm_delta: float = 1e-4
        experimental: bool = False

        def __post_init__(self) -> None:
            parent = getattr(super(), "__post_init__", None)
            if parent is not None:
                parent()
            _check_extra(
                dual_clip=self.dual_clip,
                m2po_tau=self.m2po_tau,
                m2po_pair=self.m2po_pair,
                opsm_delta=self.opsm_delta,
                experimental=self.experimental,
                where="RolloutOptPolicyLossConfig",
            )

    RolloutOptPolicyLossConfig.__module__ = __name__
    RolloutOptPolicyLossConfig.__qualname__ = "RolloutOptPolicyLossConfig"
    _CONFIG_CLASS.append(RolloutOptPolicyLossConfig)
    globals()["RolloutOptPolicyLossConfig"] = RolloutOptPolicyLossConfig
    return RolloutOptPolicyLossConfig


def __getattr__(name: str) -> Any:
    """``RolloutOptPolicyLossConfig`` is defined on first access (it subclasses a verl class: imports verl)."""
    if name == "RolloutOptPolicyLossConfig":
        return _config_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# ----------------------------------------------------------------------------------------------- import time

if "verl" in sys.modules:  # loaded by verl itself (entry point, VERL_USE_EXTERNAL_MODULES) or after `import verl`
    _register_logged()
    _config_class()
elif _HOOK not in sys.meta_path:
    sys.meta_path.insert(0, _HOOK)
