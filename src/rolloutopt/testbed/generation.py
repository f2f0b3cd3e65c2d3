r"""A token-level generation simulator for stop rules: per-step signals with a latent failure point.

:class:`GenerationSimulator` draws a batch of rollouts (``P`` prompts × ``G`` rollouts) token by token, without a
model: per step the sampled token's log-prob, the entropy, the top-k log-probs ``[N, K]`` and token ids, the
critic's value, a teacher's top-k ids (for on-policy distillation rules) and an answer-probe confidence. Each
rollout carries its ground truth: whether it succeeds, its latent *failure point* (the token from which a failing
rollout can no longer succeed; none for successful ones), the token where it writes its answer, and its length
(EOS, or the horizon). After the failure point the signals degrade — the distribution flattens (higher entropy,
higher regret :math:`\max_a \log\pi - \log\pi(a_t)`, lower sampled probability), transition markers become more
frequent, the value drops, the teacher's top-k drifts away — so :meth:`SimulatedGeneration.premature` can say
whether a stop rule's stop came too early. ``benchmarks/control.py`` drives every stop rule over it.

The model is the library's own **synthetic** model (``docs/methods/control_benchmark.md``), not taken from a
paper; every distributional choice is a keyword of :class:`GenerationSimulator`, documented there. It is
deliberately simple:
the signals step at the failure point (no gradual drift), tokens are independent given the row's latent state,
and the rules see exactly the signals the model puts in. What a rule achieves here says how it reacts to such
signals, not how it does on a real model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt._validation import check_int as _int
from rolloutopt._validation import check_real as _real
from rolloutopt._validation import describe
from rolloutopt.errors import InputError
from rolloutopt.typing import BoolB, BoolBT, FloatB, FloatBT, FloatBTK, IntB, IntBT

__all__ = ["GenerationSimulator", "SimulatedGeneration"]


def _span(value: Any, name: str) -> tuple[float, float]:
    ok = isinstance(value, (tuple, list)) and len(value) == 2
    if ok:
        lo, hi = (_real(v, name, 0.0, 1.0) for v in value)
        if lo <= hi:
            return lo, hi
    raise InputError(
        name, "a pair (low, high) with 0 <= low <= high <= 1", describe(value), f"pass e.g. {name}=(0.1, 0.4)"
    )


def _ids(value: Any, name: str, vocab_size: int) -> tuple[int, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence) or not value:
        raise InputError(name, "a non-empty sequence of token ids (ints)", describe(value), f"pass e.g. {name}=(1,)")
    ids = tuple(value)
    if any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < vocab_size for i in ids):
        raise InputError(name, f"token ids in [0, {vocab_size})", describe(value), "pass ids inside the vocabulary")
    return tuple(sorted(set(ids)))


@dataclass(frozen=True)
class SimulatedGeneration:
    """One simulated batch: per-token signals ``[N, T]`` (``T`` = the horizon) and per-row ground truth ``[N]``
    (``N`` rollouts: the ``B`` of the shape annotations).

    Per token (row ``i``, step ``t``; positions ``t >= length[i]`` hold draws of the same model, finite, with
    ``mask`` False — a generation loop passes ``active=mask[:, t]``):

    - ``mask`` bool: ``t < length``; ``logp`` float32: the sampled token's log-prob; ``entropy`` float32
      (nats, of the full-vocabulary distribution); ``topk_logp`` float32 ``[N, T, K]`` sorted descending
      (``logp <= topk_logp[..., 0]``; the sampled token is one of the top-k or a tail token below them);
      ``tokens`` int64; ``topk_ids`` int64 ``[N, T, K]`` (distinct per step, in rank order; contains the sampled
      token when it is in the top-k); ``teacher_topk_ids`` int64 ``[N, T, K]`` (distinct per step);
      ``values`` float32 in [0, 1] (the critic's estimate of the success probability);
      ``confidence`` float32 in (0, 1) (the confidence of an answer forced at this step, for probe-gated rules);
      ``degraded`` bool: the row fails and ``t >= fail_at``.

    Per row: ``group`` int64 (prompt index, ``G`` consecutive rows each), ``pass_rate`` float32 (the prompt's
    success probability), ``success`` bool, ``rewards`` float32 (1.0 for success, else 0.0), ``length`` int64
    (tokens generated when running to the horizon, EOS included), ``finished`` bool (emitted EOS within the
    horizon), ``fail_at`` int64 (the failure point of a failing row, -1 for successful rows), ``answer_at``
    int64 (the index of the answer-marker token, -1 for a row cut by the horizon before its answer).
    """

    mask: BoolBT
    logp: FloatBT
    entropy: FloatBT
    topk_logp: FloatBTK
    tokens: IntBT
    topk_ids: Int[Tensor, "B T topk"]
    teacher_topk_ids: Int[Tensor, "B T topk"]
    values: FloatBT
    confidence: FloatBT
    degraded: BoolBT
    group: IntB
    pass_rate: FloatB
    success: BoolB
    rewards: FloatB
    length: IntB
    finished: BoolB
    fail_at: IntB
    answer_at: IntB

    @property
    def num_rows(self) -> int:
        """N, the number of rollouts."""
        return int(self.mask.shape[0])

    @property
    def max_tokens(self) -> int:
        """T, the horizon."""
        return int(self.mask.shape[1])

    def cutoff(self, answer: BoolB | bool = False) -> IntB:
        r"""The first token index at which a stop is *justified*, int64 ``[N]``; a stop at ``position < cutoff``
        is premature.

        A failing row: its failure point (from there it can no longer succeed, so nothing is lost). A successful
        row: never (``T``) when the stop abandons the rollout (``answer`` False: it becomes a failure, e.g. ESPO's
        absorbing state or a pruned branch), or its ``answer_at`` when the stop keeps the answer written so far
        (``answer`` True: an early exit that extracts the answer, e.g. DEER or DUET's "answered" stop).
        ``answer``: a bool, or bool ``[N]`` per row (e.g. ``result.reason == <answer reason>``).
        """
        ans = torch.as_tensor(answer, dtype=torch.bool).expand(self.num_rows)
        never = torch.full_like(self.length, self.max_tokens)
        ok = torch.where(ans & (self.answer_at >= 0), self.answer_at, never)
        return torch.where(self.success, ok, self.fail_at)

    def premature(self, stopped: BoolB, position: IntB, answer: BoolB | bool = False) -> BoolB:
        """Bool ``[N]``: rows stopped at a ``position`` (index of the last kept token) before :meth:`cutoff`.

        ``stopped`` bool ``[N]`` and ``position`` int ``[N]`` as in :class:`~rolloutopt.control.StopResult`.
        A stop after the row's natural end (``position >= length``) never happens in a generation loop that passes
        ``active=mask[:, t]``.
        """
        self._rows(stopped, "stopped")
        self._rows(position, "position")
        return stopped.to(torch.bool) & (position.long() < self.cutoff(answer))

    def kept_tokens(self, stopped: BoolB, position: IntB) -> IntB:
        """Tokens each row generates under a stop rule, int64 ``[N]``: ``min(position + 1, length)`` where
        stopped, else ``length`` (running to EOS or the horizon)."""
        self._rows(stopped, "stopped")
        self._rows(position, "position")
        kept = torch.minimum(position.long() + 1, self.length)
        return torch.where(stopped.to(torch.bool), kept, self.length)

    def _rows(self, x: Any, name: str) -> None:
        if not isinstance(x, Tensor) or tuple(x.shape) != (self.num_rows,):
            raise InputError(name, f"a tensor [N] with N={self.num_rows}", describe(x), "pass result." + name)


class GenerationSimulator:
    r"""Synthetic token-level generation with a latent failure point per rollout (a model, not from a paper).

    ``sample(P, generator)`` draws ``N = P G`` rollouts. Per prompt :math:`g`: pass rate
    :math:`p_g = \sigma(\mu_p + \sigma_p z_g)`. Per rollout :math:`i` of prompt :math:`g`:

    - success :math:`s_i \sim \mathrm{Bernoulli}(p_g)`; natural length :math:`\ell_i = \max(\ell_{min},
      \lfloor m\, e^{\sigma_\ell z_i}\, \phi^{[s_i = 0]} \rceil)` (log-normal; failures longer by :math:`\phi`);
      successful rows always finish (:math:`\ell_i` clipped to the horizon :math:`T`), so
      :math:`\text{length}_i = \min(\ell_i, T)`, and a failing row with :math:`\ell_i > T` is cut by the
      horizon (no EOS);
    - failure point (failing rows) :math:`f_i = \min(\lfloor u_i \ell_i \rfloor, \text{length}_i - 1)`,
      :math:`u_i \sim U(\text{fail\_frac})`; answer token :math:`a_i = \min(\lfloor v_i \ell_i \rfloor,
      \ell_i - 2)`, :math:`v_i \sim U(\text{answer\_frac})` (dropped, -1, when the horizon cuts the row before it);
      ``fail_frac``'s upper end must not exceed ``answer_frac``'s lower end, so a failing row fails at or before
      its (wrong) answer;
    - step :math:`t` is *degraded* when :math:`s_i = 0 \wedge t \ge f_i`. Logits of the top-k tokens and of the
      tail: :math:`l_0 = 0,\ l_j = -\sum_{m<j} e_m` with gaps :math:`e_m \sim \gamma_{i,t}\,\mathrm{Exp}(1)`,
      :math:`m = 0..K-1`; the :math:`V - K` other tokens share the tail logit :math:`l_K`. The gap scale is
      :math:`\gamma_{i,t} = \gamma\, e^{\sigma_\gamma z'_i}` with :math:`\gamma` = ``gap_ok`` (healthy) or
      ``gap_failed`` (degraded): a smaller gap is a flatter distribution. ``topk_logp`` are
      :math:`l_j - \log Z`, the entropy is exact for this distribution, and the sampled token is drawn from it
      (rank :math:`r`; a tail token when :math:`r = K`), so the regret :math:`l_0 - l_r` grows as it flattens:

      .. math::
          \log\pi_j = l_j - \log Z, \quad Z = \sum_{j<K} e^{l_j} + (V - K)\,e^{l_K}, \qquad
          H = -\sum_{j<K} \pi_j \log\pi_j - (V - K)\,\pi_K \log\pi_K ;

    - token ids: distinct ordinary ids (never a special id) in rank order; the sampled token's id is the id at its
      rank. Special tokens overwrite the sampled token (keeping its log-prob): EOS at ``length - 1`` of finished
      rows, an answer marker (uniform over ``answer_ids``) at :math:`a_i`, and elsewhere a transition marker
      (uniform over ``marker_ids``, e.g. the ids of "Wait") with probability ``marker_rate`` (healthy, before
      the answer), ``marker_rate_failed`` (degraded) or ``marker_rate_checking`` (a successful row after its
      answer: double-checking);
    - teacher top-k ids: each of the student's top-k ids (by rank) stays in the teacher's top-k with
      probability ``overlap_ok`` (healthy) or ``overlap_failed`` (degraded), else a fresh id takes its place;
    - values: :math:`\operatorname{clip}(v^*_{i,t} + \epsilon, 0, 1)`, :math:`\epsilon \sim
      \mathcal N(0, \sigma_v^2)`, with :math:`v^* = 0` when degraded, 1 for a successful row from its answer on,
      else :math:`p_g` (a critic that knows the prompt's pass rate and learns of failure and success as they
      happen);
    - answer-probe confidence: :math:`\sigma(c + \sigma_c \xi)`, :math:`c` = ``confidence_solved`` for a
      successful row from its answer on, else ``confidence_unsolved``.

    Every draw comes from the ``generator`` passed to :meth:`sample`, in a fixed order: same generator state,
    same batch. Memory: the result holds about ``20 N T K`` bytes (the top-k log-probs and two id tensors);
    sampling peaks at a few times that.

    Args:
        max_tokens: :math:`T`, the horizon (default 1024).
        group_size: :math:`G` rollouts per prompt (default 8).
        vocab_size: :math:`V` (default 32768); needs ``V - #special ids >= 2K + 1``.
        top_k: :math:`K` (default 20).
        pass_logit_mean, pass_logit_std: :math:`\mu_p, \sigma_p` (defaults 0.0 and 2.0: many prompts near 0 or 1,
            so all-correct groups are common).
        length_median: :math:`m` (default 400.0); ``length_sigma``: :math:`\sigma_\ell` (default 0.5);
            ``fail_length_factor``: :math:`\phi \ge 1` (default 1.5: wrong answers run longer);
            ``min_length``: :math:`\ell_{min} \ge 2` (default 16).
        fail_frac: the range of :math:`u` (default (0.05, 0.4)); ``answer_frac``: the range of :math:`v`
            (default (0.4, 0.9)).
        gap_ok, gap_failed: :math:`\gamma` before and after the failure point (defaults 2.0 and 1.0);
            ``gap_row_std``: :math:`\sigma_\gamma`, per-row spread (default 0.4: some healthy
            rows are as flat as degraded ones).
        eos_id: the EOS id (default 0); ``marker_ids``: transition-marker ids (default (1,));
            ``answer_ids``: answer-marker ids (default (2,)). The three must be disjoint.
        marker_rate, marker_rate_failed, marker_rate_checking: per-token marker probabilities (defaults 0.005,
            0.02, 0.02).
        overlap_ok, overlap_failed: teacher top-k overlap probabilities (defaults 0.8 and 0.5).
        value_noise: :math:`\sigma_v` (default 0.25).
        confidence_solved, confidence_unsolved, confidence_std: :math:`c` and :math:`\sigma_c` of the probe
            confidence logit (defaults 3.0, -1.0, 1.0).

    Edge cases: ``sample(0, g)`` returns empty ``[0, T]`` tensors; ``pass_logit_std=0`` gives every prompt the
    same pass rate; ``fail_frac=(0, 0)`` makes failing rows degraded from their first token.
    """

    def __init__(
        self,
        *,
        max_tokens: int = 1024,
        group_size: int = 8,
        vocab_size: int = 32768,
        top_k: int = 20,
        pass_logit_mean: float = 0.0,
        pass_logit_std: float = 2.0,
        length_median: float = 400.0,
        length_sigma: float = 0.5,
        fail_length_factor: float = 1.5,
        min_length: int = 16,
        fail_frac: tuple[float, float] = (0.05, 0.4),
        answer_frac: tuple[float, float] = (0.4, 0.9),
        gap_ok: float = 2.0,
        gap_failed: float = 1.0,
        gap_row_std: float = 0.4,
        eos_id: int = 0,
        marker_ids: Sequence[int] = (1,),
        answer_ids: Sequence[int] = (2,),
        marker_rate: float = 0.005,
        marker_rate_failed: float = 0.02,
        marker_rate_checking: float = 0.02,
        overlap_ok: float = 0.8,
        overlap_failed: float = 0.5,
        value_noise: float = 0.25,
        confidence_solved: float = 3.0,
        confidence_unsolved: float = -1.0,
        confidence_std: float = 1.0,
    ) -> None:
        self.max_tokens = _int(max_tokens, "max_tokens", 2)
        self.group_size = _int(group_size, "group_size", 1)
        self.vocab_size = _int(vocab_size, "vocab_size", 2)
        self.top_k = _int(top_k, "top_k", 1)
        self.pass_logit_mean = _real(pass_logit_mean, "pass_logit_mean")
        self.pass_logit_std = _real(pass_logit_std, "pass_logit_std", 0.0)
        self.length_median = _real(length_median, "length_median", 0.0, open_low=True)
        self.length_sigma = _real(length_sigma, "length_sigma", 0.0)
        self.fail_length_factor = _real(fail_length_factor, "fail_length_factor", 1.0)
        self.min_length = _int(min_length, "min_length", 2)
        if self.min_length > self.max_tokens:
            raise InputError(
                "min_length", f"an int <= max_tokens ({self.max_tokens})", describe(min_length), "lower it"
            )
        self.fail_frac = _span(fail_frac, "fail_frac")
        self.answer_frac = _span(answer_frac, "answer_frac")
        if self.fail_frac[1] > self.answer_frac[0]:
            raise InputError(
                "fail_frac",
                f"an upper end <= answer_frac's lower end ({self.answer_frac[0]}): a failing row fails before its answer",
                describe(fail_frac),
                "lower fail_frac or raise answer_frac",
            )
        self.gap_ok = _real(gap_ok, "gap_ok", 0.0, open_low=True)
        self.gap_failed = _real(gap_failed, "gap_failed", 0.0, open_low=True)
        self.gap_row_std = _real(gap_row_std, "gap_row_std", 0.0)
        self.eos_id = _int(eos_id, "eos_id", 0)
        if self.eos_id >= self.vocab_size:
            raise InputError("eos_id", f"a token id < vocab_size ({self.vocab_size})", describe(eos_id), "fix it")
        self.marker_ids = _ids(marker_ids, "marker_ids", self.vocab_size)
        self.answer_ids = _ids(answer_ids, "answer_ids", self.vocab_size)
        special = [self.eos_id, *self.marker_ids, *self.answer_ids]
        if len(set(special)) != len(special):
            raise InputError("marker_ids", "ids disjoint from eos_id and answer_ids", describe(special), "fix the ids")
        self._special = torch.tensor(sorted(special), dtype=torch.long)
        self._ordinary = self.vocab_size - len(special)
        if self._ordinary < 2 * self.top_k + 1:
            raise InputError(
                "vocab_size",
                f"at least 2 * top_k + 1 = {2 * self.top_k + 1} ordinary ids besides the special ones",
                describe(vocab_size),
                "raise vocab_size or lower top_k",
            )
        self.marker_rate = _real(marker_rate, "marker_rate", 0.0, 1.0)
        self.marker_rate_failed = _real(marker_rate_failed, "marker_rate_failed", 0.0, 1.0)
        self.marker_rate_checking = _real(marker_rate_checking, "marker_rate_checking", 0.0, 1.0)
        self.overlap_ok = _real(overlap_ok, "overlap_ok", 0.0, 1.0)
        self.overlap_failed = _real(overlap_failed, "overlap_failed", 0.0, 1.0)
        self.value_noise = _real(value_noise, "value_noise", 0.0)
        self.confidence_solved = _real(confidence_solved, "confidence_solved")
        self.confidence_unsolved = _real(confidence_unsolved, "confidence_unsolved")
        self.confidence_std = _real(confidence_std, "confidence_std", 0.0)

    def _id(self, index: Tensor) -> Tensor:
        """Map ordinary indices ``[0, V - S)`` onto the ids that are not special (order-preserving bijection)."""
        s = self._special
        shifted = s - torch.arange(s.numel())  # ordinary indices at or past which a special id is skipped
        return index + torch.searchsorted(shifted, index, right=True)

    def sample(self, num_prompts: int, generator: torch.Generator) -> SimulatedGeneration:
        """Draw ``num_prompts * group_size`` rollouts (class docstring) from ``generator``; CPU tensors."""
        p = _int(num_prompts, "num_prompts", 0)
        if not isinstance(generator, torch.Generator):
            raise InputError(
                "generator", "a torch.Generator", describe(generator), "pass torch.Generator().manual_seed(0)"
            )
        g, t_max, k = self.group_size, self.max_tokens, self.top_k
        n = p * g
        gen = generator

        def rand(*shape: int) -> Tensor:
            return torch.rand(shape, generator=gen)

        def randn(*shape: int) -> Tensor:
            return torch.randn(shape, generator=gen)

        # -- rows: prompt pass rates, success, lengths, failure and answer points
        group = torch.arange(p).repeat_interleave(g)
        rate = torch.sigmoid(self.pass_logit_mean + self.pass_logit_std * randn(p))[group]
        success = rand(n) < rate
        factor = torch.where(success, 1.0, self.fail_length_factor)
        natural = (self.length_median * torch.exp(self.length_sigma * randn(n)) * factor).round().long()
        natural = natural.clamp_min(self.min_length)
        natural = torch.where(success, natural.clamp_max(t_max), natural)
        length = natural.clamp_max(t_max)
        finished = natural <= t_max
        lo, hi = self.fail_frac
        fail_at = (((lo + (hi - lo) * rand(n)) * natural).floor().long()).minimum(length - 1)
        fail_at = torch.where(success, -1, fail_at)
        lo, hi = self.answer_frac
        answer_at = (((lo + (hi - lo) * rand(n)) * natural).floor().long()).minimum(natural - 2)
        answer_at = torch.where(answer_at < length, answer_at, -1)  # the horizon cut the row before its answer
        row_gap = torch.exp(self.gap_row_std * randn(n))

        # -- steps: which are degraded, the top-k distribution, the sampled rank
        t = torch.arange(t_max)
        degraded = ~success[:, None] & (t[None, :] >= fail_at[:, None])
        solved = success[:, None] & (answer_at[:, None] >= 0) & (t[None, :] >= answer_at[:, None])
        scale = torch.where(degraded, self.gap_failed, self.gap_ok) * row_gap[:, None]
        gaps = -torch.log1p(-rand(n, t_max, k)) * scale[..., None]  # Exp(1) * scale, K gaps
        logits = torch.cat([torch.zeros(n, t_max, 1), -gaps.cumsum(-1)], dim=-1)  # [N, T, K + 1]: l_0..l_K
        tail = logits[..., k] + math.log(self.vocab_size - k)
        log_z = torch.logsumexp(torch.cat([logits[..., :k], tail[..., None]], dim=-1), dim=-1)
        topk_lp = logits[..., :k] - log_z[..., None]
        tail_lp = logits[..., k] - log_z  # log-prob of one tail token
        tail_mass = torch.exp(tail + 0.0 - log_z)
        probs = topk_lp.exp()
        entropy = -(probs * topk_lp).sum(-1) - tail_mass * tail_lp
        u = rand(n, t_max)
        rank = (probs.cumsum(-1) < u[..., None]).sum(-1)  # K = a tail token
        in_top = rank < k
        logp = torch.where(in_top, topk_lp.gather(-1, rank.clamp_max(k - 1)[..., None])[..., 0], tail_lp)

        # -- ids: a block of consecutive ordinary indices per step (student top-k, teacher's fresh ids, tail)
        m = self._ordinary
        base = torch.randint(m, (n, t_max), generator=gen)
        j = torch.arange(k)
        student = self._id((base[..., None] + j) % m)
        fresh = self._id((base[..., None] + k + j) % m)
        tail_id = self._id((base + 2 * k) % m)
        tokens = torch.where(in_top, student.gather(-1, rank.clamp_max(k - 1)[..., None])[..., 0], tail_id)

        # special tokens overwrite the sampled token: EOS, the answer marker, transition markers
        rate_t = torch.where(
            degraded, self.marker_rate_failed, torch.where(solved, self.marker_rate_checking, self.marker_rate)
        )
        pick_marker = torch.randint(len(self.marker_ids), (n, t_max), generator=gen)
        is_marker = rand(n, t_max) < rate_t
        pick_answer = torch.randint(len(self.answer_ids), (n,), generator=gen)
        special = torch.full((n, t_max), -1, dtype=torch.long)
        special = torch.where(is_marker, torch.tensor(self.marker_ids)[pick_marker], special)
        at_answer = t[None, :] == answer_at[:, None]
        special = torch.where(at_answer, torch.tensor(self.answer_ids)[pick_answer][:, None], special)
        at_eos = finished[:, None] & (t[None, :] == length[:, None] - 1)
        special = torch.where(at_eos, self.eos_id, special)
        has = special >= 0
        tokens = torch.where(has, special, tokens)
        sampled_col = (j == rank[..., None]) & has[..., None]
        student = torch.where(sampled_col, special[..., None], student)
        keep = rand(n, t_max, k) < torch.where(degraded, self.overlap_failed, self.overlap_ok)[..., None]
        teacher = torch.where(keep, student, fresh)

        # -- critic values and the answer-probe confidence
        v_star = torch.where(degraded, 0.0, torch.where(solved, 1.0, rate[:, None].expand(n, t_max)))
        values = (v_star + self.value_noise * randn(n, t_max)).clamp(0.0, 1.0)
        c = torch.where(solved, self.confidence_solved, self.confidence_unsolved)
        confidence = torch.sigmoid(c + self.confidence_std * randn(n, t_max))

        return SimulatedGeneration(
            mask=t[None, :] < length[:, None],
            logp=logp,
            entropy=entropy,
            topk_logp=topk_lp,
            tokens=tokens,
            topk_ids=student,
            teacher_topk_ids=teacher,
            values=values,
            confidence=confidence,
            degraded=degraded,
            group=group,
            pass_rate=rate,
            success=success,
            rewards=success.float(),
            length=length,
            finished=finished,
            fail_at=fail_at,
            answer_at=answer_at,
        )
