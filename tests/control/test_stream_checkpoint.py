"""Every stop rule, by name, on streamed tokens with a checkpoint mid-stream: the stream continues identically.

Each rule of the control registry that streams (a :class:`~rolloutopt.control.StopRule`) is driven for 160
decoding steps with every input it declares (required and accepted), the per-step inputs drawn from seeded
generators; after 96 steps the stream state (``StopState.state_dict()``) and the rule's own cross-batch state
(``rule.state_dict()``) go through ``torch.save`` / ``torch.load(weights_only=True)`` into a fresh rule, which
streams the rest. Its stop decisions, its final stream state (every running statistic in ``extra``) and the
final result (the loss fields included) equal the uninterrupted run's. With these generic inputs ESR, ARRoL
and Prune-OPD stop rows during the stream (ESR and ARRoL after the checkpoint); the other rules keep every row
running, so for them the test checks that their running statistics continue identically.
"""

from __future__ import annotations

import io
from typing import Any

import pytest
import torch

import rolloutopt.control as control
from rolloutopt.control import StopRule, StopState

from .test_registry import RULES, N, make, tensor_input

STEPS, CUT = 160, 96


def _inputs(rule: StopRule, names: set[str], step: int) -> dict[str, torch.Tensor]:
    """The per-step inputs of ``rule`` at decoding step ``step`` (a different seeded draw per step)."""
    torch.manual_seed(1000 + step)  # tensor_input draws from its own seeded generator: shift it per step
    out = {}
    for k in names:
        if k in rule.init_inputs:
            continue
        x = tensor_input(rule, k)
        if x.is_floating_point():
            x = x * (0.5 + 0.5 * torch.rand(x.shape, generator=torch.Generator().manual_seed(step)))
        out[k] = x
    return out


def _stream(rule: StopRule, state: StopState, names: set[str], steps: range) -> tuple[StopState, list[Any]]:
    stops = []
    for s in steps:
        state, stop = rule.step(state, **_inputs(rule, names, s))
        stops.append(stop.clone())
    return state, stops


def _roundtrip(obj: Any) -> Any:
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


STREAMING = [n for n in RULES if isinstance(make(n), StopRule)]


def _same(a: Any, b: Any) -> bool:
    """Equality of nested dicts of tensors, NaN equal to NaN."""
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor) or a.dtype != b.dtype or a.shape != b.shape:
            return False
        return torch.equal(a, b) or (a.is_floating_point() and torch.allclose(a, b, rtol=0, atol=0, equal_nan=True))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return bool(a == b)


def test_every_streaming_rule_is_covered_and_some_stop() -> None:
    assert len(STREAMING) >= 10 and set(STREAMING) <= set(control.names())
    stopping = set()
    for name in STREAMING:
        entry = control.entry(name)
        names = set(entry.requires) | set(entry.accepts)
        rule = make(name)
        init = {k: tensor_input(rule, k) for k in names if k in rule.init_inputs}
        _, stops = _stream(rule, rule.init(N, **init), names, range(STEPS))
        if any(bool(s.any()) for s in stops[CUT:]):
            stopping.add(name)
    assert {"esr", "arrol"} <= stopping  # rows stop after the checkpoint: the resumed stream decides them


@pytest.mark.parametrize("name", STREAMING)
def test_every_stop_rule_continues_identically_after_a_checkpoint(name: str) -> None:
    entry = control.entry(name)
    names = set(entry.requires) | set(entry.accepts)
    whole = make(name)
    init = {k: tensor_input(whole, k) for k in names if k in whole.init_inputs}
    want_state, want = _stream(whole, whole.init(N, **init), names, range(STEPS))
    want_result = whole.finalize(want_state)

    first = make(name)
    state, got = _stream(first, first.init(N, **init), names, range(CUT))
    saved = _roundtrip({"stream": state.state_dict(), "rule": first.state_dict()})
    resumed = make(name)
    resumed.load_state_dict(saved["rule"])
    state, rest = _stream(resumed, StopState.from_state_dict(saved["stream"]), names, range(CUT, STEPS))
    got += rest
    for s, (a, b) in enumerate(zip(want, got, strict=True)):
        assert torch.equal(a, b), f"step {s}"
    assert _same(want_state.state_dict(), state.state_dict())
    result = resumed.finalize(state)
    for field_name in ("stopped", "position", "length", "reason"):
        assert torch.equal(getattr(want_result, field_name), getattr(result, field_name)), field_name
    for field_name in ("terminal_reward", "terminal_rows", "row_weight", "token_weight"):  # the loss side too
        want_field, got_field = getattr(want_result, field_name), getattr(result, field_name)
        assert (want_field is None) == (got_field is None), field_name
        assert want_field is None or _same(want_field, got_field), field_name
