"""The checkpoint of a :class:`~rolloutopt.control.partial.PartialScheduler` (:class:`_PartialCheckpoint`, mixed
into it: ``state_dict`` / ``load_state_dict``) and the validation of a state's ragged fields (rollout records,
groups, queues, running requests), rebuilt into fresh objects before anything is assigned."""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import describe
from rolloutopt.control._partial_records import (
    _ROLLOUT_FIELDS,
    _RUNNING,
    REMOVAL_REASONS,
    STATUS_NAMES,
    _Rollout,
)
from rolloutopt.errors import InputError

__all__: list[str] = []


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _int_list(x: Any) -> list[int] | None:
    """``x`` as a list of ints, or None when it is not a list of ints."""
    if not isinstance(x, (list, tuple)) or not all(_is_int(v) for v in x):
        return None
    return [int(v) for v in x]


def _bad(key: str | tuple[str | int, ...], expected: str, got: Any) -> InputError:
    """An InputError naming ``state[key]`` (a tuple: the nested path, e.g. ``state['rollouts'][3]['tokens']``)."""
    path = "state" + "".join(f"[{k!r}]" for k in (key if isinstance(key, tuple) else (key,)))
    return InputError(path, expected, got if isinstance(got, str) else describe(got), "pass state_dict()")


def _record(d: Any, rid: int, n_samples: int) -> _Rollout:
    key: tuple[str | int, ...] = ("rollouts", rid)
    if not isinstance(d, dict) or set(d) != set(_ROLLOUT_FIELDS):
        raise _bad(key, f"a rollout record with the keys {list(_ROLLOUT_FIELDS)}", d)
    for k in ("prompt", "group", "sample", "status", "oldest"):
        if not _is_int(d[k]):
            raise _bad((*key, k), "an int", d[k])
    if not 0 <= d["status"] < len(STATUS_NAMES) or not 0 <= d["sample"] < n_samples or d["group"] < 0:
        raise _bad(key, f"a status in [0, {len(STATUS_NAMES)}), a sample in [0, {n_samples}), a group >= 0", d)
    if isinstance(d["reward"], bool) or not isinstance(d["reward"], (int, float)):
        raise _bad((*key, "reward"), "a float (NaN while unfinished)", d["reward"])
    tensors: dict[str, Tensor] = {}
    for k, kind in (("tokens", "int"), ("logp", "float"), ("versions", "int"), ("stored", "float")):
        t = d[k]
        if not isinstance(t, Tensor) or t.ndim != 1 or t.is_complex() or t.dtype == torch.bool:
            raise _bad((*key, k), f"a 1-d {kind} tensor", t)
        if t.is_floating_point() != (kind == "float"):
            raise _bad((*key, k), f"a 1-d {kind} tensor", t)
        tensors[k] = t.detach().to("cpu", torch.float32 if kind == "float" else torch.long).clone()
    length = tensors["tokens"].numel()
    for k in ("logp", "versions"):
        if tensors[k].numel() != length:
            raise _bad((*key, k), f"{length} values (one per token)", tensors[k])
    if tensors["stored"].numel() > length:
        raise _bad((*key, "stored"), f"at most {length} values (the tokens)", tensors["stored"])
    if not bool(torch.isfinite(tensors["logp"]).all()) or not bool(torch.isfinite(tensors["stored"]).all()):
        raise _bad(key, "finite log-probs", "NaN or inf")
    return _Rollout(
        prompt=d["prompt"],
        group=d["group"],
        sample=d["sample"],
        status=d["status"],
        reward=float(d["reward"]),
        oldest=d["oldest"],
        **tensors,
    )


