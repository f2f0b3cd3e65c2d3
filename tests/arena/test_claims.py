"""The papers' claims beside the arena's ratios: every key names a registered method of its family, every registered
method has a claim or is listed as a baseline without one, and each arXiv id is the one its registry names."""

from __future__ import annotations

import re

import pytest

from rolloutopt import advantages, allocators, control, losses
from rolloutopt.arena.claims import CLAIMS, NO_CLAIM, Claim, registered
from rolloutopt.arena.report import FAMILIES
from rolloutopt.control import posthoc
from rolloutopt.errors import InputError


def reference(family: str, method: str) -> str:
    """The registry's reference text of a method."""
    if family == "allocator":
        return allocators.entry(method).reference
    if family == "estimator":
        return advantages.entry(method).reference
    if family == "loss":
        return losses.entry(method).reference
    return (control.entry(method) if method in control.names() else posthoc.entry(method)).reference


def test_every_key_is_a_registered_method_of_an_arena_family() -> None:
    for family, method in CLAIMS:
        assert family in FAMILIES
        assert method in registered(family), (family, method)
    with pytest.raises(InputError, match="family"):
        registered("shaper")


def test_every_registered_method_has_a_claim_or_is_a_listed_baseline() -> None:
    for family in FAMILIES:
        for method in registered(family):
            assert ((family, method) in CLAIMS) != ((family, method) in NO_CLAIM), (family, method)
    assert set(NO_CLAIM) == {(f, FAMILIES[f].baseline) for f in FAMILIES}
    assert "none" not in registered("stop")  # the stop family's baseline is no rule, not a registered method


def test_arxiv_ids_are_the_registries() -> None:
    """A claim's arXiv id appears in its registry's reference; an empty id only where the reference names none."""
    for (family, method), claim in CLAIMS.items():
        ref = reference(family, method)
        ids = re.findall(r"\d{4}\.\d{5}", ref)
        if claim.arxiv:
            assert claim.arxiv in ids, (family, method, ref)
        else:
            assert not ids, (family, method, ref)


def test_claims_are_short_and_numbers_only_where_quantitative() -> None:
    for key, claim in CLAIMS.items():
        assert isinstance(claim, Claim) and 0 < len(claim.text) <= 120, key
        if not claim.quantitative:  # a qualitative claim quotes no speed-up or percentage
            assert not re.search(r"\d+(\.\d+)?\s*(%|x\b)", claim.text), key
    quantitative = {k for k, c in CLAIMS.items() if c.quantitative}
    assert ("allocator", "ar3po") in quantitative and ("stop", "dot") in quantitative
