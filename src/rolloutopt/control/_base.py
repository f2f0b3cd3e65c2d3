"""The streaming stop-rule protocol every rule speaks (``docs/api/control.md``), and the outputs rules share.

A stop rule is streamed, vectorised over the live batch, and never sees a model::

    state = rule.init(batch_size)                        # per-generation state: tensors only
    for each decoding step:
        state, stop = rule.step(state, logp=..., entropy=..., topk_logp=..., tokens=..., active=...)
        # stop: bool [N], cumulative (a row once stopped stays stopped); stop sampling those rows
    result = rule.finalize(state)                        # per-row stop positions and reasons, for the loss side
    rewards = result.rewards(rewards)                    # the rule's terminal rewards applied (ESPO, abstention)
    weights = result.loss_weights(mask)                  # [N, T]: mask, truncated, times the rule's weights

:class:`StopRule` implements the bookkeeping once (validation, the cumulative ``stop`` mask, positions and
reasons, the inputs a rule declares); a rule subclasses it and decides only *which live rows fire now*
(:meth:`StopRule._step`); a rule that implies a terminal reward or loss weights adds them to the result in its
``finalize``. :func:`replay` drives a rule over recorded ``[N, T]`` tensors (offline analysis, tests).

Declared inputs. Every rule class declares ``requires`` (the inputs it cannot run without: a missing one raises an
:class:`~rolloutopt.errors.InputError` naming it), ``accepts`` (inputs it reads when given, e.g. the checkpoint or
probe inputs that only some steps need), ``reference`` (the arXiv id) and ``experimental`` (why the rule is
reconstructed and needs ``experimental=True``, or None); the registry of :mod:`rolloutopt.control` reads them. The
names are the library's glossary (``logp``, ``entropy``, ``topk_logp``, ``tokens``, ``group``) plus the rule's own
inputs declared in ``extra_inputs`` (``step`` keywords) and ``init_inputs`` (``init`` keywords).

Positions. Row ``i``'s token counter ``state.steps[i]`` counts the tokens it generated while live (active and not
stopped). A rule that fires at a step keeps the token of that step: ``position`` is that token's index and the
kept length is ``position + 1``. ``active=False`` rows (finished by EOS, or padding) are never stopped, never
counted, and their rule state does not change.

Post-hoc rules (decide after generation) return a :class:`TruncationOutput` (new mask, rewards, lengths and
metrics): nothing is dropped silently, every changed row is visible in the output. It is defined with the helpers
those rules share in ``rolloutopt._length_rules``, below ``advantages``, where DLER's rules live
(:mod:`rolloutopt.advantages.dler`), and re-exported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

import torch
from jaxtyping import Float, Shaped
from torch import Tensor

from rolloutopt._length_rules import TruncationOutput
from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import Dims, as_float, as_index, as_mask, checks_enabled, describe, finite
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.typing import BoolB, BoolBT, FloatB, FloatBT, IntB

__all__ = [
    "StepInputs",
    "StopResult",
    "StopRule",
    "StopState",
    "TruncationOutput",
    "replay",
    "truncate_mask",
]

#: The inputs every rule's ``step`` accepts, with their shapes (``N`` live batch, ``K`` top-k width).
STANDARD_INPUTS: dict[str, str] = {
    "logp": "N",
    "entropy": "N",
    "topk_logp": "N K",
    "tokens": "N",
}


@dataclass(frozen=True)
class StopState:
    """Per-generation state of a stop rule: tensors only, so ``torch.save(state.state_dict())`` checkpoints it.

    ``stopped`` bool ``[N]`` (cumulative), ``position`` int64 ``[N]`` (index of the last kept token of a stopped
    row, -1 while running), ``reason`` int64 ``[N]`` (0 while running, else an index into the rule's
    ``reason_names``), ``steps`` int64 ``[N]`` (tokens generated while live), ``extra`` (the rule's own per-row
    tensors, e.g. a smoothed regret).
    """

    stopped: BoolB
    position: IntB
    reason: IntB
    steps: IntB
    extra: dict[str, Tensor] = field(default_factory=dict)

    @property
    def batch_size(self) -> int:
        """N, the number of rows."""
        return int(self.stopped.shape[0])

    STATE: ClassVar[dict[str, Field]] = {
        "stopped": Field("bool", ("N",)),
        "position": Field("int", ("N",)),
        "reason": Field("int", ("N",), ("nonneg",)),
        "steps": Field("int", ("N",), ("nonneg",)),
        "extra": Field("any"),  # the rule's own per-row tensors: checked in from_state_dict (first dim N)
    }
    """The declared fields of :meth:`state_dict` (validated by :meth:`from_state_dict`)."""

    def state_dict(self) -> dict[str, Any]:
        """A plain dict of tensors (cloned) that :meth:`from_state_dict` restores exactly."""
        out: dict[str, Any] = {f.name: getattr(self, f.name).clone() for f in fields(self) if f.name != "extra"}
        out["extra"] = {k: v.clone() for k, v in self.extra.items()}
        return dump_state(out)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> StopState:
        """Rebuild a state saved with :meth:`state_dict`, validated field by field (an ``InputError`` names a bad
        one): bool ``stopped``, int ``position``/``reason``/``steps`` of one length N, ``position`` -1 exactly on
        the running rows and in ``[0, steps)`` on the stopped ones, ``extra`` a dict of tensors ``[N, ...]``."""
        s = load_state(state, cls.STATE, "StopState")
        fix = "pass state.state_dict()"
        stopped, position, reason, steps = s["stopped"], s["position"], s["reason"], s["steps"]
        if bool((stopped & ((position < 0) | (position >= steps))).any()) or bool((~stopped & (position != -1)).any()):
            raise InputError(
                "state['position']", "-1 on running rows, in [0, steps) on stopped rows", describe(position), fix
            )
        if bool((~stopped & (reason != 0)).any()) or bool((stopped & (reason == 0)).any()):
            raise InputError("state['reason']", "0 exactly on the running rows", describe(reason), fix)
        extra = s["extra"]
        if not isinstance(extra, dict):
            raise InputError("state['extra']", "a dict of per-row tensors", describe(extra), fix)
        n = int(stopped.shape[0])
        for key, value in extra.items():
            if not isinstance(key, str) or not isinstance(value, Tensor) or value.ndim < 1 or value.shape[0] != n:
                raise InputError(f"state['extra'][{key!r}]", f"a tensor [N={n}, ...]", describe(value), fix)
        return cls(
            stopped=stopped,
            position=position,
            reason=reason,
            steps=steps,
            extra={k: v.clone() for k, v in extra.items()},
        )


@dataclass(frozen=True)
class StepInputs:
    """The validated inputs of one ``step`` (fp32 floats, bool ``active``); absent inputs are ``None``.

    ``live`` is ``active & ~stopped``: the rows a rule may change. ``extra`` holds the rule-specific inputs
    declared in its ``extra_inputs`` (e.g. critic values ``[N]``, teacher top-k ids ``[N, K]``).
    """

    live: BoolB
    active: BoolB
    logp: FloatB | None = None
    entropy: FloatB | None = None
    topk_logp: Float[Tensor, "B topk"] | None = None
    tokens: IntB | None = None
    extra: dict[str, Tensor] = field(default_factory=dict)

    def need(self, name: str, by: str) -> Shaped[Tensor, "B ..."]:
        """Return input ``name`` or raise an InputError saying that rule ``by`` needs it."""
        value = self.extra.get(name) if name not in STANDARD_INPUTS else getattr(self, name)
        if value is None:
            raise InputError(name, f"a tensor: {by} needs it", "None", f"pass {name}= to step()")
        return value


@dataclass(frozen=True)
class StopResult:
    """Where and why each row stopped, and what the rule implies for the loss.

    ``stopped`` bool ``[N]``; ``position`` int64 ``[N]`` (last kept token, -1 for rows that did not stop);
    ``length`` int64 ``[N]`` (tokens kept: ``position + 1`` for stopped rows, the tokens generated otherwise);
    ``reason`` int64 ``[N]`` into ``reason_names`` (``reason_names[0]`` is ``"running"``: never stopped);
    ``metrics``: detached 0-d tensors (``stop_frac``, ``stop_position_mean``, ``stop_frac/<reason>``).

    What the rule implies for the loss, filled by its :meth:`StopRule.finalize` (None where it implies nothing):

    - ``terminal_reward`` float32 ``[N]`` with ``terminal_rows`` bool ``[N]`` (both or neither): the sequence
      reward that replaces a row's own on the ``terminal_rows`` (ESPO's :math:`r_{fail}` for a stopped row,
      Abstention's :math:`r_{abs}` for an abstained one); its values on the other rows are not read;
    - ``row_weight`` float32 ``[N]``: a loss weight per row (DUET's importance weights, 0 for ARRoL's pruned
      rows);
    - ``token_weight`` float32 ``[N, L]``: a loss weight per token, ``L`` the longest generated row
      (``max(length)`` before truncation; Prune-OPD's decay after a drift).

    Read them through :meth:`rewards` and :meth:`loss_weights`, which work for every rule: a trainer calls the
    two whatever the rule, and gets the rewards and mask unchanged (the mask truncated) where the rule implies
    nothing.
    """

    stopped: BoolB
    position: IntB
    length: IntB
    reason: IntB
    reason_names: tuple[str, ...]
    metrics: dict[str, Tensor] = field(default_factory=dict)
    terminal_reward: FloatB | None = None
    terminal_rows: BoolB | None = None
    row_weight: FloatB | None = None
    token_weight: FloatBT | None = None

    def __post_init__(self) -> None:
        if not checks_enabled():
            return
        n = int(self.stopped.shape[0])
        fix = "build the loss fields in finalize: [N] per row, [N, L] per token"
        if (self.terminal_reward is None) != (self.terminal_rows is None):
            raise InputError(
                "terminal_rows",
                "terminal_reward and terminal_rows both given or both None",
                f"terminal_reward {describe(self.terminal_reward)}, terminal_rows {describe(self.terminal_rows)}",
                "give the rows whose reward terminal_reward replaces",
            )
        for name in ("terminal_reward", "terminal_rows", "row_weight", "token_weight"):
            value = getattr(self, name)
            ndim = 2 if name == "token_weight" else 1
            if value is not None and (not isinstance(value, Tensor) or value.ndim != ndim or value.shape[0] != n):
                raise InputError(name, f"a tensor [{', '.join(['N', 'L'][:ndim])}] with N={n}", describe(value), fix)

    def reasons(self) -> list[str]:
        """The reason of every row, as names (a convenience for logs and tests)."""
        return [self.reason_names[int(r)] for r in self.reason]

    def keep_mask(self, length: int) -> BoolBT:
        """Bool ``[N, length]``: True for the tokens a stopped row keeps; rows that did not stop keep all."""
        t = torch.arange(length, device=self.position.device)
        limit = torch.where(self.stopped, self.position + 1, torch.full_like(self.position, length))
        return t[None, :] < limit[:, None]

    def rewards(self, rewards: FloatB) -> FloatB:
        r"""The sequence rewards with the rule's terminal rewards applied.

        .. math::
            r'_i = \begin{cases} \text{terminal\_reward}_i & \text{terminal\_rows}_i \\ r_i & \text{otherwise}
            \end{cases}

        A copy of ``rewards`` when the rule implies no terminal reward (every rule but ESPO, arXiv 2605.29860,
        its critic-free variant and Abstention, arXiv 2604.18419). Token rewards and GAE's ``done`` flags:
        :func:`~rolloutopt.control.absorbing_failure`.

        Args:
            rewards: float ``[N]``, finite, the rollouts' own sequence rewards, in the rows' order.

        Returns:
            float32 ``[N]`` (float64 stays float64) on ``rewards``' device. ``N = 0`` gives ``[0]``.
        """
        n = int(self.stopped.shape[0])
        r = as_float(rewards, "rewards")
        if checks_enabled():
            if r.ndim != 1 or r.shape[0] != n:
                raise InputError(
                    "rewards",
                    f"a float tensor [N={n}] (one sequence reward per row of the result)",
                    describe(r),
                    "pass the batch's sequence rewards [N] in the rows' order (token rewards: absorbing_failure)",
                )
            finite(r, "rewards", exclude=None)
        if self.terminal_reward is None or self.terminal_rows is None:
            return r.clone()
        rows = self.terminal_rows.to(r.device)
        return torch.where(rows, self.terminal_reward.to(r.device, r.dtype), r)

    def loss_weights(self, mask: BoolBT) -> FloatBT:
        r"""The per-token loss weights the rule implies: the loss mask, truncated, times its row and token weights.

        .. math::
            w_{i,t} = [m_{i,t} \wedge t < \ell^{keep}_i] \cdot a_i \cdot b_{i,t}

        with :math:`\ell^{keep}_i` the kept length of a stopped row (:meth:`keep_mask`; all of a row that did not
        stop), :math:`a` = ``row_weight`` and :math:`b` = ``token_weight`` (each 1 when the rule implies none;
        :math:`b` is 1 past its width ``L``, where only the keep mask counts). For a rule that implies no weights
        this is ``truncate_mask(mask, result).float()``. The rules with weights are DUET (arXiv 2605.08441, row
        weights), ARRoL (arXiv 2603.24840, row weights) and Prune-OPD (arXiv 2605.07804, token weights). Pass it
        to :func:`~rolloutopt.losses.policy_loss` as ``is_weights`` with ``mask=truncate_mask(mask, result)``, or
        multiply it into per-token rewards (Prune-OPD's teacher rewards).

        Args:
            mask: bool ``[N, T]`` (or 0/1), the response mask of the rows the rule observed.

        Returns:
            float32 ``[N, T]`` on ``mask``'s device, 0 wherever ``mask`` is 0 or after a stop.
        """
        n = int(self.stopped.shape[0])
        m = as_mask(mask, "mask", Dims(), "N T")
        if checks_enabled() and m.shape[0] != n:
            raise InputError(
                "mask",
                f"a bool tensor [N={n}, T] (one row per row of the result)",
                describe(mask),
                "pass the response mask of the batch the rule observed, in the same row order",
            )
        t_len = int(m.shape[1])
        w = (m & self.keep_mask(t_len).to(m.device)).float()
        if self.row_weight is not None:
            w = w * self.row_weight.to(w.device, w.dtype)[:, None]
        if self.token_weight is not None:
            tw = self.token_weight.to(w.device, w.dtype)[:, :t_len]
            if tw.shape[1] < t_len:
                tw = torch.nn.functional.pad(tw, (0, t_len - tw.shape[1]), value=1.0)
            w = w * tw
        return w


def truncate_mask(mask: BoolBT, result: StopResult) -> BoolBT:
    """The loss mask after a stop rule: ``mask & keep`` where ``keep`` holds the first ``position + 1`` tokens
    of every stopped row (rows that did not stop are unchanged).

    ``mask`` bool ``[N, T]``; ``result`` from :meth:`StopRule.finalize` for the same rows.
    """
    dims = Dims()
    m = as_mask(mask, "mask", dims, "N T")
    if checks_enabled() and result.stopped.shape[0] != m.shape[0]:
        raise InputError(
            "result",
            f"a StopResult for N={m.shape[0]} rows",
            f"one for {result.stopped.shape[0]} rows",
            "finalize the same batch",
        )
    return m & result.keep_mask(m.shape[1]).to(m.device)


class StopRule:
    """Base class of the streaming stop rules: ``init`` → ``step``… → ``finalize``.

    A subclass sets ``reason_names`` (``reason_names[0]`` must be ``"running"``) and declares its inputs:

    - ``requires``: the inputs it cannot run without — standard ``step`` inputs (``logp``, ``entropy``,
      ``topk_logp``, ``tokens``), its own ``step`` inputs and its ``init`` inputs; a missing one (absent or None)
      raises an :class:`~rolloutopt.errors.InputError` naming it;
    - ``accepts``: inputs it reads when given (e.g. the checkpoint or probe inputs that only some steps need,
      optional ``init`` keywords such as ``row_id``); standard inputs outside ``requires`` and ``accepts`` are
      ignored, so one generation loop can pass the same keywords to several rules;
    - ``extra_inputs`` (its own ``step`` inputs) and ``init_inputs`` (its ``init`` keywords): name →
      ``(shape spec, kind)`` with kind ``"float"``, ``"int"`` or ``"bool"``; shapes use ``N`` and other letters;
    - ``reference`` (arXiv id) and ``experimental`` (why it is reconstructed and needs ``experimental=True``, or
      None), for the registry.

    It overrides :meth:`_init` (per-row ``extra`` state) and :meth:`_step` (which live rows fire, and why); when it
    learns across batches, :meth:`state_dict`/:meth:`load_state_dict`; and when it implies a terminal reward or
    loss weights, :meth:`finalize` (``dataclasses.replace`` of the base result with the :class:`StopResult`
    fields ``terminal_reward``/``terminal_rows``, ``row_weight`` or ``token_weight``).
    """

    reason_names: ClassVar[tuple[str, ...]] = ("running", "stopped")
    requires: ClassVar[tuple[str, ...]] = ()
    accepts: ClassVar[tuple[str, ...]] = ()
    extra_inputs: ClassVar[dict[str, tuple[str, str]]] = {}
    init_inputs: ClassVar[dict[str, tuple[str, str]]] = {}
    reference: ClassVar[str] = ""
    experimental: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "uses" in cls.__dict__:  # the former declaration: refuse it rather than ignore it
            raise InputError(
                f"{cls.__name__}.uses",
                "the declarations requires and accepts (uses was replaced by them)",
                repr(cls.__dict__["uses"]),
                "declare requires = (...) for the inputs the rule cannot run without and accepts = (...) for the rest",
            )

    # -- the protocol ------------------------------------------------------------------------------------------
    def init(
        self,
        batch_size: int,
        *,
        device: torch.device | str | None = None,
        **inputs: Shaped[Tensor, "B ..."] | Groups | None,
    ) -> StopState:
        """A fresh state for ``batch_size`` rows (rule-specific keywords, e.g. ``group=``, go to :meth:`_init`;
        the rule's ``init_inputs`` lists them)."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 0:
            raise InputError("batch_size", "a non-negative int", describe(batch_size), "pass the number of rows")
        name = type(self).__name__
        for key, value in inputs.items():
            if key not in self.init_inputs:
                known = ", ".join(sorted(self.init_inputs)) or "none"
                raise InputError(key, f"a keyword {name}.init accepts ({known})", describe(value), f"remove {key}=")
        for key in self.requires:
            if key in self.init_inputs and inputs.get(key) is None:
                spec = ", ".join(self.init_inputs[key][0].split())
                raise InputError(key, f"a tensor [{spec}]: {name} requires it", "None", f"pass init(n, {key}=...)")
        dev = torch.device(device) if device is not None else torch.device("cpu")
        n = batch_size
        return StopState(
            stopped=torch.zeros(n, dtype=torch.bool, device=dev),
            position=torch.full((n,), -1, dtype=torch.long, device=dev),
            reason=torch.zeros(n, dtype=torch.long, device=dev),
            steps=torch.zeros(n, dtype=torch.long, device=dev),
            extra=self._init(n, dev, **inputs),
        )

    def step(
        self,
        state: StopState,
        *,
        logp: FloatB | None = None,
        entropy: FloatB | None = None,
        topk_logp: Float[Tensor, "B topk"] | None = None,
        tokens: IntB | None = None,
        active: BoolB | None = None,
        **inputs: Any,
    ) -> tuple[StopState, BoolB]:
        """Observe one decoding step of every row; return the new state and the cumulative bool ``stop [N]``.

        ``logp`` float ``[N]`` (log-prob of the sampled token), ``entropy`` float ``[N]``, ``topk_logp`` float
        ``[N, K]``, ``tokens`` int ``[N]``, ``active`` bool ``[N]`` (default all True). A missing input the rule
        ``requires`` raises; standard inputs it neither requires nor accepts are ignored; rule-specific inputs go
        by keyword (see the rule's ``extra_inputs``) and an unknown one raises.
        """
        if not isinstance(state, StopState):
            raise InputError("state", "a StopState from rule.init()", describe(state), "call rule.init(batch_size)")
        x = self._inputs(state, logp, entropy, topk_logp, tokens, active, inputs)
        extra, fire, reason = self._step(state, x)
        newly = fire.to(torch.bool) & x.live
        reason_t = torch.as_tensor(reason, dtype=torch.long, device=state.reason.device).expand_as(state.reason)
        new = StopState(
            stopped=state.stopped | newly,
            position=torch.where(newly, state.steps, state.position),
            reason=torch.where(newly, reason_t, state.reason),
            steps=state.steps + x.live.long(),
            extra=extra,
        )
        return new, new.stopped

    def finalize(self, state: StopState) -> StopResult:
        """Per-row stop positions, kept lengths and reasons, with ``stop_frac`` and per-reason metrics; a rule that
        implies a terminal reward or loss weights adds them (its own ``finalize``), None otherwise."""
        if not isinstance(state, StopState):
            raise InputError("state", "a StopState from rule.init()", describe(state), "pass the state step() returned")
        stopped = state.stopped
        n = max(stopped.numel(), 1)
        fstop = stopped.float()
        metrics: dict[str, Tensor] = {
            "stop_frac": fstop.sum() / n,
            "stop_position_mean": (state.position.clamp_min(0).float() * fstop).sum() / fstop.sum().clamp_min(1.0),
            "tokens_mean": state.steps.float().sum() / n,
        }
        for code, name in enumerate(self.reason_names[1:], start=1):
            metrics[f"stop_frac/{name}"] = (state.reason == code).float().sum() / n
        return StopResult(
            stopped=stopped.clone(),
            position=state.position.clone(),
            length=state.steps.clone(),
            reason=state.reason.clone(),
            reason_names=self.reason_names,
            metrics={k: v.detach() for k, v in metrics.items()},
        )

    STATE: ClassVar[dict[str, Field]] = {}
    """The declared fields of :meth:`state_dict` (none for a memoryless rule; a learning rule declares its own)."""

    def state_dict(self) -> dict[str, Any]:
        """The rule's cross-batch state (running statistics, controllers); empty for memoryless rules."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` exactly (validated against :attr:`STATE`: a memoryless rule takes ``{}``)."""
        load_state(state, self.STATE, type(self).__name__)

    # -- for subclasses ----------------------------------------------------------------------------------------
    def _init(self, n: int, device: torch.device, **inputs: Any) -> dict[str, Tensor]:
        if inputs:
            name = sorted(inputs)[0]
            raise InputError(
                name, f"no keyword {name!r}: {type(self).__name__}.init takes none", name, f"remove {name}="
            )
        return {}

    def _step(self, state: StopState, x: StepInputs) -> tuple[dict[str, Tensor], Tensor, Tensor | int]:
        """Return ``(new extra, fire bool [N], reason code(s))``; only live rows' decisions count."""
        raise NotImplementedError

    # -- validation --------------------------------------------------------------------------------------------
    def _inputs(
        self,
        state: StopState,
        logp: Any,
        entropy: Any,
        topk_logp: Any,
        tokens: Any,
        active: Any,
        inputs: dict[str, Any],
    ) -> StepInputs:
        name = type(self).__name__
        n = state.batch_size
        dims = Dims()
        dims.sizes["N"] = (n, "state")
        dev = state.stopped.device
        given = {"logp": logp, "entropy": entropy, "topk_logp": topk_logp, "tokens": tokens}
        for need in self.requires:
            if need in STANDARD_INPUTS and given[need] is None:
                raise InputError(
                    need,
                    f"a tensor of shape [{', '.join(STANDARD_INPUTS[need].split())}]: {name} requires it",
                    "None",
                    f"pass {need}= to step()",
                )
            if need in self.extra_inputs and inputs.get(need) is None:
                raise InputError(
                    need,
                    f"a tensor of shape [{', '.join(self.extra_inputs[need][0].split())}]: {name} requires it",
                    "None",
                    f"pass {need}= to step()",
                )
        reads = set(self.requires) | set(self.accepts)
        std: dict[str, Tensor | None] = {}
        for key, value in given.items():
            if value is None or key not in reads:
                std[key] = None
            elif key == "tokens":
                std[key] = as_index(value, key, dims, "N").to(dev)
            else:
                t = as_float(value, key, dims, STANDARD_INPUTS[key]).to(dev)
                std[key] = t
        act = (
            torch.ones(n, dtype=torch.bool, device=dev)
            if active is None
            else as_mask(active, "active", dims, "N").to(dev)
        )
        live = act & ~state.stopped
        for key in ("logp", "entropy", "topk_logp"):
            value_t = std[key]
            if value_t is not None:
                finite(value_t, key, live[:, None].expand_as(value_t) if value_t.ndim == 2 else live)
        extra: dict[str, Tensor] = {}
        for key, value in inputs.items():
            if key not in self.extra_inputs:
                known = ", ".join(sorted(self.extra_inputs)) or "none"
                raise InputError(
                    key, f"a keyword {name}.step accepts (extra inputs: {known})", describe(value), f"remove {key}="
                )
            if value is not None:
                extra[key] = extra_input(value, key, self.extra_inputs[key], dims, live)
        return StepInputs(live=live, active=act, extra=extra, **std)


def extra_input(
    value: Shaped[Tensor, "B ..."], key: str, spec_kind: tuple[str, str], dims: Dims, rows: BoolB
) -> Shaped[Tensor, "B ..."]:
    """Validate one rule-specific ``step`` input: shape ``spec`` (dims bound in ``dims``), kind ``"float"`` (fp32,
    finite at ``rows``), ``"int"`` (int64) or ``"bool"``; returned on ``rows``' device."""
    spec, kind = spec_kind
    if kind == "float":
        t = as_float(value, key, dims, spec).to(rows.device)
        finite(t, key, rows.view(-1, *([1] * (t.ndim - 1))).expand_as(t))
        return t
    if kind == "int":
        return as_index(value, key, dims, spec).to(rows.device)
    return as_mask(value, key, dims, spec).to(rows.device)


def replay(
    rule: StopRule,
    *,
    mask: BoolBT | None = None,
    init: dict[str, Any] | None = None,
    **per_token: Shaped[Tensor, "B T ..."] | None,
) -> StopResult:
    """Drive ``rule`` over a recorded generation and return :meth:`StopRule.finalize`'s result (the rule's terminal
    rewards and loss weights included: the same :class:`StopResult` as a streamed run).

    Every per-token input is ``[N, T, ...]`` (``logp``, ``entropy``, ``topk_logp [N, T, K]``, ``tokens``,
    and the rule's extra inputs); step ``t`` passes ``x[:, t]``. ``mask`` bool ``[N, T]`` is the ``active`` mask
    (default all True), ``init`` the keywords for ``rule.init`` (e.g. ``{"group": group}``). A Python loop over
    T — the time axis of generation — as the engine's own loop would run it.
    """
    if not isinstance(rule, StopRule):
        raise InputError("rule", "a StopRule", describe(rule), "pass a rule such as ESPO()")
    tensors = {k: v for k, v in per_token.items() if v is not None}
    if not tensors and mask is None:
        raise InputError("per_token", "at least one [N, T] input or mask", "nothing", "pass logp=... or mask=...")
    first = mask if mask is not None else next(iter(tensors.values()))
    if not isinstance(first, Tensor) or first.ndim < 2:
        raise InputError(
            "mask" if mask is not None else next(iter(tensors)),
            "a tensor [N, T, ...]",
            describe(first),
            "pass per-token tensors",
        )
    n, t_len = int(first.shape[0]), int(first.shape[1])
    for key, value in tensors.items():
        if not isinstance(value, Tensor) or value.ndim < 2 or tuple(value.shape[:2]) != (n, t_len):
            raise InputError(
                key,
                f"a tensor [N, T, ...] with N={n}, T={t_len}",
                describe(value),
                "pass per-token tensors of one shape",
            )
    act = None if mask is None else as_mask(mask, "mask", Dims(), "N T")
    state = rule.init(n, device=first.device, **(init or {}))
    for t in range(t_len):
        step_inputs = {k: v[:, t] for k, v in tensors.items()}
        state, _ = rule.step(state, active=None if act is None else act[:, t], **step_inputs)
    return rule.finalize(state)