def _parse_state(s: dict[str, Any], n_samples: int, owner: str) -> dict[str, Any]:
    """Check the ragged fields of a :class:`PartialScheduler` state (validated keys) and return them rebuilt."""
    raw = s["rollouts"]
    if not isinstance(raw, dict) or not all(_is_int(r) and r >= 0 for r in raw):
        raise _bad("rollouts", "a dict rollout id (int >= 0) -> record", raw)
    rollouts = {int(r): _record(d, int(r), n_samples) for r, d in raw.items()}
    graw = s["groups"]
    if not isinstance(graw, dict) or not all(_is_int(g) and g >= 0 for g in graw):
        raise _bad("groups", "a dict group id (int >= 0) -> rollout ids", graw)
    groups: dict[int, list[int]] = {}
    seen: set[int] = set()
    for g, rids in graw.items():
        lst = _int_list(rids)
        if lst is None or not lst or any(r not in rollouts or r in seen or rollouts[r].group != g for r in lst):
            raise _bad(("groups", g), "distinct ids of held rollouts whose records name this group", rids)
        seen.update(lst)
        groups[int(g)] = lst
    if len(seen) != len(rollouts):
        lost = sorted(set(rollouts) - seen)
        raise _bad("groups", "every held rollout in its group", f"rollouts {lost} in no group")
    counters = _int_list(s["counters"])
    if counters is None or len(counters) != 4 or min(counters) < 0:
        raise _bad("counters", "4 ints >= 0 (next rollout, group, request ids; off-policy tokens)", s["counters"])
    if counters[0] <= max(rollouts, default=-1) or counters[1] <= max(groups, default=-1):
        raise _bad("counters", "next ids past every held rollout and group id", s["counters"])
    running: dict[int, int] = {}
    pairs = s["running"]
    if not isinstance(pairs, (list, tuple)):
        raise _bad("running", "a list of [request id, rollout id] pairs", pairs)
    for pair in pairs:
        qr = _int_list(pair)
        if qr is None or len(qr) != 2 or qr[0] in running or not 0 <= qr[0] < counters[2]:
            raise _bad("running", "[request id, rollout id] pairs with distinct issued request ids", pair)
        if qr[1] not in rollouts or rollouts[qr[1]].status != _RUNNING or qr[1] in running.values():
            raise _bad("running", "requests of held, running rollouts (one each)", f"the pair {qr}")
        running[qr[0]] = qr[1]
    if sum(rec.status == _RUNNING for rec in rollouts.values()) != len(running):
        raise _bad("running", "one request for every rollout whose status is running", pairs)
    aborted = _int_list(s["aborted"])
    if aborted is None:
        raise _bad("aborted", "a list of rollout ids", s["aborted"])
    removed: list[tuple[int, int, int, int]] = []
    if not isinstance(s["removed"], (list, tuple)):
        raise _bad("removed", "a list of [rollout, prompt, group, reason] lists", s["removed"])
    for item in s["removed"]:
        row = _int_list(item)
        if row is None or len(row) != 4 or not 0 <= row[3] < len(REMOVAL_REASONS):
            raise _bad("removed", "[rollout, prompt, group, reason] lists of ints (a known reason)", item)
        removed.append((row[0], row[1], row[2], row[3]))
    version = s["version"]
    if version is not None and not _is_int(version):
        raise _bad("version", "None or an int", version)
    if not isinstance(s["open"], bool):
        raise _bad("open", "a bool", s["open"])
    return {
        "rollouts": rollouts,
        "groups": groups,
        "running": running,
        "aborted": aborted,
        "removed": removed,
        "counters": tuple(counters),
        "version": version,
        "open": s["open"],
    }


