"""The parts the two Multi-Adversary GDRO allocators of :mod:`rolloutopt.allocators.gdro` share: the debiased
per-bin EMA (:class:`_BinEMA`) and its state fields, the exponential weights over bins (:func:`_mw_probs`), the
per-prompt visit statistics and hardness of a step, the seeded per-prompt keys, and the validation of the shared
hyperparameters and of the classifier (arXiv 2601.19280, ``docs/methods/gdro.md``; every rule [reconstructed])."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from rolloutopt._state import Check, Field
from rolloutopt._validation import check_int as _int
from rolloutopt._validation import choice, describe, positive
from rolloutopt.allocators._base import AllocationResult
from rolloutopt.allocators._result_check import _check_result
from rolloutopt.allocators.gdro_bins import _F64, DifficultyClassifier, _float_tensor, _unit
from rolloutopt.errors import InputError


def _id_keys(order: Tensor, generator: torch.Generator) -> Tensor:
    """One uniform in (0, 1) per prompt, assigned by the rank of its id (``order = ids.argsort()``), so that
    permuting the prompts permutes the draws with them (the plan depends on the set of prompts, not their order)."""
    u = torch.rand(order.numel(), generator=generator, dtype=_F64).clamp_(1e-12, 1 - 1e-12)
    return torch.empty_like(u).scatter_(0, order, u)


class _BinEMA:
    """Per-bin EMAs with Adam-style debiasing: ``s_hat = s / (1 - beta**t)`` (``t`` updates of that bin)."""

    def __init__(self, num_bins: int, beta: float) -> None:
        self.beta = beta
        self.s = torch.zeros(num_bins, dtype=_F64)
        self.t = torch.zeros(num_bins, dtype=torch.long)

    def update(self, bins: Tensor, values: Tensor) -> None:
        """Each bin that holds at least one value takes one EMA step towards the mean of its values."""
        k = self.s.numel()
        cnt = torch.bincount(bins, minlength=k).to(_F64)
        tot = torch.zeros(k, dtype=_F64).index_add_(0, bins, values)
        hit = cnt > 0
        mean = tot / cnt.clamp(min=1)
        self.s = torch.where(hit, self.beta * self.s + (1 - self.beta) * mean, self.s)
        self.t = self.t + hit.long()

    def debiased(self) -> Tensor:
        """``s_hat`` per bin (NaN where a bin has had no update)."""
        denom = 1 - torch.pow(torch.full_like(self.s, self.beta), self.t.to(_F64))
        return torch.where(self.t > 0, self.s / denom.clamp(min=1e-300), torch.full_like(self.s, math.nan))

    def state(self) -> dict[str, Tensor]:
        return {"s": self.s.clone(), "t": self.t.clone()}

    def load(self, s: dict[str, Tensor]) -> None:
        """Take a state validated against :func:`_bin_ema_fields` (fresh copies from ``load_state``)."""
        self.s, self.t = s["s"], s["t"]


def _bin_ema_fields(check: Check) -> dict[str, Field]:
    """The nested fields of a :class:`_BinEMA` state: ``s`` (with ``check``) and the update counts ``t``, one per
    bin (``K``, shared by every bin EMA of the allocator; it must equal the classifier's ``num_bins``)."""
    return {"s": Field("float", ("K",), (check,)), "t": Field("int", ("K",), ("nonneg",))}


def _check_bins(s: dict[str, Any], keys: tuple[str, ...], classifier: DifficultyClassifier) -> None:
    """The semantic checks of a GDRO state that passed its ``STATE``: bin EMAs over the classifier's bins, and
    the classifier's own check."""
    k = classifier.num_bins
    for key in keys:
        t = s[key]["s"]
        if t.numel() != k:
            raise InputError(
                f"state[{key!r}]['s']",
                f"{k} bins (the classifier's num_bins)",
                describe(t),
                "pass the state_dict() of an allocator whose classifier has the same edges",
            )
    classifier._check_loaded(s["classifier"], "state['classifier']")


def _mw_probs(scores: _BinEMA, present: Tensor, eta: float, gamma: float) -> Tensor:
    r"""EMA-debiased exponential weights over the present bins: :math:`q \propto e^{\eta \hat s}`, mixed with
    uniform. A bin without updates scores like the best scored bin (0 when none is scored), so it is explored."""
    if not bool(present.any()):
        return torch.zeros(present.shape, dtype=_F64)
    s_hat = scores.debiased()
    seen = ~torch.isnan(s_hat)
    best = s_hat[seen & present].max() if bool((seen & present).any()) else torch.tensor(0.0, dtype=_F64)
    s_hat = torch.where(seen, s_hat, best)
    logits = torch.where(present, eta * s_hat, torch.full_like(s_hat, -math.inf))
    q = torch.softmax(logits, dim=0)
    num_present = present.sum().clamp(min=1).to(_F64)
    return torch.where(present, (1 - gamma) * q + gamma / num_present, torch.zeros_like(q))


def _visit_stats(result: AllocationResult, threshold: float) -> tuple[Tensor, Tensor, Tensor]:
    """Per planned prompt: rollouts observed, successes, and whether it was visited (n >= 1)."""
    _check_result(result)
    p = result.plan_prompt_ids.numel()
    n = result.counts.long()
    succ = (result.rewards >= threshold).long()
    c = torch.zeros(p, dtype=torch.long).index_add_(0, result.group.long(), succ)
    return n, c, n > 0


def _hardness(kind: str, n: Tensor, c: Tensor, visited: Tensor, override: Any, p: int) -> Tensor:
    if override is not None:  # the observed hardness signal [P]: NaN for prompts not requested, so only the
        if not isinstance(override, Tensor) or override.shape != (p,):  # visited ones must be finite
            raise InputError(
                "hardness", f"a float tensor [P] = ({p},)", describe(override), "one value per result.plan_prompt_ids"
            )
        return _float_tensor(override[visited], "hardness")
    rate = c[visited].to(_F64) / n[visited].to(_F64)
    return 1 - rate if kind == "fail_rate" else rate * (1 - rate)


def _common(beta: Any, eta: Any, gamma: Any, hardness: Any, seed: Any) -> tuple[float, float, float, int]:
    b = _unit(beta, "beta", closed_low=True, closed_high=False)
    positive(eta, "eta", strict=False)
    g = _unit(gamma, "gamma", closed_low=True, closed_high=True)
    choice(hardness, "hardness", ("fail_rate", "variance"))
    s = _int(seed, "seed", 0)
    return b, float(eta), g, s


def _classifier(classifier: Any, capacity: Any, table: Any, name: str) -> DifficultyClassifier:
    """The allocator's classifier: ``classifier``, or one with its defaults in a table (``capacity``/``table``, as
    :func:`~rolloutopt.allocators.table.open_table`) under the allocator's owner ``name``."""
    if classifier is None:
        return DifficultyClassifier(experimental=True, capacity=capacity, table=table, name=name)
    if not isinstance(classifier, DifficultyClassifier):
        raise InputError("classifier", "a DifficultyClassifier or None", describe(classifier), "leave it None")
    for arg, value in (("capacity", capacity), ("table", table)):
        if value is not None:
            raise InputError(
                arg,
                "None when classifier= is given (the classifier holds the per-prompt state)",
                describe(value),
                f"construct the DifficultyClassifier with {arg}= instead",
            )
    return classifier
