"""``rolloutopt.distributed.global_denominators`` on two CPU processes (gloo) and without torch.distributed.

Each rank holds a different ragged micro-batch (different B and T, empty rows, a group with no token). The
global counts must be those of the concatenated batch, and ``aggregate(..., denominators=d)`` on each rank,
averaged over ranks as DDP averages gradients, must equal the aggregate of the concatenated batch for every
mode (groups are kept on one rank, as verl and TRL do).
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
from hypothesis import given
from hypothesis import strategies as st

import rolloutopt
from rolloutopt.distributed import global_denominators
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups
from rolloutopt.losses import AGG_MODES, Denominators, aggregate

WORLD = 2
MAX_LEN = 6  # Dr.GRPO's constant L_max for seq-mean-token-sum-norm


def micro_batch(rank: int) -> dict[str, torch.Tensor]:
    """Rank 0: B=4, T=5, one empty row and a group (13) with no token. Rank 1: B=3, T=3."""
    if rank == 0:
        mask = torch.tensor(
            [
                [1, 1, 1, 0, 0],
                [1, 1, 1, 1, 1],
                [1, 0, 0, 0, 0],
                [0, 0, 0, 0, 0],
            ],
            dtype=torch.bool,
        )
        group = torch.tensor([10, 11, 10, 13])
        seq_weight = torch.tensor([1.0, 0.0, 0.5, 1.0])  # row 1 (group 11's only row) leaves every count
    else:
        mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]], dtype=torch.bool)
        group = torch.tensor([20, 20, 21])
        seq_weight = torch.tensor([2.0, 1.0, 1.0])
    gen = torch.Generator().manual_seed(100 + rank)
    per_token = torch.randn(mask.shape, generator=gen, dtype=torch.float64)
    return {"mask": mask, "group": group, "seq_weight": seq_weight, "per_token": per_token}


def concatenated() -> dict[str, torch.Tensor]:
    parts = [micro_batch(r) for r in range(WORLD)]
    width = max(p["mask"].shape[1] for p in parts)

    def pad(x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.pad(x, (0, width - x.shape[1]))

    return {
        "mask": torch.cat([pad(p["mask"]) for p in parts]),
        "per_token": torch.cat([pad(p["per_token"]) for p in parts]),
        "group": torch.cat([p["group"] for p in parts]),
        "seq_weight": torch.cat([p["seq_weight"] for p in parts]),
    }


def _worker(rank: int, port: int, out_dir: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    try:
        b = micro_batch(rank)
        d = global_denominators(b["mask"], group=b["group"])
        d_plain = global_denominators(b["mask"])
        d_weighted = global_denominators(b["mask"], group=Groups(b["group"]), seq_weight=b["seq_weight"])
        d_sub = global_denominators(b["mask"], group=b["group"], process_group=dist.new_group([0, 1]))
        losses = {
            mode: aggregate(b["per_token"], b["mask"], mode, denominators=d, group=b["group"], max_len=MAX_LEN)
            for mode in AGG_MODES
        }
        result: dict[str, Any] = {
            "d": d,
            "d_plain": d_plain,
            "d_weighted": d_weighted,
            "d_sub": d_sub,
            "losses": losses,
        }
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def counts(d: Denominators) -> list[float | None]:
    return [None if v is None else float(v) for v in (d.tokens, d.sequences, d.groups)]


@pytest.mark.slow
def test_two_ranks_gloo(tmp_path: Path) -> None:
    ctx = mp.start_processes(_worker, args=(free_port(), str(tmp_path)), nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + 120
    while not ctx.join(timeout=1):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two gloo ranks did not finish within 120 s")
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]

    full = concatenated()
    # concatenated batch: 9 + 5 tokens; 5 non-empty rows; groups 10, 11, 20 (13 and 21 have no token)
    want = [float(full["mask"].sum()), float((full["mask"].sum(-1) > 0).sum()), 3.0]
    assert want == [14.0, 5.0, 3.0]
    # seq_weight 0 on rank 0's row 1 removes its 5 tokens, the row and group 11
    want_weighted = [9.0, 4.0, 2.0]
    for res in results:
        assert counts(res["d"]) == want
        assert counts(res["d_sub"]) == want
        assert counts(res["d_plain"]) == [*want[:2], None]
        assert counts(res["d_weighted"]) == want_weighted
        for d in (res["d"], res["d_plain"], res["d_weighted"]):
            assert d.world_size == WORLD
            assert d.tokens.dtype == torch.float32 and d.tokens.ndim == 0

    for mode in AGG_MODES:
        ddp_mean = torch.stack([res["losses"][mode] for res in results]).mean()
        reference = aggregate(full["per_token"], full["mask"], mode, group=full["group"], max_len=MAX_LEN)
        torch.testing.assert_close(ddp_mean, reference, rtol=1e-6, atol=1e-6, msg=f"mode {mode}")
    # without the global denominators the rank average is not the global loss (the test can tell them apart)
    b0, b1 = micro_batch(0), micro_batch(1)
    local = (aggregate(b0["per_token"], b0["mask"]) + aggregate(b1["per_token"], b1["mask"])) / 2
    assert not torch.allclose(local, aggregate(full["per_token"], full["mask"]))


def test_fallback_without_distributed() -> None:
    assert not dist.is_initialized()
    b = micro_batch(0)
    d = global_denominators(b["mask"], group=b["group"])
    assert counts(d) == [9.0, 3.0, 2.0]  # groups 10 and 11; group 13 has no token
    assert d.world_size == 1
    assert d.tokens.dtype == d.sequences.dtype == torch.float32
    assert d.tokens.device == b["mask"].device
    assert counts(global_denominators(b["mask"])) == [9.0, 3.0, None]
    # with local denominators, aggregate is unchanged
    for mode in ("token-mean", "seq-mean-token-mean", "prompt-mean"):
        torch.testing.assert_close(
            aggregate(b["per_token"], b["mask"], mode, denominators=d, group=b["group"]),
            aggregate(b["per_token"], b["mask"], mode, group=b["group"]),
        )


def test_seq_weight_zero_rows_leave_the_counts() -> None:
    b = micro_batch(0)
    d = global_denominators(b["mask"], group=b["group"], seq_weight=b["seq_weight"])
    assert counts(d) == [4.0, 2.0, 1.0]  # row 1 (5 tokens, group 11) is gone; only group 10 is left
    d = global_denominators(b["mask"].long(), seq_weight=torch.zeros(4, dtype=torch.bfloat16))
    assert counts(d) == [0.0, 0.0, None]
    d = global_denominators(b["mask"], seq_weight=torch.tensor([-1.0, 1e-8, 1.0, 1.0]))  # nonzero weights count
    assert counts(d) == [9.0, 3.0, None]


def test_bad_input() -> None:
    b = micro_batch(0)
    with pytest.raises(InputError, match=r"^mask: "):
        global_denominators(b["mask"][0])
    with pytest.raises(InputError, match=r"^mask: .*0 and 1"):
        global_denominators(b["mask"].float() * 2)
    with pytest.raises(InputError, match=r"^seq_weight: .*B=4"):
        global_denominators(b["mask"], seq_weight=torch.ones(3))
    with pytest.raises(InputError, match=r"^group: "):
        global_denominators(b["mask"], group=torch.tensor([1, 2, 3]))
    with pytest.raises(InputError, match=r"^group: "):
        global_denominators(b["mask"], group=torch.tensor([1.0, 2.0, 3.0, 4.0]))
    with rolloutopt.checks(False):
        assert counts(global_denominators(b["mask"].long())) == [9.0, 3.0, None]


@given(st.integers(1, 6), st.integers(1, 6), st.data())
def test_local_counts_property(b: int, t_: int, data: st.DataObject) -> None:
    mask = torch.tensor(data.draw(st.lists(st.lists(st.booleans(), min_size=t_, max_size=t_), min_size=b, max_size=b)))
    group = torch.tensor(data.draw(st.lists(st.integers(0, 3), min_size=b, max_size=b)))
    weight = torch.tensor(data.draw(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=b, max_size=b)))
    d = global_denominators(mask, group=group, seq_weight=weight)
    counted = mask & (weight != 0)[:, None]
    rows = [i for i in range(b) if counted[i].any()]
    assert float(d.tokens) == int(counted.sum())
    assert float(d.sequences) == len(rows)
    assert float(d.groups) == len({int(group[i]) for i in rows})
    assert d.world_size == 1
    perm = torch.randperm(b)
    dp = global_denominators(mask[perm], group=group[perm], seq_weight=weight[perm])
    assert (float(dp.tokens), float(dp.sequences), float(dp.groups)) == (
        float(d.tokens),
        float(d.sequences),
        float(d.groups),
    )
