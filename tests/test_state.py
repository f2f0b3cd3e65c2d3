"""State as data (``rolloutopt._state``): declared fields, one validation for every ``load_state_dict``."""

from __future__ import annotations

import io
import math

import pytest
import torch

from rolloutopt._state import FORMAT_KEY, Field, dump_state, load_state
from rolloutopt.errors import InputError

SPEC = {
    "ids": Field("int", ("M",), ("ids",)),
    "count": Field("int", ("M",), ("nonneg",)),
    "window": Field("float", ("M", 3), ("finite_or_nan",)),
    "rate": Field("float", ("M",), ("prob",)),
    "step": Field("integer", low=0),
    "mu": Field("real", low=0.0, high=1.0),
    "inner": Field("nested", fields={"s": Field("float", ("K",), ("finite",)), "t": Field("int", ("K",))}),
    "generator": Field("generator"),
    "new": Field("int", ("M",), optional=True),
}


def good() -> dict[str, object]:
    return dump_state(
        {
            "ids": torch.tensor([1, 5, 9], dtype=torch.int32),
            "count": torch.tensor([0, 2, 3]),
            "window": torch.tensor([[1.0, math.nan, 0.0]] * 3, dtype=torch.float32),
            "rate": torch.tensor([0.0, 0.5, 1.0]),
            "step": 4,
            "mu": 0.5,
            "inner": {"s": torch.ones(2), "t": torch.zeros(2, dtype=torch.long)},
            "generator": torch.Generator().manual_seed(0).get_state(),
        }
    )


def test_a_good_state_loads_as_canonical_copies_through_weights_only() -> None:
    state = good()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    out = load_state(torch.load(buf, weights_only=True), SPEC, "Owner")
    assert out["ids"].dtype == torch.long and out["ids"].tolist() == [1, 5, 9]
    assert out["window"].dtype == torch.float64 and math.isnan(float(out["window"][0, 1]))
    assert out["step"] == 4 and out["mu"] == 0.5 and out["inner"]["s"].tolist() == [1.0, 1.0]
    assert "new" not in out  # optional and absent: the owner supplies the default
    out["count"][0] = 7
    assert int(state["count"][0]) == 0  # copies: the caller's state is untouched
    assert FORMAT_KEY not in out and state[FORMAT_KEY] == 1
    no_version = {k: v for k, v in state.items() if k != FORMAT_KEY}
    load_state(no_version, SPEC, "Owner")  # saved before versions: loads as version 1


def _with(**changes: object) -> dict[str, object]:
    state = good()
    state.update(changes)
    return state


@pytest.mark.parametrize(
    ("state", "argument"),
    [
        ("not a dict", "state"),
        (_with(extra=1), "state"),  # unknown key
        ({k: v for k, v in good().items() if k != "ids"}, "state"),  # missing key
        (_with(format=2), "state['format']"),
        (_with(ids=torch.tensor([1, 9, 5])), "state['ids']"),  # not sorted
        (_with(ids=torch.tensor([1, 5, 5])), "state['ids']"),  # repeated
        (_with(ids=torch.tensor([1.0, 5.0, 9.0])), "state['ids']"),  # float ids
        (_with(count=torch.tensor([0, -1, 3])), "state['count']"),  # negative counter
        (_with(count=torch.tensor([0, 2])), "state['count']"),  # truncated: M is 3 from ids
        (_with(count="0 2 3"), "state['count']"),  # a string for a tensor
        (_with(window=torch.ones(3, 4)), "state['window']"),  # the fixed width 3
        (_with(window=torch.full((3, 3), math.inf)), "state['window']"),
        (_with(rate=torch.tensor([0.0, 1.5, 1.0])), "state['rate']"),
        (_with(rate=torch.tensor([0.0, math.nan, 1.0])), "state['rate']"),
        (_with(step=-1), "state['step']"),
        (_with(step=1.0), "state['step']"),
        (_with(step=True), "state['step']"),
        (_with(mu=math.nan), "state['mu']"),
        (_with(mu=2.0), "state['mu']"),
        (_with(inner={"s": torch.tensor([math.nan]), "t": torch.zeros(1, dtype=torch.long)}), "state['inner']['s']"),
        (_with(inner={"s": torch.ones(2), "t": torch.zeros(3, dtype=torch.long)}), "state['inner']['t']"),  # K
        (
            _with(inner={"s": torch.ones(2), "t": torch.zeros(2, dtype=torch.long), "format": 3}),
            "state['inner']['format']",
        ),
        (_with(inner="x"), "state['inner']"),
        (_with(generator=torch.zeros(3, dtype=torch.uint8)), "state['generator']"),
        (_with(generator=torch.zeros(3)), "state['generator']"),
        (_with(new=torch.zeros(2, dtype=torch.long)), "state['new']"),  # optional, but present: checked
    ],
)
def test_every_bad_field_is_an_input_error_naming_it(state: object, argument: str) -> None:
    with pytest.raises(InputError) as err:
        load_state(state, SPEC, "Owner")
    assert err.value.argument == argument
    assert "Owner.state_dict()" in err.value.fix