class _PartialCheckpoint:
    """The checkpoint of a :class:`~rolloutopt.control.PartialScheduler` (mixed into it): :meth:`state_dict` and
    :meth:`load_state_dict`, which validates every field (with :func:`_parse_state`) before assigning any.

    A scheduler provides ``_config`` (its constructor's arguments), ``_extra_keys``/``_extra_state``/
    ``_load_extra`` (its own queues) and may override ``_check_extra`` (their semantic checks).
    """

    _extra_keys: ClassVar[tuple[str, ...]] = ()
    n_samples_per_prompt: int
    _rollouts: dict[int, _Rollout]
    _groups: dict[int, list[int]]
    _running: dict[int, int]
    _aborted: list[int]
    _removed: list[tuple[int, int, int, int]]
    _next_rollout: int
    _next_group: int
    _next_request: int
    _total_off_policy: int
    _version: int | None
    _open: bool

    def _config(self) -> dict[str, Any]:
        raise NotImplementedError

    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra(self, state: dict[str, Any]) -> None:
        pass

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue identically: tensors and plain Python containers (``torch.save``-able)."""
        rollouts = {
            r: {
                k: (v.clone() if isinstance(v, Tensor) else v)
                for k, v in ((k, getattr(rec, k)) for k in _ROLLOUT_FIELDS)
            }
            for r, rec in self._rollouts.items()
        }
        return dump_state(
            {
                "kind": type(self).__name__,
                "config": self._config(),
                "rollouts": rollouts,
                "groups": {g: list(rids) for g, rids in self._groups.items()},
                "running": [[q, r] for q, r in self._running.items()],
                "aborted": list(self._aborted),
                "removed": [list(x) for x in self._removed],
                "counters": [self._next_rollout, self._next_group, self._next_request, self._total_off_policy],
                "version": self._version,
                "open": self._open,
                "extra": self._extra_state(),
            }
        )

    STATE: ClassVar[dict[str, Field]] = {
        "kind": Field("any"),  # the class name: must be this class's
        "config": Field("any"),  # the constructor's arguments: must equal this scheduler's
        # the records, id tables and queues below are ragged containers: _parse_state checks each one
        "rollouts": Field("any"),
        "groups": Field("any"),
        "running": Field("any"),
        "aborted": Field("any"),
        "removed": Field("any"),
        "counters": Field("any"),
        "version": Field("any"),
        "open": Field("any"),
        "extra": Field("any"),
    }
    """The declared fields of :meth:`state_dict` (validated by :meth:`load_state_dict`)."""

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a :meth:`state_dict` of a scheduler of the same class and configuration.

        Validated before anything is assigned (an ``InputError`` names the bad field): the keys and the format
        version, every rollout record (fields, tensor kinds, one length for tokens/logp/versions), the groups
        (each rollout in exactly the group its record names), the running requests (known rollouts, status
        running), the counters (past every id) and the subclass's queues.
        """
        name = type(self).__name__
        s = load_state(state, self.STATE, name)
        if s["kind"] != name or s["config"] != self._config():
            raise InputError(
                "state",
                f"the state of a {name} with config {self._config()}",
                f"{s['kind']} with config {s['config']}",
                "construct the scheduler with the same arguments",
            )
        parsed = _parse_state(s, self.n_samples_per_prompt, name)
        rollouts, groups = parsed["rollouts"], parsed["groups"]
        extra = s["extra"]
        if not isinstance(extra, dict) or set(extra) != set(self._extra_keys):
            raise InputError("state['extra']", f"keys {self._extra_keys}", describe(extra), "pass state_dict()")
        for key, value in extra.items():
            ok = _int_list(value) is not None if key != "remaining" else _is_int(value) and value >= 0
            if not ok:
                raise InputError(f"state['extra'][{key!r}]", "a list of ints", describe(value), "pass state_dict()")
        self._check_extra(extra, rollouts, groups)
        self._rollouts, self._groups = rollouts, groups
        self._running, self._aborted, self._removed = parsed["running"], parsed["aborted"], parsed["removed"]
        self._next_rollout, self._next_group, self._next_request, self._total_off_policy = parsed["counters"]
        self._version, self._open = parsed["version"], parsed["open"]
        self._load_extra(extra)

    def _check_extra(self, extra: dict[str, Any], rollouts: dict[int, _Rollout], groups: dict[int, list[int]]) -> None:
        """Semantic checks of the subclass's own state (ids that must name held rollouts or groups)."""
