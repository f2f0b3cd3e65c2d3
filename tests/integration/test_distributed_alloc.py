"""Data-parallel allocators: two gloo ranks plan identically, each generates its shard, and they stay identical.

Every rank runs the same allocator (same plain seed) on the same candidate prompts; each request's rollouts are
split with ``request_shard``, each rank draws its share's rewards with its own ``rank_generator`` (the engine
samples differently per rank), and ``gather_rewards`` gives every rank all the rewards. After 20 steps the
allocators' state dicts, the results, and a PromptHistory fed the results must be identical on both ranks, and
equal to a single process that draws the same rewards in rank order.
"""

from __future__ import annotations

import itertools
import socket
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from rolloutopt import allocators as A
from rolloutopt.distributed import gather_rewards, rank_generator, request_shard
from rolloutopt.errors import InputError
from rolloutopt.testbed import PromptPopulation

WORLD = 2
STEPS = 20
BUDGET = 96


def make_allocators() -> dict[str, Any]:
    return {
        "dps": A.DPS(n=4, seed=3),
        "greso": A.GRESO(n=4, train_batch_size=8, sampling_batch_size=12, min_sampling_batch_size=4, seed=3),
        "vigor": A.VIGOR(n_init=2, experimental=True),
    }


def rewards_for(population: PromptPopulation, request: A.Request, rank: int, world: int, step: int) -> torch.Tensor:
    """This rank's share of the request's rewards, drawn from a per-rank, per-step generator."""
    flat = request.prompt_ids.repeat_interleave(request.counts)
    share = request_shard(request.total, rank=rank, world_size=world)
    ids = flat[share]
    gen = rank_generator(1000 + step, rank)
    return population.sample(ids, torch.ones_like(ids), gen)


def drive(full_rewards: Any) -> dict[str, Any]:
    """20 steps of every allocator; ``full_rewards(population, request, step)`` gives the request's rewards."""
    population = PromptPopulation(num_prompts=64, seed=5)
    pool = torch.arange(64)
    out: dict[str, Any] = {}
    for name, alloc in make_allocators().items():
        history = A.PromptHistory(capacity=128)
        results = []
        for step in range(STEPS):
            plan = alloc.plan(pool, BUDGET)
            while (req := plan.next()) is not None:
                plan.observe(req, full_rewards(population, req, step))
            res = plan.finish()
            alloc.update(res)
            history.update_from_result(res, step=step)
            results.append((res.prompt_ids, res.rewards, res.weight, res.counts))
        out[name] = {"state": alloc.state_dict(), "history": history.state_dict(), "results": results}
    return out


def single_process() -> dict[str, Any]:
    """The same run in one process: the full reward vector is every rank's share drawn in rank order."""
    return drive(
        lambda pop, req, step: torch.cat([rewards_for(pop, req, k, WORLD, step) for k in range(WORLD)]).double()
    )


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        out = drive(lambda pop, req, step: gather_rewards(rewards_for(pop, req, rank, WORLD, step), req.total))
        torch.save(out, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def assert_same(a: Any, b: Any, where: str = "") -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_same(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.slow
def test_two_ranks_allocators_stay_identical(tmp_path: Path) -> None:
    ctx = mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 180
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two gloo ranks did not finish within 180 s")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD))
    assert_same(r0, r1, "rank0 vs rank1")
    assert_same(r0, single_process(), "ranks vs single process")
    # not vacuous: the allocators learned something and the steps differ
    for name in r0:
        counts = [res[3] for res in r0[name]["results"]]
        assert any(not torch.equal(counts[0], c) for c in counts[1:]) or name == "vigor", name
        assert sum(res[1].numel() for res in r0[name]["results"]) > 0


def test_request_shard_covers_the_request_once() -> None:
    for total in range(0, 23):
        for world in (1, 2, 3, 5):
            shares = [request_shard(total, rank=k, world_size=world) for k in range(world)]
            assert shares[0].start == 0 and shares[-1].stop == total
            assert all(a.stop == b.start for a, b in itertools.pairwise(shares))
            sizes = [s.stop - s.start for s in shares]
            assert max(sizes) - min(sizes) <= 1


def test_gather_rewards_without_distributed_and_bad_input() -> None:
    local = torch.tensor([1.0, 0.0, 1.0])
    assert torch.equal(gather_rewards(local, 3), local.double())
    with pytest.raises(InputError, match="local"):
        gather_rewards(local, 4)
    with pytest.raises(InputError, match="local"):
        gather_rewards(torch.tensor([1, 0]), 2)
    with pytest.raises(InputError, match="total"):
        request_shard(-1)
    with pytest.raises(InputError, match="rank"):
        request_shard(4, rank=2, world_size=2)
