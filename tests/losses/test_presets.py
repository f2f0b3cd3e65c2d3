"""Named loss presets: each is policy_loss with its documented configuration; registry behaviour."""

from __future__ import annotations

from typing import Any

import pytest
import torch

import rolloutopt.losses as L
from rolloutopt.errors import InputError
from rolloutopt.losses import Preset, policy_loss
from rolloutopt.ratios import CISPO, SAPO, CoPRISProximal, GSPORatio, PPOClip, TokenRatio

# the documented configurations (docs/conventions.md; the docstring of each preset)
DOCUMENTED: dict[str, dict[str, Any]] = {
    "grpo": {"ratio": TokenRatio(), "trust": PPOClip(low=0.2, high=0.2, dual=None), "agg": "seq-mean-token-mean"},
    "dapo": {"ratio": TokenRatio(), "trust": PPOClip(low=0.2, high=0.28, dual=None), "agg": "token-mean"},
    "dr_grpo": {
        "ratio": TokenRatio(),
        "trust": PPOClip(low=0.2, high=0.2, dual=None),
        "agg": "seq-mean-token-sum-norm",
    },
    "gspo": {
        "ratio": GSPORatio(clamp_max=10.0),
        "trust": PPOClip(low=3e-4, high=4e-4, dual=None),
        "agg": "seq-mean-token-mean",
    },
    "cispo": {"ratio": TokenRatio(), "trust": CISPO(low=None, high=0.2, cap=None), "agg": "token-mean"},
    "sapo": {"ratio": TokenRatio(), "trust": SAPO(tau_pos=1.0, tau_neg=1.05), "agg": "seq-mean-token-mean"},
}


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -2 * torch.rand(4, 6, generator=g, dtype=torch.float64)
    logp = (old + 0.3 * torch.randn(4, 6, generator=g, dtype=torch.float64)).clamp(max=0.0)
    mask = torch.rand(4, 6, generator=g) > 0.25
    mask[:, 0] = True
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    return logp, old, adv, mask


def test_names() -> None:
    names = L.names()
    assert set(DOCUMENTED) <= set(names)
    assert names == sorted(names)


@pytest.mark.parametrize("name", sorted(DOCUMENTED))
def test_get_returns_preset_equal_to_documented_policy_loss(name: str) -> None:
    preset = L.get(name)
    assert isinstance(preset, Preset)
    assert preset.name == name
    assert "arXiv" in preset.reference
    assert preset.config == DOCUMENTED[name]
    logp, old, adv, mask = _inputs()
    extra = {"max_len": 6} if name == "dr_grpo" else {}
    got = preset(logp, old, adv, mask, **extra)
    want = policy_loss(logp, old, adv, mask, **DOCUMENTED[name], **extra)
    torch.testing.assert_close(got.loss, want.loss)
    torch.testing.assert_close(got.per_token, want.per_token)
    assert got.metrics.keys() == want.metrics.keys()


def test_presets_differ_from_each_other() -> None:
    logp, old, adv, mask = _inputs(1)
    losses = {
        n: float(L.get(n)(logp, old, adv, mask, **({"max_len": 6} if n == "dr_grpo" else {})).loss) for n in DOCUMENTED
    }
    assert len(set(losses.values())) == len(losses), losses


def test_keyword_overrides_win() -> None:
    logp, old, adv, mask = _inputs(2)
    trust = PPOClip(low=0.1, high=0.1, dual=2.0)
    got = L.get("dapo")(logp, old, adv, mask, trust=trust, agg="seq-mean-token-sum")
    want = policy_loss(logp, old, adv, mask, ratio=TokenRatio(), trust=trust, agg="seq-mean-token-sum")
    torch.testing.assert_close(got.loss, want.loss)
    assert not torch.allclose(got.loss, L.get("dapo")(logp, old, adv, mask).loss)
    # the bound config is not mutated by an override
    assert L.get("dapo").config["trust"] == PPOClip(low=0.2, high=0.28, dual=None)


def test_unknown_name_lists_names() -> None:
    with pytest.raises(InputError) as e:
        L.get("nope")
    msg = str(e.value)
    assert "'nope'" in msg
    for name in DOCUMENTED:
        assert name in msg


def test_dr_grpo_without_max_len() -> None:
    logp, old, adv, mask = _inputs()
    with pytest.raises(InputError) as e:
        L.get("dr_grpo")(logp, old, adv, mask)
    assert e.value.argument == "max_len"
    assert "max_len" in str(e.value)


def test_register() -> None:
    preset = Preset("test_presets_tmp", "arXiv 0000.00000 (test)", {"trust": None, "agg": "token-sum"})
    assert L.register("test_presets_tmp", preset) is preset
    try:
        assert L.get("test_presets_tmp") is preset
        assert "test_presets_tmp" in L.names()
        assert L.register("test_presets_tmp", preset) is preset  # the same object again is a no-op
        other = Preset("test_presets_tmp", "other", {})
        with pytest.raises(InputError) as e:
            L.register("test_presets_tmp", other)
        assert e.value.argument == "name"
        assert L.register("test_presets_tmp", other, overwrite=True) is other
        logp, old, adv, mask = _inputs()
        torch.testing.assert_close(
            L.get("test_presets_tmp")(logp, old, adv, mask).loss, policy_loss(logp, old, adv, mask, **other.config).loss
        )
    finally:
        L.PRESETS._items.pop("test_presets_tmp", None)


