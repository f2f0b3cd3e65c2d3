"""DRPO, Decoupled Reward Policy Optimization (arXiv 2510.04474): length-aware weights of the correct rollouts.

:func:`drpo` puts a length reward on the correct rollouts only, turns it into closed-form weights of the positive
group, and uses the DisCO discriminative objective. It is a loss; :func:`drpo` returns its exact per-sequence
gradient coefficients as advantages, which :func:`rolloutopt.losses.policy_loss` consumes, and
:func:`drpo_trust_penalty` its KL hinge.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from jaxtyping import Shaped
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_mask, checks_enabled, choice, describe, finite, positive
from rolloutopt.advantages._base import REGISTRY, AdvantageOutput
from rolloutopt.advantages.reference import _emptied, _empty_batch
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups, as_groups
from rolloutopt.typing import BoolB, BoolBT, FloatBT, IntB, NumB, Scalar

__all__ = ["drpo", "drpo_trust_penalty"]


def _number(value: Any, name: str, *, allow_inf: bool = False) -> None:
    """Raise unless ``value`` is a positive number (``inf`` allowed with ``allow_inf``)."""
    positive(value, name)
    if not allow_inf and not math.isfinite(value):
        raise InputError(name, "a finite positive number", describe(value), f"set {name} to a finite value")


def _drpo_checks(
    r: Tensor,
    lp: Tensor,
    m: Tensor,
    v: Tensor | None,
    lengths: Tensor,
    active: Tensor,
    max_len: int,
    threshold: float | None,
) -> None:
    """DRPO's value checks, in order (run only when the combined check in :func:`drpo` flagged a row)."""
    finite(r, "rewards", v, exclude="valid")
    finite(lp, "logp", m & active[:, None])
    if threshold is None and bool((((r != 0) & (r != 1)) & active).any()):
        raise InputError(
            "rewards",
            "binary correctness: exactly 0 or 1 (or a bool tensor)",
            "values other than 0 and 1",
            "binarise the rewards, or pass threshold=... (rewards >= threshold count as correct)",
        )
    if bool(((lengths > max_len) & active).any()):
        raise InputError(
            "max_len",
            f"at least every response length (max_len={max_len})",
            f"a response of {int(lengths.max())} tokens",
            "pass the configured maximum length",
        )


def _counts(g: Groups, *masks: Tensor) -> tuple[Tensor, ...]:
    """``g.count(mask)`` for each bool mask ``[B]`` (int64 ``[G]``), with a reshape for equal-sized groups.

    On ragged groups one ``index_add_`` per mask is faster than one over the stacked ``[B, k]`` masks.
    """
    if g.dense_size is None:
        return tuple(g.count(x) for x in masks)
    out = []
    for x in masks:
        if not g.rows_sorted:
            x = x.index_select(0, g.order)
        out.append(x.view(g.num_groups, g.dense_size).sum(1))
    return tuple(out)


def _masked_max(g: Groups, x: Tensor, count: Tensor) -> Tensor:
    """``g.max(x, keep)`` for ``x`` already -inf outside ``keep``, given ``count = g.count(keep)`` (0 if none)."""
    if g.dense_size is not None:
        if not g.rows_sorted:
            x = x.index_select(0, g.order)
        out = x.view(g.num_groups, g.dense_size).amax(1)
    else:
        out = torch.full((g.num_groups,), -math.inf, dtype=x.dtype, device=x.device)
        out = out.scatter_reduce(0, g.inverse, x, reduce="amax", include_self=True)
    return torch.where(count > 0, out, 0.0)


