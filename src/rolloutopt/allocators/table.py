"""The prompt table: one bounded, vectorised per-prompt store that several allocators share and a checkpoint
holds once.

Allocators that learn across steps keep facts per prompt (success counts, reward windows, EMAs, Beta posteriors,
scores, last-seen steps, expected response lengths, ...). A :class:`PromptTable` holds them all in dense columns
aligned with one sorted int64 id column, so that a lookup of 100k ids is one ``torch.searchsorted`` and a
gather per column, never a Python loop over prompts. Each allocator *registers* its columns under its own name
(:meth:`PromptTable.register` returns a :class:`TableColumns` view), so two allocators can share one table
without seeing each other's columns, and ``table.state_dict()`` checkpoints every column of every owner once.

Without ``table=`` an allocator builds a private table (capacity 1,000,000) and its ``state_dict`` nests it; with
a shared table the allocator's ``state_dict`` holds only its own scalars and the table is saved once, by the
caller::

    table = PromptTable(capacity=200_000)
    greso, dps = GRESO(n=8, table=table), DPS(n=8, table=table)
    ckpt = {"table": table.state_dict(), "greso": greso.state_dict(), "dps": dps.state_dict()}
    ...
    table = PromptTable(capacity=200_000)
    greso, dps = GRESO(n=8, table=table), DPS(n=8, table=table)   # same owners, same order
    table.load_state_dict(ckpt["table"]); greso.load_state_dict(ckpt["greso"]); dps.load_state_dict(ckpt["dps"])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch
from jaxtyping import Bool
from torch import Tensor

from rolloutopt._state import Field, dump_state, load_state
from rolloutopt._validation import check_int, describe
from rolloutopt.allocators._ids import _locate, _lookup
from rolloutopt.errors import InputError
from rolloutopt.typing import IntP

__all__ = ["Column", "PromptTable", "TableColumns"]

Kind = Literal["float", "int", "bool"]
_DTYPES = {"float": torch.float64, "int": torch.long, "bool": torch.bool}


@dataclass(frozen=True)
class Column:
    """A column an allocator registers in a :class:`PromptTable`.

    ``kind``: ``"float"`` (float64), ``"int"`` (int64) or ``"bool"``; ``shape``: the trailing sizes of one
    prompt's entry (``()`` for a scalar, ``(W,)`` for a window of ``W`` values); ``fill``: the value of a new
    row (a prompt the owner has not seen yet: a NaN fill marks "unknown"); ``checks``: what a loaded checkpoint
    must satisfy (``"finite"``, ``"finite_or_nan"``, ``"nonneg"``, ``"prob"``; see
    :class:`~rolloutopt._state.Field`).
    """

    kind: Kind
    shape: tuple[int, ...] = ()
    fill: float | int | bool = 0
    checks: tuple[Any, ...] = ()

    def __post_init__(self) -> None:
        if self.kind not in _DTYPES:
            raise InputError("kind", "'float', 'int' or 'bool'", repr(self.kind), "pass Column('float')")
        if not isinstance(self.shape, tuple) or not all(type(d) is int and d >= 1 for d in self.shape):
            raise InputError("shape", "a tuple of sizes >= 1", describe(self.shape), "pass e.g. shape=(8,)")
        if not isinstance(self.fill, (int, float)):
            raise InputError("fill", "a number or a bool", describe(self.fill), "pass e.g. fill=0")
        if not set(self.checks) <= {"finite", "finite_or_nan", "nonneg", "prob"}:
            raise InputError(
                "checks", "a tuple of 'finite', 'finite_or_nan', 'nonneg', 'prob'", repr(self.checks), "drop the rest"
            )


class PromptTable:
    r"""A bounded per-prompt store keyed by stable int64 prompt ids, with columns registered by its owners.

    Rows are sorted by prompt id (lookup: ``torch.searchsorted``; insertion: one merge and one permutation of
    every column). A row exists once any owner has added the prompt (:meth:`TableColumns.add`); each owner also
    has its own ``seen`` flag, so a prompt another owner added is still unseen for this one.

    **Capacity and eviction.** At most ``capacity`` rows are stored (memory :math:`O(\mathrm{capacity} \cdot
    \sum \text{column widths})`). When an :meth:`TableColumns.add` brings new prompts into a full table, the
    rows *least recently added* (by any owner; an internal counter of ``add`` calls, ties toward the smaller
    id) are evicted first, never a prompt of the call itself. Eviction removes the row for every owner: the
    prompt is unseen again everywhere. One ``add`` with more than ``capacity`` distinct prompts raises.

    **Checkpoints.** :meth:`state_dict` holds the ids, the recency counter and every registered column;
    :meth:`load_state_dict` requires the same owners with the same columns (register them first, by
    constructing the same allocators with this table in the same order) and validates every column (an
    ``InputError`` names the bad one). The capacity of a loaded table may differ from the saved one as long as
    the saved rows fit.

    The layout and the eviction rule are this library's (the papers each keep a private per-prompt dict).

    Args:
        capacity: maximum number of stored prompts (default 1,000,000).
    """

    def __init__(self, *, capacity: int = 1_000_000) -> None:
        self.capacity = check_int(capacity, "capacity", 1)
        self._ids = torch.zeros(0, dtype=torch.long)
        self._touch = torch.zeros(0, dtype=torch.long)
        self._clock = 0
        self._specs: dict[str, Column] = {}
        self._cols: dict[str, Tensor] = {}
        self._owners: list[str] = []

    # -- owners ---------------------------------------------------------------------------------------------
    def register(self, owner: str, columns: dict[str, Column]) -> TableColumns:
        """Register ``columns`` under ``owner`` and return the owner's view.

        ``owner`` is made unique (``"greso"``, then ``"greso#2"`` for a second GRESO on the same table), so the
        order in which owners register must be the same when a checkpoint is loaded. The view adds a bool column
        ``seen``. Registering into a table that already holds rows fills the new columns with their ``fill``.
        """
        if not isinstance(owner, str) or not owner or "/" in owner:
            raise InputError("owner", "a non-empty str without '/'", describe(owner), "pass the allocator's name")
        if not isinstance(columns, dict):
            raise InputError("columns", "a dict name -> Column", describe(columns), "pass {'count': Column('int')}")
        for col, c in columns.items():
            if not isinstance(col, str) or not col or "/" in col or col == "seen":
                raise InputError(
                    "columns", "column names: non-empty str without '/', not 'seen'", repr(col), "rename it"
                )
            if not isinstance(c, Column) or c.kind not in _DTYPES:
                raise InputError(
                    f"columns[{col!r}]", "a Column of kind 'float', 'int' or 'bool'", describe(c), "pass Column(...)"
                )
        name, k = owner, 1
        while name in self._owners:
            k += 1
            name = f"{owner}#{k}"
        self._owners.append(name)
        spec = {"seen": Column("bool", fill=False), **columns}
        m = self._ids.numel()
        for col, c in spec.items():
            key = f"{name}/{col}"
            self._specs[key] = c
            self._cols[key] = torch.full((m, *c.shape), c.fill, dtype=_DTYPES[c.kind])
        return TableColumns(self, name)

    @property
    def owners(self) -> tuple[str, ...]:
        """The registered owners, in registration order."""
        return tuple(self._owners)

    @property
    def prompt_ids(self) -> IntP:
        """int64 ``[M]``: the stored prompt ids, sorted (read it, do not modify it)."""
        return self._ids

    def __len__(self) -> int:
        return int(self._ids.numel())

    # -- storage --------------------------------------------------------------------------------------------
    def _add(self, ids: Tensor, owner: str) -> tuple[Tensor, Tensor]:
        """Rows for ``ids`` (int64 ``[P]``, repeats allowed): insert the missing ones (evicting if full), mark them
        seen by ``owner`` and touched now. Returns ``(pos, order)``: the increasing rows of ``ids[order]``."""
        pos, found, order = _locate(self._ids, ids)
        self._clock += 1
        if not bool(found.all()):
            new_ids = _distinct(ids[order[~found]])  # sorted-query order: sorted
            stored = _distinct(pos[found]).numel()
            if new_ids.numel() + stored > self.capacity:  # refused before anything changes
                self._clock -= 1
                raise InputError(
                    "prompt_ids",
                    f"at most capacity={self.capacity} distinct prompts in one step",
                    f"{new_ids.numel() + stored} distinct prompts",
                    "construct the PromptTable with a larger capacity, or update in smaller batches",
                )
            self._touch.index_fill_(0, pos[found], self._clock)  # the call's stored rows are never evicted
            self._insert(new_ids)
            pos, found, order = _locate(self._ids, ids)
        self._touch.index_fill_(0, pos, self._clock)
        self._cols[f"{owner}/seen"].index_fill_(0, pos, True)
        return pos, order

    def _insert(self, new_ids: Tensor) -> None:
        """Insert the distinct ``new_ids`` (absent from the table), evicting the least recent rows if full."""
        k = new_ids.numel()
        overflow = self._ids.numel() + k - self.capacity
        keep = None
        if overflow > 0:
            # the rows of this call are the most recent after it: evict the least recent of the others (ties
            # toward the smaller id: the rows are sorted by id and the sort is stable)
            victims = torch.sort(self._touch, stable=True).indices[:overflow]
            keep = torch.ones(self._ids.numel(), dtype=torch.bool).index_fill_(0, victims, False)
        ids = self._ids if keep is None else self._ids[keep]
        merged, perm = torch.cat([ids, new_ids]).sort()
        self._ids = merged

        def grow(t: Tensor, fill: float | int | bool) -> Tensor:
            old = t if keep is None else t[keep]
            return torch.cat([old, torch.full((k, *t.shape[1:]), fill, dtype=t.dtype)]).index_select(0, perm)

        self._touch = grow(self._touch, 0)
        self._cols = {key: grow(t, self._specs[key].fill) for key, t in self._cols.items()}

    # -- checkpointing --------------------------------------------------------------------------------------
    @property
    def STATE(self) -> dict[str, Field]:  # noqa: N802 (the declared-state name every stateful object uses)
        """The declared fields of :meth:`state_dict` for the registered columns (``M`` stored prompts)."""
        cols = {key: Field(c.kind, ("M", *c.shape), tuple(c.checks)) for key, c in self._specs.items()}
        return {
            "prompt_ids": Field("int", ("M",), ("ids",)),
            "touch": Field("int", ("M",), ("nonneg",)),
            "clock": Field("integer", low=0),
            "columns": Field("nested", fields=cols),
        }

    def state_dict(self) -> dict[str, Any]:
        """The ids, the recency counter and every column of every owner (copies)."""
        return dump_state(
            {
                "prompt_ids": self._ids.clone(),
                "touch": self._touch.clone(),
                "clock": self._clock,
                "columns": {key: t.clone() for key, t in self._cols.items()},
            }
        )

    def load_state_dict(self, state: dict[str, Any], *, name: str = "state") -> None:
        """Restore a :meth:`state_dict` of a table with the same owners and columns, validated column by column."""
        s = load_state(state, self.STATE, "PromptTable", name=name)
        m = s["prompt_ids"].numel()
        if m > self.capacity:
            raise InputError(
                f"{name}['prompt_ids']",
                f"at most capacity={self.capacity} stored prompts",
                f"{m} prompts",
                "construct the PromptTable with the saved table's capacity",
            )
        if m and int(s["touch"].max()) > s["clock"]:
            raise InputError(f"{name}['touch']", f"values <= clock = {s['clock']}", "larger values", "pass state")
        self._ids, self._touch, self._clock = s["prompt_ids"], s["touch"], s["clock"]
        self._cols = dict(s["columns"])


def _distinct(x: Tensor) -> Tensor:
    """The distinct values of a sorted 1-d tensor."""
    keep = torch.ones(x.shape, dtype=torch.bool)
    keep[1:] = x[1:] != x[:-1]
    return x[keep]


class TableColumns:
    """One owner's view of a :class:`PromptTable`: its columns by short name, lookups and additions.

    Column tensors are replaced when rows are inserted: read them through the view (``view["alpha"]``) after
    every :meth:`add`, never keep one across steps. Writing in place (``view["alpha"].index_copy_(...)``) and
    replacing a whole column of the same shape (``view["alpha"] = t``) are both fine.
    """

    def __init__(self, table: PromptTable, owner: str, *, private: bool = False) -> None:
        self.table = table
        self.owner = owner
        self.private = private

    def __getitem__(self, name: str) -> Tensor:
        return self.table._cols[f"{self.owner}/{name}"]

    def __setitem__(self, name: str, value: Tensor) -> None:
        key = f"{self.owner}/{name}"
        old = self.table._cols[key]
        assert value.shape == old.shape and value.dtype == old.dtype, f"column {key}: {value.shape} {value.dtype}"
        self.table._cols[key] = value

    @property
    def empty(self) -> bool:
        """True while the table has no row at all (every lookup is then unseen)."""
        return self.table._ids.numel() == 0

    def find(self, ids: IntP) -> tuple[IntP, Bool[Tensor, " P"]]:
        """``(pos, seen)`` for ``ids`` (int64 ``[P]``) in the given order: rows, and whether this owner has seen
        the prompt (rows of unseen prompts are junk; mask them with ``seen``). The table must not be
        :attr:`empty`."""
        pos, found = _lookup(self.table._ids, ids)
        return pos, found & self["seen"].index_select(0, pos)

    def add(self, ids: IntP) -> tuple[IntP, IntP]:
        """Make rows for ``ids`` (int64 ``[P]``, repeats allowed), seen by this owner (new rows hold every
        column's fill); returns ``(pos, order)``: the increasing rows of ``ids[order]``."""
        return self.table._add(ids, self.owner)

    # -- the owner's checkpoint -----------------------------------------------------------------------------
    FIELD = Field("any")
    """The field under which an owner's ``state_dict`` stores :meth:`state` (validated by :meth:`load`)."""

    def state(self) -> dict[str, Any]:
        """What the owner's ``state_dict`` stores under ``"table"``: its name in the table and, for a private
        table, the table's whole state (a shared table is saved once, by the caller)."""
        return {"owner": self.owner, "rows": self.table.state_dict() if self.private else None}

    def load(self, value: Any, name: str = "state['table']") -> None:
        """Validate and restore what :meth:`state` saved: the same owner name, and the private table's state (a
        shared table is restored by the caller with ``table.load_state_dict``)."""
        fix = "pass the owner's state_dict()"
        if not isinstance(value, dict) or set(value) != {"owner", "rows"}:
            raise InputError(name, "a dict with keys 'owner' and 'rows'", describe(value), fix)
        if value["owner"] != self.owner:
            raise InputError(
                f"{name}['owner']",
                f"{self.owner!r}, this allocator's name in its table",
                repr(value["owner"]),
                "register the owners of a shared table in the order they had when the state was saved",
            )
        rows = value["rows"]
        if self.private:
            if rows is None:
                raise InputError(
                    f"{name}['rows']", "the private table's state", "None (saved with a shared table)", fix
                )
            self.table.load_state_dict(rows, name=f"{name}['rows']")
        elif rows is not None:
            raise InputError(
                f"{name}['rows']",
                "None: this allocator uses a shared table, which is restored with table.load_state_dict",
                "a private table's state",
                "construct the allocator without table= to load a state saved with a private table",
            )

    def incoming(self, value: Any, name: str = "state['table']") -> tuple[dict[str, Tensor], str]:
        """The owner's columns (by short name, ``"seen"`` included) that :meth:`load` of ``value`` would put in
        effect, for the checks across columns a :class:`Column` cannot state (a bin below ``num_bins``, a count
        at most a window, ...), made before anything is assigned; and the path that names them in an error
        (``f"{path}[{'owner/col'!r}]"``).

        A private table: its saved rows, validated as :meth:`load` validates them (a malformed ``value`` raises
        that ``InputError``). A shared table is restored by the caller first: its live columns.
        """
        if not self.private:
            return _owned(self, self.table._cols), "table.state_dict()['columns']"
        rows = value.get("rows") if isinstance(value, dict) and set(value) == {"owner", "rows"} else None
        if not isinstance(rows, dict) or value.get("owner") != self.owner:
            self.load(value, name)  # raises the InputError that names what is wrong
        s = load_state(rows, self.table.STATE, "PromptTable", name=f"{name}['rows']")
        return _owned(self, s["columns"]), f"{name}['rows']['columns']"


class TableOwner:
    """Mixin of the allocators that keep per-prompt state in a :class:`PromptTable` (as ``self._cols``)."""

    _cols: TableColumns

    @property
    def table(self) -> PromptTable:
        """The :class:`PromptTable` holding this allocator's per-prompt columns (private, or shared via
        ``table=``)."""
        return self._cols.table


def _owned(view: TableColumns, columns: dict[str, Tensor]) -> dict[str, Tensor]:
    prefix = f"{view.owner}/"
    return {key[len(prefix) :]: t for key, t in columns.items() if key.startswith(prefix)}


def open_table(table: Any, capacity: Any, owner: str, columns: dict[str, Column]) -> TableColumns:
    """The owner's view of ``table`` (a shared :class:`PromptTable`; ``capacity`` must then be None) or, for
    ``table=None``, of a private table of ``capacity`` rows (None: 1,000,000). An ``InputError`` otherwise."""
    if table is None:
        cap = 1_000_000 if capacity is None else check_int(capacity, "capacity", 1)
        t = PromptTable(capacity=cap)
        view = t.register(owner, columns)
        view.private = True
        return view
    if not isinstance(table, PromptTable):
        raise InputError("table", "a PromptTable or None", describe(table), "pass table=PromptTable() or omit it")
    if capacity is not None:
        raise InputError(
            "capacity", "None when table= is given (the shared table has its own)", repr(capacity), "drop capacity="
        )
    return table.register(owner, columns)
