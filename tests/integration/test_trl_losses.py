"""Parity with TRL 1.16's ``GRPOTrainer`` loss (``loss_type``) on identical inputs, in value and gradient.

TRL computes the loss inside ``GRPOTrainer._compute_loss(self, model, inputs)``. It is called here unbound, on
a fake ``self`` (a ``types.SimpleNamespace``, so that an attribute TRL reads and the fake lacks raises
``AttributeError``) whose ``_get_per_token_logps_and_entropies`` returns our ``logp`` leaf, so the gradient
flows back to it. No model and no accelerator are built; ``accelerator.gather``/``reduce`` are the identity.

==============================================  ==========================================================
TRL 1.16                                        rolloutopt
==============================================  ==========================================================
``loss_type="grpo"``                            ``get("grpo", denominators=Denominators(sequences=B·GA))``
``loss_type="dapo"`` (ε_high 0.28)              ``get("dapo", denominators=Denominators(tokens=N·GA/spg,
                                                world_size=P))``, N = ``num_items_in_batch``
``loss_type="dr_grpo"``                         ``get("dr_grpo", max_len=max_completion_length,
                                                denominators=Denominators(sequences=B·GA))``
``loss_type="cispo"``, ``epsilon_high=c``       ``get("cispo", trust=CISPO(low=None, high=None, cap=c))`` + the
                                                dapo denominators
``loss_type="sapo"``                            ``get("sapo", denominators=Denominators(sequences=B·GA))``
``importance_sampling_level="sequence"`` +      ``get("gspo", denominators=Denominators(sequences=B))``
``loss_type="grpo"``, ε 3e-4 / 4e-4
``beta=β``                                      ``kl=KL("k3", coef=β, clamp=False)``
``delta=δ`` (two-sided clip)                    ``trust=PPOClip(low, high, dual=δ)`` (δ ≥ 1 + ε_high)
==============================================  ==========================================================

B counts every row of the micro-batch, empty completions included (TRL's ``.mean()`` over rows and its
``per_token_loss.size(0)``); our default sequence count leaves empty rows out, so ``Denominators(sequences=B)``
reproduces TRL. TRL has no dual clip (our presets neither), no ±20 clamp on the log-ratio and no clamp at 10
on GSPO's, and adds the entropy bonus as a separate token mean whatever the loss type.
"""

from __future__ import annotations

import types
from collections import defaultdict
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import rolloutopt.losses as losses
from rolloutopt.losses import KL, Denominators, aggregate
from rolloutopt.ratios import CISPO, SAPO, PPOClip, TokenRatio

grpo_trainer = pytest.importorskip("trl.trainer.grpo_trainer")
GRPOTrainer = grpo_trainer.GRPOTrainer

pytestmark = pytest.mark.trl

B, T, P_LEN = 16, 10, 3
MAX_COMPLETION = 16  # TRL's max_completion_length, wider than the padded width T
SEEDS = (0, 1)


class FakeAccelerator:
    """The accelerator surface ``_compute_loss`` touches, for one process (or a pretend world of ``n``)."""

    def __init__(self, num_processes: int = 1) -> None:
        self.num_processes = num_processes
        self.sync_gradients = True

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def gather_for_metrics(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def reduce(self, x: torch.Tensor, reduction: str = "sum") -> torch.Tensor:
        return x


def make_batch(seed: int, b: int = B, t: int = T) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=f64)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=f64)

    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[:3] = torch.tensor([0, 0, t])  # two empty completions, one full
    lengths = lengths[torch.randperm(b, generator=gen)]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -3.0 * rand(b, t) - 0.01
    lr = 0.4 * randn(b, t)
    big = rand(b, t) < 0.25  # r in e^{±[1.2, 2.2]}: the clip (and TRL's delta / CISPO cap) fire
    lr = torch.where(big, torch.sign(randn(b, t)) * (1.2 + rand(b, t)), lr)
    logp = old + lr
    d = 0.6 * randn(b, t)
    far = rand(b, t) < 0.15  # ref far from logp: k3 > 10, where verl would clamp and TRL does not
    d = torch.where(far, torch.where(rand(b, t) < 0.5, 3.5, -3.0).to(f64), d)
    ref = logp + d
    # one shift of every log-prob keeps every ratio and KL term and makes them real log-probabilities (<= 0)
    old, logp, ref = old - 7.0, logp - 7.0, ref - 7.0
    pad = ~mask  # padding holds unrelated finite values
    logp = torch.where(pad, -15.0 * rand(b, t), logp)
    old = torch.where(pad, -15.0 * rand(b, t), old)
    ref = torch.where(pad, -15.0 * rand(b, t), ref)
    adv = randn(b)
    adv[:2] = torch.tensor([0.0, -abs(adv[1].item()) - 0.1])
    return {"logp": logp, "old": old, "ref": ref, "adv": adv, "mask": mask, "entropy": 2.0 * rand(b, t)}


