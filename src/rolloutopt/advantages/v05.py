"""V_{0.5}: a value model's prior fused with the group mean, and how many extra rollouts each prompt should get.

:func:`v05` fuses a value model's prior success rate with the empirical group mean through a shrinkage weight
whose positive part is a hypothesis test of the prior against the data. The formula is **reconstructed** (see
``docs/methods/prior.md``): neither the paper's code nor its full text was available, only the abstract and public
summaries. Every reconstructed detail is a keyword, and each call raises unless ``experimental=True``
acknowledges that the formula may change when a primary source is checked.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from jaxtyping import Bool, Int
from torch import Tensor

from rolloutopt._validation import (
    as_float,
    checks_enabled,
    choice,
    finite,
    positive,
    require_experimental,
)
from rolloutopt.advantages._base import REGISTRY, AdvantageOutput
from rolloutopt.advantages.reference import _prepare, _reference
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.typing import (
    BoolB,
    FloatB,
    FloatG,
    IntB,
    PerSeqOrToken,  # noqa: F401 - resolves the inherited fields of V05Output's generated __init__
)

__all__ = ["V05Output", "v05"]


Variance = Literal["bernoulli", "sample", "population"]


def _experimental(name: str, experimental: bool) -> None:
    require_experimental(
        experimental,
        f"{name}'s formula (from the abstract and public summaries of its paper)",
        "docs/methods/prior.md",
    )


def _frac(num: Tensor, den: Tensor) -> Tensor:
    return (num.sum() / den.sum().clamp(min=1)).detach()


@dataclass(frozen=True, kw_only=True)
class V05Output(AdvantageOutput):
    """What :func:`v05` returns: the advantages plus the per-group fusion, test outcome and budget request.

    Every per-group tensor ``[G]`` is ordered as ``group_ids`` (the increasing distinct ids, as
    :attr:`rolloutopt.groups.Groups.unique_ids`).

    Attributes:
        advantages, weight, metrics: as in :class:`~rolloutopt.advantages.AdvantageOutput`.
        group_ids: the distinct group ids ``[G]`` (int64), so that an allocator can map rows back to prompts.
        prior: the prior baseline actually used ``[G]`` (after clipping to ``prior_range``).
        baseline: the fused baseline :math:`b = w\\bar r + (1-w)\\hat b_0` per group ``[G]``.
        fusion_weight: the weight :math:`w \\in [0, 1]` on the empirical mean per group ``[G]``.
        accepted: bool ``[G]``, True where the test keeps the prior (:math:`\\hat\\delta^2 = 0`, so
            :math:`w = 0` and the baseline is the prior).
        statistic: the test statistic :math:`z^2 = n(\\bar r - \\hat b_0)^2/\\hat v` per group ``[G]``
            (``inf`` where :math:`\\hat v = 0` and the mean differs from the prior, 0 where they agree).
        extra_rollouts: int64 ``[G]``, the number of further rollouts requested for each prompt.
    """

    group_ids: Int[Tensor, " G"]
    prior: FloatG
    baseline: FloatG
    fusion_weight: FloatG
    accepted: Bool[Tensor, " G"]
    statistic: FloatG
    extra_rollouts: Int[Tensor, " G"]


def _predicted_mse(delta2: Tensor, var: Tensor, m: Tensor) -> Tensor:
    """Plug-in MSE of the MSE-optimal fused baseline after ``m`` rollouts, :math:`\\delta^2 v / (m\\delta^2 + v)`.

    Computed as the harmonic form :math:`1 / (m/v + 1/\\delta^2)`, which cannot overflow; 0 where either is 0.
    """
    pos = (delta2 > 0) & (var > 0)
    one = torch.ones_like(delta2)
    out = 1 / (m / torch.where(pos, var, one) + 1 / torch.where(pos, delta2, one))
    return torch.where(pos, out, torch.zeros_like(out))


def v05(
    rewards: FloatB,
    group: Groups | IntB,
    prior: FloatB,
    *,
    variance: Variance = "bernoulli",
    fallback: Literal["prior", "none"] = "prior",
    var_floor: float = 0.0,
    threshold: float = 1.0,
    prior_range: tuple[float, float] | None = (0.0, 1.0),
    scale: Literal["std"] | None = None,
    eps: float = 1e-6,
    cost: float = 1e-3,
    max_extra: int = 4,
    experimental: bool = False,
    valid: BoolB | None = None,
) -> V05Output:
    r"""V_{0.5} advantage: reward minus a value-model prior fused with the group mean by a shrinkage test.

    .. math::  \bar r = \tfrac1n\textstyle\sum_{i\in g} r_i, \quad
               \hat v = \bar r(1-\bar r)\ \text{(Bernoulli)}, \quad
               \hat\delta^2 = \max\!\big(0,\ (\bar r-\hat b_0)^2 - \tau\,\hat v/n\big), \quad
               w = \frac{\hat\delta^2}{\hat\delta^2 + \hat v/n}, \quad
               b = w\,\bar r + (1-w)\,\hat b_0, \quad A_i = r_i - b

    :math:`w` is the MSE-optimal weight on the empirical mean when the prior's bias is :math:`\hat\delta`;
    the positive part is a test of the prior: with the statistic :math:`z^2 = n(\bar r-\hat b_0)^2/\hat v`,
    the prior is accepted (``accepted``, :math:`w = 0`, :math:`b = \hat b_0`) when :math:`z^2 \le \tau` and
    gradually isolated (:math:`w \to 1`) as the conflict grows. Reference: arXiv 2603.10848 (V_{0.5},
    "Empirical Shrinkage Fusion" and "Sequential OSLA budget allocation").

    **Reconstructed** (from the abstract and summaries; no code exists; ``docs/methods/prior.md``): the
    weight, the variance estimate, the threshold :math:`\tau = 1` (the plain positive part; a 5% two-sided
    z-test would be ``threshold=3.84``), the zero-variance fallback and the budget rule. Each is a keyword.

    Extra rollouts (one-step look-ahead, the rule a later allocator consumes): the plug-in MSE of the fused
    baseline after :math:`m` rollouts is :math:`\mathrm{MSE}(m) = \hat\delta^2 \hat v/(m\hat\delta^2+\hat v)`;
    ``extra_rollouts`` is the smallest :math:`k \in [0, \text{max\_extra}]` with
    :math:`\mathrm{MSE}(n+k) - \mathrm{MSE}(n+k+1) < c` (``cost``), else ``max_extra``. MSE is convex in
    :math:`m`, so this is where sequential look-ahead would stop. An accepted prior (:math:`\hat\delta^2 = 0`)
    requests nothing; a group with no valid row requests ``max_extra`` (its prior is untested).

    Args:
        rewards: reward per rollout ``[B]``; binary in the paper. With ``variance="bernoulli"`` rewards must lie
            in [0, 1] (non-binary rewards in [0, 1] are fine: :math:`\bar r(1-\bar r)` bounds their variance).
        group: group ids ``[B]`` or a :class:`~rolloutopt.groups.Groups`.
        prior: the value model's prediction :math:`\hat b_0` **per rollout** ``[B]``, equal for every row of a
            group (the row layout trainers hold; a differing value raises). Invalid rows' priors count too.
        variance: ``"bernoulli"`` (default, binary rewards) :math:`\bar r(1-\bar r)`, or the ``"sample"``
            (n-1) or ``"population"`` variance of the group's rewards.
        fallback: where :math:`\hat v = 0` (a group of one, all-equal rewards), ``"prior"`` (default) uses the
            prior's Bernoulli variance :math:`\hat b_0(1-\hat b_0)`; ``"none"`` keeps 0, so any disagreement
            gives :math:`w = 1`. The switch happens at exactly 0: binary rewards give either 0 or at least
            :math:`(n-1)/n^2`, but near-equal continuous rewards jump from :math:`w \approx 1` to the fallback.
        var_floor: lower bound on :math:`\hat v` after the fallback (default 0).
        threshold: :math:`\tau`, the critical value of :math:`z^2` (default 1.0, the positive-part rule).
        prior_range: the prior is clipped to this interval (default [0, 1], a success rate); None: no clipping.
        scale: None (default) leaves :math:`A_i = r_i - b`; ``"std"`` divides by :math:`\sqrt{\hat v} + \varepsilon`
            (the variance used by the test) where :math:`\hat v > 0`.
        eps: added to the std for ``scale="std"``.
        cost: marginal cost :math:`c` of one rollout in units of baseline MSE (default 1e-3).
        max_extra: cap on the extra rollouts per prompt (default 4, i.e. doubling the paper's group size 4).
        experimental: must be True: it acknowledges the reconstructed formula (otherwise an ``InputError``).
        valid: optional mask ``[B]`` of rows that enter the statistics; other rows get advantage 0, weight 0.

    Returns:
        :class:`V05Output`; metrics ``prior_accepted_frac`` (groups with a valid row), ``fusion_weight_mean``,
        ``baseline_mean``, ``extra_rollouts_mean``, ``prior_clipped_frac``, ``excluded_frac``, ``reward_mean``.

    Edge cases: a singleton group has a baseline (the prior, shrunk towards the reward if they conflict), so
    it is not zeroed and no warning is raised. All-equal groups get a non-zero advantage wherever the prior
    disagrees with them, which is the point of the method; their advantages do not sum to 0 (biased, lower
    variance by design). If :math:`\bar r = \hat b_0` then :math:`b = \hat b_0` exactly. Gradients flow into
    ``rewards`` (also through the baseline; detach it if you want a constant baseline) and ``prior``.
    """
    _experimental("v05", experimental)
    choice(variance, "variance", ("bernoulli", "sample", "population"))
    choice(fallback, "fallback", ("prior", "none"))
    choice(scale, "scale", ("std", None))
    positive(var_floor, "var_floor", strict=False)
    positive(threshold, "threshold", strict=False)
    positive(eps, "eps", strict=False)
    positive(cost, "cost", strict=False)
    if not isinstance(max_extra, int) or isinstance(max_extra, bool) or max_extra < 0:
        raise InputError("max_extra", "a non-negative int", repr(max_extra), "pass the cap as an int, e.g. 4")
    if prior_range is not None:
        ok = (
            isinstance(prior_range, tuple)
            and len(prior_range) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in prior_range)
            and prior_range[0] <= prior_range[1]
        )
        if not ok:
            raise InputError(
                "prior_range",
                "a tuple (low, high) with low <= high, or None",
                repr(prior_range),
                "pass e.g. prior_range=(0.0, 1.0) for success rates, or None to use the prior unclipped",
            )

    r, g, v, dims = _prepare(rewards, group, valid)
    p = as_float(prior, "prior", dims, "B", device=r.device)
    finite(p, "prior")
    common = torch.promote_types(r.dtype, p.dtype)
    r, p = r.to(common), p.to(common)
    if checks_enabled():
        first = g.broadcast(p.detach().index_select(0, g.first_rows))
        if bool((p.detach() != first).any()):
            raise InputError(
                "prior",
                "one prior value per prompt, repeated on every row of its group",
                "a group whose rows carry different priors",
                "broadcast the value model's per-prompt prediction to its rollouts",
            )
        if variance == "bernoulli":
            inside = (r.detach() >= 0) & (r.detach() <= 1)
            if not bool((inside if v is None else inside | ~v).all()):
                raise InputError(
                    "rewards",
                    "rewards in [0, 1] for variance='bernoulli'",
                    "rewards outside [0, 1]",
                    "rescale rewards to [0, 1], or pass variance='sample'",
                )

    b0_raw = p.index_select(0, g.first_rows)  # [G]: the first row of each group (all rows agree)
    b0 = b0_raw if prior_range is None else b0_raw.clamp(prior_range[0], prior_range[1])
    n = g.count(v)
    nf = n.to(r.dtype)
    has = n > 0
    # Statistics of rewards centred at a (detached) member: an all-equal group then has a mean equal to its
    # reward and a variance of exactly 0, so the zero-variance fallback is not missed by rounding.
    ref = _reference(r, g, v)
    rs = r - g.broadcast(ref)
    mean = g.mean(rs, v) + ref
    bern = variance == "bernoulli"
    var = (mean * (1 - mean)).clamp(min=0) if bern else g.var(rs, v, unbiased=variance == "sample")
    if fallback == "prior":
        var = torch.where(var > 0, var, (b0 * (1 - b0)).clamp(min=0))
    var = var.clamp(min=var_floor)
    se2 = torch.where(has, var / nf.clamp(min=1), torch.zeros_like(var))  # v / n
    gap2 = (mean - b0) ** 2
    delta2 = torch.where(has, (gap2 - threshold * se2).clamp(min=0), torch.zeros_like(gap2))
    den = delta2 + se2
    w = torch.where(den > 0, delta2 / torch.where(den > 0, den, torch.ones_like(den)), torch.zeros_like(den))
    baseline = w * mean + (1 - w) * b0
    accepted = ~(delta2.detach() > 0)
    with torch.no_grad():
        stat = torch.where(
            se2 > 0,
            gap2 / torch.where(se2 > 0, se2, torch.ones_like(se2)),
            torch.where(gap2 > 0, torch.full_like(gap2, float("inf")), torch.zeros_like(gap2)),
        )
        stat = torch.where(has, stat, torch.zeros_like(stat))
        ks = torch.arange(max_extra + 1, device=r.device, dtype=r.dtype)
        m = nf.detach()[:, None] + ks[None, :]
        d2, vv = delta2.detach()[:, None], var.detach()[:, None]
        gain = _predicted_mse(d2, vv, m) - _predicted_mse(d2, vv, m + 1)
        below = gain < cost
        first_below = torch.where(below.any(dim=1), below.to(torch.int8).argmax(dim=1), torch.full_like(n, max_extra))
        extra = torch.where(has, first_below.long(), torch.full_like(n, max_extra))

    adv = r - g.broadcast(baseline)
    if scale == "std":
        sd = torch.where(var > 0, var, torch.ones_like(var)).sqrt()
        adv = adv / g.broadcast(torch.where(var > 0, sd + eps, torch.ones_like(sd)))
    weight = torch.ones_like(r) if v is None else v.to(r.dtype)
    if v is not None:
        adv = torch.where(v, adv, torch.zeros_like(adv))
    hasf = has.to(r.dtype)
    metrics = {
        "prior_accepted_frac": _frac((accepted & has).to(r.dtype), hasf),
        "fusion_weight_mean": _frac(w.detach() * hasf, hasf),
        "baseline_mean": _frac(baseline.detach() * hasf, hasf),
        "extra_rollouts_mean": extra.to(r.dtype).mean().detach(),
        "prior_clipped_frac": (b0_raw.detach() != b0.detach()).to(r.dtype).mean().detach(),
        "excluded_frac": (1 - weight.detach()).mean(),
        "reward_mean": _frac(r.detach() * weight.detach(), weight.detach()),
    }
    return V05Output(
        advantages=adv,
        weight=weight,
        metrics=metrics,
        group_ids=g.unique_ids,
        prior=b0,
        baseline=baseline,
        fusion_weight=w,
        accepted=accepted,
        statistic=stat,
        extra_rollouts=extra,
    )


REGISTRY.register(
    "v05",
    v05,
    requires=("prior",),
    accepts=("valid",),
    reference="V_0.5 arXiv 2603.10848 (no public code)",
    experimental="the shrinkage weight, the variance estimate, the test threshold, the zero-variance fallback and "
    "the budget rule are reconstructed from the abstract and public summaries (no public code)",
)
