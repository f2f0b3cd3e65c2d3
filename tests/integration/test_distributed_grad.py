"""Data-parallel gradients with ``rolloutopt.distributed`` on two CPU processes (gloo), against one process.

A tiny model (``torch.nn.Linear`` from per-token features to the logits of a 5-token vocabulary, float64,
identical weights on both ranks) scores a ragged micro-batch per rank (rank 0: B=4, T=5 with an empty row and
a row of ``seq_weight`` 0; rank 1: B=3, T=3; each prompt's rollouts on one rank). For every aggregation mode and
a set of presets, each rank computes its loss with ``global_denominators(...)``; then

- the sum over ranks of the per-rank gradients equals ``world_size`` × the gradient of the single-process loss
  on the concatenated batch (``Denominators.world_size`` multiplies each rank's loss), and
- under ``DistributedDataParallel`` (which averages gradients) each rank's gradient equals the single-process
  gradient itself.

Presets with a batch-level statistic (M2PO's second moment, SAT's staleness quantile) compute it per rank, so
there the equality does NOT hold (asserted: the gradients differ), and holds again when the trust region is
wrapped in :class:`rolloutopt.distributed.GlobalBatchTrust`. The seed helpers are checked on the same ranks.
"""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.parallel import DistributedDataParallel

from rolloutopt import losses
from rolloutopt.distributed import GlobalBatchTrust, global_denominators, rank_generator, rank_seed
from rolloutopt.errors import InputError
from rolloutopt.losses import AGG_MODES
from rolloutopt.ratios import M2POClip, PPOClip

WORLD = 2
MAX_LEN = 6  # Dr.GRPO's constant L_max for seq-mean-token-sum-norm
VOCAB, FEAT = 5, 4
SEED = 1234
# per-token presets: the per-rank losses with global denominators sum to the global loss exactly
EXACT = ("grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo", "tis", "icepop", "opsm", "decoupled_ppo", "echo_clip")
# presets whose trust region reads a statistic of the whole batch
BATCH_STAT = ("m2po_clip", "m2po", "sat")
EXPERIMENTAL = {"sat"}
# GSPO's band is 3e-4 / 4e-4 around the sequence ratio: a smaller policy lag keeps some sequences unclipped
OLD_SCALE = {"gspo": 1e-3}
# wrapped in GlobalBatchTrust: the batch-statistic presets, and ECHO (per rollout; gathers the [B] confidence)
WRAPPED = (*BATCH_STAT, "echo_clip")


def micro_batch(rank: int) -> dict[str, torch.Tensor]:
    """Rank 0: B=4, T=5, an empty row, a row with seq_weight 0, little engine mismatch. Rank 1: B=3, T=3."""
    if rank == 0:
        mask = torch.tensor(
            [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0]],
            dtype=torch.bool,
        )
        group = torch.tensor([10, 10, 11, 11])
        seq_weight = torch.tensor([1.0, 0.5, 1.0, 0.0], dtype=torch.float64)
        old_scale, behav_scale = 0.3, 0.05
    else:
        mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]], dtype=torch.bool)
        group = torch.tensor([20, 20, 20])
        seq_weight = torch.tensor([1.0, 2.0, 1.0], dtype=torch.float64)
        old_scale, behav_scale = 0.6, 0.6
    b, t = mask.shape
    gen = torch.Generator().manual_seed(100 + rank)
    out = {
        "mask": mask,
        "group": group,
        "seq_weight": seq_weight,
        "features": torch.randn(b, t, FEAT, generator=gen, dtype=torch.float64),
        "ids": torch.randint(0, VOCAB, (b, t), generator=gen),
        "old_shift": old_scale * torch.randn(b, t, generator=gen, dtype=torch.float64),
        "behav_shift": behav_scale * torch.randn(b, t, generator=gen, dtype=torch.float64),
        "advantages": torch.randn(b, generator=gen, dtype=torch.float64),
        "confidence": torch.rand(b, generator=gen, dtype=torch.float64),
    }
    # SAT: rank 0's token (1, 0) is its stalest (|old - behav| = 0.5, in rank 0's 5% tail, so its upper clip
    # bound contracts to ~1.03) but not the global batch's (rank 1 holds a staler token, 1.5); its ratio
    # exp(0.1) with A > 0 is then clipped on rank 0 alone and unclipped in the single process.
    if rank == 0:
        out["behav_shift"][1, 0], out["old_shift"][1, 0], out["advantages"][1] = -0.5, -0.1, 1.0
    else:
        out["behav_shift"][1, 1] = 1.5
    return out


