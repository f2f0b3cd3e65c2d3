"""Parity with verl 0.9.1's outcome advantage estimators (``verl.trainer.ppo.core_algos``) on identical inputs.

verl takes ``token_level_rewards [B, T]`` (the score is their sum over T), a ``response_mask [B, T]`` and
``index``, a numpy object array of uid strings. The compatible rolloutopt calls are

======================================================  ===================================================
verl 0.9.1                                              rolloutopt
======================================================  ===================================================
``compute_grpo_outcome_advantage`` (loop)               ``grpo(r, ids, singleton="raw", eps=epsilon)``
``compute_grpo_vectorized_outcome_advantage``           same
``... norm_adv_by_std_in_grpo=False``                   ``dr_grpo(r, ids, singleton="raw")``
``compute_rloo_outcome_advantage``                      ``rloo(r, ids, singleton="raw")``
``compute_rloo_vectorized_outcome_advantage``           ``rloo(r, ids)`` (singleton="zero", the default)
``compute_reinforce_plus_plus_baseline_outcome_...``    ``reinforce_pp_baseline(r, ids, mask, singleton="raw")``
======================================================  ===================================================

each broadcast with ``to_tokens(A, mask)``. Two differences are pinned below: our default singleton convention
(0, not the raw score) and all-equal groups whose float32 mean is inexact, where verl leaves residues of up to
±0.2 (GRPO) and we return exactly 0.

The last part runs every registered estimator through its ``rolloutopt_<name>`` adapter: verl's inputs
(summed rewards, uid groups, the response mask) either feed it, giving the estimator's own numbers, or the call
names the input verl cannot supply.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
import torch

import rolloutopt.advantages as advantages
import rolloutopt.integrations.verl as plugin
from rolloutopt.advantages import dr_grpo, grpo, reinforce_pp_baseline, rloo, to_tokens
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")

pytestmark = [pytest.mark.verl, pytest.mark.filterwarnings("ignore:rolloutopt. a group of size 1")]

T = 6


def make_batch(case: str, seed: int, binary: bool) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(seed)
    if case == "equal":
        sizes = torch.full((24,), 8)
    else:  # ragged, with several groups of one
        sizes = torch.randint(1, 12, (30,), generator=gen)
        sizes[:4] = 1
    gid = torch.repeat_interleave(torch.randperm(10_000, generator=gen)[: len(sizes)], sizes)
    perm = torch.randperm(len(gid), generator=gen)
    gid = gid[perm]
    b = len(gid)
    scores = (torch.rand(b, generator=gen) > 0.5).float() if binary else torch.randn(b, generator=gen) * 3 + 1
    lengths = torch.randint(0, T + 1, (b,), generator=gen)  # some rows fully masked: they still count in verl
    lengths[:2] = 0
    mask = torch.arange(T)[None, :] < lengths[:, None]
    # the score sits at the last response token (or at position 0 of an empty response); verl sums over T
    pos = (lengths - 1).clamp(min=0)
    token_level_rewards = torch.zeros(b, T)
    token_level_rewards[torch.arange(b), pos] = scores
    index = np.array([f"uid-{i:06d}" for i in gid.tolist()], dtype=object)
    return {"tlr": token_level_rewards, "mask": mask, "index": index, "ids": gid, "scores": scores}


def verl(fn_name: str, batch: dict[str, Any], **kw: Any) -> torch.Tensor:
    fn = getattr(core_algos, fn_name)
    adv, ret = fn(
        token_level_rewards=batch["tlr"].clone(), response_mask=batch["mask"].float(), index=batch["index"], **kw
    )
    assert torch.equal(adv, ret)
    return adv  # type: ignore[no-any-return]


def same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs.to(ours.dtype), atol=1e-5, rtol=1e-5)


CASES = [(case, seed, binary) for case in ("equal", "ragged") for seed in (0, 1) for binary in (False, True)]


@pytest.fixture(params=CASES, ids=lambda p: f"{p[0]}-seed{p[1]}-{'binary' if p[2] else 'gauss'}")
def batch(request: pytest.FixtureRequest) -> dict[str, Any]:
    return make_batch(*request.param)


@pytest.mark.parametrize("fn_name", ["compute_grpo_outcome_advantage", "compute_grpo_vectorized_outcome_advantage"])
@pytest.mark.parametrize("epsilon", [1e-6, 1e-4])
def test_grpo(batch: dict[str, Any], fn_name: str, epsilon: float) -> None:
    r, ids, mask = batch["tlr"].sum(-1), batch["ids"], batch["mask"]
    theirs = verl(fn_name, batch, epsilon=epsilon, norm_adv_by_std_in_grpo=True)
    same(to_tokens(grpo(r, ids, singleton="raw", eps=epsilon).advantages, mask), theirs)
    if epsilon == 1e-6:  # verl's default epsilon is ours
        same(to_tokens(grpo(r, ids, singleton="raw").advantages, mask), theirs)


@pytest.mark.parametrize("fn_name", ["compute_grpo_outcome_advantage", "compute_grpo_vectorized_outcome_advantage"])
def test_grpo_without_std_is_dr_grpo(batch: dict[str, Any], fn_name: str) -> None:
    r, ids, mask = batch["tlr"].sum(-1), batch["ids"], batch["mask"]
    theirs = verl(fn_name, batch, norm_adv_by_std_in_grpo=False)
    same(to_tokens(dr_grpo(r, ids, singleton="raw").advantages, mask), theirs)
    same(to_tokens(grpo(r, ids, scale=None, singleton="raw").advantages, mask), theirs)


def test_rloo_loop_is_singleton_raw(batch: dict[str, Any]) -> None:
    r, ids, mask = batch["tlr"].sum(-1), batch["ids"], batch["mask"]
    same(to_tokens(rloo(r, ids, singleton="raw").advantages, mask), verl("compute_rloo_outcome_advantage", batch))


def test_rloo_vectorized_is_singleton_zero(batch: dict[str, Any]) -> None:
    r, ids, mask = batch["tlr"].sum(-1), batch["ids"], batch["mask"]
    theirs = verl("compute_rloo_vectorized_outcome_advantage", batch)
    same(to_tokens(rloo(r, ids).advantages, mask), theirs)


def test_reinforce_pp_baseline(batch: dict[str, Any]) -> None:
    r, ids, mask = batch["tlr"].sum(-1), batch["ids"], batch["mask"]
    theirs = verl("compute_reinforce_plus_plus_baseline_outcome_advantage", batch)
    same(reinforce_pp_baseline(r, ids, mask, singleton="raw").advantages, theirs)


def test_singleton_convention_differs_only_at_singletons() -> None:
    batch = make_batch("ragged", 3, binary=False)
    r, ids, mask = batch["tlr"].sum(-1), batch["ids"], batch["mask"]
    theirs = verl("compute_grpo_outcome_advantage", batch)[:, 0]
    inverse = torch.unique(ids, return_inverse=True)[1]
    single = torch.bincount(inverse)[inverse] == 1
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ours = to_tokens(grpo(r, ids).advantages, mask)[:, 0]
    assert any("size 1" in str(w.message) for w in caught)
    has_token = mask[:, 0]
    assert torch.equal(ours[single], torch.zeros(int(single.sum())))
    assert (theirs[single & has_token] != 0).all()  # verl: A = r / (1 + eps)
    same(ours[~single], theirs[~single])


def test_all_equal_groups_are_zero_where_verl_leaves_residues() -> None:
    # Sixteen copies of one reward per group: verl's float32 mean is inexact and (s - mean)/(std + 1e-6)
    # turns the residue into advantages of order 0.1; rolloutopt centres on a member first and returns 0.
    gen = torch.Generator().manual_seed(0)
    values = torch.rand(64, generator=gen)
    ids = torch.arange(64).repeat_interleave(16)
    scores = values.repeat_interleave(16)
    batch = {
        "tlr": scores[:, None],
        "mask": torch.ones(len(scores), 1, dtype=torch.bool),
        "index": np.array([str(i) for i in ids.tolist()], dtype=object),
    }
    theirs = verl("compute_grpo_outcome_advantage", batch)
    assert theirs.abs().max() > 1e-2  # verl 0.9.1 behaviour, pinned
    assert torch.equal(grpo(scores, ids).advantages, torch.zeros(len(scores)))
    assert torch.equal(rloo(scores, ids).advantages, torch.zeros(len(scores)))


# ------------------------------------------------------------------------ every estimator through the verl adapter


def adapter(name: str, batch: dict[str, Any], config: Any = None, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``rolloutopt_<name>`` called as verl's ``compute_advantage`` calls a registered estimator."""
    fn = core_algos.get_adv_estimator_fn(f"rolloutopt_{name}")
    return fn(  # type: ignore[no-any-return]
        token_level_rewards=batch["tlr"].clone(),
        response_mask=batch["mask"].long(),
        index=batch["index"],
        config=config,
        **kwargs,
    )


