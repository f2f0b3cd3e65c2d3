r"""The loss side of a stop rule that makes a stopped rollout an absorbing failure state (ESPO, arXiv 2605.29860).

:func:`absorbing_failure` rewrites a batch after any :class:`~rolloutopt.control.StopRule`: the terminal reward
at the stop position, ``done`` flags there (no bootstrap past the stop) and the truncated loss mask, so that
PPO/GAE then run unchanged; :class:`AbsorbingFailure` is what it returns (``docs/methods/early_stop.md``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from rolloutopt._validation import Dims, as_float, as_mask, checks_enabled, describe, finite
from rolloutopt._validation import check_real as _real
from rolloutopt.control._base import StopResult, truncate_mask
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolB, BoolBT, FloatB, FloatBT, PerSeqOrToken

__all__ = ["AbsorbingFailure", "absorbing_failure"]


@dataclass(frozen=True)
class AbsorbingFailure:
    """A batch rewritten by :func:`absorbing_failure`.

    Attributes:
        token_rewards: float32 ``[N, T]``; a stopped row has 0 everywhere except ``r_fail`` at its stop position.
        rewards: float32 ``[N]``; ``r_fail`` for stopped rows, the original sequence reward otherwise.
        done: bool ``[N, T]``; True at the terminal token of each row (the stop position of a stopped row, the
            last kept token of the others): GAE must not bootstrap past it.
        mask: bool ``[N, T]``; the loss mask truncated after each stop position (:func:`truncate_mask`).
        stopped: bool ``[N]``; the rows that became absorbing failures.
        metrics: detached 0-d tensors: ``stop_frac``, ``tokens_removed`` (masked-in tokens dropped by the stops).
    """

    token_rewards: FloatBT
    rewards: FloatB
    done: BoolBT
    mask: BoolBT
    stopped: BoolB
    metrics: dict[str, Tensor] = field(default_factory=dict)


def absorbing_failure(
    rewards: PerSeqOrToken, mask: BoolBT, result: StopResult, *, r_fail: float | None = None
) -> AbsorbingFailure:
    r"""Turn rollouts a stop rule cut into absorbing failure states: terminal reward, ``done``, truncated mask.

    .. math::
        r_{i,t} = \begin{cases} r^{fail}_i & t = T^{stop}_i \\ 0 & t \ne T^{stop}_i \end{cases}
        \ \text{(stopped rows)}, \qquad r_{i,t} \text{ unchanged (other rows)}, \qquad
        \text{done}_{i,t} = [t = T^{end}_i]

    Reference: ESPO, arXiv 2605.29860 (``docs/methods/early_stop.md``, "loss-side effect"): no bootstrap beyond
    the stop, so GAE concentrates the negative TD error near the stop point; PPO/GAE then run unchanged. The
    terminal reward is **never** added to rows that finished normally. Works for any
    :class:`~rolloutopt.control.StopRule`'s result; the terminal reward is the result's own by default (ESPO's
    ``r_fail``, :class:`~rolloutopt.control.Abstention`'s ``r_abs``: ``result.terminal_reward``).

    Args:
        rewards: float ``[N]`` sequence rewards (placed on each row's last masked-in token) or ``[N, T]`` token
            rewards (kept as they are for rows that did not stop).
        mask: bool ``[N, T]``, the response mask before the stop rule.
        result: the rule's :meth:`~rolloutopt.control.StopRule.finalize` output for the same rows; a stopped row's
            position must be a masked-in token of ``mask``.
        r_fail: the terminal reward of every stopped row; None (default) takes the result's own,
            ``result.terminal_reward`` on its ``terminal_rows``, and -1.0 (the ESPO digests' value) on a stopped
            row without one (a rule that implies no terminal reward).

    Edge cases: a row with an empty mask gets zero token rewards and no ``done`` (its sequence reward stays in
    ``rewards``); with no stopped row the token rewards are the input's (placed, for ``[N]`` rewards); ``N = 0``
    or ``T = 0`` works.
    """
    dims = Dims()
    m = as_mask(mask, "mask", dims, "N T")
    fail = -1.0 if r_fail is None else _real(r_fail, "r_fail")
    r = as_float(rewards, "rewards")
    if checks_enabled():
        if r.ndim == 1:
            dims.check(r, "rewards", "N")
        else:
            dims.check(r, "rewards", "N T")
        if not isinstance(result, StopResult):
            raise InputError("result", "a StopResult from rule.finalize()", describe(result), "pass rule.finalize()")
        if result.stopped.shape[0] != m.shape[0]:
            raise InputError(
                "result", f"a StopResult for N={m.shape[0]} rows", f"one for {result.stopped.shape[0]}", "same batch"
            )
    r = r.to(m.device).float()
    if checks_enabled():
        finite(r, "rewards", None if r.ndim == 1 else m)
    n, t_len = m.shape
    stopped = result.stopped.to(m.device)
    pos = result.position.to(m.device)
    cols = torch.arange(t_len, device=m.device)
    if checks_enabled() and bool(stopped.any()):
        bad = stopped & ((pos >= t_len) | ~m.gather(1, pos.clamp(0, max(t_len - 1, 0))[:, None]).squeeze(1))
        if t_len == 0 or bool(bad.any()):
            raise InputError(
                "result",
                "stop positions at masked-in tokens of mask",
                "a stopped row whose position is outside its mask",
                "pass the mask of the generation the rule observed",
            )
    new_mask = truncate_mask(m, result)
    # the last masked-in token of each row after truncation, -1 if none
    if t_len > 0:
        last = torch.where(new_mask, cols[None, :], torch.full_like(new_mask, -1, dtype=torch.long)).amax(dim=1)
    else:
        last = torch.full((n,), -1, dtype=torch.long, device=m.device)
    at_last = cols[None, :] == last[:, None]
    if r.ndim == 1:
        seq = r
        base = torch.where(at_last, r[:, None], torch.zeros((), device=m.device))
    else:
        seq = torch.where(m, r, torch.zeros((), device=m.device)).sum(dim=1)
        base = torch.where(m, r, torch.zeros((), device=m.device))
    fail_row = torch.full_like(seq, fail)  # the terminal reward of each row (read on the stopped rows only)
    if r_fail is None and result.terminal_reward is not None and result.terminal_rows is not None:
        own = result.terminal_rows.to(m.device)
        fail_row = torch.where(own, result.terminal_reward.to(m.device, fail_row.dtype), fail_row)
    fail_t = torch.where(at_last, fail_row[:, None], torch.zeros((), device=m.device))
    token_rewards = torch.where(stopped[:, None], fail_t, base)
    rewards_out = torch.where(stopped, fail_row, seq)
    done = at_last & (last >= 0)[:, None]
    removed = (m & ~new_mask).sum()
    metrics = {"stop_frac": stopped.float().sum() / max(n, 1), "tokens_removed": removed.float()}
    return AbsorbingFailure(
        token_rewards=token_rewards,
        rewards=rewards_out,
        done=done,
        mask=new_mask,
        stopped=stopped.clone(),
        metrics={k: v.detach() for k, v in metrics.items()},
    )
