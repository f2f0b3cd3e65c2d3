"""Every preset and stage compiles with ``torch.compile(fullgraph=True)`` when checks are off (docs/guide.md).

The compiled loss, metrics and gradient must equal eager ones. Shapes are tiny: compilation dominates, so the
presets compiled here are a representative subset (grpo and dapo differ from dr_grpo and the stage tests only
in hyper-parameters and aggregation mode), and the stage tests cover every stage class and mode family.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import rolloutopt
from rolloutopt.losses import KL, Denominators, get, policy_loss
from rolloutopt.ratios import CISPO, SAPO, TBPO, GSPORatio, PPOClip, TokenRatio


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    old = -2 * torch.rand(3, 5, generator=g)
    logp = old + 0.3 * torch.randn(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    mask[:, 0] = True
    mask[2] = False  # an all-masked row
    return {
        "logp": logp,
        "old_logp": old,
        "advantages": torch.randn(3, generator=g),
        "mask": mask,
        "ref_logp": old - 0.1,
        "entropy": torch.rand(3, 5, generator=g),
    }


def _check(fn: Callable[..., Any]) -> None:
    x = _inputs()
    with rolloutopt.checks(False):
        torch._dynamo.reset()
        compiled = torch.compile(fn, fullgraph=True)
        results = []
        for f in (fn, compiled):
            lp = x["logp"].clone().requires_grad_()
            out = f(lp, {k: v for k, v in x.items() if k != "logp"})
            (grad,) = torch.autograd.grad(out.loss, lp)
            results.append((out, grad))
    (eager, g_eager), (comp, g_comp) = results
    torch.testing.assert_close(comp.loss, eager.loss)
    torch.testing.assert_close(comp.per_token, eager.per_token)
    torch.testing.assert_close(g_comp, g_eager)
    assert comp.metrics.keys() == eager.metrics.keys()
    for key in eager.metrics:
        torch.testing.assert_close(comp.metrics[key], eager.metrics[key], msg=key)
    assert g_eager.abs().sum() > 0  # not a vacuous comparison


PRESET_KW: dict[str, dict[str, Any]] = {"dr_grpo": {"max_len": 5}}


@pytest.mark.parametrize("name", ["dr_grpo", "gspo", "cispo", "sapo"])
def test_preset_compiles(name: str) -> None:
    preset = get(name)

    def fn(lp: torch.Tensor, x: dict[str, torch.Tensor]) -> Any:
        return preset(lp, x["old_logp"], x["advantages"], x["mask"], **PRESET_KW.get(name, {}))

    _check(fn)


def test_token_ratio_ppo_clip_token_mean_with_regularisers_compiles() -> None:
    # TokenRatio(clamp) + PPOClip(dual) + KL("k3+") + entropy + is_weights + seq_weight + explicit denominators
    def fn(lp: torch.Tensor, x: dict[str, torch.Tensor]) -> Any:
        return policy_loss(
            lp, x["old_logp"], x["advantages"][:, None].expand(3, 5), x["mask"], ref_logp=x["ref_logp"],
            entropy=x["entropy"], ratio=TokenRatio(clamp=5.0), trust=PPOClip(low=0.1, high=0.2, dual=2.0),
            kl=KL(estimator="k3+", coef=0.1), entropy_coef=0.01, is_weights=x["entropy"] + 0.5,
            denominators=Denominators(tokens=20.0, world_size=2), agg="token-mean",
            seq_weight=torch.tensor([1.0, 0.5, 0.0]),
        )  # fmt: skip

    _check(fn)


def test_cispo_cap_gspo_and_sapo_stages_compile() -> None:
    def fn(lp: torch.Tensor, x: dict[str, torch.Tensor]) -> Any:
        a = policy_loss(lp, x["old_logp"], x["advantages"], x["mask"], trust=CISPO(high=None, cap=1.1))
        b = policy_loss(
            lp, x["old_logp"], x["advantages"], x["mask"], ratio=GSPORatio(clamp_max=0.05),
            trust=SAPO(tau_pos=0.5, tau_neg=2.0), kl=KL(estimator="k1", coef=0.2, clamp=False),
            ref_logp=x["ref_logp"], agg="seq-mean-token-sum", denominators=Denominators(sequences=4.0),
        )  # fmt: skip
        return type(a)(
            a.loss + b.loss, a.per_token + b.per_token, {**a.metrics, **{f"b_{k}": v for k, v in b.metrics.items()}}
        )

    _check(fn)


NEW_PRESET_INPUTS = ("behav_logp", "versions", "topk_logp", "topk_behav_logp", "confidence")


@pytest.mark.parametrize(
    "name",
    [
        "decoupled_ppo",
        "copris",
        "cumulative",
        "pnpo",
        "m2po",
        "m2po_clip",
        "sat",
        "tbpo",
        "dppo_tv",
        "dppo_predictive",
        "echo_clip",
    ],
)
def test_ratio_and_trust_region_presets_compile(name: str) -> None:
    preset = get(name)
    g = torch.Generator().manual_seed(1)
    extra: dict[str, Any] = {
        "behav_logp": _inputs()["old_logp"] + 0.1 * torch.randn(3, 5, generator=g),
        "versions": 4 - torch.randint(0, 3, (3, 5), generator=g),
        "policy_version": 4,
        "topk_behav_logp": torch.log_softmax(torch.randn(3, 5, 4, generator=g), -1),
        "confidence": torch.rand(3, generator=g),
        "max_len": 5,
    }
    extra["topk_logp"] = extra["topk_behav_logp"] + 0.1 * torch.randn(3, 5, 4, generator=g)
    if preset.experimental is not None:
        extra["experimental"] = True
    if name == "tbpo":  # GSPO's 3e-4 bounds clip every sequence of these inputs: widen them for a non-zero gradient
        extra["trust"] = TBPO(low=0.5, high=0.5, band=10.0, experimental=True)

    used = set(preset.requires) | set(preset.accepts) | {"experimental", "trust"}
    extra = {k: v for k, v in extra.items() if k in used}

    def fn(lp: torch.Tensor, x: dict[str, torch.Tensor]) -> Any:
        return preset(lp, x["old_logp"], x["advantages"], x["mask"], **extra)

    _check(fn)