def algo_config(name: str, **hyper: Any) -> Any:
    import omegaconf

    return omegaconf.OmegaConf.create({"norm_adv_by_std_in_grpo": True, "rolloutopt": {name: hyper}})


def expected_tokens(name: str, batch: dict[str, Any], **inputs: Any) -> torch.Tensor:
    """The estimator called directly with what the adapter feeds it, broadcast as the adapter does."""
    est = advantages.get(name)
    kw = dict(inputs)
    if "mask" in (*est.requires, *est.accepts):
        kw["mask"] = batch["mask"]
    if "max_len" in est.hyper:
        kw["max_len"] = T  # the padded response width
    if est.experimental is not None:
        kw["experimental"] = True
    out = est(batch["tlr"].sum(-1), Groups.from_labels(batch["index"]), **kw)
    w = out.weight if out.advantages.dim() == 1 else out.weight[:, None]
    return to_tokens(out.advantages * w, batch["mask"])


ESTIMATORS = advantages.names()


@pytest.mark.parametrize("name", ESTIMATORS)
def test_every_estimator_is_registered_and_fed_or_refused(name: str) -> None:
    """Each rolloutopt estimator is in verl's registry; verl's own inputs (rewards, uid groups, response mask)
    either suffice, giving the estimator's own numbers, or the call names what verl cannot supply."""
    assert core_algos.get_adv_estimator_fn(f"rolloutopt_{name}") is plugin.make_advantage_fn(name)
    est = advantages.get(name)
    batch = make_batch("equal", 0, binary=True)
    config = algo_config(name, **({"experimental": True} if est.experimental else {}))
    missing = [p for p in est.requires if p != "mask"]
    if est.reward_dims == "B K":
        with pytest.raises(InputError, match="per-component rewards") as info:
            adapter(name, batch, config)
        assert info.value.argument == f"algorithm.adv_estimator=rolloutopt_{name}"
    elif missing:
        with pytest.raises(InputError, match="verl does not give") as info:
            adapter(name, batch, config)
        assert info.value.argument == missing[0]
    else:
        adv, ret = adapter(name, batch, config)
        assert torch.equal(adv, ret)
        assert torch.equal(adv, expected_tokens(name, batch))


