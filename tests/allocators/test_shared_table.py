"""Every allocator that keeps per-prompt state in a :class:`PromptTable` (its constructor takes ``table=``), on a
table it shares with a DEPO and a second instance of itself (``"<owner>#2"``), over overlapping candidate pools,
answering every signal it requires or accepts: the results and the learnt state of private tables; a checkpoint
(``table.state_dict()`` and each owner's ``state_dict()`` through ``torch.save``/``torch.load(weights_only=True)``)
restores owners built afresh on a fresh table that go on identically; a private table's state and a shared
table's do not load into each other, nor one owner's into another; ``capacity=`` with ``table=`` is refused.

What one allocator adds to this (its own columns' checks, eviction by hand, a shared table with particular
owners or configurations) is tested in its own file, with the drivers of :mod:`.table_helpers`.
"""

from __future__ import annotations

from typing import Any

import pytest

import rolloutopt.allocators as allocators

from .table_helpers import TABLE_NAMES, build, check_shared_table, check_states_do_not_mix, in_turn, partner


def test_the_allocators_with_a_prompt_table_are_all_tested() -> None:
    """The parametrization is over every registered allocator whose constructor takes ``table=``: a new one is
    tested here without being listed, and none drops out unnoticed."""
    assert TABLE_NAMES == [
        "aero",
        "ar3po",
        "coba",
        "depo",
        "dots",
        "dps",
        "e3_budget",
        "greso",
        "hive",
        "knapsack",
        "prompt_gdro",
        "rollout_gdro",
        "v05_budget",
    ]
    assert set(TABLE_NAMES) < set(allocators.names())


@pytest.mark.parametrize("name", TABLE_NAMES)
def test_a_shared_table_gives_the_private_tables_results_and_reloads(name: str) -> None:
    def make(table: Any) -> Any:
        return build(name, table)

    shared = check_shared_table([make, partner, make], in_turn())
    (own,) = shared.owners[0]  # the allocator's name in a table
    second, third = ("depo#2", "depo#3") if own == "depo" else ("depo", f"{own}#2")
    assert shared.table.owners == (own, second, third)


@pytest.mark.parametrize("name", TABLE_NAMES)
def test_private_and_shared_states_do_not_mix(name: str) -> None:
    check_states_do_not_mix(lambda **kwargs: build(name, **kwargs), in_turn())