def test_register_builtin_name_twice_raises() -> None:
    with pytest.raises(InputError) as e:
        L.register("grpo", Preset("grpo", "mine", {}))
    assert "already" in str(e.value)
    assert L.get("grpo").config == DOCUMENTED["grpo"]


def test_experimental_preset_needs_acknowledgement_and_required_inputs_are_named() -> None:
    config = {"trust": None, "proximal": CoPRISProximal()}
    preset = Preset("test_presets_exp", "arXiv 0000.00000 (test)", config, experimental="its form is reconstructed")
    assert preset.requires == ("behav_logp", "versions")  # derived from CoPRISProximal's declaration
    logp, old, adv, mask = _inputs()
    with pytest.raises(InputError, match="reconstructed") as e:
        preset(logp, old, adv, mask, behav_logp=old, versions=torch.zeros(4, 6, dtype=torch.long))
    assert e.value.argument == "experimental"
    with pytest.raises(InputError, match="versions") as e:
        preset(logp, old, adv, mask, behav_logp=old, experimental=True)
    assert e.value.argument == "versions"
    with pytest.raises(InputError, match="behav_logp"):
        preset(logp, old, adv, mask, experimental=True)
    versions = torch.zeros(4, 6, dtype=torch.long)
    got = preset(logp, old, adv, mask, behav_logp=old, versions=versions, experimental=True)
    want = policy_loss(logp, old, adv, mask, **config, behav_logp=old, versions=versions)
    torch.testing.assert_close(got.loss, want.loss)


def _all_inputs(seed: int = 3) -> dict[str, Any]:
    """Every input any preset may need, float64, with a ragged mask, an all-masked row and stale versions."""
    g = torch.Generator().manual_seed(seed)
    b, t, k = 6, 7, 4
    f64 = torch.float64
    old = -2 * torch.rand(b, t, generator=g, dtype=f64) - 0.05
    mask = torch.arange(t)[None, :] < torch.tensor([7, 5, 1, 0, 3, 6])[:, None]
    topk_behav = torch.log_softmax(torch.randn(b, t, k, generator=g, dtype=f64), -1)
    return {
        "logp": (old + 0.3 * torch.randn(b, t, generator=g, dtype=f64)).clamp(max=0.0),
        "old_logp": old,
        "advantages": torch.randn(b, generator=g, dtype=f64),
        "mask": mask,
        "behav_logp": (old + 0.2 * torch.randn(b, t, generator=g, dtype=f64)).clamp(max=0.0),
        "versions": 5 - torch.randint(0, 3, (b, t), generator=g),
        "policy_version": 5,
        "topk_behav_logp": topk_behav,
        "topk_logp": topk_behav + 0.1 * torch.randn(b, t, k, generator=g, dtype=f64),
        "confidence": torch.rand(b, generator=g, dtype=f64),
        "max_len": t,
    }


def _consumed(preset: Preset, x: dict[str, Any]) -> dict[str, Any]:
    """The inputs of ``x`` that the preset consumes (it refuses the others)."""
    return {k: v for k, v in x.items() if k in preset.requires or k in preset.accepts}


@pytest.mark.parametrize("name", L.names())
def test_every_preset_runs_with_its_inputs_and_names_missing_ones(name: str) -> None:
    preset = L.get(name)
    x = _all_inputs()
    lp = x.pop("logp").requires_grad_()
    old, adv, mask = x.pop("old_logp"), x.pop("advantages"), x.pop("mask")
    x = _consumed(preset, x)
    ack = {"experimental": True} if preset.experimental is not None else {}
    out = preset(lp, old, adv, mask, **x, **ack)
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert torch.isfinite(out.loss) and torch.isfinite(grad).all()
    assert torch.equal(grad[~mask], torch.zeros_like(grad[~mask]))
    for key, value in out.metrics.items():
        assert value.ndim == 0 and not value.requires_grad and torch.isfinite(value), key
    if preset.experimental is not None:
        with pytest.raises(InputError, match="experimental"):
            preset(lp, old, adv, mask, **x)
    for missing in preset.requires:
        kwargs = {k: v for k, v in x.items() if k != missing}
        with pytest.raises(InputError, match=missing):
            preset(lp, old, adv, mask, **kwargs, **ack)


@pytest.mark.parametrize("name", L.names())
def test_every_preset_on_policy_gives_ratio_one(name: str) -> None:
    """logp == old_logp == behav_logp: every ratio and weight is 1, nothing is clipped or masked by staleness."""
    preset = L.get(name)
    x = _all_inputs(4)
    old, adv, mask = x.pop("old_logp"), x.pop("advantages"), x.pop("mask")
    x.pop("logp")
    x["behav_logp"] = old
    x["topk_logp"] = x["topk_behav_logp"]
    x["versions"] = torch.full_like(x["versions"], 5)
    x = _consumed(preset, x)
    ack = {"experimental": True} if preset.experimental is not None else {}
    out = preset(old.clone().requires_grad_(), old, adv, mask, **x, **ack)
    m = out.metrics
    torch.testing.assert_close(m["ratio_mean"], torch.tensor(1.0, dtype=torch.float64))
    torch.testing.assert_close(m["log_ratio_max"], torch.tensor(0.0, dtype=torch.float64))
    assert float(m["masked_frac"]) == 0.0, name
    assert float(m.get("clipfrac", torch.tensor(0.0))) == 0.0, name