@pytest.mark.parametrize("name", ["ace", "xrpo_sharpen", "drpo"])
def test_log_prob_inputs_come_from_compute_advantage_kwargs(name: str) -> None:
    """``logp`` from ``old_log_probs`` and ``ref_logp`` from ``ref_log_prob`` when a trainer passes them (verl's
    own OTB estimators receive ``old_log_probs``); per-token, with the response mask."""
    batch = make_batch("equal", 1, binary=True)
    gen = torch.Generator().manual_seed(3)
    logp, ref = -torch.rand(len(batch["scores"]), T, generator=gen), -torch.rand(len(batch["scores"]), T, generator=gen)
    experimental = {"experimental": True} if name == "ace" else {}
    adv, _ = adapter(name, batch, algo_config(name, **experimental), old_log_probs=logp, ref_log_prob=ref)
    inputs = {"logp": logp, "ref_logp": ref} if name == "ace" else {"logp": logp}
    assert torch.equal(adv, expected_tokens(name, batch, **inputs))


def test_adapter_refusals_name_the_argument() -> None:
    batch = make_batch("equal", 2, binary=True)
    logp, ref = -torch.rand(len(batch["scores"]), T), -torch.rand(len(batch["scores"]), T)
    with pytest.raises(InputError, match="experimental=True for the 'ace'") as info:  # not acknowledged
        adapter("ace", batch, algo_config("ace"), old_log_probs=logp, ref_log_prob=ref)
    assert info.value.argument == "experimental"
    with pytest.raises(InputError, match="inputs such as mask come from verl's batch") as info:
        adapter("latent_mask", batch, algo_config("latent_mask", mask=True))  # an input is not a config key
    assert info.value.argument == "algorithm.rolloutopt.latent_mask.mask"
    with pytest.raises(InputError, match=r"hyper-parameter of rolloutopt\.advantages\.grpo") as info:
        adapter("grpo", batch, algo_config("grpo", epsilon=1e-6))
    assert info.value.argument == "algorithm.rolloutopt.grpo.epsilon"
    with pytest.raises(ValueError, match="Unknown advantage estimator"):  # shapers are not estimators
        core_algos.get_adv_estimator_fn("rolloutopt_fapo_penalty")
