"""T-PPO's extended GAE (EGAE) for incomplete responses (arXiv 2506.15050; reconstructed).

:func:`egae` computes advantages and value targets for responses cut before they finished, bootstrapped by the
critic at the cut. Provenance and worked examples: ``docs/methods/length_rules.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
from jaxtyping import Float
from torch import Tensor

from rolloutopt._length_rules import _DOCS, _experimental, _frac
from rolloutopt._validation import Dims, as_float, as_mask, checks_enabled, choice, describe, finite
from rolloutopt._validation import (
    check_real as _real,
)
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolB, BoolBT, FloatB, FloatBT, PerSeqOrToken

__all__ = ["EGAEOutput", "egae"]

#: ``c ** chunk >= exp(-_LOG_RANGE)``: the scaled flip-cumsum of one chunk stays in float64's normal range.
_LOG_RANGE = 280.0 * math.log(10.0)


def _discounted_reverse_cumsum(x: Tensor, c: float) -> Tensor:
    """``y[..., t] = sum_{k >= t} c**(k - t) * x[..., k]`` along the last dimension.

    ``c == 1``: one flip-cumsum-flip (exact). ``c == 0``: ``x``. Otherwise, in float64, the scaled form
    ``y_t = c**-t * revcumsum(c**k x_k)_t`` over chunks short enough that ``c**chunk`` stays normal, with the
    carry ``c**(end - t) * y_end`` from the next chunk: a Python loop over ``ceil(T / chunk)`` chunks (one chunk
    for ``c >= 0.9`` and ``T <= 6000``), never over tokens.
    """
    t_len = x.shape[-1]
    if t_len == 0 or c == 0.0:
        return x.clone()
    if c == 1.0:
        return x.flip(-1).cumsum(-1).flip(-1)
    x64 = x.to(torch.float64)
    chunk = max(1, int(_LOG_RANGE / -math.log(c)))
    out = torch.empty_like(x64)
    carry = torch.zeros(x64.shape[:-1], dtype=torch.float64, device=x.device)
    end = t_len
    while end > 0:
        start = max(0, end - chunk)
        n = end - start
        j = torch.arange(n, dtype=torch.float64, device=x.device)
        p = torch.pow(torch.tensor(c, dtype=torch.float64, device=x.device), j)
        seg = (x64[..., start:end] * p).flip(-1).cumsum(-1).flip(-1) / p
        seg = seg + carry[..., None] * torch.pow(torch.tensor(c, dtype=torch.float64, device=x.device), n - j)
        out[..., start:end] = seg
        carry = seg[..., 0]
        end = start
    return out.to(x.dtype)


@dataclass(frozen=True)
class EGAEOutput:
    """What :func:`egae` returns.

    Attributes:
        advantages: ``[B, T]`` (0 outside the mask).
        returns: ``[B, T]`` value targets (0 outside the mask).
        value_mask: bool ``[B, T]``: the tokens the value model trains on (finished rows only).
        metrics: detached 0-d tensors ``finished_frac``, ``value_token_frac``, ``advantage_mean``,
            ``bootstrap_mean`` (mean :math:`V(s_l)` over unfinished rows).
    """

    advantages: FloatBT
    returns: FloatBT
    value_mask: BoolBT
    metrics: dict[str, Tensor] = field(default_factory=dict)


def egae(
    values: Float[Tensor, "B _"],
    rewards: PerSeqOrToken,
    mask: BoolBT,
    finished: BoolB,
    *,
    bootstrap: FloatB | None = None,
    gamma: float = 1.0,
    lam: float = 1.0,
    returns: Literal["mc", "lambda"] = "mc",
    experimental: bool = False,
) -> EGAEOutput:
    r"""T-PPO's extended GAE: advantages for incomplete responses, bootstrapped by the critic at the cut.

    .. math::  \delta_t = r_t + \gamma\,\bar V_{t+1} - V(s_t), \qquad
               \bar V_{t+1} = \begin{cases} V(s_{t+1}) & t + 1 < l \\ V(s_l) & t + 1 = l,\ \text{unfinished}
               \\ 0 & t + 1 = l,\ \text{finished} \end{cases}, \qquad
               A_t = \sum_{k=t}^{l-1} (\gamma\lambda)^{k-t}\,\delta_k

    A response cut at length :math:`l` before it finished bootstraps with the critic's :math:`V(s_l)`; a finished
    response ends in its terminal reward with no bootstrap. With :math:`\gamma = \lambda = 1` and zero
    intermediate rewards, :math:`A_t = V(s_l) - V(s_t)` for an unfinished response and :math:`R - V(s_t)` for a
    finished one with outcome reward :math:`R`.

    Reference: T-PPO (Truncated PPO), ByteDance Seed, arXiv 2506.15050. From the abstract: generation is
    length-restricted per step, incomplete responses are trained on with Extended GAE, and policy and value are
    optimised independently. **Reconstructed** (``experimental=True``
    required): the bootstrap form above, outcome rewards only on finished responses, and the value model trained
    only on finished responses (``value_mask``) with Monte-Carlo returns (``returns="mc"``:
    :math:`G_t = \sum_{k \ge t} \gamma^{k-t} r_k`, plus :math:`\gamma^{l-t} V(s_l)` on unfinished rows, which the
    value mask excludes); ``returns="lambda"`` gives verl's :math:`A_t + V(s_t)` instead. Defaults
    :math:`\gamma = \lambda = 1` are verl's GAE defaults for LLM PPO.

    Computation: a discounted reverse cumulative sum, vectorised over rows and tokens — exactly a flip-cumsum
    when :math:`\gamma\lambda = 1`, otherwise a scaled flip-cumsum in float64 over token chunks short enough to
    stay in range (a loop over ``ceil(T / chunk)`` chunks, one chunk for :math:`\gamma\lambda \ge 0.9` and
    ``T <= 6000``; no loop over tokens).

    Args:
        values: critic values, either ``[B, T+1]`` with ``values[:, t]`` = :math:`V(s_t)` (the state before
            token ``t``) and :math:`V(s_l)` at column :math:`l`, or ``[B, T]`` together with ``bootstrap``.
        rewards: outcome rewards ``[B]`` (placed on the last token of finished rows; unfinished rows earned no
            outcome and their entry is ignored) or per-token rewards ``[B, T]`` (used as given inside the mask).
        mask: right-padded bool ``[B, T]``: row ``i``'s response is its first :math:`l_i` positions.
        finished: bool ``[B]``: the response ended (EOS) within the window; False where it was cut.
        bootstrap: :math:`V(s_l)` ``[B]``, required with ``[B, T]`` values (read for unfinished rows only).
        gamma: discount :math:`\gamma \in [0, 1]` (1).
        lam: GAE :math:`\lambda \in [0, 1]` (1).
        returns: ``"mc"`` (default, the reconstructed rule) or ``"lambda"``.
        experimental: must be True.

    Returns:
        :class:`EGAEOutput`.

    Edge cases: an empty row (:math:`l = 0`) has zero advantages and no value tokens; an all-unfinished batch has
    an all-False ``value_mask``; an empty batch returns empty tensors. The mask must be a prefix mask (checked
    while checks are on), because GAE runs along the response.
    """
    _experimental(experimental, "T-PPO's Extended GAE", _DOCS)
    g_ = _real(gamma, "gamma", low=0.0, high=1.0)
    l_ = _real(lam, "lam", low=0.0, high=1.0)
    choice(returns, "returns", ("mc", "lambda"))
    dims = Dims()
    m = as_mask(mask, "mask", dims, "B T")
    b, t_len = m.shape
    fin = as_mask(finished, "finished", dims, "B", device=m.device)
    length = m.sum(-1)
    pos = torch.arange(t_len, device=m.device)
    if checks_enabled() and bool((m != (pos[None, :] < length[:, None])).any()):
        raise InputError(
            "mask", "a right-padded prefix mask (True then False in every row)", describe(mask), "pad on the right"
        )
    v = as_float(values, "values", device=m.device)
    if checks_enabled() and (v.ndim != 2 or v.shape[0] != b or v.shape[1] not in (t_len, t_len + 1)):
        raise InputError(
            "values",
            f"a tensor [B, T+1] or [B, T] (B={b}, T={t_len} from mask)",
            describe(values),
            "pass V(s_t) for t = 0..T, or [B, T] values with bootstrap=",
        )
    unfinished = ~fin
    if v.shape[1] == t_len + 1:
        if bootstrap is not None:
            raise InputError(
                "bootstrap", "None with [B, T+1] values (V(s_l) is values[:, l])", describe(bootstrap), "drop it"
            )
        full = v
    else:
        if bootstrap is None:
            raise InputError(
                "bootstrap", "V(s_l) [B]: values are [B, T]", "None", "pass bootstrap= or values of shape [B, T+1]"
            )
        boot = as_float(bootstrap, "bootstrap", dims, "B", device=m.device)
        finite(boot, "bootstrap", unfinished)
        boot = torch.where(unfinished, boot, torch.zeros_like(boot)).to(v.dtype)
        full = torch.cat([v, torch.zeros_like(v[:, :1])], dim=1)
        full = full.scatter(1, length[:, None], boot[:, None])
    pos1 = torch.arange(t_len + 1, device=m.device)
    finite(full, "values", pos1[None, :] < (length + unfinished.long())[:, None])
    r = as_float(rewards, "rewards", device=m.device)
    if r.ndim == 1:
        dims.check(r, "rewards", "B")
        finite(r, "rewards", fin)
        last = (length - 1).clamp(min=0)
        outcome = torch.where(fin & (length > 0), r, torch.zeros_like(r)).to(full.dtype)
        rt = torch.zeros(b, t_len, dtype=full.dtype, device=m.device)
        if t_len > 0:
            rt = rt.scatter(1, last[:, None], outcome[:, None])
    else:
        dims.check(r, "rewards", "B T")
        finite(r, "rewards", m)
        rt = torch.where(m, r, torch.zeros_like(r)).to(full.dtype)
    at_end = pos[None, :] == (length - 1)[:, None]
    v_t = torch.where(m, full[:, :t_len], torch.zeros_like(full[:, :t_len]))
    v_next = full[:, 1:]
    v_next = torch.where(at_end & fin[:, None], torch.zeros_like(v_next), v_next)
    v_next = torch.where(m, v_next, torch.zeros_like(v_next))
    delta = torch.where(m, rt + g_ * v_next - v_t, torch.zeros_like(rt))
    adv = _discounted_reverse_cumsum(delta, g_ * l_)
    if returns == "lambda":
        ret = torch.where(m, adv + v_t, torch.zeros_like(adv))
    else:
        boot_row = full.gather(1, length[:, None]).squeeze(1)
        extra = torch.where(at_end & unfinished[:, None], g_ * boot_row[:, None], torch.zeros_like(rt))
        ret = torch.where(m, _discounted_reverse_cumsum(rt + extra, g_), torch.zeros_like(rt))
    value_mask = m & fin[:, None]
    has = unfinished & (length > 0)
    boot_vals = full.gather(1, length[:, None]).squeeze(1)
    metrics = {
        "finished_frac": _frac(fin),
        "value_token_frac": (value_mask.sum() / m.sum().clamp(min=1)).float().detach(),
        "advantage_mean": (adv.sum() / m.sum().clamp(min=1)).float().detach(),
        "bootstrap_mean": (torch.where(has, boot_vals, torch.zeros_like(boot_vals)).sum() / has.sum().clamp(min=1))
        .float()
        .detach(),
    }
    return EGAEOutput(advantages=adv, returns=ret, value_mask=value_mask, metrics=metrics)
