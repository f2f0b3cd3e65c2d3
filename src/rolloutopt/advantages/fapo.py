"""FAPO's flawed-positive penalty (arXiv 2510.22543): a correct answer reached through a flawed derivation is
rewarded less.

:func:`fapo_penalty` is a reward shaper: it returns :class:`ShapedRewards`, whose ``.rewards`` feed any estimator.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_mask, checks_enabled, describe, finite, positive
from rolloutopt.advantages._base import SHAPERS, ShapedRewards
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolB, FloatB, NumB

__all__ = ["fapo_penalty"]


def _frac(x: Tensor, over: Tensor | None = None) -> Tensor:
    """Fraction of True in ``x`` (among ``over``), as a detached float 0-d tensor; 0 for an empty set."""
    xf = x.float() if over is None else (x & over).float()
    n = torch.tensor(float(x.numel()), device=x.device) if over is None else over.float().sum()
    return (xf.sum() / n.clamp(min=1)).detach()


def fapo_penalty(
    rewards: FloatB,
    is_flawed: NumB,
    *,
    lam: float = 1.0,
    correct_above: float = 0.0,
    valid: BoolB | None = None,
) -> ShapedRewards:
    r"""FAPO flawed-positive penalty: a correct rollout whose reasoning has an error loses :math:`\lambda`.

    .. math::  \tilde r_i = r_i - \lambda\, \mathbb 1[r_i > c]\, \mathbb 1[\text{flawed}_i]

    Reference: FAPO, arXiv 2510.22543; code ``volcengine/verl recipe/fapo/reward_fn_reasoning.py@dfc9b534``
    (``FLAWED_REWARD_PENALTY = 1.0``): the base reward is +1 for a matching boxed answer and −1 otherwise, a
    generative reward model returns the index of the first erroneous step of a *correct* rollout (−1 = none),
    and a flawed positive gets :math:`1 - \lambda = 0`. Advantages then come from the usual estimator: with
    ``dr_grpo``, a 0-reward flawed positive is reinforced while most of its group is wrong (group mean < 0)
    and suppressed once clean positives dominate — FAPO's "parameter-free" exploit-then-suppress schedule.
    See ``docs/methods/shaping.md``.

    Args:
        rewards: outcome rewards ``[B]`` (FAPO: ±1; any finite values).
        is_flawed: per-rollout flaw flag ``[B]``: a bool tensor, or the GenRM's integer first-error index
            (−1 = no error; parse failures should be passed as −1/False, as the code counts them not flawed).
        lam: penalty :math:`\lambda` (code default 1.0). Do not apply FAPO to evaluation rollouts (the code
            never penalises the test split).
        correct_above: :math:`c`; only rollouts with ``rewards > c`` are positives that can be penalised
            (default 0, between FAPO's −1 and +1). Flags on incorrect rollouts are ignored.
        valid: optional mask ``[B]``; invalid rows are left unchanged and out of the metrics.

    Returns:
        :class:`ShapedRewards` with the shaped ``rewards [B]``; metrics ``flawed_positive_frac`` (penalised
        rollouts among correct valid ones, the paper reports 20–40 %), ``penalised_frac`` (among all valid
        rollouts) and ``reward_mean``.

    Edge cases: nothing is dropped (a penalised rollout keeps weight 1 downstream); no correct rollout gives
    the rewards unchanged; ``lam=0`` is the identity.
    """
    positive(lam, "lam", strict=False)
    if (
        not isinstance(correct_above, (int, float))
        or isinstance(correct_above, bool)
        or not math.isfinite(correct_above)
    ):
        raise InputError("correct_above", "a finite number", describe(correct_above), "pass e.g. correct_above=0.0")
    dims = Dims()
    r = as_float(rewards, "rewards", dims, "B")
    if checks_enabled():
        if not isinstance(is_flawed, Tensor):
            raise InputError("is_flawed", "a bool or int tensor [B]", describe(is_flawed), "pass a tensor")
        if is_flawed.is_floating_point() or is_flawed.is_complex():
            raise InputError(
                "is_flawed",
                "a bool tensor, or int first-error indices (-1 = none)",
                describe(is_flawed),
                "pass is_flawed.bool() or the GenRM's integer step index",
            )
        dims.check(is_flawed, "is_flawed", "B")
        if is_flawed.device != r.device:
            raise InputError("is_flawed", f"a tensor on {r.device}", describe(is_flawed), f"move it to {r.device}")
        if is_flawed.dtype != torch.bool and bool((is_flawed < -1).any()):
            raise InputError(
                "is_flawed", "first-error indices >= -1 (-1 = no error)", "values below -1", "map parse failures to -1"
            )
    flawed = is_flawed if is_flawed.dtype == torch.bool else is_flawed != -1
    v = None if valid is None else as_mask(valid, "valid", dims, "B", device=r.device)
    finite(r, "rewards", v, exclude="valid")
    correct = r > correct_above
    if v is not None:
        correct = correct & v
    hit = correct & flawed
    out = r - lam * hit.to(r.dtype)
    over = torch.ones_like(hit) if v is None else v
    w = over.to(r.dtype)
    metrics = {
        "flawed_positive_frac": _frac(hit, correct),
        "penalised_frac": _frac(hit, over),
        "reward_mean": ((torch.where(over, out, torch.zeros_like(out)) * w).sum() / w.sum().clamp(min=1)).detach(),
    }
    return ShapedRewards(rewards=out, metrics=metrics)


SHAPERS.register(
    "fapo_penalty",
    fapo_penalty,
    requires=("rewards", "is_flawed"),
    accepts=("valid",),
    reference="FAPO arXiv 2510.22543; code volcengine/verl recipe/fapo/reward_fn_reasoning.py@dfc9b534",
)