def fake_trainer(
    logp: torch.Tensor,
    entropy: torch.Tensor,
    *,
    loss_type: str,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    level: str = "token",
    beta: float = 0.0,
    delta: float | None = None,
    entropy_coef: float = 0.0,
    ga: int = 1,
    steps_per_generation: int = 1,
    num_processes: int = 1,
    use_vllm: bool = False,
) -> types.SimpleNamespace:
    """Exactly the attributes ``GRPOTrainer._compute_loss`` reads (TRL 1.16), set as ``__init__`` sets them."""
    args = types.SimpleNamespace(
        use_bias_correction_kl=False,
        delta=delta,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
        steps_per_generation=steps_per_generation,
        entropy_target=0.2,
    )
    return types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda model, input_ids, attention_mask, logits_to_keep, **kw: (
            logp,
            entropy,
            None,
        ),
        args=args,
        aux_loss_enabled=False,
        router_aux_loss_coef=0.0,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level=level,
        beta=beta,
        loss_type=loss_type,
        epsilon_low=epsilon,
        epsilon_high=epsilon_high if epsilon_high is not None else epsilon,
        use_vllm=use_vllm,
        vllm_importance_sampling_correction=True,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=ga,
        max_completion_length=MAX_COMPLETION,
        accelerator=FakeAccelerator(num_processes),
        _metrics=defaultdict(lambda: defaultdict(list)),
        _entropy_bonus_enabled=entropy_coef != 0.0,
        entropy_coef=entropy_coef,
        use_adaptive_entropy=False,
    )


def run_trl(
    batch: dict[str, torch.Tensor],
    *,
    num_items: float | None = None,
    with_entropy_grad: bool = False,
    is_ratio: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], dict[str, list[float]]]:
    lp = batch["logp"].clone().requires_grad_(True)
    ent = batch["entropy"].clone().requires_grad_(with_entropy_grad)
    trainer = fake_trainer(lp, ent, use_vllm=is_ratio is not None, **kwargs)
    mask = batch["mask"].long()  # TRL's completion_mask is an int tensor
    b = mask.shape[0]
    inputs = {
        "prompt_ids": torch.ones(b, P_LEN, dtype=torch.long),
        "prompt_mask": torch.ones(b, P_LEN, dtype=torch.long),
        "completion_ids": torch.ones_like(mask),
        "completion_mask": mask,
        "advantages": batch["adv"],
        "old_per_token_logps": batch["old"],
        "num_items_in_batch": torch.tensor(float(mask.sum()) if num_items is None else num_items),
    }
    if trainer.beta != 0.0:
        inputs["ref_per_token_logps"] = batch["ref"]
    if is_ratio is not None:
        inputs["importance_sampling_ratio"] = is_ratio
    loss = GRPOTrainer._compute_loss(trainer, None, inputs)
    grads = torch.autograd.grad(loss, (lp, ent) if with_entropy_grad else (lp,))
    return loss.detach(), grads, trainer._metrics["train"]


