"""Group advantages on 65,536 rollouts: rolloutopt's grpo/rloo against verl 0.9.1's estimators, in one run.

Cases: (a) equal groups of 8 in consecutive order (what a trainer with ``rollout.n = 8`` produces) and (b)
ragged groups of random sizes 1–32 in shuffled order (what allocators produce). T = 8 response tokens with
random lengths; verl takes ``token_level_rewards [B, T]`` and ``index``, a numpy object array of uid strings.

Baselines: verl's default estimators (``compute_grpo_outcome_advantage``, ``compute_rloo_outcome_advantage``:
Python loops over rows and ids) and its vectorised ones (``compute_grpo_vectorized_outcome_advantage``,
``compute_rloo_vectorized_outcome_advantage``). rolloutopt runs in the compatible mode (``singleton="raw"``
against verl's GRPO and loop RLOO, ``"zero"`` against vectorised RLOO) and the numbers are asserted equal
within 1e-5. Our time includes the reward sum over T and ``to_tokens`` (verl returns ``[B, T]``), input
validation (checks on, the default) and, in the "ours" column, building :class:`~rolloutopt.groups.Groups`
from the same input verl gets: ``Groups.from_labels`` on the uid strings (verl's real input,
``str(uuid.uuid4())`` per prompt), ``Groups(ids)`` on dense int ids (verl's fast path). The "prebuilt" column
passes a Groups built once per step and shared by every estimator of that step. One thread (``torch.set_num_threads(1)``) for everything; medians of several
repeats after a warmup (fewer for the slow loops).

Run: ``python benchmarks/groups.py``.
"""

from __future__ import annotations

import platform
import uuid
import warnings
from typing import Any

import numpy as np
import torch

from _common import B, T, case_ids, timeit  # benchmarks/ is on sys.path when run as a script
from rolloutopt.advantages import grpo, rloo, to_tokens
from rolloutopt.groups import Groups

REPEATS, LOOP_REPEATS = 30, 3


def make_case(case: str, gen: torch.Generator) -> dict[str, Any]:
    ids = case_ids(case, gen)
    lengths = torch.randint(1, T + 1, (B,), generator=gen)
    mask = torch.arange(T)[None, :] < lengths[:, None]
    scores = (torch.rand(B, generator=gen) > 0.5).float() + 0.1 * torch.randn(B, generator=gen)
    tlr = torch.zeros(B, T)
    tlr[torch.arange(B), lengths - 1] = scores
    # verl's uids are str(uuid.uuid4()), 36 characters; derive them from the seeded ids so runs repeat.
    uid = {i: str(uuid.UUID(int=(i * 0x9E3779B97F4A7C15 + 1) % 2**128)) for i in set(ids.tolist())}
    index = np.array([uid[i] for i in ids.tolist()], dtype=object)
    return {"ids": ids, "mask": mask, "mask_f": mask.float(), "tlr": tlr, "index": index}


def run_case(case: str, d: dict[str, Any], ca: Any) -> None:
    ids, mask, tlr, index = d["ids"], d["mask"], d["tlr"], d["index"]
    prebuilt = Groups(ids)

    def groups_of(idx: Any) -> Groups:
        # Ours starts from the same input as verl: uid strings go through Groups.from_labels, int ids to Groups.
        return Groups.from_labels(idx) if idx.dtype == object else Groups(torch.from_numpy(idx))

    def ours_grpo(idx: Any, g: Groups | None = None) -> torch.Tensor:
        return to_tokens(grpo(tlr.sum(-1), g or groups_of(idx), singleton="raw").advantages, mask)

    def ours_rloo_raw(idx: Any, g: Groups | None = None) -> torch.Tensor:
        return to_tokens(rloo(tlr.sum(-1), g or groups_of(idx), singleton="raw").advantages, mask)

    def ours_rloo_zero(idx: Any, g: Groups | None = None) -> torch.Tensor:
        return to_tokens(rloo(tlr.sum(-1), g or groups_of(idx)).advantages, mask)

    # verl's fast path: integer labels skip as_torch_index's string factorisation. They must be dense (0..G-1):
    # group_mean_std allocates max(label) + 1 slots, so sparse int ids cost it a second per call.
    int_index = np.unique(ids.numpy(), return_inverse=True)[1]
    rows = [
        ("grpo", "compute_grpo_outcome_advantage", ours_grpo, LOOP_REPEATS, index),
        ("grpo", "compute_grpo_vectorized_outcome_advantage", ours_grpo, REPEATS, index),
        ("grpo", "compute_grpo_vectorized_outcome_advantage", ours_grpo, REPEATS, int_index),
        ("rloo", "compute_rloo_outcome_advantage", ours_rloo_raw, LOOP_REPEATS, index),
        ("rloo", "compute_rloo_vectorized_outcome_advantage", ours_rloo_zero, REPEATS, index),
        ("rloo", "compute_rloo_vectorized_outcome_advantage", ours_rloo_zero, REPEATS, int_index),
    ]
    for method, fn_name, ours, reps, idx in rows:
        fn = getattr(ca, fn_name)
        name = fn_name.removeprefix("compute_").removesuffix("_outcome_advantage")
        name += " (uid str)" if idx is index else " (dense int ids)"

        def theirs(fn: Any = fn, idx: Any = idx) -> torch.Tensor:
            return fn(token_level_rewards=tlr.clone(), response_mask=d["mask_f"], index=idx)[0]  # type: ignore[no-any-return]

        diff = float((ours(idx) - theirs()).abs().max())
        assert diff <= 1e-5, (case, name, diff)
        t_ours = timeit(lambda ours=ours, idx=idx: ours(idx), REPEATS)
        t_pre = timeit(lambda ours=ours, idx=idx: ours(idx, prebuilt), REPEATS)
        t_base = timeit(theirs, reps, warmup=1)
        print(
            f"| {case:6} | {method:5} | {name:32} | {t_ours:8.2f} | {t_pre:11.2f} | {t_base:11.2f} "
            f"| {t_base / t_ours:6.0f}x | {t_base / t_pre:13.0f}x | {diff:12.1e} |"
        )
    t_groups = timeit(lambda: Groups(ids), REPEATS)
    t_labels = timeit(lambda: Groups.from_labels(index), 10, warmup=1)
    t_uid = timeit(lambda: np.unique(index, return_inverse=True), 5, warmup=1)
    print(
        f"| {case:6} | Groups(ids): {t_groups:.2f} ms; Groups.from_labels(uids): {t_labels:.2f} ms; "
        f"np.unique(uids) as verl does: {t_uid:.2f} ms |"
    )


def main() -> None:
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="rolloutopt: a group of size 1")
    from verl.trainer.ppo import core_algos as ca

    gen = torch.Generator().manual_seed(0)
    print(
        f"B={B}, T={T}, torch {torch.__version__}, threads {torch.get_num_threads()}, {platform.processor() or platform.machine()}"
    )
    header = (
        f"| {'case':6} | {'method':5} | {'baseline (verl 0.9.1 compute_*)':32} | {'ours ms':>8} | {'prebuilt ms':>11} "
        f"| {'baseline ms':>11} | {'ratio':>7} | {'ratio prebuilt':>14} | {'max abs diff':>12} |"
    )
    print(header)
    print("|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|")
    for case in ("equal", "ragged"):
        run_case(case, make_case(case, gen), ca)


if __name__ == "__main__":
    main()
