"""Shared helpers of the checkpoint stop-rule tests (Abstention, ARRoL): data, rule makers and a replay driver."""

from __future__ import annotations

from typing import Any

import torch

from rolloutopt.control import Abstention, ARRoL, replay

EXP = {"experimental": True}
NAN = float("nan")


def _data(n: int, t: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "values": torch.rand(n, t, generator=g),
        "scores": torch.rand(n, t, generator=g),
        "mask": torch.rand(n, t, generator=g) < 0.9,
        "group": torch.randint(0, 3, (n,), generator=g) * 10,
    }


def _abst() -> Abstention:
    return Abstention(r_abs=0.35, every=2, **EXP)


def _qhp() -> ARRoL:
    return ARRoL(dim=3, keep_frac=0.5, checkpoint=2, seed=5, **EXP)


def _replay(rule: Any, d: dict[str, torch.Tensor], use_scores: bool = True) -> Any:
    if isinstance(rule, Abstention):
        return replay(rule, values=d["values"], mask=d["mask"])
    if use_scores:
        return replay(rule, scores=d["scores"], mask=d["mask"], init={"group": d["group"]})
    feats = torch.zeros(*d["mask"].shape, 3)  # unused before the head is ready: the seeded draws decide
    return replay(rule, features=feats, mask=d["mask"], init={"group": d["group"]})