def concatenated() -> dict[str, torch.Tensor]:
    parts = [micro_batch(r) for r in range(WORLD)]
    width = max(p["mask"].shape[1] for p in parts)
    out: dict[str, torch.Tensor] = {}
    for key in parts[0]:
        xs = [p[key] for p in parts]
        if xs[0].ndim >= 2:  # [B, T, ...]: pad T
            xs = [torch.nn.functional.pad(x, (0, 0) * (x.ndim - 2) + (0, width - x.shape[1])) for x in xs]
        out[key] = torch.cat(xs)
    return out


def make_model() -> torch.nn.Linear:
    model = torch.nn.Linear(FEAT, VOCAB, dtype=torch.float64)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        model.weight.copy_(torch.randn(VOCAB, FEAT, generator=gen, dtype=torch.float64))
        model.bias.copy_(torch.randn(VOCAB, generator=gen, dtype=torch.float64))
    return model


def loss_of(
    model: torch.nn.Module,
    b: dict[str, torch.Tensor],
    name: str,
    mode: str,
    denominators: Any = None,
    trust: Any = None,
    **overrides: Any,
) -> torch.Tensor:
    logits = model(b["features"])
    logp = torch.log_softmax(logits, -1).gather(-1, b["ids"][..., None])[..., 0]
    old = (logp.detach() + OLD_SCALE.get(name, 1.0) * b["old_shift"]).clamp(max=0.0)  # log-probs are <= 0
    inputs: dict[str, Any] = {
        "group": b["group"],
        "max_len": MAX_LEN,
        "behav_logp": (old + b["behav_shift"]).clamp(max=0.0),
        "confidence": b["confidence"],
    }
    kw: dict[str, Any] = {"agg": mode, "denominators": denominators, "seq_weight": b["seq_weight"]}
    if trust is not None:
        kw["trust"] = trust
    if name in EXPERIMENTAL:
        kw["experimental"] = True
    kw.update(overrides)
    preset = losses.get(name)
    stages = {k: v for k, v in {**preset.config, **kw}.items() if k in ("ratio", "trust", "correction", "proximal")}
    requires, accepts = losses.declared_inputs(**stages, agg=mode)
    kw.update({k: v for k, v in inputs.items() if k in requires or k in accepts})  # what the loss consumes
    return preset(logp, old, b["advantages"], b["mask"], **kw).loss


class _M2POClipReadingBehav:
    """M2POClip declaring optional inputs, so that they reach GlobalBatchTrust (policy_loss refuses a required or
    undeclared input on each rank before any communication)."""

    accepts = ("behav_logp", "x")  # and a stage input, which GlobalBatchTrust itself must refuse

    def __call__(self, *args: Any, ctx: Any = None) -> Any:
        return M2POClip()(*args, ctx=ctx)


def ddp_case(label: str, mode: str) -> bool:
    """Cases also run under DistributedDataParallel (all presets at token-mean; two presets at every mode)."""
    return mode == "token-mean" or label in ("grpo", "m2po_clip+global", "m2po_clip")


def grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]  # type: ignore[union-attr]


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        torch.set_num_threads(1)
        b = micro_batch(rank)
        d = global_denominators(b["mask"], group=b["group"], seq_weight=b["seq_weight"])
        plain = make_model()
        ddp = DistributedDataParallel(make_model())
        raw: dict[tuple[str, str], Any] = {}
        averaged: dict[tuple[str, str], Any] = {}
        cases = [(n, None) for n in (*EXACT, *BATCH_STAT)]
        cases += [(f"{n}+global", GlobalBatchTrust(losses.get(n).config["trust"])) for n in WRAPPED]
        for label, trust in cases:
            name = label.split("+")[0]
            for mode in AGG_MODES:
                plain.zero_grad()
                loss = loss_of(plain, b, name, mode, d, trust)
                loss.backward()
                raw[label, mode] = (loss.detach(), grads(plain))
                if ddp_case(label, mode):
                    ddp.zero_grad()
                    loss_of(ddp, b, name, mode, d, trust).backward()
                    averaged[label, mode] = grads(ddp)
        # removed_in_denominator=False: masked tokens leave the local denominator, but not the global count
        plain.zero_grad()
        loss_of(plain, b, "icepop", "token-mean", d, removed_in_denominator=False).backward()
        raw["icepop_removed", "token-mean"] = (None, grads(plain))
        # stage_inputs cannot be gathered: every rank raises before any collective
        try:
            loss_of_extra = losses.get("m2po_clip")
            logp = torch.zeros(b["mask"].shape, dtype=torch.float64)
            loss_of_extra(
                logp,
                logp,
                b["advantages"],
                b["mask"],
                trust=GlobalBatchTrust(_M2POClipReadingBehav()),
                stage_inputs={"x": 1},
            )
            extra_error = ""
        except InputError as e:
            extra_error = str(e)
        # optional inputs must agree across ranks: both ranks raise after the shape all-reduce
        try:
            logp = torch.zeros(b["mask"].shape, dtype=torch.float64)
            losses.policy_loss(
                logp,
                logp,
                b["advantages"],
                b["mask"],
                trust=GlobalBatchTrust(_M2POClipReadingBehav()),
                behav_logp=logp if rank == 0 else None,
            )
            mismatch_error = ""
        except InputError as e:
            mismatch_error = str(e)
        result = {
            "mismatch_error": mismatch_error,
            "raw": raw,
            "ddp": averaged,
            "extra_error": extra_error,
            "seed": rank_seed(SEED),
            "draw": torch.rand(4, generator=rank_generator(SEED)),
            "world_size": d.world_size,
        }
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_ranks(out: Path) -> list[dict[str, Any]]:
    ctx = mp.start_processes(_worker, args=(free_port(), str(out)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two gloo ranks did not finish within 120 s")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def single(name: str, mode: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradient of one process on the concatenated batch (local denominators)."""
    model = make_model()
    loss = loss_of(model, concatenated(), name, mode)
    loss.backward()
    return loss.detach(), grads(model)


def close(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.allclose(x, y, rtol=1e-10, atol=1e-12) for x, y in zip(a, b, strict=True))


@pytest.mark.slow
def test_two_ranks_gloo(tmp_path: Path) -> None:
    """One start of two ranks (the expensive part) checks everything below; each check names its case."""
    ranks = run_ranks(tmp_path)
    assert ranks[0]["world_size"] == ranks[1]["world_size"] == WORLD
    want = {(n, mode): single(n, mode) for n in (*EXACT, *BATCH_STAT) for mode in AGG_MODES}

    # 1. per-token presets, and batch-statistic presets wrapped in GlobalBatchTrust: exact equality
    for label in (*EXACT, *(f"{n}+global" for n in WRAPPED)):
        for mode in AGG_MODES:
            case = f"{label}/{mode}"
            want_loss, want_grad = want[label.split("+")[0], mode]
            assert any(float(g.abs().max()) > 1e-6 for g in want_grad), f"{case}: a zero gradient proves nothing"
            loss_sum = sum(r["raw"][label, mode][0] for r in ranks)
            torch.testing.assert_close(loss_sum, WORLD * want_loss, rtol=1e-10, atol=1e-12, msg=case)
            summed = [sum(gs) for gs in zip(*(r["raw"][label, mode][1] for r in ranks), strict=True)]
            for got, w in zip(summed, want_grad, strict=True):
                torch.testing.assert_close(got, WORLD * w, rtol=1e-10, atol=1e-12, msg=case)
            if ddp_case(label, mode):  # DDP averages: each rank holds the single-process gradient
                for r in ranks:
                    for got, w in zip(r["ddp"][label, mode], want_grad, strict=True):
                        torch.testing.assert_close(got, w, rtol=1e-10, atol=1e-12, msg=f"DDP {case}")

    # 2. M2PO / SAT statistics computed per rank: the data-parallel gradient is NOT the single-process one
    for name in BATCH_STAT:
        for mode in AGG_MODES:
            summed = [sum(gs) / WORLD for gs in zip(*(r["raw"][name, mode][1] for r in ranks), strict=True)]
            assert not close(summed, want[name, mode][1]), f"{name}/{mode} unexpectedly matches"
            if ddp_case(name, mode):
                assert close(ranks[0]["ddp"][name, mode], ranks[1]["ddp"][name, mode])
                assert close(ranks[0]["ddp"][name, mode], summed)

    # 3. removed_in_denominator=False (verl's folding of rejection masks into the denominator) is not exact with
    #    global_denominators: the counts are taken before IcePop's mask (here rank 1's token with exp(-1.5) < 0.5)
    model = make_model()
    loss_of(model, concatenated(), "icepop", "token-mean", removed_in_denominator=False).backward()
    summed = [sum(gs) / WORLD for gs in zip(*(r["raw"]["icepop_removed", "token-mean"][1] for r in ranks), strict=True)]
    assert not close(summed, grads(model))

    # 4. GlobalBatchTrust refuses stage_inputs on every rank (before any collective, so nothing hangs)
    for r in ranks:
        assert r["extra_error"].startswith("stage_inputs: ")
        assert r["mismatch_error"].startswith("ctx: ") and "behav_logp" in r["mismatch_error"]

    # 5. per-rank seeds: different, and reproducible outside the run
    seeds = [r["seed"] for r in ranks]
    assert seeds[0] != seeds[1]
    assert seeds == [rank_seed(SEED, rank) for rank in range(WORLD)]
    assert not torch.equal(ranks[0]["draw"], ranks[1]["draw"])
    for rank, r in enumerate(ranks):
        torch.testing.assert_close(r["draw"], torch.rand(4, generator=rank_generator(SEED, rank)))


def test_rank_seed_without_distributed() -> None:
    assert not dist.is_initialized()
    assert rank_seed(SEED) == rank_seed(SEED, 0) == rank_seed(SEED, rank=0)
    assert rank_seed(0, 1) != rank_seed(1, 0)  # unlike seed + rank
    assert rank_seed(SEED, 0) != SEED
    g1, g2 = rank_generator(3, 1), rank_generator(3, 1)
    assert torch.equal(torch.rand(3, generator=g1), torch.rand(3, generator=g2))
    torch.manual_seed(rank_seed(-5, 2))  # accepted by torch for negative and huge base seeds
    torch.manual_seed(rank_seed(2**80, 2))


@settings(max_examples=50, deadline=None)
@given(st.integers(-(2**70), 2**70), st.integers(0, 1000))
def test_rank_seed_property(seed: int, rank: int) -> None:
    s = rank_seed(seed, rank)
    assert 0 <= s < 2**63
    assert s == rank_seed(seed, rank)
    assert s != rank_seed(seed, rank + 1)


def test_rank_seed_bad_input() -> None:
    with pytest.raises(InputError, match=r"^seed: "):
        rank_seed(1.5)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"^seed: "):
        rank_seed(True)
    with pytest.raises(InputError, match=r"^rank: "):
        rank_seed(1, -1)
    with pytest.raises(InputError, match=r"^rank: "):
        rank_seed(1, 1.0)  # type: ignore[arg-type]


def test_global_batch_trust_without_distributed() -> None:
    """Without torch.distributed the wrapper is the wrapped trust region."""
    b = concatenated()
    for name in BATCH_STAT:
        inner = losses.get(name).config["trust"]
        want_loss, want = single(name, "token-mean")
        model = make_model()
        loss = loss_of(model, b, name, "token-mean", trust=GlobalBatchTrust(inner))
        loss.backward()
        torch.testing.assert_close(loss.detach(), want_loss, rtol=0, atol=0)
        assert close(grads(model), want)
    with pytest.raises(InputError, match=r"^GlobalBatchTrust.trust: "):
        GlobalBatchTrust(PPOClip(0.2, 0.2).low)  # type: ignore[arg-type]