def drpo(
    rewards: NumB,
    group: Groups | IntB,
    logp: FloatBT,
    mask: BoolBT,
    *,
    max_len: int,
    lam: float = 0.1,
    tau: float = 10.0,
    threshold: float | None = None,
    valid: BoolB | None = None,
) -> AdvantageOutput:
    r"""DRPO: length-weighted positives against a log-sum-exp of negatives, as per-sequence gradient coefficients.

    Decoupled Reward Policy Optimization (arXiv 2510.04474, ICLR 2026; code ``Optimization-AI/DRPO@405f702``,
    ``compute_policy_loss_drpo``) maximises, per prompt :math:`q` with at least one correct and one incorrect
    rollout,

    .. math::
        J_q = \sum_{i \in +} w_i\, s_i \;-\; \tau \log \frac{1}{|-|}\sum_{j \in -} e^{s_j / \tau}, \qquad
        s_i = \frac{1}{L_i}\sum_t m_{i,t}\,\ell^\theta_{i,t}, \qquad
        w_i = \frac{e^{u_i/\lambda}}{\sum_{k \in +} e^{u_k/\lambda}}, \quad u_i = 1 - \frac{L_i}{L_{max}}

    and the objective :math:`\sum_q J_q / N_q` (:math:`N_q` = questions in the batch, valid or not). The
    weights :math:`w` are the closed-form optimum :math:`P^*(y) \propto \pi_{old}(y \mid q, +)\, e^{u(y)/\lambda}`
    of the positive distribution under a KL regulariser with temperature :math:`\lambda`, self-normalised over
    the correct rollouts of the group: the length signal is normalised within the positive group only and never
    touches the incorrect rollouts (whose term is not re-weighted, since :math:`\sum w = 1`).

    This function returns :math:`A_i = \partial J_q / \partial s_i` (detached):

    .. math::  A_i = w_i \ \ (i \in +), \qquad
               A_j = -\operatorname{softmax}_{k \in -}(s_k/\tau)_j \ \ (j \in -), \qquad \sum_{i \in q} A_i = 0

    so that the standard surrogate reproduces DRPO's gradient exactly (the paper's code also only uses the
    gradient of its log-mean-exp term, through a value-1 surrogate)::

        out = drpo(rewards, group, logp.detach(), mask, max_len=L_max)
        loss = policy_loss(logp, None, out.advantages, mask, trust=None, agg="seq-mean-token-mean",
                           denominators=Denominators(sequences=num_questions)).loss
        loss = loss + drpo_trust_penalty(logp, old_logp, mask)

    ``old_logp=None`` makes the ratio :math:`e^{\ell^\theta - sg(\ell^\theta)} \equiv 1` with gradient
    :math:`\nabla \ell^\theta`, as in DRPO's score; ``seq-mean-token-mean`` supplies the :math:`1/L_i` of
    :math:`s_i` and ``sequences=num_questions`` the :math:`1/N_q` (``out.metrics["num_questions"]`` locally; the
    global count under data parallelism). The negative coefficients depend on the current :math:`\ell^\theta`:
    call :func:`drpo` again at every optimiser step of a multi-epoch update (it costs one pass over ``[B, T]``).
    :math:`\lambda = \infty` gives uniform positive weights: DisCO (arXiv 2505.12366).

    Args:
        rewards: correctness ``[B]``: a bool tensor, or floats exactly 0/1 (the paper's code: 1 positive, 0
            negative; other values raise unless ``threshold`` is given).
        group: group ids ``[B]`` or a :class:`~rolloutopt.groups.Groups`.
        logp: current-policy log-probs ``[B, T]``; only their value is used (the score :math:`s_i`).
        mask: response mask ``[B, T]``; :math:`L_i = \sum_t m_{i,t}`.
        max_len: the configured maximum response length :math:`L_{max}` (the paper's code uses the padded width,
            which changes from batch to batch; pass the rollout engine's max new tokens). ``L_i > max_len`` raises.
        lam: length temperature :math:`\lambda` (script default ``Lambda=0.1``); ``float("inf")`` is DisCO.
        tau: temperature :math:`\tau` of the negatives' log-mean-exp (script default 10).
        threshold: for non-binary rewards: ``rewards >= threshold`` is correct, every other row incorrect. The
            default ``None`` requires exactly 0/1 (the code silently ignores other values; we raise instead).
        valid: optional mask ``[B]``; invalid rows are neither positive nor negative, get advantage and weight 0.

    Returns:
        :class:`AdvantageOutput`: ``advantages [B]`` as above; ``weight [B]`` 1 for a rollout of a valid group,
        0 for rollouts that carry no gradient (all-correct or all-wrong group, invalid or all-masked row);
        metrics ``excluded_frac`` (rollouts with weight 0), ``skipped_group_frac``, ``num_questions``,
        ``positive_ess_frac`` (mean over valid groups of the effective sample size of :math:`w` over the
        number of positives: 1 = uniform, small = a few short answers dominate), ``length_reward_mean``.

    Edge cases: all-correct and all-wrong groups (so also singleton groups) contribute exactly 0 but still count
    in :math:`N_q`; a batch without a valid group gives all-zero advantages (a zero loss that keeps the graph).
    Rows with no token have no score and are excluded (weight 0). Positive weights are computed with the group
    maximum subtracted, so tiny :math:`\lambda` cannot overflow. An empty batch (B = 0) gives empty outputs and
    metrics 0 (``num_questions`` 0).
    """
    if not isinstance(max_len, int) or isinstance(max_len, bool) or max_len < 1:
        raise InputError(
            "max_len",
            "the configured maximum response length, an int >= 1",
            describe(max_len),
            "pass max_len=<max new tokens of the rollout engine>",
        )
    _number(lam, "lam", allow_inf=True)
    _number(tau, "tau")
    if threshold is not None and (
        not isinstance(threshold, (int, float)) or isinstance(threshold, bool) or not math.isfinite(threshold)
    ):
        raise InputError("threshold", "a finite number or None", describe(threshold), "pass e.g. threshold=0.5")
    as_r = rewards.float() if isinstance(rewards, Tensor) and rewards.dtype == torch.bool else rewards
    rows = ((logp, "logp", "B T", False), (mask, "mask", "B T", True))
    if (empty := _empty_batch(as_r, group, valid, *rows)) is not None:
        r0, g0, v0, lp0, m0 = empty
        kw: dict[str, Any] = {"max_len": max_len, "lam": lam, "tau": tau, "threshold": threshold}
        return _emptied(drpo(r0, g0, lp0, m0, **kw, valid=v0))
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    m = as_mask(mask, "mask", dims, "B T", device=lp.device)
    if checks_enabled() and not isinstance(rewards, Tensor):
        raise InputError("rewards", "a torch.Tensor", describe(rewards), "pass rewards as a tensor")
    if isinstance(rewards, Tensor) and rewards.dtype == torch.bool:
        if checks_enabled():
            dims.check(rewards, "rewards", "B")
        r = rewards.to(device=lp.device, dtype=lp.dtype)
    else:
        r = as_float(rewards, "rewards", dims, "B", device=lp.device).to(lp.dtype)
    g = as_groups(group, dims)
    v = None if valid is None else as_mask(valid, "valid", dims, "B", device=lp.device)
    lengths = m.sum(-1, dtype=torch.int32).to(lp.dtype)  # int32: half the traffic of int64, same counts
    active = lengths > 0 if v is None else (lengths > 0) & v
    # The one pass over [B, T]: the masked token sum (the score's numerator) also certifies finiteness, since a
    # sum with a non-finite term is non-finite.
    total = torch.where(m, lp.detach(), 0.0).sum(-1)
    if checks_enabled():
        # One combined host sync on [B] tensors; only when it flags a row do the exact checks run (they raise
        # the same errors, in the same order, as before). The probe is non-zero where a reward is non-binary
        # (r (1 - r) != 0) or non-finite, or the token sum is non-finite (x - x is NaN). It is masked by
        # ``valid``, not by the active rows: an all-masked row has a zero sum and length, so the superset only
        # adds a non-binary reward of an all-masked row, which sends a call to the exact checks (no raise).
        probe = (r * (1 - r) if threshold is None else r - r) + (total - total)
        flag = (probe != 0) | (lengths > max_len)
        if bool((flag if v is None else flag & v).any()):
            _drpo_checks(r, lp, m, v, lengths, active, max_len, threshold)
    if threshold is None:
        pos, neg = active & (r == 1), active & (r == 0)
    else:
        pos, neg = active & (r >= threshold), active & (r < threshold)

    with torch.no_grad():
        n_pos, n_neg, n_act = _counts(g, pos, neg, active)
        ok = (n_pos > 0) & (n_neg > 0)
        tiny = torch.finfo(lp.dtype).tiny
        # positives: closed-form weights of the length reward, normalised within the positive group only. Rows
        # outside the set enter as -inf, so exp gives their 0 directly; dividing by inf zeroes skipped groups.
        u = 1.0 - lengths / max_len
        ninf = torch.full_like(u, -math.inf)  # a tensor operand: torch.where with a scalar is ~2x slower on CPU
        if math.isinf(lam):
            e = pos.to(lp.dtype)  # exp(0 - 0): the group maximum of zeros is 0
        else:
            zm = torch.where(pos, u / lam, ninf)
            e = torch.exp(zm - g.broadcast(_masked_max(g, zm, n_pos)))
        w = e / g.broadcast(torch.where(ok, g.sum(e).clamp(min=tiny), math.inf))
        # negatives: gradient of tau * log-mean-exp(s / tau) is the softmax of s / tau over the negatives
        ym = torch.where(neg, total / lengths.clamp(min=1) / tau, ninf)
        en = torch.exp(ym - g.broadcast(_masked_max(g, ym, n_neg)))
        q = en / g.broadcast(torch.where(ok, g.sum(en).clamp(min=tiny), math.inf))
        adv = w - q  # exactly 0 outside the positives and negatives of valid groups
        ok_rows = g.broadcast(ok)
        pos_keep = pos & ok_rows
        weight = (pos_keep | (neg & ok_rows)).to(lp.dtype)

        has_rows = n_act > 0
        n_ok = ok.sum()
        ess = 1.0 / g.sum(w * w).clamp(min=tiny) / n_pos.clamp(min=1).to(w.dtype)
        metrics = {
            "excluded_frac": (1.0 - weight.mean()).detach(),
            "skipped_group_frac": ((has_rows & ~ok).sum() / has_rows.sum().clamp(min=1)).to(lp.dtype),
            "num_questions": torch.tensor(float(g.num_groups), dtype=lp.dtype, device=lp.device),
            "positive_ess_frac": (torch.where(ok, ess, 0.0).sum() / n_ok.clamp(min=1)),
            "length_reward_mean": (torch.where(pos_keep, u, torch.zeros_like(u)).sum() / pos_keep.sum().clamp(min=1)),
        }
    return AdvantageOutput(advantages=adv, weight=weight, metrics=metrics)


