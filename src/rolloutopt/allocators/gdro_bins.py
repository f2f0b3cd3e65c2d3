r"""Multi-Adversary GDRO's difficulty bins and pure functions (arXiv 2601.19280): :class:`DifficultyClassifier`,
:func:`pass_at_k`, :func:`sqrt_allocation`, :func:`shadow_price_arms`, :func:`shadow_price_update`. The two
adversaries that use them are in :mod:`rolloutopt.allocators.gdro`.

Provenance (``docs/methods/gdro.md``): no public code. From the abstract and public summaries: difficulty bins
come from a real-time pass@k estimate with hysteresis; Rollout-GDRO is a shadow price over discrete rollout arms
``n_min..n_max`` under a fixed *mean* rollout budget, with a square-root optimal allocation. Every update
equation and every default below is **[reconstructed]** by this project; each is a keyword.

:class:`DifficultyClassifier` takes keyword arguments only and our suggested defaults, and needs
``experimental=True`` (otherwise an :class:`~rolloutopt.errors.InputError` naming ``experimental``). The pure
functions are exact mathematics of stated problems and need no flag: :func:`pass_at_k` (the unbiased estimator of
Chen et al., arXiv 2107.03374), :func:`sqrt_allocation` (the closed-form optimum of the relaxed rollout problem),
:func:`shadow_price_arms` and :func:`shadow_price_update` (the discrete controller's two steps).
"""

from __future__ import annotations

import itertools
import math
from typing import Any, ClassVar, Literal

import torch
from jaxtyping import Float, Int
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import check_int as _int
from rolloutopt._validation import choice, describe, positive, require_experimental
from rolloutopt.allocators._base import as_prompt_ids
from rolloutopt.allocators.table import Column, PromptTable, TableColumns, TableOwner, open_table
from rolloutopt.errors import InputError
from rolloutopt.typing import FloatP, IntP

__all__ = ["DifficultyClassifier", "pass_at_k", "shadow_price_arms", "shadow_price_update", "sqrt_allocation"]

_DOCS = "docs/methods/gdro.md"
_F64 = torch.float64


# ------------------------------------------------------------------------------------------ validation helpers


def _unit(value: Any, name: str, *, closed_low: bool, closed_high: bool) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = (value >= 0 if closed_low else value > 0) and (value <= 1 if closed_high else value < 1)
    if not ok:
        lo, hi = "[" if closed_low else "(", "]" if closed_high else ")"
        raise InputError(name, f"a number in {lo}0, 1{hi}", describe(value), f"set {name} inside that interval")
    return float(value)


def _int_tensor(x: Any, name: str) -> Tensor:
    if not isinstance(x, Tensor) or x.is_floating_point() or x.is_complex() or x.dtype == torch.bool:
        raise InputError(name, "an integer tensor", describe(x), f"pass {name} as torch.tensor(..., dtype=torch.long)")
    return x.long()


def _float_tensor(x: Any, name: str) -> Tensor:
    if not isinstance(x, Tensor) or not x.is_floating_point():
        raise InputError(name, "a float tensor", describe(x), f"pass {name} as a float tensor")
    if not bool(torch.isfinite(x).all()):
        raise InputError(name, "finite values", f"{describe(x)} with NaN or inf", f"fix the producer of {name}")
    return x.detach().to(_F64)


# ------------------------------------------------------------------------------------------------ pure functions


