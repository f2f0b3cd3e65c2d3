"""Checks across an owner's table columns before a checkpoint is loaded (:func:`incoming_columns`).

A :class:`~rolloutopt.allocators.PromptTable` validates each column alone (dtype, shape, ``Column.checks``); an
owner whose columns obey a rule the table cannot state (bins below ``num_bins``, a window count at most the window,
a stored step before the owner's step counter) checks it here, on the columns that loading would install, before
it assigns anything.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from rolloutopt._state import load_state
from rolloutopt.allocators.table import TableColumns
from rolloutopt.errors import InputError


def incoming_columns(view: TableColumns, value: Any, name: str = "state['table']") -> tuple[dict[str, Tensor], str]:
    """The owner's columns (by short name, ``"seen"`` included) that ``view.load(value)`` would install, and the
    path that names them in an error (``f"{path}[{'owner/col'!r}]"``).

    A private table's rows are validated here as ``view.load`` validates them (a malformed ``value`` raises the same
    ``InputError``), so the returned tensors are checked copies. A shared table is restored by the caller
    (``table.load_state_dict``) before the owners load their states: its live columns are returned.
    """
    prefix = f"{view.owner}/"
    if not view.private:
        cols = {key[len(prefix) :]: t for key, t in view.table._cols.items() if key.startswith(prefix)}
        return cols, "table.state_dict()['columns']"
    rows = value.get("rows") if isinstance(value, dict) and set(value) == {"owner", "rows"} else None
    if value is None or not isinstance(rows, dict) or value.get("owner") != view.owner:
        view.load(value, name)  # raises the InputError that names what is wrong
        raise InputError(name, "a table state", "no rows", "pass the owner's state_dict()")  # pragma: no cover
    s = load_state(rows, view.table.STATE, "PromptTable", name=f"{name}['rows']")
    cols = {key[len(prefix) :]: t for key, t in s["columns"].items() if key.startswith(prefix)}
    return cols, f"{name}['rows']['columns']"
