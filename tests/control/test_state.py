"""State as data for the control layer: every load is validated against the declared fields.

For every rule class of the registry with cross-batch state, for :class:`StopState` and for the two partial-rollout
buffers: after some use, a state with an unknown key, a missing key, a truncated tensor, a string for a tensor, a
foreign object's state or another format version is an ``InputError`` and the object is unchanged (its next result
equals an untouched twin's). Plus the cases fuzzing found: NaN values and negative counters (refused naming the
field), a StopState with ``steps`` of the wrong length or a float ``stopped``, a buffer state with a rollout record
dropped or ``running`` naming an unknown rollout.
"""

from __future__ import annotations

import io
import math
from typing import Any

import pytest
import torch

import rolloutopt.control as control
from rolloutopt._state import FORMAT_KEY
from rolloutopt.control import APRILBuffer, CoPRISScheduler, StopRule, StopState
from rolloutopt.errors import InputError

from .partial_helpers import seg
from .test_registry import OBSERVE_INPUTS, RULES, make, run_stream, tensor_input

STATEFUL = [name for name in RULES if make(name).state_dict()]


def same(a: Any, b: Any) -> bool:
    """Deep equality of states and results (tensors by value, NaN equal to NaN)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a.isnan(), b.isnan()) if a.is_floating_point() else True)
            and bool(torch.equal(torch.nan_to_num(a), torch.nan_to_num(b)))
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and set(a) == set(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "__dataclass_fields__"):
        return type(a) is type(b) and same(vars(a) if hasattr(a, "__dict__") else _fields(a), _fields(b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return bool(a == b)


def _fields(x: Any) -> dict[str, Any]:
    return {k: getattr(x, k) for k in x.__dataclass_fields__}


# ------------------------------------------------------------------------------------------------ the rules


def use(name: str, rule: Any) -> Any:
    """One round of use: a stream (and the rule's batch update), or one observe; returns what it produced."""
    if isinstance(rule, StopRule):
        req = set(control.entry(name).requires)
        init = {k: tensor_input(rule, k) for k in req if k in rule.init_inputs}
        step = {k: tensor_input(rule, k) for k in req if k not in rule.init_inputs}
        state = rule.init(4, **init)
        state, _ = rule.step(state, **step)
        out: dict[str, Any] = {"result": rule.finalize(state)}
        if name == "espo":
            out["update"] = rule.update(state)
        elif name == "espo_critic_free":
            out["update"] = rule.update(state, torch.tensor([True, True, False, True]))
        elif name == "arrol":
            out["result2"] = run_stream(rule, req)
        return out
    return rule.observe(**{k: OBSERVE_INPUTS[k] for k in control.entry(name).requires})


def corruptions(sd: dict[str, Any], foreign: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The corrupted variants of a valid state ``sd`` (``foreign``: another object's valid state)."""
    keys = [k for k in sd if k != FORMAT_KEY]
    tensors = [k for k in keys if isinstance(sd[k], torch.Tensor) and sd[k].ndim >= 1 and sd[k].shape[0] > 0]
    out = {
        "unknown key": {**sd, "bogus": 0},
        "missing key": {k: v for k, v in sd.items() if k != keys[0]},
        "string for a tensor": {**sd, (tensors or keys)[0]: "x"},
        "foreign state": foreign,
        "other format version": {**sd, FORMAT_KEY: 2},
    }
    if tensors:
        out["truncated tensor"] = {**sd, tensors[0]: sd[tensors[0]][:-1]}
    return out


def test_the_stateful_rules_are_the_learning_ones() -> None:
    expected = ["adwin_horizon", "arrol", "duet_abort", "espo", "espo_critic_free", "prune_opd_window", "stable_opd"]
    assert expected == STATEFUL
    for name in sorted(set(RULES) - set(STATEFUL)):  # memoryless: {} loads, anything else is refused
        rule = make(name)
        rule.load_state_dict({})
        with pytest.raises(InputError):
            rule.load_state_dict({"bogus": 0})


@pytest.mark.parametrize("name", STATEFUL)
def test_every_rule_refuses_a_corrupted_state_and_keeps_its_own(name: str) -> None:
    rule, twin = make(name), make(name)
    use(name, rule), use(name, twin)
    sd = rule.state_dict()
    assert sd[FORMAT_KEY] == 1
    other = next(n for n in STATEFUL if n != name)
    foreign = make(other)
    use(other, foreign)
    for what, bad in corruptions(sd, foreign.state_dict()).items():
        with pytest.raises(InputError):
            rule.load_state_dict(bad)
        assert same(rule.state_dict(), twin.state_dict()), what
    assert same(use(name, rule), use(name, twin))
    assert same(rule.state_dict(), twin.state_dict())


@pytest.mark.parametrize("name", STATEFUL)
def test_every_rule_state_loads_with_weights_only_and_continues_identically(name: str) -> None:
    rule = make(name)
    use(name, rule)
    f = io.BytesIO()
    torch.save(rule.state_dict(), f)
    f.seek(0)
    fresh = make(name)
    fresh.load_state_dict(torch.load(f, weights_only=True))
    assert same(fresh.state_dict(), rule.state_dict())
    assert same(use(name, fresh), use(name, rule))


#: per rule: (key, a NaN or non-finite value, a negative counter key) — each refused naming the field
FUZZ: dict[str, tuple[str, Any, str]] = {
    "adwin_horizon": ("probes", [[0, math.nan, True, 512]], "n_probes"),
    "arrol": ("weight", torch.full((3,), math.nan), "count"),
    "duet_abort": ("epoch", math.nan, "epoch"),
    "espo": ("mu", math.nan, "batches"),
    "espo_critic_free": ("rho_bar", math.nan, "batches"),
    "prune_opd_window": ("length", math.nan, "steps"),
    "stable_opd": ("kl_multiplier", math.nan, "trips"),
}


@pytest.mark.parametrize("name", STATEFUL)
def test_every_rule_refuses_nan_and_negative_counters_naming_the_field(name: str) -> None:
    rule, twin = make(name), make(name)
    use(name, rule), use(name, twin)
    sd = rule.state_dict()
    nan_key, nan_value, counter = FUZZ[name]
    bad: dict[str, Any] = {**sd, nan_key: nan_value}
    if name == "espo_critic_free":
        bad["s_rho"] = 0.5  # both given, so the NaN is what is wrong
    for key, state in ((nan_key, bad), (counter, {**sd, counter: -1})):
        with pytest.raises(InputError) as err:
            rule.load_state_dict(state)
        assert err.value.argument == f"state[{key!r}]"
    assert same(rule.state_dict(), twin.state_dict())


def test_espo_refuses_inf_a_negative_variance_and_a_non_bool_gate() -> None:
    rule = make("espo")
    sd = rule.state_dict()
    for key, value in (("beta", math.inf), ("var", -1.0), ("warm", 1), ("last_loss", math.nan), ("streak", 1.5)):
        with pytest.raises(InputError) as err:
            rule.load_state_dict({**sd, key: value})
        assert err.value.argument == f"state[{key!r}]"
    assert rule.state_dict() == make("espo").state_dict()


def test_horizon_rules_refuse_values_outside_their_bounds() -> None:
    win = make("prune_opd_window")  # l0 4, l_max 16, patience 3
    for key, value in (("length", 17), ("length", 3), ("streak", 3)):
        with pytest.raises(InputError) as err:
            win.load_state_dict({**win.state_dict(), key: value})
        assert err.value.argument == f"state[{key!r}]"
    adwin = make("adwin_horizon")
    sd = adwin.state_dict()
    for key, value in (("horizon", 10), ("probes", [[0, 0.5, True, 10]]), ("probes", [[0, 0.5]]), ("n_stale", 1)):
        with pytest.raises(InputError) as err:
            adwin.load_state_dict({**sd, key: value})
        assert err.value.argument == f"state[{key!r}]"
    stable = make("stable_opd")
    for key, value in (("history", [0.5, math.nan]), ("history", "x"), ("kl_multiplier", 0.5), ("trips", 1)):
        with pytest.raises(InputError) as err:
            stable.load_state_dict({**stable.state_dict(), key: value})
        assert err.value.argument == f"state[{key!r}]"


# ------------------------------------------------------------------------------------------------ StopState


def stop_state() -> StopState:
    rule = make("espo")
    state = rule.init(4)
    inputs = {k: tensor_input(rule, k) for k in control.entry("espo").requires}
    state, _ = rule.step(state, **inputs)
    return state


def test_stop_state_refuses_a_corrupted_state() -> None:
    sd = stop_state().state_dict()
    assert sd[FORMAT_KEY] == 1
    assert same(StopState.from_state_dict(sd).state_dict(), sd)
    for what, bad in corruptions(sd, make("espo").state_dict()).items():
        with pytest.raises(InputError):
            StopState.from_state_dict(bad)
        assert what


@pytest.mark.parametrize(
    ("key", "bad"),
    [
        ("steps", lambda sd: sd["steps"][:-1]),  # the wrong length
        ("steps", lambda sd: torch.cat([sd["steps"], sd["steps"][:1]])),
        ("stopped", lambda sd: sd["stopped"].float()),  # a float stopped
        ("steps", lambda sd: sd["steps"] - 5),  # a negative counter
        ("position", lambda sd: torch.full_like(sd["position"], 3)),  # running rows with a stop position
        ("reason", lambda sd: sd["reason"] + 1),  # running rows with a reason
        ("extra", lambda sd: {**sd["extra"], "z": sd["extra"]["z"][:-1]}),  # a truncated per-row tensor
        ("extra", lambda sd: "x"),
    ],
)
def test_stop_state_fuzz_cases_are_refused_naming_the_field(key: str, bad: Any) -> None:
    sd = stop_state().state_dict()
    sd = {**sd, "stopped": torch.zeros_like(sd["stopped"]), "position": torch.full_like(sd["position"], -1)}
    sd["reason"] = torch.zeros_like(sd["reason"])
    StopState.from_state_dict(sd)  # the base is valid
    with pytest.raises(InputError) as err:
        StopState.from_state_dict({**sd, key: bad(sd)})
    assert err.value.argument.startswith(f"state[{key!r}]")


# ------------------------------------------------------------------------------------------------ the buffers


def buffer(kind: str) -> APRILBuffer | CoPRISScheduler:
    """A buffer mid-round: one request finished, one aborted with a partial response, one still running."""
    s: APRILBuffer | CoPRISScheduler = (
        APRILBuffer(rollout_batch_size=1, over_sampling_batch_size=2, n_samples_per_prompt=2, max_new_tokens=6)
        if kind == "april"
        else CoPRISScheduler(
            train_batch_size=1, gen_batch_size=2, n_samples_per_prompt=2, pool_size=4, max_new_tokens=6
        )
    )
    s.begin_round(torch.tensor([7, 8]), policy_version=0)
    reqs = s.next_requests()
    q = reqs.request_ids.tolist()
    s.finish(q[0], *seg(2), reward=1.0)
    s.abort(q[1], *seg(1, 5))
    return s


def finish_round(s: APRILBuffer | CoPRISScheduler) -> Any:
    for _ in range(3):
        reqs = s.next_requests()
        for k, q in enumerate(reqs.request_ids.tolist()):
            s.finish(q, *seg(1), reward=float(k % 2))
    return s.end_round()


def buffer_corruptions(sd: dict[str, Any], foreign: dict[str, Any]) -> dict[str, dict[str, Any]]:
    rid = next(r for r, d in sd["rollouts"].items() if d["tokens"].numel() > 0)
    rec = sd["rollouts"][rid]

    def with_record(**changes: Any) -> dict[str, Any]:
        return {**sd, "rollouts": {**sd["rollouts"], rid: {**rec, **changes}}}

    first = min(sd["rollouts"])
    running_rid = sd["running"][0][1]
    return {
        "unknown key": {**sd, "bogus": 0},
        "missing key": {k: v for k, v in sd.items() if k != "groups"},
        "truncated tensor": with_record(logp=rec["logp"][:-1]),
        "truncated stored tensor": with_record(stored=torch.cat([rec["tokens"].float(), torch.zeros(1)])),
        "string for a tensor": with_record(tokens="x"),
        "NaN log-prob": with_record(logp=torch.full_like(rec["logp"], math.nan)),
        "float tokens": with_record(tokens=rec["tokens"].float()),
        "foreign state": foreign,
        "foreign rule state": make("espo").state_dict(),
        "other format version": {**sd, FORMAT_KEY: 2},
        "rollout record dropped": {**sd, "rollouts": {r: d for r, d in sd["rollouts"].items() if r != first}},
        "running at an unknown rollout": {**sd, "running": [[sd["running"][0][0], 999], *sd["running"][1:]]},
        "running at a finished rollout": {**sd, "running": [[sd["running"][0][0], rid], *sd["running"][1:]]},
        "a running rollout without request": {**sd, "running": [p for p in sd["running"] if p[1] != running_rid]},
        "record in the wrong group": with_record(group=rec["group"] + 1),
        "unknown status": with_record(status=9),
        "negative counter": {**sd, "counters": [-1, *sd["counters"][1:]]},
        "stale next rollout id": {**sd, "counters": [0, *sd["counters"][1:]]},
        "unknown removal reason": {**sd, "removed": [[0, 7, 0, 9]]},
        "extra with a string": {**sd, "extra": {k: "x" for k in sd["extra"]}},
    }


@pytest.mark.parametrize("kind", ["april", "copris"])
def test_every_buffer_refuses_a_corrupted_state_and_keeps_its_own(kind: str) -> None:
    s, twin = buffer(kind), buffer(kind)
    sd = s.state_dict()
    assert sd[FORMAT_KEY] == 1 and sd["running"]
    foreign = buffer("copris" if kind == "april" else "april").state_dict()
    for what, bad in buffer_corruptions(sd, foreign).items():
        with pytest.raises(InputError):
            s.load_state_dict(bad)
        assert same(s.state_dict(), twin.state_dict()), what
    assert same(finish_round(s), finish_round(twin))
    assert same(s.state_dict(), twin.state_dict())


@pytest.mark.parametrize("kind", ["april", "copris"])
def test_buffer_fuzz_cases_fail_at_load_not_at_end_round(kind: str) -> None:
    s, twin = buffer(kind), buffer(kind)
    sd = s.state_dict()
    dropped = {**sd, "rollouts": {r: d for r, d in sd["rollouts"].items() if r != min(sd["rollouts"])}}
    with pytest.raises(InputError) as err:
        s.load_state_dict(dropped)
    assert err.value.argument.startswith("state['groups']")
    unknown = {**sd, "running": [[sd["running"][0][0], 999]]}
    with pytest.raises(InputError) as err:
        s.load_state_dict(unknown)
    assert err.value.argument == "state['running']"
    assert same(finish_round(s), finish_round(twin))  # the buffer still runs on its own state


def test_a_buffer_refuses_accepted_groups_it_does_not_hold() -> None:
    s = APRILBuffer(rollout_batch_size=2, over_sampling_batch_size=2, n_samples_per_prompt=1, max_new_tokens=4)
    s.begin_round(torch.tensor([1, 2]), policy_version=0)
    s.finish(s.next_requests().request_ids.tolist()[0], *seg(1), reward=1.0)
    sd = s.state_dict()
    assert sd["extra"]["accepted"]
    with pytest.raises(InputError) as err:
        s.load_state_dict({**sd, "extra": {**sd["extra"], "accepted": [99]}})
    assert err.value.argument == "state['extra']['accepted']"
    c = CoPRISScheduler(train_batch_size=1, gen_batch_size=1, n_samples_per_prompt=1, pool_size=1, max_new_tokens=4)
    c.begin_round(torch.tensor([1]), policy_version=0)
    c.finish(c.next_requests().request_ids.tolist()[0], *seg(1), reward=1.0)
    sd = c.state_dict()
    with pytest.raises(InputError) as err:
        c.load_state_dict({**sd, "extra": {**sd["extra"], "kept": [99]}})
    assert err.value.argument == "state['extra']['kept']"