def pass_at_k(n: IntP, c: IntP, k: int, *, small_group: Literal["plugin", "clip"] = "plugin") -> FloatP:
    r"""Unbiased pass@k estimate from ``c`` successes in ``n`` samples, vectorised.

    .. math::  \widehat{\mathrm{pass@}k} = 1 - \binom{n-c}{k} \Big/ \binom{n}{k}
               = 1 - \exp\bigl(\ln\Gamma(n-c+1) - \ln\Gamma(n-c-k+1) - \ln\Gamma(n+1) + \ln\Gamma(n-k+1)\bigr)

    for :math:`k \le n` (exactly 1 when :math:`n - c < k`). Reference: Chen et al., arXiv 2107.03374; used as
    the difficulty signal of Multi-Adversary GDRO (arXiv 2601.19280, ``docs/methods/gdro.md``).

    Args:
        n: samples per prompt, integer ``[P]`` (>= 1).
        c: successes per prompt, integer ``[P]``, ``0 <= c <= n``.
        k: the k of pass@k (>= 1).
        small_group: what a group with :math:`n < k` gives ([reconstructed]; the unbiased estimator needs
            :math:`n \ge k`): ``"plugin"`` (default) :math:`1 - (1 - c/n)^k`, the plug-in estimate;
            ``"clip"`` uses :math:`k = n`, i.e. 1 if any sample succeeded, else 0.

    Returns:
        float64 ``[P]`` in ``[0, 1]``. An empty input gives an empty output.
    """
    k = _int(k, "k", 1)
    choice(small_group, "small_group", ("plugin", "clip"))
    nn, cc = _int_tensor(n, "n"), _int_tensor(c, "c")
    if nn.shape != cc.shape:
        raise InputError("c", f"the shape of n {tuple(nn.shape)}", describe(c), "pass one count per prompt")
    if bool((nn < 1).any()):
        raise InputError("n", "sample counts >= 1", describe(n), "leave out prompts without samples")
    if bool(((cc < 0) | (cc > nn)).any()):
        raise InputError("c", "success counts with 0 <= c <= n", describe(c), "count successes among the n samples")
    nf, cf = nn.to(_F64), cc.to(_F64)
    fail = nf - cf
    enough = fail >= k  # otherwise every k-subset holds a success
    safe_fail = torch.where(enough, fail, torch.full_like(fail, float(k)))
    safe_n = torch.maximum(nf, torch.full_like(nf, float(k)))
    log_ratio = (
        torch.lgamma(safe_fail + 1)
        - torch.lgamma(safe_fail - k + 1)
        - torch.lgamma(safe_n + 1)
        + torch.lgamma(safe_n - k + 1)
    )
    unbiased = torch.where(enough, -torch.expm1(log_ratio.clamp(max=0.0)), torch.ones_like(nf))
    small = 1 - (1 - cf / nf) ** k if small_group == "plugin" else (cf > 0).to(_F64)
    return torch.where(nf >= k, unbiased, small).clamp(0.0, 1.0)


def sqrt_allocation(a: Float[Tensor, " K"], pi: Float[Tensor, " K"], n_bar: float) -> Float[Tensor, " K"]:
    r"""Closed-form rollouts per bin of the relaxed Rollout-GDRO problem (the square-root rule).

    .. math::  \min_{n > 0} \sum_b \pi_b \frac{a_b}{n_b} \ \text{s.t.}\ \sum_b \pi_b n_b = \bar n
               \quad\Longrightarrow\quad n_b = \sqrt{a_b / \mu} = \bar n\,
               \frac{\sqrt{a_b}}{\sum_j \pi_j \sqrt{a_j}}, \qquad \mu = \Bigl(\frac{\sum_j \pi_j\sqrt{a_j}}{\bar n}
               \Bigr)^2,

    with :math:`a_b = w_b v_b` (adversarial weight times variance proxy). Reference: Multi-Adversary GDRO,
    arXiv 2601.19280 ("a variance-proxy analysis gives a square-root optimal allocation"); the problem statement is
    our [reconstructed] relaxation. Continuous and uncapped: :class:`RolloutGDRO`'s
    controller approaches it on discrete arms ``n_min..n_max`` (tested).

    Args:
        a: per-bin :math:`w_b v_b`, float ``[K]``, finite, >= 0.
        pi: per-bin mass, float ``[K]``, >= 0 with a positive sum (normalised here).
        n_bar: the mean budget :math:`\bar n > 0` (rollouts per prompt on average).

    Returns:
        float64 ``[K]`` with :math:`\sum_b \pi_b n_b = \bar n`. Bins with :math:`a_b = 0` get 0; if every bin with
        mass has :math:`a_b = 0` there is no signal and every bin gets :math:`\bar n`.
    """
    aa, pp = _float_tensor(a, "a"), _float_tensor(pi, "pi")
    if aa.ndim != 1 or pp.shape != aa.shape:
        raise InputError("pi", f"a 1-d tensor shaped like a {tuple(aa.shape)}", describe(pi), "one mass per bin")
    if bool((aa < 0).any()):
        raise InputError("a", "non-negative w * v per bin", describe(a), "clamp the variance proxy at 0")
    if bool((pp < 0).any()) or not float(pp.sum()) > 0:
        raise InputError("pi", "non-negative bin masses with a positive sum", describe(pi), "pass bin shares")
    positive(n_bar, "n_bar")
    pp = pp / pp.sum()
    root = aa.sqrt()
    denom = (pp * root).sum()
    if not float(denom) > 0:
        return torch.full_like(aa, float(n_bar))
    return float(n_bar) * root / denom