def run_ours(
    preset: str,
    batch: dict[str, torch.Tensor],
    *,
    with_entropy_grad: bool = False,
    extra_entropy: float = 0.0,
    **kw: Any,
) -> tuple[torch.Tensor, tuple[torch.Tensor, ...], dict[str, torch.Tensor]]:
    lp = batch["logp"].clone().requires_grad_(True)
    ent = batch["entropy"].clone().requires_grad_(with_entropy_grad)
    if "kl" in kw:
        kw["ref_logp"] = batch["ref"]
    out = losses.get(preset)(lp, batch["old"], batch["adv"], batch["mask"], entropy=ent, **kw)
    loss = out.loss
    if extra_entropy:  # TRL's entropy bonus: a token mean of its own, whatever the loss type
        loss = loss - extra_entropy * aggregate(ent, batch["mask"], "token-mean")
    grads = torch.autograd.grad(loss, (lp, ent) if with_entropy_grad else (lp,))
    return loss.detach(), grads, out.metrics


def assert_same(trl: tuple[Any, ...], ours: tuple[Any, ...], mask: torch.Tensor) -> None:
    assert_close(ours[0], trl[0], rtol=1e-7, atol=1e-10)
    for g_o, g_t in zip(ours[1], trl[1], strict=True):
        assert_close(g_o, g_t, rtol=1e-7, atol=1e-10)
    assert ours[1][0].abs().sum() > 0
    assert (ours[1][0][~mask] == 0).all()


ROWS = Denominators(sequences=B)  # TRL's sequence denominator counts every row, empty completions included
# TRL builds its SAPO temperatures with torch.where on Python floats, i.e. in fp32: tau_neg is 1.0499999523...
# (a ~1e-6 relative change of an fp64 loss, invisible in fp32 training). SAPO(tau_neg=...) reproduces it.
TRL_SAPO = SAPO(tau_pos=1.0, tau_neg=torch.tensor(1.05, dtype=torch.float32).item())

