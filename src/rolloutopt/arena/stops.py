r"""The arena's "stop" family: stop, truncation and length rules by registered name, against no rule (``"none"``).

How a rule runs in the arena (the replay model). :class:`~rolloutopt.testbed.policy.TinyPolicy` samples every row
independently (:func:`~rolloutopt.testbed.policy.sample_from`: row ``i``'s token at ``t`` depends only on row
``i``'s prompt and tokens before ``t``, and on one multinomial draw per position), so a row stopped at position
``t`` by a streaming rule would have produced exactly the recorded row's tokens up to ``t``. The run therefore
generates full rollouts (with the top-K log-probs recorded, ``topk=``:attr:`StopMethod.topk`, where a rule reads
them), and :meth:`StopMethod.apply` replays the rule over the recording, step by step as
:func:`rolloutopt.control.replay` does, with ``active`` = the rollout mask. Then:

- the tokens after a stop count as not generated (saved): the row's mask ends at the stop (``position + 1``
  tokens kept);
- a stopped row's reward is recomputed by the suite on the truncated response (``reward_fn``), unless the rule
  gives a terminal reward (:meth:`~rolloutopt.control.StopResult.rewards`: ESPO's critic-free variant gives
  :math:`r_{fail}`);
- the rule's row weights (DUET's importance weights, ARRoL's 0 for pruned rows) become ``seq_weight``, its token
  weights (none of the rules run here has them) ``token_weight``.

The one thing replay cannot reproduce is wall-clock: a streamed run would not spend the saved tokens' compute,
which :attr:`StopOutcome.saved_frac` measures instead. A post-hoc length rule (DOT, JET's reward, DLER, the soft
compression penalty) is called once on the finished batch: every token was generated, and the rule reshapes
rewards and the mask as its paper says (a mask it cuts counts as saved, the tokens leaving the loss).

Rules that learn across batches keep one rule object across the run's steps (the run calls ``apply`` once per
step), fed what ``benchmarks/control.py`` feeds them, from the real generation and only from what a streamed run
would know: ESPO-critic-free's reference band (``update``) from the rows it did not stop, with their success
(reward 1); ARRoL's quality head (``train_head``) from the rows that reached its checkpoint and survived it, with
their final reward (a pruned row never finishes, so its label is unknown to a streamed run).

Settings. Every rule runs with its library defaults (``experimental=True`` where the registry entry says the rule
is reconstructed; ``seed`` = the run's seed where it takes one), except the arena's scale: the library's own
token-count defaults (set for reasoning traces of thousands of tokens, no paper value) would never fire on the
arena's responses of at most ``response_limit`` tokens (9 with the default suite). Those are set to
:math:`H = \max(1, \lfloor \text{response\_limit} / 2 \rfloor)`, as ``benchmarks/control.py`` scales DUET's
horizon to :math:`T/2`: DUET's ``horizon`` (4096), ECHO's ``window`` (32; its warm-up ``min_tokens`` follows
it), ARRoL's ``checkpoint`` (128), ESPO-critic-free's ``t_min`` (10); and DLER's ``max_len``, which has no
default (the paper truncates well below the model's natural length). ``StopMethod(..., options={...})`` overrides
any keyword of the rule.

Vocabulary. The arena's responses are the answer digits then ``<eos>`` (``rolloutopt.arena.tasks``: digits 0-9,
``<eos>`` 10, ``<bos>`` 11, ``=`` 12, ``<pad>`` 13, the operation tokens R S A C and ``+``): there is no
reasoning before the answer. DUET's *answer marker* (a closing ``\boxed{}``: "the answer is complete") maps to
``<eos>``, the token that closes an arena answer (the reward requires it right after the answer); so DUET's
"answered" stop never cuts a token, and its horizon gate aborts the rows still without ``<eos>`` after
:math:`H` tokens. Transition markers ("Wait": DEER) and step markers (``"\n\n"``: Step-GRPO) have no counterpart,
so those rules are refused (:data:`REFUSED`).

The methods (:data:`STOP_METHODS`):

- ``none``: no rule, the baseline.
- ``arrol`` (arXiv 2603.24840): at checkpoint :math:`L_c` a logistic head :math:`q_i = \sigma(w^\top h_i + b)`
  scores each group's rows and keeps :math:`\lceil 0.5\, n_g\rceil` whose predicted positive fraction is
  closest to :math:`\rho = 0.5`; pruned rows get row weight 0. Features :math:`h` = the running means of the
  surrogate regret :math:`\max_a \log\pi - \log\pi(a_t)` and of the entropy; random scores until the head has
  64 labels. The run's group is ARRoL's over-generated group :math:`n' = n / \text{keep\_frac}`.
- ``duet_abort`` (arXiv 2605.08441): stop at the answer marker; a row without one after :math:`H` tokens is
  aborted with probability :math:`1 - p` (:math:`p = 0.05`), survivors weighted :math:`1/p`, aborted 0.
- ``echo_pruning`` (arXiv 2602.02150): a branch (row) whose windowed confidence
  :math:`\bar c = \operatorname{mean}_{W} p(y_t) < 0.5` is pruned, lowest first, while its tree (prompt group)
  keeps one branch.
- ``espo_critic_free`` (arXiv 2605.29860): stop when the smoothed cumulative regret :math:`S_t` exceeds
  :math:`t\bar\rho + \kappa\sqrt t\, s_\rho` (:math:`\kappa = 3`), the band learnt from successful completed
  rows; a stopped row earns :math:`r_{fail} = -1`.
- ``dot`` (arXiv 2601.03969): in all-correct groups, rows longer than :math:`Q_3 + 1.5\,\mathrm{IQR}` are cut
  there and rescored 0.
- ``jet_reward`` (arXiv 2509.23392): :math:`0.9\,acc + 0.1\,fmt + [acc=1](\delta + (1-\delta)\alpha
  \frac{L_{max}-L}{L_{max}-L_{min}+\epsilon})`, with :math:`fmt` = the response stopped with ``<eos>``.
- ``dler_truncation_penalty`` (arXiv 2510.15110): a row longer than :math:`L_{max} = H` is cut there and earns 0.
- ``dler_difficulty_penalty`` (arXiv 2510.15110): the same with the budget
  :math:`\lfloor H (1 - 0.5\, s_g)\rfloor`, tighter on groups with a high pass rate.
- ``soft_compression_penalty``: correct rows of mastered groups (pass rate :math:`\ge 0.75`) longer than the
  shortest correct one lose :math:`\min(0.5 (L - L^\star)/L^\star, 0.5)`.

In the arena every correct response to a prompt has the same length (the answer and ``<eos>``), so the rules that
compare correct lengths (DOT, JET's bonus, the soft compression penalty) have little to act on; that is a
finding of the arena, not a fault of the replay.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from jaxtyping import Float
from torch import Tensor

from rolloutopt import control
from rolloutopt.control import StopRule, StopState
from rolloutopt.control import posthoc as _posthoc
from rolloutopt.errors import InputError
from rolloutopt.testbed.policy import Rollouts
from rolloutopt.testbed.task import EOS
from rolloutopt.typing import BoolBT, FloatB, FloatBT, IntB

__all__ = [
    "LENGTH_RULES",
    "REFUSED",
    "STOP_METHODS",
    "RewardFn",
    "StopMethod",
    "StopOutcome",
    "check_method",
    "reference",
]

RewardFn = Callable[[IntB, Tensor, BoolBT], FloatB]
"""``reward_fn(prompt_ids [B], tokens [B, T], mask [B, T]) -> rewards [B]``: the suite's reward of (truncated)
responses, e.g. :meth:`rolloutopt.arena.tasks.TaskSuite.reward`."""

_STREAMING: tuple[str, ...] = ("arrol", "duet_abort", "echo_pruning", "espo_critic_free")
_POSTHOC: tuple[str, ...] = (
    "dler_difficulty_penalty",
    "dler_truncation_penalty",
    "dot",
    "jet_reward",
    "soft_compression_penalty",
)

_GENERATION_CAPS: tuple[str, ...] = ("dler_truncation_penalty",)
"""Post-hoc rules whose truncation is a length cap known before sampling (DLER truncates generation at its
``max_len``): the tokens past it are never generated. The other post-hoc rules act after seeing the group."""

STOP_METHODS: tuple[str, ...] = ("none", *_STREAMING, *_POSTHOC)
"""What the arena can run: ``"none"`` (the baseline), the streaming stop rules of ``rolloutopt.control`` that the
arena can feed, and the post-hoc length rules (``rolloutopt.control.posthoc``) it can apply."""

LENGTH_RULES: tuple[str, ...] = (
    *_posthoc.names(),
    "absorbing_failure",
    "count_steps",
    "dler_difficulty_budget",
    "egae",
    "esr_mask",
    "jet_group_layout",
    "jet_truncation_points",
    "popd_horizon",
    "repeated_ngram_share",
    "siri_max_length",
    "topd_horizon",
    "truncate_mask",
)
"""The public post-hoc truncation, length and horizon functions of ``rolloutopt.control`` (the registered post-hoc
rules, the schedules and the helpers): each is in :data:`STOP_METHODS` or :data:`REFUSED`."""

_NO_TEACHER = "the arena distils from no teacher (it runs RL on a verifiable reward)"
REFUSED: dict[str, str] = {
    "abstention": (
        "it needs a value estimate of the partial rollout at every checkpoint: a critic's values (the arena trains "
        "no critic) or the rewards of continuations sampled from the partial rollout (a stop rule has no policy to "
        "sample them with); its abstention reward r_abs has no paper default (arXiv 2604.18419)"
    ),
    "adwin_horizon": f"an on-policy-distillation horizon controller fed student/teacher alignment; {_NO_TEACHER}",
    "deer": (
        "it probes a trial answer at reasoning-transition markers ('Wait'); arena responses are the answer digits "
        "then <eos>, with no reasoning, and no token of the task vocabulary marks a transition"
    ),
    "espo": (
        "it requires a critic's values V(s_t) at every token; the arena trains no critic "
        "(its critic-free variant, espo_critic_free, runs)"
    ),
    "esr": (
        "an on-policy-distillation rule: its kept prefix is trained on a teacher's per-token reverse KL, with no "
        f"reward; {_NO_TEACHER} (and its N = 100 exceeds the response limit: it would equal 'none')"
    ),
    "prune_opd": f"it requires the student/teacher top-k overlap at every token; {_NO_TEACHER}",
    "prune_opd_window": f"Prune-OPD's window controller, fed the lengths Prune-OPD keeps; {_NO_TEACHER}",
    "stable_opd": f"an on-policy-distillation monitor (reference-KL coefficient, teacher rollout mixture); {_NO_TEACHER}",
    "step_grpo_truncation": (
        "it probes an answer at semantic step boundaries ('\\n\\n', 'Wait'); arena responses are the answer digits "
        "then <eos>, a single step, and no token of the task vocabulary marks a step boundary"
    ),
    "step_aware_reward": (
        "it rewards fewer semantic steps, counted at step markers; the arena's vocabulary has none, so every "
        "response is one step and the reward would be unchanged"
    ),
    "siri_max_length": (
        "SIRI's cosine schedule has no paper values for l_lo, l_hi and the period (the library gives no defaults), "
        "and its period is a fraction of a training length the rule is not given"
    ),
    "popd_horizon": f"an on-policy-distillation horizon schedule; {_NO_TEACHER}",
    "topd_horizon": f"an on-policy-distillation horizon; {_NO_TEACHER}",
    "esr_mask": f"ESR's loss mask for on-policy distillation; {_NO_TEACHER}",
    "jet_truncation_points": (
        "JET's engine-side variants cut a reasoning prefix and append an answer-forcing suffix; arena responses are "
        "answers only (no reasoning to cut, no suffix to force); JET's reward, jet_reward, runs"
    ),
    "jet_group_layout": "the row layout of JET's truncated variants (see jet_truncation_points); jet_reward runs",
    "dler_difficulty_budget": "the budget of dler_difficulty_penalty, which runs (not a rule of its own)",
    "truncate_mask": "a helper, not a rule: the mask cut that every streaming method here applies",
    "count_steps": "Step-GRPO's step counter (see step_aware_reward): the arena's vocabulary has no step markers",
    "absorbing_failure": (
        "a helper: ESPO's token-reward and done-flag rewrite for GAE; the arena's loss takes sequence rewards, to "
        "which StopResult.rewards applies the terminal reward"
    ),
    "egae": "T-PPO's extended GAE: it needs a critic's values; the arena trains no critic",
    "repeated_ngram_share": f"Stable-OPD's repetition score (see stable_opd); {_NO_TEACHER}",
}
"""Every rule (and length function) of ``rolloutopt.control`` the arena cannot run, with the reason."""

_TOPK = 1
"""Top-K width recorded for the rules that read ``topk_logp``: the surrogate regret needs only the top-1 log-prob
(the max of any top-K is the top-1), so K = 1 is exact."""
_NEEDS_TOPK = ("arrol", "espo_critic_free")
_FEATURES = 2  # ARRoL head features: running mean regret, running mean entropy


def reference(name: str) -> str:
    """The reference of stop method ``name`` (the registry entry's ``reference``, with its arXiv id); ``""`` for
    ``"none"``. An unknown or refused name raises :class:`~rolloutopt.errors.InputError`."""
    check_method(name)
    if name == "none":
        return ""
    if name in _STREAMING:
        return str(control.entry(name).reference)
    return str(_posthoc.entry(name).reference)


def check_method(name: Any, argument: str = "name") -> None:
    """Refuse ``name`` unless it is in :data:`STOP_METHODS`: an :class:`~rolloutopt.errors.InputError` naming
    ``argument``, with the reason when the arena refuses that rule (:data:`REFUSED`)."""
    if isinstance(name, str) and name in STOP_METHODS:
        return
    if isinstance(name, str) and name in REFUSED:
        raise InputError(
            argument,
            f"a stop method the arena can run ({', '.join(STOP_METHODS)})",
            repr(name),
            f"{name} is refused: {REFUSED[name]}",
        )
    raise InputError(
        argument, f"one of {STOP_METHODS}", repr(name), "pick a name of rolloutopt.arena.stops.STOP_METHODS"
    )


def _check_int(x: Any, name: str, low: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or x < low:
        raise InputError(name, f"an int >= {low}", repr(x), f"pass {name} as an int >= {low}")
    return x


@dataclass(frozen=True)
class StopOutcome:
    """What a stop method made of one step's rollouts.

    Attributes:
        mask: bool ``[B, T]``, the tokens in the loss: a subset of the rollouts' mask.
        generated: bool ``[B, T]``, the tokens a run with the rule generates: ``mask`` for a streaming rule and
            for a generation cap known before sampling (DLER's fixed truncation length); the full rollouts for a
            post-hoc rule that truncates or reshapes after seeing the group (the tokens were generated).
        rewards: float32 ``[B]``, the rewards after the rule (recomputed on truncated responses, or the rule's
            terminal or reshaped rewards).
        seq_weight: float32 ``[B]``, the row loss weights (1 where the rule implies none; 0 drops a row).
        token_weight: float32 ``[B, T]`` token loss weights, or None (every rule run here implies none).
        stopped_frac: fraction of rows the rule stopped or truncated (a streaming rule: rows whose mask it cut;
            a post-hoc rule: the rows it changed, its ``truncated``).
        saved_frac: fraction of the full generation's tokens not generated, :math:`1 - \\sum g / \\sum m` with
            :math:`g` = ``generated``.
        seconds: wall-clock seconds inside the rule (driving it, its updates; the reward recomputation excluded).
        metrics: the rule's own metrics, as floats.
    """

    mask: BoolBT
    generated: BoolBT
    rewards: FloatB
    seq_weight: FloatB
    token_weight: FloatBT | None
    stopped_frac: float
    saved_frac: float
    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)


class StopMethod:
    r"""One stop method of the arena by name (:data:`STOP_METHODS`), for one run: a rule that learns across batches
    keeps its state from one :meth:`apply` to the next.

    Args:
        name: a name of :data:`STOP_METHODS` (a name of :data:`REFUSED` raises, with the reason).
        seed: the run's seed (ARRoL's generator, DUET's gate draws).
        group_size: rollouts per prompt of the run (>= 1); groups come with each batch (``apply``'s ``group``).
        response_limit: the suite's response limit in tokens (>= 1): the arena's token-count settings are
            :math:`H = \max(1, \lfloor \text{response\_limit}/2 \rfloor)` (module docstring).
        options: keywords that override the rule's settings (its constructor's, or its post-hoc function's),
            except those the arena fixes: ``experimental``, ``seed`` (the argument), DUET's ``markers`` (the
            vocabulary mapping), ARRoL's ``dim`` (its features), a post-hoc rule's ``mask``.

    Attributes:
        topk: the top-K width the run must record (``policy.sample(..., topk=method.topk)``); 0 when the rule reads
            no top-K log-probs.
        rule: the streaming rule object (None for ``"none"`` and the post-hoc rules).
    """

    def __init__(
        self,
        name: str,
        seed: int = 0,
        *,
        group_size: int,
        response_limit: int,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        check_method(name)
        self.name = name
        self.seed = _check_int(seed, "seed", 0)
        self.group_size = _check_int(group_size, "group_size", 1)
        self.response_limit = _check_int(response_limit, "response_limit", 1)
        self.horizon = max(1, response_limit // 2)
        if options is not None and (not isinstance(options, Mapping) or not all(isinstance(k, str) for k in options)):
            raise InputError("options", "a mapping of keyword names to values", repr(options), "pass a dict")
        self.options: dict[str, Any] = dict(options or {})
        self.topk = _TOPK if name in _NEEDS_TOPK else 0
        self.calls = 0
        self.rule: StopRule | None = None
        self._posthoc_kwargs: dict[str, Any] = {}
        if name in _STREAMING:
            self.rule = self._build()
        elif name in _POSTHOC:
            self._posthoc_kwargs = self._posthoc_settings()
        elif self.options:
            raise InputError("options", "no options: 'none' has no settings", repr(self.options), "drop options")

    # -- construction ------------------------------------------------------------------------------------------
    def _settable(self, fn: Callable[..., Any], fixed: tuple[str, ...]) -> None:
        params = inspect.signature(fn).parameters
        allowed = sorted(k for k, p in params.items() if p.kind is inspect.Parameter.KEYWORD_ONLY and k not in fixed)
        for key in self.options:
            if key not in allowed:
                raise InputError(
                    "options",
                    f"keywords of {self.name} the arena lets you set ({', '.join(allowed)})",
                    repr(key),
                    f"remove {key!r}",
                )

    def _build(self) -> StopRule:
        name = self.name
        cls = control.get(name)
        kwargs: dict[str, Any] = {"experimental": True} if control.entry(name).experimental is not None else {}
        h = self.horizon
        if name == "arrol":
            kwargs.update(dim=_FEATURES, checkpoint=h, seed=self.seed)
            fixed: tuple[str, ...] = ("dim", "experimental", "device", "seed")
        elif name == "duet_abort":
            kwargs.update(markers=(EOS,), horizon=h, seed=self.seed)
            fixed = ("experimental", "markers", "seed")
        elif name == "echo_pruning":
            kwargs.update(window=h)
            fixed = ("experimental",)
        else:  # espo_critic_free
            kwargs.update(t_min=h)
            fixed = ("experimental",)
        self._settable(cls, fixed)
        kwargs.update(self.options)
        rule = cls(**kwargs)
        assert isinstance(rule, StopRule)
        return rule

    def _posthoc_settings(self) -> dict[str, Any]:
        name = self.name
        fn = _posthoc.get(name)
        kwargs: dict[str, Any] = {"experimental": True} if _posthoc.entry(name).experimental is not None else {}
        if name.startswith("dler_"):
            kwargs["max_len"] = self.horizon
        self._settable(fn, ("experimental", "mask"))
        kwargs.update(self.options)
        return kwargs

    # -- one step ----------------------------------------------------------------------------------------------
    def apply(self, ids: IntB, roll: Rollouts, rewards: FloatB, group: IntB, reward_fn: RewardFn) -> StopOutcome:
        """Apply the method to one step's full rollouts; return the kept mask, rewards and loss weights.

        Args:
            ids: int64 prompt ids ``[B]`` of the rows (for ``reward_fn``).
            roll: the full rollouts ``[B, T]``, sampled with ``topk=self.topk`` when that is > 0.
            rewards: float ``[B]``, the suite's rewards of the full responses.
            group: int ``[B]`` group ids (rows of one prompt share one).
            reward_fn: ``reward_fn(ids, tokens, mask) -> [B]``, the suite's reward of truncated responses.

        Returns:
            :class:`StopOutcome`; ``"none"`` returns the rollouts' mask and rewards unchanged, weights 1.
        """
        start = time.perf_counter()
        self._check(ids, roll, rewards, group, reward_fn)
        self.calls += 1
        mask = roll.mask.to(torch.bool)
        r = rewards.to(torch.float32)
        ones = torch.ones(r.shape, dtype=torch.float32, device=r.device)
        if self.name == "none":
            return StopOutcome(mask.clone(), mask.clone(), r.clone(), ones, None, 0.0, 0.0, time.perf_counter() - start)
        if self.name in _POSTHOC:
            return self._apply_posthoc(ids, roll, mask, r, group, ones, start)
        return self._apply_streaming(ids, roll, mask, r, group, ones, reward_fn, start)

    def _check(self, ids: Any, roll: Any, rewards: Any, group: Any, reward_fn: Any) -> None:
        if not isinstance(roll, Rollouts):
            raise InputError("roll", "a Rollouts from TinyPolicy.sample", repr(type(roll)), "pass the rollouts")
        b = int(roll.mask.shape[0])
        for arg, value, kind in (("ids", ids, "int"), ("rewards", rewards, "float"), ("group", group, "int")):
            bad = not isinstance(value, Tensor) or value.ndim != 1 or value.shape[0] != b
            if not bad and (value.is_floating_point() != (kind == "float") or value.dtype == torch.bool):
                bad = True
            if bad:
                raise InputError(arg, f"a {kind} tensor [B={b}] (one per rollout)", repr(value), f"pass {arg} [B]")
        if not bool(torch.isfinite(rewards).all()):
            raise InputError("rewards", "finite rewards", "non-finite values", "pass the suite's rewards")
        if not callable(reward_fn):
            raise InputError("reward_fn", "a callable (ids, tokens, mask) -> rewards", repr(reward_fn), "pass one")
        if self.topk and (roll.topk_logp is None or roll.topk_logp.shape[-1] < 1):
            raise InputError(
                "roll",
                f"rollouts with top-K log-probs recorded: {self.name} reads topk_logp",
                "topk_logp None",
                f"sample with policy.sample(..., topk=method.topk) (topk={self.topk})",
            )

    def _apply_posthoc(
        self, ids: IntB, roll: Rollouts, mask: BoolBT, r: FloatB, group: IntB, ones: FloatB, start: float
    ) -> StopOutcome:
        fn = _posthoc.get(self.name)
        lengths = mask.sum(1)
        kw = dict(self._posthoc_kwargs)
        if self.name == "jet_reward":  # accuracy = the binary reward; format = the response stopped with <eos>
            fmt = ((roll.tokens == EOS) & mask).any(1)
            out = fn(r, fmt, lengths, group, mask=mask, **kw)
        elif self.name == "dler_truncation_penalty":
            out = fn(r, lengths, mask=mask, **kw)
        else:
            out = fn(r, lengths, group, mask=mask, **kw)
        new_mask = out.mask.to(torch.bool) & mask
        generated = new_mask if self.name in _GENERATION_CAPS else mask
        return StopOutcome(
            mask=new_mask,
            generated=generated,
            rewards=out.rewards.to(torch.float32),
            seq_weight=ones,
            token_weight=None,
            stopped_frac=float(out.truncated.float().mean()) if r.numel() else 0.0,
            saved_frac=_saved(mask, generated),
            seconds=time.perf_counter() - start,
            metrics={k: float(v) for k, v in out.metrics.items()},
        )

    def _apply_streaming(
        self,
        ids: IntB,
        roll: Rollouts,
        mask: BoolBT,
        r: FloatB,
        group: IntB,
        ones: FloatB,
        reward_fn: RewardFn,
        start: float,
    ) -> StopOutcome:
        rule = self.rule
        assert rule is not None
        per_token, init = self._inputs(roll, mask, group)
        state = _drive(rule, mask, init, per_token)
        res = rule.finalize(state)
        t_len = int(mask.shape[1])
        new_mask = mask & res.keep_mask(t_len).to(mask.device)
        cut = (new_mask != mask).any(1)
        new_r = r.clone()
        reward_seconds = 0.0
        if bool(cut.any()):
            t0 = time.perf_counter()
            recomputed = reward_fn(ids, roll.tokens, new_mask).to(torch.float32)
            reward_seconds = time.perf_counter() - t0
            new_r = torch.where(cut, recomputed, new_r)
        new_r = res.rewards(new_r).to(torch.float32)
        seq_weight = ones if res.row_weight is None else res.row_weight.to(torch.float32)
        token_weight = None
        if res.token_weight is not None:
            tw = res.token_weight.to(torch.float32)[:, :t_len]
            token_weight = torch.nn.functional.pad(tw, (0, t_len - tw.shape[1]), value=1.0)
        self._learn(state, res, per_token, mask, r)
        metrics = {k: float(v) for k, v in res.metrics.items()}
        return StopOutcome(
            mask=new_mask,
            generated=new_mask,
            rewards=new_r,
            seq_weight=seq_weight,
            token_weight=token_weight,
            stopped_frac=float(cut.float().mean()) if r.numel() else 0.0,
            saved_frac=_saved(mask, new_mask),
            seconds=time.perf_counter() - start - reward_seconds,
            metrics=metrics,
        )

    def _inputs(self, roll: Rollouts, mask: BoolBT, group: IntB) -> tuple[dict[str, Tensor], dict[str, Any]]:
        """The per-token inputs ``[B, T, ...]`` and the ``init`` keywords the rule is fed (as benchmarks/control.py
        feeds it)."""
        name = self.name
        if name == "duet_abort":
            return {"tokens": roll.tokens}, {}
        if name == "echo_pruning":  # trees = prompt groups
            return {"logp": roll.logp, "entropy": roll.entropy}, {"group": group}
        assert roll.topk_logp is not None
        if name == "espo_critic_free":
            return {"logp": roll.logp, "topk_logp": roll.topk_logp}, {}
        return {"features": _features(roll, mask)}, {"group": group}  # arrol

    def _learn(
        self, state: StopState, res: control.StopResult, per_token: dict[str, Tensor], mask: BoolBT, r: FloatB
    ) -> None:
        """Cross-batch learning from what a streamed run would know (module docstring)."""
        rule = self.rule
        success = r > 0.5
        if isinstance(rule, control.ESPOCriticFree):
            rule.update(state, success)  # uses the rows it did not stop, which completed
        elif isinstance(rule, control.ARRoL):
            at = rule.checkpoint - 1
            pruned = res.stopped & (res.reason == 1)
            reach = (mask.sum(1) > at) & ~pruned
            if at < mask.shape[1] and bool(reach.any()):
                rule.train_head(per_token["features"][reach, at], success[reach])


def _saved(mask: BoolBT, kept: BoolBT) -> float:
    total = int(mask.sum())
    return 0.0 if total == 0 else 1.0 - int(kept.sum()) / total


def _features(roll: Rollouts, mask: BoolBT) -> Float[Tensor, "B T d"]:
    """ARRoL's head features ``[B, T, 2]`` at every position: the running means (so far, this token included) of
    the surrogate regret :math:`\\max_a \\log\\pi(a) - \\log\\pi(a_t)` and of the entropy."""
    assert roll.topk_logp is not None
    m = mask.float()
    count = m.cumsum(1).clamp(min=1.0)
    regret = (roll.topk_logp.amax(-1) - roll.logp).clamp(min=0.0) * m
    ent = roll.entropy * m
    return torch.stack([regret.cumsum(1) / count, ent.cumsum(1) / count], dim=-1).float()


def _drive(rule: StopRule, mask: BoolBT, init: dict[str, Any], per_token: dict[str, Tensor]) -> StopState:
    """:func:`rolloutopt.control.replay`'s loop, returning the final state (``update`` needs it): step ``t`` passes
    ``x[:, t]`` of every input with ``active = mask[:, t]``."""
    state = rule.init(int(mask.shape[0]), device=mask.device, **init)
    for t in range(int(mask.shape[1])):
        state, _ = rule.step(state, active=mask[:, t], **{k: v[:, t] for k, v in per_token.items()})
    return state