def shadow_price_arms(a: Float[Tensor, " K"], mu: float, *, n_min: int, n_max: int) -> Int[Tensor, " K"]:
    r"""Rollout-GDRO's discrete arm per bin at shadow price :math:`\mu`.

    .. math::  n_b = \arg\max_{n \in \{n_{min},\dots,n_{max}\}} a_b\Bigl(\frac{1}{n_{min}} - \frac{1}{n}\Bigr) - \mu n
               = n_{min} + \#\Bigl\{k \in \{n_{min}+1,\dots,n_{max}\} : \frac{a_b}{k(k-1)} > \mu\Bigr\},

    the second form because the gain of the k-th rollout, :math:`a_b/(k(k-1)) - \mu`, decreases in k (ties go to
    the smaller arm). Reference: arXiv 2601.19280; ``docs/methods/gdro.md`` [reconstructed].

    Args:
        a: per-bin :math:`w_b v_b`, float ``[K]``, finite, >= 0.
        mu: the shadow price, >= 0. ``mu = 0`` gives ``n_max`` wherever :math:`a_b > 0`.
        n_min, n_max: the arms, ``1 <= n_min <= n_max``.

    Returns:
        int64 ``[K]`` in ``[n_min, n_max]``; :math:`a_b = 0` gives ``n_min``.
    """
    aa = _float_tensor(a, "a")
    if bool((aa < 0).any()):
        raise InputError("a", "non-negative w * v per bin", describe(a), "clamp the variance proxy at 0")
    positive(mu, "mu", strict=False)
    lo, hi = _arms(n_min, n_max)
    return _arms_of(aa, float(mu), lo, hi)


def _arms(n_min: Any, n_max: Any) -> tuple[int, int]:
    lo = _int(n_min, "n_min", 1)
    hi = _int(n_max, "n_max", 1)
    if hi < lo:
        raise InputError("n_max", f"n_max >= n_min = {lo}", describe(n_max), "raise n_max or lower n_min")
    return lo, hi


def _arms_of(a: Tensor, mu: float, n_min: int, n_max: int) -> Tensor:
    k = torch.arange(n_min + 1, n_max + 1, dtype=_F64)
    gain = a[:, None] / (k * (k - 1))[None, :]
    return n_min + (gain > mu).sum(dim=1)


def shadow_price_update(mu: float, mean_n: float, n_bar: float, *, eta_mu: float, scale: float = 1.0) -> float:
    r"""One dual (sub)gradient step of the shadow price.

    .. math::  \mu \leftarrow \max\bigl(0, \mu + \eta_\mu\, c\, (\bar n_t - \bar n)\bigr)

    :math:`\bar n_t = \sum_b \pi_b n_b` is the mean of the arms the controller *proposed* this step (the
    Lagrangian maximiser, before any cut to the step's hard budget). ``scale`` :math:`c = 1` is the plain rule;
    :class:`RolloutGDRO`'s default passes :math:`c = \mu^\star / \bar n` (the closed-form price of the step over
    the mean budget), which makes :math:`\eta_\mu` dimensionless. Reference: arXiv 2601.19280;
    ``docs/methods/gdro.md`` [reconstructed].
    """
    positive(mu, "mu", strict=False)
    positive(eta_mu, "eta_mu", strict=False)
    positive(scale, "scale", strict=False)
    positive(n_bar, "n_bar")
    if not (isinstance(mean_n, (int, float)) and math.isfinite(mean_n)):
        raise InputError("mean_n", "a finite number", describe(mean_n), "pass sum_b pi_b * arm_b")
    return max(0.0, float(mu) + float(eta_mu) * float(scale) * (float(mean_n) - float(n_bar)))