# preset -> (TRL settings (``level`` is importance_sampling_level), rolloutopt keywords)
PRESET_TO_TRL: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "grpo": ({"loss_type": "grpo"}, {"denominators": ROWS}),
    "dapo": ({"loss_type": "dapo", "epsilon_high": 0.28}, {}),
    "dr_grpo": ({"loss_type": "dr_grpo"}, {"max_len": MAX_COMPLETION, "denominators": ROWS}),
    "cispo": ({"loss_type": "cispo", "epsilon_high": 5.0}, {"trust": CISPO(low=None, high=None, cap=5.0)}),
    "sapo": ({"loss_type": "sapo"}, {"trust": TRL_SAPO, "denominators": ROWS}),
    "gspo": (
        {"loss_type": "grpo", "level": "sequence", "epsilon": 3e-4, "epsilon_high": 4e-4},
        {"denominators": ROWS},
    ),
}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("preset", list(PRESET_TO_TRL))
def test_preset_matches_trl(preset: str, seed: int) -> None:
    trl_kw, ours_kw = PRESET_TO_TRL[preset]
    batch = make_batch(seed)
    trl = run_trl(batch, **trl_kw)
    ours = run_ours(preset, batch, **ours_kw)
    assert_same(trl, ours, batch["mask"])
    if preset in ("grpo", "dapo", "dr_grpo"):  # TRL's clip metrics are ours (token means; TRL's are fp32)
        assert_close(ours[2]["clip_low_frac"].item(), trl[2]["clip_ratio/low_mean"][0], rtol=1e-6, atol=0)
        assert_close(ours[2]["clip_high_frac"].item(), trl[2]["clip_ratio/high_mean"][0], rtol=1e-6, atol=0)
        assert 0 < trl[2]["clip_ratio/region_mean"][0] < 1


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "sapo", "gspo"])
def test_trl_counts_empty_rows(preset: str) -> None:
    """Our default sequence count (non-empty rows, as verl's agg_loss) differs from TRL's B by B / (B - 2)."""
    trl_kw, ours_kw = PRESET_TO_TRL[preset][0], dict(PRESET_TO_TRL[preset][1])
    batch = make_batch(2)
    trl = run_trl(batch, **trl_kw)
    ours_kw.pop("denominators")
    default = run_ours(preset, batch, **ours_kw)
    assert_close(default[0] * (B - 2) / B, trl[0], rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(("low", "high"), [(0.2, 0.28), (3e-4, 4e-4)])
@pytest.mark.parametrize(("loss_type", "agg"), [("grpo", "seq-mean-token-mean"), ("dapo", "token-mean")])
def test_gspo_sequence_level(loss_type: str, agg: str, low: float, high: float, seed: int) -> None:
    """importance_sampling_level="sequence": the GSPO-token form has the same value and gradient.

    With loss_type="dapo" TRL sums each sequence's term over its tokens (length-weighted), which is our
    ``agg="token-mean"``.
    """
    batch = make_batch(seed)
    trl = run_trl(batch, loss_type=loss_type, level="sequence", epsilon=low, epsilon_high=high)
    kw: dict[str, Any] = {"denominators": ROWS} if agg != "token-mean" else {}
    ours = run_ours("gspo", batch, trust=PPOClip(low, high, dual=None), agg=agg, **kw)
    assert_same(trl, ours, batch["mask"])


def test_cispo_relative_bound_is_a_cap() -> None:
    """Our default CISPO(high=0.2) (no lower bound) is TRL's absolute cap epsilon_high = 1.2."""
    batch = make_batch(3)
    trl = run_trl(batch, loss_type="cispo", epsilon_high=1.2)
    assert_same(trl, run_ours("cispo", batch), batch["mask"])


@pytest.mark.parametrize("preset", ["grpo", "dapo", "sapo"])
def test_beta_kl_is_unclamped_k3(preset: str) -> None:
    trl_kw, ours_kw = PRESET_TO_TRL[preset]
    batch = make_batch(4)
    trl = run_trl(batch, beta=0.04, **trl_kw)
    ours = run_ours(preset, batch, kl=KL("k3", coef=0.04, clamp=False), **ours_kw)
    assert_same(trl, ours, batch["mask"])
    assert_close(ours[2]["kl"].item(), trl[2]["kl"][0], rtol=1e-9, atol=0)
    clamped = run_ours(preset, batch, kl=KL("k3", coef=0.04), **ours_kw)  # verl's clamp at 10 differs
    assert not torch.allclose(clamped[0], trl[0])


@pytest.mark.parametrize(("loss_type", "preset"), [("dapo", "dapo"), ("grpo", "grpo"), ("dr_grpo", "dr_grpo")])
def test_delta_is_dual_clip(loss_type: str, preset: str) -> None:
    """TRL's two-sided clip caps the unclipped branch at δ; for δ ≥ 1+ε_high that is the dual clip with c = δ."""
    trl_kw, ours_kw = PRESET_TO_TRL[preset]
    high = trl_kw.get("epsilon_high", 0.2)
    batch = make_batch(5)
    trl = run_trl(batch, delta=3.0, **trl_kw)
    ours = run_ours(preset, batch, trust=PPOClip(0.2, high, dual=3.0), **ours_kw)
    assert_same(trl, ours, batch["mask"])
    assert not torch.allclose(run_ours(preset, batch, **ours_kw)[0], trl[0])  # δ does bind on these inputs


@pytest.mark.parametrize(
    ("ga", "spg", "procs", "num_items"),
    [(2, 2, 1, None), (2, 1, 1, None), (1, 1, 2, 400.0), (4, 2, 2, 333.0)],
    ids=["ga2-spg2", "ga2-spg1", "world2", "ga4-spg2-world2"],
)
@pytest.mark.parametrize("preset", ["dapo", "cispo"])
def test_global_token_normaliser(preset: str, ga: int, spg: int, procs: int, num_items: float | None) -> None:
    """dapo/cispo divide by num_items_in_batch / P · GA / steps_per_generation: Denominators(tokens, world_size)."""
    trl_kw, ours_kw = PRESET_TO_TRL[preset]
    batch = make_batch(6)
    n = float(batch["mask"].sum()) if num_items is None else num_items
    trl = run_trl(batch, num_items=num_items, ga=ga, steps_per_generation=spg, num_processes=procs, **trl_kw)
    den = Denominators(tokens=n * ga / spg, world_size=procs)
    assert_same(trl, run_ours(preset, batch, denominators=den, **ours_kw), batch["mask"])


@pytest.mark.parametrize("preset", ["grpo", "dr_grpo", "sapo"])
def test_gradient_accumulation_divisor(preset: str) -> None:
    """grpo/dr_grpo/sapo divide the micro-batch loss by GA: Denominators(sequences=B·GA)."""
    trl_kw, ours_kw = PRESET_TO_TRL[preset]
    batch = make_batch(7)
    trl = run_trl(batch, ga=4, **trl_kw)
    ours = run_ours(preset, batch, **{**ours_kw, "denominators": Denominators(sequences=B * 4)})
    assert_same(trl, ours, batch["mask"])


@pytest.mark.parametrize("preset", ["grpo", "dapo"])
def test_entropy_bonus(preset: str) -> None:
    """TRL subtracts coef · (token mean of entropy) whatever the loss type; policy_loss aggregates it with agg.

    For the token-mean presets the two agree; for the others add the token mean separately.
    """
    trl_kw, ours_kw = PRESET_TO_TRL[preset]
    batch = make_batch(8)
    trl = run_trl(batch, entropy_coef=0.1, with_entropy_grad=True, **trl_kw)
    separate = run_ours(preset, batch, with_entropy_grad=True, extra_entropy=0.1, **ours_kw)
    assert_same(trl, separate, batch["mask"])
    integrated = run_ours(preset, batch, with_entropy_grad=True, entropy_coef=0.1, **ours_kw)
    if preset == "dapo":
        assert_same(trl, integrated, batch["mask"])
    else:
        assert not torch.allclose(integrated[0], trl[0])


def test_unclamped_log_ratio() -> None:
    """TRL exponentiates the raw log-ratio; ours clamps it to ±20 (verl) unless TokenRatio(clamp=...) is raised."""
    batch = make_batch(9)
    row = int(torch.nonzero(batch["mask"].sum(-1) > 0)[0])
    batch["old"][row, 0] = -30.0
    batch["logp"][row, 0] = batch["old"][row, 0] + 25.0
    batch["adv"][row] = -1.0  # A < 0: the unclipped branch r·|A| is the loss
    trl = run_trl(batch, loss_type="dapo", epsilon_high=0.28)
    assert_same(trl, run_ours("dapo", batch, ratio=TokenRatio(clamp=50.0)), batch["mask"])
    assert not torch.allclose(run_ours("dapo", batch)[0], trl[0])


@pytest.mark.parametrize("preset", ["grpo", "dapo", "cispo", "sapo", "gspo"])
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_vllm_importance_sampling_ratio(preset: str, level: str) -> None:
    """TRL multiplies the policy term (not the KL) by ``importance_sampling_ratio``: our ``is_weights=``.

    ``level`` is the IS ratio's own level (TRL's ``vllm_importance_sampling_mode`` token_* gives [B, T], sequence_*
    gives [B, 1]); ours takes [B, T] or [B].
    """
    trl_kw, ours_kw = PRESET_TO_TRL[preset]
    batch = make_batch(10)
    w = 0.5 + torch.rand(B, T, generator=torch.Generator().manual_seed(10), dtype=torch.float64)
    w_trl, w_ours = (w, w) if level == "token" else (w[:, :1], w[:, 0])
    trl = run_trl(batch, is_ratio=w_trl, beta=0.04, **trl_kw)
    ours = run_ours(preset, batch, is_weights=w_ours, kl=KL("k3", coef=0.04, clamp=False), **ours_kw)
    if preset == "gspo" and level == "token":
        # Same value, different gradient: TRL's sequence ratio spreads each token's IS weight over the whole
        # sequence (token t' gets (1/L)·mean_t w_t), the GSPO-token form keeps w_t on token t. No switch.
        assert_close(ours[0], trl[0], rtol=1e-7, atol=1e-10)
        assert not torch.allclose(ours[1][0], trl[1][0])
        return
    assert_same(trl, ours, batch["mask"])