def drpo_trust_penalty(
    logp: FloatBT,
    old_logp: FloatBT,
    mask: BoolBT,
    *,
    delta: float = 1e-4,
    beta: float = 1e3,
    kl_type: Literal["kl", "low_var_kl"] = "kl",
    tokens: float | Shaped[Tensor, ""] | None = None,
) -> Scalar:
    r"""DisCO/DRPO trust region: a squared-hinge penalty on the batch KL to the proximal policy.

    .. math::  P = sg\big(\beta \max(\widehat{KL} - \delta, 0)\big)\, \widehat{KL}, \qquad
               \widehat{KL} = \frac{1}{N_{tok}} \sum_{i,t} m_{i,t}\, k(\ell^\theta_{i,t} - \ell^{old}_{i,t})

    with :math:`k(x) = -x` (``"kl"``) or :math:`e^{x} - 1 - x` (``"low_var_kl"``, k3). Its gradient is that of
    :math:`\tfrac{\beta}{2}\max(\widehat{KL}-\delta, 0)^2`. Add it to the loss of the :func:`drpo` composition.
    Reference: DisCO arXiv 2505.12366, DRPO arXiv 2510.04474 (code ``compute_policy_loss_drpo``); defaults from
    ``run_drpo_1.5b_8k.sh``: ``delta=1e-4``, ``beta=1e3``, ``ppo_kl_type=kl`` (the function's own default is
    ``low_var_kl``).

    Args:
        logp, old_logp: current and proximal log-probs ``[B, T]``.
        mask: response mask ``[B, T]``.
        delta: KL budget :math:`\delta`. beta: hinge coefficient :math:`\beta`.
        kl_type: ``"kl"`` or ``"low_var_kl"``.
        tokens: global number of loss tokens :math:`N_{tok}` under data parallelism (default: the local count).

    Edge cases: no token gives 0; the log-ratio is clamped to ±20 before ``exp``, so finite inputs stay finite.
    Returns a 0-d tensor; ``KL > delta`` (the code's ``pg_clipfrac``) means the hinge is active.
    """
    positive(delta, "delta", strict=False)
    positive(beta, "beta", strict=False)
    choice(kl_type, "kl_type", ("kl", "low_var_kl"))
    dims = Dims()
    lp = as_float(logp, "logp", dims, "B T")
    old = as_float(old_logp, "old_logp", dims, "B T", device=lp.device)
    m = as_mask(mask, "mask", dims, "B T", device=lp.device)
    finite(lp, "logp", m)
    finite(old, "old_logp", m)
    x = torch.where(m, lp - old, torch.zeros_like(lp)).clamp(-20.0, 20.0)
    k = -x if kl_type == "kl" else torch.expm1(x) - x
    n = m.sum().to(lp.dtype) if tokens is None else torch.as_tensor(tokens, dtype=lp.dtype, device=lp.device)
    kl = torch.where(m, k, torch.zeros_like(k)).sum() / n.clamp(min=1)
    return (beta * (kl - delta)).clamp(min=0).detach() * kl


REGISTRY.register(
    "drpo",
    drpo,
    requires=("logp", "mask"),
    accepts=("valid",),
    reference="DRPO arXiv 2510.04474 (ICLR 2026); code Optimization-AI/DRPO@405f702 (compute_policy_loss_drpo); "
    "DisCO arXiv 2505.12366",
)