# -------------------------------------------------------------------------------------------- the classifier


class DifficultyClassifier(TableOwner):
    r"""Online difficulty bins from each prompt's recent pass@k, with hysteresis [reconstructed].

    Per visit (a prompt's group in one step, ``c`` successes of ``n``), :math:`e = \widehat{\mathrm{pass@}k}(n, c)`
    (:func:`pass_at_k`) and the prompt's EMA becomes

    .. math::  s \leftarrow \lambda s + (1 - \lambda) e \quad(\text{first visit: } s = e), \qquad
               \mathrm{cand} = \#\{j : s \ge \mathrm{edges}_j\}.

    Bin 0 is the hardest (lowest pass@k). A known prompt moves from its bin :math:`b` (interval
    :math:`[\mathrm{edges}_{b-1}, \mathrm{edges}_b)`) to ``cand`` only if :math:`s` lies more than ``margin``
    outside that interval, or ``cand != b`` on ``patience`` consecutive visits (hysteresis; ``margin=0,
    patience=1`` turns it off). A first visit takes ``cand`` directly.

    Reference: Multi-Adversary GDRO, arXiv 2601.19280 (pass@k bins with hysteresis: from the summaries). The
    EMA, the edges, ``k``, the margin/patience rule and the unseen-prompt policy are **[reconstructed]**
    (``docs/methods/gdro.md``), hence ``experimental=True``.

    State (bounded, vectorised, in a :class:`~rolloutopt.allocators.PromptTable` keyed by int64 prompt ids): per
    prompt the EMA, the bin and the streak of visits across an edge — three numbers per prompt. The table's
    ``capacity`` bounds the number of prompts: beyond it the least recently visited are forgotten (ties: the
    smaller id first) and become unseen again.

    Args:
        k: the k of pass@k (default 4, [reconstructed]: unbiased from groups of >= 4, not saturated at 8).
        edges: increasing bin edges in (0, 1) (default ``(0.2, 0.4, 0.6, 0.8)``: 5 bins, [reconstructed]).
        smoothing: :math:`\lambda \in [0, 1)`, the weight of the old EMA (default 0.5).
        margin: hysteresis margin :math:`h \ge 0` (default 0.05).
        patience: consecutive visits across an edge that move a prompt anyway (default 2).
        unseen: never-seen prompts go to ``"separate"`` (default: an extra bin ``len(edges) + 1``, the last) or
            ``"middle"`` (bin ``(len(edges) + 1) // 2``).
        success_threshold: a reward counts as a success when ``reward >= success_threshold`` (default 1.0:
            binary 0/1 and DAPO's ±1 rewards both work).
        small_group: forwarded to :func:`pass_at_k` for groups smaller than ``k``.
        experimental: must be True (see above).
        capacity: prompts kept in a private table (default None: 1,000,000; the least recently visited are
            forgotten first).
        table: a shared :class:`~rolloutopt.allocators.PromptTable` (default None: a private one); the classifier
            registers ``ema``, ``bin`` and ``streak`` as owner ``name``, and the caller saves a shared table once.
        name: the classifier's owner name in its table (default ``"difficulty"``; the GDRO allocators name the
            classifier they build ``"promptgdro"`` / ``"rolloutgdro"``).
    """

    def __init__(
        self,
        *,
        k: int = 4,
        edges: tuple[float, ...] = (0.2, 0.4, 0.6, 0.8),
        smoothing: float = 0.5,
        margin: float = 0.05,
        patience: int = 2,
        unseen: Literal["separate", "middle"] = "separate",
        success_threshold: float = 1.0,
        small_group: Literal["plugin", "clip"] = "plugin",
        experimental: bool = False,
        capacity: int | None = None,
        table: PromptTable | None = None,
        name: str = "difficulty",
    ) -> None:
        require_experimental(experimental, "the GDRO difficulty classifier (EMA of pass@k, edges, hysteresis)", _DOCS)
        self.k = _int(k, "k", 1)
        e = tuple(edges) if isinstance(edges, (tuple, list)) else None
        if (
            e is None
            or not e
            or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 < x < 1 for x in e)
            or any(b <= a for a, b in itertools.pairwise(e))
        ):
            raise InputError(
                "edges", "a non-empty increasing tuple of numbers in (0, 1)", describe(edges), "e.g. (0.3, 0.7)"
            )
        self.edges = tuple(float(x) for x in e)
        self.smoothing = _unit(smoothing, "smoothing", closed_low=True, closed_high=False)
        positive(margin, "margin", strict=False)
        self.margin = float(margin)
        self.patience = _int(patience, "patience", 1)
        choice(unseen, "unseen", ("separate", "middle"))
        self.unseen = unseen
        if not (isinstance(success_threshold, (int, float)) and math.isfinite(success_threshold)):
            raise InputError("success_threshold", "a finite number", describe(success_threshold), "e.g. 1.0")
        self.success_threshold = float(success_threshold)
        choice(small_group, "small_group", ("plugin", "clip"))
        self.small_group = small_group
        self._edges = torch.tensor(self.edges, dtype=_F64)
        known = len(self.edges) + 1
        self.num_bins = known + 1 if unseen == "separate" else known
        self.unseen_bin = known if unseen == "separate" else known // 2
        # the fills are an unseen prompt's: no EMA yet (NaN, exactly where the row is not seen), the unseen bin,
        # no streak
        self._cols = open_table(
            table,
            capacity,
            name,
            {
                "ema": Column("float", fill=math.nan, checks=("finite_or_nan",)),  # in [0, 1]: _check_loaded
                "bin": Column("int", fill=self.unseen_bin, checks=("nonneg",)),  # < num_bins: _check_loaded
                "streak": Column("int", checks=("nonneg",)),
            },
        )

    @property
    def capacity(self) -> int:
        """The table's capacity (at most this many prompts are remembered)."""
        return self._cols.table.capacity

    def __len__(self) -> int:
        """Number of prompts the classifier remembers (visited and not forgotten)."""
        return 0 if self._cols.empty else int(self._cols["seen"].sum())

    def _find(self, ids: Tensor) -> tuple[Tensor, Tensor]:
        """Rows of ``ids`` and whether the classifier has visited each (rows of the others are junk)."""
        if self._cols.empty:
            return torch.zeros_like(ids), torch.zeros(ids.shape, dtype=torch.bool)
        return self._cols.find(ids)

    def bins(self, prompt_ids: IntP) -> IntP:
        """Current bin of each prompt, int64 ``[P]`` (never-seen prompts: ``unseen_bin``)."""
        return self._bins_at(*self._find(as_prompt_ids(prompt_ids)))

    def _bins_at(self, pos: Tensor, found: Tensor) -> Tensor:
        if self._cols.empty:
            return torch.full(pos.shape, self.unseen_bin, dtype=torch.long)
        return torch.where(found, self._cols["bin"].index_select(0, pos), self.unseen_bin)

    def ema(self, prompt_ids: IntP) -> FloatP:
        """The pass@k EMA of each prompt, float64 ``[P]`` (NaN for never-seen prompts)."""
        ids = as_prompt_ids(prompt_ids)
        if self._cols.empty:
            return torch.full(ids.shape, math.nan, dtype=_F64)
        pos, found = self._find(ids)
        return torch.where(found, self._cols["ema"].index_select(0, pos), math.nan)  # (NaN where not seen anyway)

    def update(self, prompt_ids: IntP, n: IntP, c: IntP) -> None:
        """One visit per prompt: ``c`` successes out of ``n`` rollouts (distinct ids ``[M]``, ``n >= 1``)."""
        ids = as_prompt_ids(prompt_ids)
        nn, cc = _int_tensor(n, "n"), _int_tensor(c, "c")
        if nn.shape != ids.shape or cc.shape != ids.shape:
            raise InputError("n", f"counts shaped like prompt_ids {tuple(ids.shape)}", describe(n), "one per prompt")
        self._visit(ids, nn, cc)

    def _visit(self, ids: Tensor, nn: Tensor, cc: Tensor) -> Tensor:
        """One visit of the distinct ``ids``; returns their bins before it (int64, in the order of ``ids``)."""
        est = pass_at_k(nn, cc, self.k, small_group=self.small_group)
        rows, order = self._cols.add(ids)  # the increasing rows of ids[order]; new rows hold the fills
        est = est.index_select(0, order)
        ema, bin_, streak = self._cols["ema"], self._cols["bin"], self._cols["streak"]
        old = ema.index_select(0, rows)
        known = ~torch.isnan(old)  # visited before (a row this classifier has not visited holds a NaN EMA)
        cur = torch.where(known, bin_.index_select(0, rows), self.unseen_bin)
        # known prompts: EMA and hysteresis; new prompts: the first visit sets the EMA and the bin
        lam = self.smoothing
        new = torch.where(known, lam * old + (1 - lam) * est, est)
        cand = torch.bucketize(new, self._edges, right=True)
        inf = torch.tensor([math.inf], dtype=_F64)
        lo_edges = torch.cat([-inf, self._edges])
        hi_edges = torch.cat([self._edges, inf])
        known_cur = cur.clamp(max=len(self.edges))  # a "middle" unseen bin is a real bin; "separate" never stored
        outside = (new < lo_edges[known_cur] - self.margin) | (new >= hi_edges[known_cur] + self.margin)
        across = cand != cur
        run = torch.where(across, streak.index_select(0, rows) + 1, 0)
        move = ~known | (across & (outside | (run >= self.patience)))
        ema.index_copy_(0, rows, new)
        bin_.index_copy_(0, rows, torch.where(move, cand, cur))
        streak.index_copy_(0, rows, torch.where(move, 0, run))
        return torch.empty_like(cur).scatter_(0, order, cur)

    STATE: ClassVar[dict[str, Field]] = {"table": TableColumns.FIELD}
    """The declared fields of :meth:`state_dict` (the table validates the columns; bins must also be below
    ``num_bins``, checked by :meth:`load_state_dict`); the GDRO allocators nest it under ``"classifier"``."""

    def state_dict(self) -> dict[str, Any]:
        """The table (per prompt the EMA, bin and streak; the rows only when the table is private), copies."""
        return dump_state(self._state())

    def _state(self) -> dict[str, Any]:
        """The fields of :meth:`state_dict` without the format version (what the GDRO allocators nest)."""
        return {"table": self._cols.state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` saved, validated field by field (an ``InputError`` names a bad one),
        with bins of this classifier's edges."""
        s = load_state(state, self.STATE, "DifficultyClassifier")
        self._check_loaded(s, "state")
        self._assign(s, "state")

    def _check_loaded(self, s: dict[str, Any], name: str) -> None:
        """The semantic check of a state that passed :data:`STATE` (``name``: its path, for the error)."""
        cols, at = self._cols.incoming(s["table"], f"{name}['table']")
        b, e = cols["bin"], cols["ema"]
        if b.numel() and not bool((b < self.num_bins).all()):
            key = f"{self._cols.owner}/bin"
            raise InputError(f"{at}[{key!r}]", f"bins in [0, {self.num_bins})", describe(b), "same edges")
        if not torch.equal(~torch.isnan(e), cols["seen"]) or bool(((e < 0) | (e > 1)).any()):
            key = f"{self._cols.owner}/ema"
            raise InputError(
                f"{at}[{key!r}]",
                "a pass@k EMA in [0, 1] for each visited prompt, NaN for the others",
                describe(e),
                "pass the classifier's state_dict()",
            )

    def _assign(self, s: dict[str, Any], name: str) -> None:
        """Load the table of a checked state (the last step that can fail)."""
        self._cols.load(s["table"], f"{name}['table']")
