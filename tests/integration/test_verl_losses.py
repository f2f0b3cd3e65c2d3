"""Parity with verl 0.9.1's policy losses, ``agg_loss`` and ``kl_penalty`` (``verl.trainer.ppo.core_algos``).

Every rolloutopt loss preset is compared, in value and in gradient with respect to ``logp``, with the verl
loss of the same name, called exactly as ``verl/workers/utils/losses.py::ppo_loss`` calls it (keyword-only,
with a real ``verl.workers.config.ActorConfig``, which constructs on the CPU). Inputs are float64, with
ragged masks, all-masked rows, mixed-sign advantages (some zero), log-ratios large enough to trigger the
clip, the dual clip and the KL clamps, and unrelated finite values in the padding.

======================  ================================================================  ================================
preset                  verl 0.9.1                                                        rolloutopt
======================  ================================================================  ================================
``grpo``                ``vanilla``, clip 0.2/0.2, ``seq-mean-token-mean``                ``get("grpo")``
``dapo``                ``vanilla``, clip 0.2/0.28, ``token-mean``                        ``get("dapo")``
``dr_grpo``             ``vanilla``, clip 0.2/0.2, ``seq-mean-token-sum-norm``            ``get("dr_grpo")(max_len=L)``
``gspo``                ``gspo``, clip 3e-4/4e-4, ``seq-mean-token-mean``                 ``get("gspo")``
``cispo``               ``cispo``, ``clip_ratio_low=10`` (no lower bound), high 0.2       ``get("cispo")``
``sapo``                ``sapo`` (tau 1.0/1.05; aggregation forced to seq-mean-token-mean)  ``get("sapo")``
======================  ================================================================  ================================

Conventions pinned here (``docs/conventions.md`` has the full table):

- verl's ``vanilla`` always applies the dual clip to A < 0 (``clip_ratio_c`` must be > 1); our presets have
  none. ``clip_ratio_c=1e9`` turns verl's off exactly (the log-ratio is clamped to ±20, so r ≤ e^20 < 1e9),
  and ``trust=PPOClip(low, high, dual=3.0)`` reproduces verl's default.
- Dr.GRPO's L_max is ``loss_scale_factor``, which defaults to the padded response width ``mask.shape[-1]``:
  pass ``max_len=loss_scale_factor`` (or the width when it is unset).
- With ``config.global_batch_info`` (``dp_size``, ``batch_num_tokens``, ``global_batch_size``) the rank's loss
  equals ours with ``Denominators(tokens=batch_num_tokens, sequences=global_batch_size, world_size=dp_size)``.
  verl's trainer sets ``global_batch_size = ppo_mini_batch_size * rollout.n``, i.e. it counts empty responses,
  while its local default (and ours) counts only non-empty rows.
- ``seq-mean-token-mean`` divides by ``L_i + 1e-8`` in verl and by ``max(L_i, 1)`` here (relative 1e-8/L_i).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch
from torch.testing import assert_close

import rolloutopt.losses as losses
from rolloutopt.losses import KL, Denominators, aggregate, kl_penalty, policy_loss
from rolloutopt.ratios import CISPO, PPOClip, TokenRatio

core_algos = pytest.importorskip("verl.trainer.ppo.core_algos")
verl_config = pytest.importorskip("verl.workers.config")

pytestmark = pytest.mark.verl

B, T = 16, 10
SEEDS = (0, 1)
NO_DUAL = 1e9  # verl asserts clip_ratio_c > 1; with |log r| <= 20, r < 1e9 so this never binds
VERL_MODES = ("token-mean", "token-sum", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


def actor_config(**kwargs: Any) -> Any:
    """A real verl ActorConfig; ``strategy``, a micro-batch size and ``rollout_n`` are required, not read by losses."""
    return verl_config.ActorConfig(strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, **kwargs)


@dataclass(frozen=True)
class Batch:
    logp: torch.Tensor
    old: torch.Tensor
    ref: torch.Tensor
    adv: torch.Tensor  # [B]
    mask: torch.Tensor  # bool [B, T]
    entropy: torch.Tensor
    is_weights: torch.Tensor

    @property
    def adv_tok(self) -> torch.Tensor:
        return self.adv[:, None].expand_as(self.logp).contiguous()

    def rows(self, sl: slice) -> Batch:
        return Batch(*(getattr(self, f)[sl] for f in self.__dataclass_fields__))


def make_batch(seed: int, b: int = B, t: int = T) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64

    def rand(*shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=gen, dtype=f64)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=f64)

    lengths = torch.randint(1, t + 1, (b,), generator=gen)
    lengths[:3] = torch.tensor([0, 0, t])  # two all-masked rows, one full row
    lengths = lengths[torch.randperm(b, generator=gen)]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    old = -3.0 * rand(b, t) - 0.01
    lr = 0.4 * randn(b, t)
    big = rand(b, t) < 0.25  # r in e^{±[1.2, 2.2]}: PPO clip and, for A < 0, the dual clip (r > 3) fire
    lr = torch.where(big, torch.sign(randn(b, t)) * (1.2 + rand(b, t)), lr)
    logp = old + lr
    d = 0.6 * randn(b, t)
    far = rand(b, t) < 0.15  # ref far from logp: verl's k3 clamp at 10 fires (e^3.5 - 4.5 > 10)
    d = torch.where(far, torch.where(rand(b, t) < 0.5, 3.5, -3.0).to(f64), d)
    ref = logp + d
    # one shift of every log-prob keeps every ratio and KL term and makes them real log-probabilities (<= 0)
    old, logp, ref = old - 7.0, logp - 7.0, ref - 7.0
    pad = ~mask  # padding holds unrelated finite values, as a padded forward pass leaves there
    logp = torch.where(pad, -15.0 * rand(b, t), logp)
    old = torch.where(pad, -15.0 * rand(b, t), old)
    ref = torch.where(pad, -15.0 * rand(b, t), ref)
    adv = randn(b)
    adv[:2] = torch.tensor([0.0, -abs(adv[1].item()) - 0.1])
    return Batch(logp, old, ref, adv, mask, 2.0 * rand(b, t), 0.5 + rand(b, t))


def run_verl(
    name: str, batch: Batch, config: Any, agg: str, *, adv: torch.Tensor | None = None, weights: bool = False
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    lp = batch.logp.clone().requires_grad_(True)
    loss, metrics = core_algos.get_policy_loss_fn(name)(
        old_log_prob=batch.old,
        log_prob=lp,
        advantages=batch.adv_tok if adv is None else adv,
        response_mask=batch.mask,
        loss_agg_mode=agg,
        config=config,
        rollout_is_weights=batch.is_weights if weights else None,
    )
    (grad,) = torch.autograd.grad(loss, lp)
    return loss.detach(), grad, metrics


def run_ours(
    preset: str, batch: Batch, *, adv: torch.Tensor | None = None, weights: bool = False, **kwargs: Any
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    lp = batch.logp.clone().requires_grad_(True)
    if weights:
        kwargs["is_weights"] = batch.is_weights
    if kwargs.get("agg", losses.get(preset).config.get("agg")) != "seq-mean-token-sum-norm":
        kwargs.pop("max_len", None)  # L_max is read by seq-mean-token-sum-norm only (other modes refuse it)
    out = losses.get(preset)(lp, batch.old, batch.adv if adv is None else adv, batch.mask, **kwargs)
    (grad,) = torch.autograd.grad(out.loss, lp)
    return out.loss.detach(), grad, out.metrics


# preset -> (verl loss name, ActorConfig fields, verl loss_agg_mode, extra rolloutopt keywords)
PRESET_TO_VERL: dict[str, tuple[str, dict[str, float], str, dict[str, Any]]] = {
    "grpo": (
        "vanilla",
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": NO_DUAL},
        "seq-mean-token-mean",
        {},
    ),
    "dapo": ("vanilla", {"clip_ratio_low": 0.2, "clip_ratio_high": 0.28, "clip_ratio_c": NO_DUAL}, "token-mean", {}),
    "dr_grpo": (
        "vanilla",
        {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "clip_ratio_c": NO_DUAL},
        "seq-mean-token-sum-norm",
        {"max_len": T},  # verl's L_max: loss_scale_factor, default the padded width mask.shape[-1]
    ),
    "gspo": ("gspo", {"clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4}, "seq-mean-token-mean", {}),
    "cispo": ("cispo", {"clip_ratio_low": 10.0, "clip_ratio_high": 0.2}, "token-mean", {}),
    "sapo": ("sapo", {"tau_pos": 1.0, "tau_neg": 1.05}, "seq-mean-token-mean", {}),
}

# verl metric -> rolloutopt metric, per verl loss
METRICS = {
    "vanilla": {
        "actor/pg_clipfrac": "clipfrac",
        "actor/ppo_kl": "approx_kl",
        "actor/pg_clipfrac_lower": "dual_clip_frac",
    },
    "gspo": {"actor/pg_clipfrac": "clipfrac", "actor/ppo_kl": "approx_kl"},
    "cispo": {"actor/pg_clipfrac": "clipfrac", "actor/ppo_kl": "approx_kl"},
    "sapo": {"actor/ppo_kl": "approx_kl"},
}


def check_metrics(name: str, verl_metrics: dict[str, float], ours: dict[str, torch.Tensor]) -> None:
    for vk, ok in METRICS[name].items():
        assert_close(ours[ok].item(), verl_metrics[vk], rtol=1e-6, atol=1e-9, msg=f"{vk} vs {ok}")


@pytest.mark.parametrize("per_token_adv", [False, True], ids=["seq-adv", "token-adv"])
@pytest.mark.parametrize("weights", [False, True], ids=["no-is", "is-weights"])
@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("preset", list(PRESET_TO_VERL))
def test_preset_matches_verl(preset: str, seed: int, weights: bool, per_token_adv: bool) -> None:
    name, fields, agg, extra = PRESET_TO_VERL[preset]
    batch = make_batch(seed)
    adv_tok = torch.randn(B, T, generator=torch.Generator().manual_seed(seed + 100), dtype=torch.float64)
    v_loss, v_grad, v_metrics = run_verl(
        name, batch, actor_config(**fields), agg, adv=adv_tok if per_token_adv else None, weights=weights
    )
    o_loss, o_grad, o_metrics = run_ours(
        preset, batch, adv=adv_tok if per_token_adv else None, weights=weights, **extra
    )
    assert_close(o_loss, v_loss, rtol=1e-7, atol=1e-10)
    assert_close(o_grad, v_grad, rtol=1e-7, atol=1e-10)
    assert o_grad.abs().sum() > 0
    assert (o_grad[~batch.mask] == 0).all()
    check_metrics(name, v_metrics, o_metrics)
    if name in ("vanilla", "cispo"):  # the inputs exercise the clip: some tokens clipped, some not
        assert 0 < v_metrics["actor/pg_clipfrac"] < 1


@pytest.mark.parametrize("seed", SEEDS)
def test_gspo_wide_clip_matches_verl(seed: int) -> None:
    """GSPO with a token-sized clip, so that both the clipped and the unclipped sequence branches occur."""
    batch = make_batch(seed)
    cfg = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28)
    v_loss, v_grad, v_metrics = run_verl("gspo", batch, cfg, "seq-mean-token-mean")
    o_loss, o_grad, o_metrics = run_ours("gspo", batch, trust=PPOClip(0.2, 0.28, dual=None))
    assert_close(o_loss, v_loss, rtol=1e-7, atol=1e-10)
    assert_close(o_grad, v_grad, rtol=1e-7, atol=1e-10)
    assert 0 < v_metrics["actor/pg_clipfrac"] < 1
    check_metrics("gspo", v_metrics, o_metrics)


@pytest.mark.parametrize("agg", VERL_MODES)
def test_gspo_follows_loss_agg_mode(agg: str) -> None:
    """verl 0.9.1's gspo follows loss_agg_mode (JAN and MAIN force seq-mean-token-mean); so does agg= here."""
    batch = make_batch(3)
    cfg = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.28)
    v_loss, v_grad, _ = run_verl("gspo", batch, cfg, agg)
    o_loss, o_grad, _ = run_ours("gspo", batch, trust=PPOClip(0.2, 0.28, dual=None), agg=agg, max_len=T)
    assert_close(o_loss, v_loss, rtol=1e-7, atol=1e-10)
    assert_close(o_grad, v_grad, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("agg", VERL_MODES)
def test_sapo_ignores_loss_agg_mode(agg: str) -> None:
    """verl's sapo always aggregates with seq-mean-token-mean, whatever loss_agg_mode says."""
    batch = make_batch(4)
    v_loss, v_grad, _ = run_verl("sapo", batch, actor_config(), agg)
    o_loss, o_grad, _ = run_ours("sapo", batch)
    assert_close(o_loss, v_loss, rtol=1e-7, atol=1e-10)
    assert_close(o_grad, v_grad, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize(
    ("preset", "low", "high", "agg"), [("dapo", 0.2, 0.28, "token-mean"), ("grpo", 0.2, 0.2, "seq-mean-token-mean")]
)
def test_vanilla_default_dual_clip(preset: str, low: float, high: float, agg: str, seed: int) -> None:
    """verl's default clip_ratio_c=3 is reproduced by PPOClip(dual=3.0); the presets (dual=None) differ."""
    batch = make_batch(seed)
    cfg = actor_config(clip_ratio_low=low, clip_ratio_high=high)  # clip_ratio_c = 3.0, verl's default
    assert cfg.clip_ratio_c == 3.0
    v_loss, v_grad, v_metrics = run_verl("vanilla", batch, cfg, agg)
    o_loss, o_grad, o_metrics = run_ours(preset, batch, trust=PPOClip(low, high, dual=3.0))
    assert_close(o_loss, v_loss, rtol=1e-7, atol=1e-10)
    assert_close(o_grad, v_grad, rtol=1e-7, atol=1e-10)
    assert v_metrics["actor/pg_clipfrac_lower"] > 0
    check_metrics("vanilla", v_metrics, o_metrics)
    p_loss, p_grad, _ = run_ours(preset, batch)  # the preset itself has no dual clip
    assert not torch.allclose(p_loss, v_loss)
    assert not torch.allclose(p_grad, v_grad)


def test_dual_clip_oracle() -> None:
    """verl's own check (``compute_policy_loss_vanilla``): A = -1 with r = e^3 gives loss 3.0 and pg_clipfrac_lower
    1.0."""
    old = torch.full((1, 1), -4.0, dtype=torch.float64)
    batch = Batch(
        old + 3.0, old, old, -torch.ones(1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.bool), old, old
    )
    v_loss, v_grad, v_metrics = run_verl("vanilla", batch, actor_config(), "token-mean")
    o_loss, o_grad, o_metrics = run_ours("dapo", batch, trust=PPOClip(0.2, 0.2, dual=3.0))
    assert v_loss.item() == pytest.approx(3.0) and o_loss.item() == pytest.approx(3.0)
    assert v_metrics["actor/pg_clipfrac_lower"] == pytest.approx(1.0)
    assert o_metrics["dual_clip_frac"].item() == pytest.approx(1.0)
    assert v_grad.abs().sum() == 0 and o_grad.abs().sum() == 0


@pytest.mark.parametrize("scale", [None, 32])
def test_dr_grpo_loss_scale_factor(scale: int | None) -> None:
    """verl's Dr.GRPO constant is loss_scale_factor (ppo_loss copies it into global_batch_info), else the width."""
    batch = make_batch(5)
    cfg = actor_config(clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=NO_DUAL, loss_scale_factor=scale)
    cfg.global_batch_info["loss_scale_factor"] = cfg.loss_scale_factor  # what ppo_loss does
    v_loss, v_grad, _ = run_verl("vanilla", batch, cfg, "seq-mean-token-sum-norm")
    o_loss, o_grad, _ = run_ours("dr_grpo", batch, max_len=T if scale is None else scale)
    assert_close(o_loss, v_loss, rtol=1e-7, atol=1e-10)
    assert_close(o_grad, v_grad, rtol=1e-7, atol=1e-10)


@pytest.mark.parametrize("preset", list(PRESET_TO_VERL))
def test_global_denominators_match_verl(preset: str) -> None:
    """Two data-parallel shards with verl's global_batch_info ↔ Denominators; shard losses average to the batch's."""
    name, fields, agg, extra = PRESET_TO_VERL[preset]
    batch = make_batch(6)
    n_tok = batch.mask.sum().item()
    n_seq = B  # verl's trainer passes global_batch_size = ppo_mini_batch_size * rollout.n: empty rows count
    den = Denominators(tokens=n_tok, sequences=n_seq, world_size=2)
    shard_losses, shard_grads = [], []
    for shard in (slice(0, B // 2), slice(B // 2, B)):
        part = batch.rows(shard)
        cfg = actor_config(**fields)
        cfg.global_batch_info.update(dp_size=2, batch_num_tokens=n_tok, global_batch_size=n_seq, loss_scale_factor=None)
        v_loss, v_grad, _ = run_verl(name, part, cfg, agg)
        o_loss, o_grad, _ = run_ours(preset, part, denominators=den, **extra)
        assert_close(o_loss, v_loss, rtol=1e-7, atol=1e-10)
        assert_close(o_grad, v_grad, rtol=1e-7, atol=1e-10)
        shard_losses.append(o_loss)
        shard_grads.append(o_grad)
    # DDP averages over the 2 ranks: that mean is the single-process loss with the same global counts
    full_loss, full_grad, _ = run_ours(preset, batch, denominators=replace(den, world_size=1), **extra)
    assert_close(sum(shard_losses) / 2, full_loss, rtol=1e-7, atol=1e-10)
    assert_close(torch.cat(shard_grads) / 2, full_grad, rtol=1e-7, atol=1e-10)


# --------------------------------------------------------------------------------------------- aggregation


@pytest.mark.parametrize("global_info", [False, True], ids=["local", "global"])
@pytest.mark.parametrize("mode", VERL_MODES)
def test_aggregate_matches_agg_loss(mode: str, global_info: bool) -> None:
    batch = make_batch(7)
    x = torch.randn(B, T, generator=torch.Generator().manual_seed(7), dtype=torch.float64, requires_grad=True)
    kw: dict[str, Any] = {}
    den = None
    if global_info:
        kw = {"dp_size": 4, "batch_num_tokens": 173, "global_batch_size": 61, "loss_scale_factor": 24}
        den = Denominators(tokens=173, sequences=61, world_size=4)
    v = core_algos.agg_loss(loss_mat=x, loss_mask=batch.mask, loss_agg_mode=mode, **kw)
    o = aggregate(x, batch.mask, mode, denominators=den, max_len=24 if global_info else T)  # type: ignore[arg-type]
    (v_grad,) = torch.autograd.grad(v, x)
    (o_grad,) = torch.autograd.grad(o, x)
    assert_close(o, v, rtol=1e-7, atol=1e-10)
    assert_close(o_grad, v_grad, rtol=1e-7, atol=1e-10)


def test_agg_loss_golden() -> None:
    """verl's ``agg_loss`` golden example: [[1,2,3],[4,0,0]] with mask [[1,1,1],[1,0,0]] → 2.5 / 10 / 5 / 3 /
    1.667."""
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0]], dtype=torch.float64)
    m = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    expected = dict(
        zip(
            ("token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
            (2.5, 10.0, 5.0, 3.0, 5 / 3),
            strict=True,
        )
    )
    for mode, value in expected.items():
        v = core_algos.agg_loss(loss_mat=x, loss_mask=m, loss_agg_mode=mode)
        o = aggregate(x, m, mode, max_len=3)  # type: ignore[arg-type]
        assert v.item() == pytest.approx(value) and o.item() == pytest.approx(value)


# --------------------------------------------------------------------------------------------- KL, entropy


KL_NAMES = ("kl", "k1", "abs", "mse", "k2", "low_var_kl", "k3")


@pytest.mark.parametrize("name", [n + p for n in KL_NAMES for p in ("", "+")])
def test_kl_penalty_matches_verl(name: str) -> None:
    batch = make_batch(8)
    w = torch.rand(B, T, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    lp_v = batch.logp.clone().requires_grad_(True)
    lp_o = batch.logp.clone().requires_grad_(True)
    v = core_algos.kl_penalty(lp_v, batch.ref, name)
    o = kl_penalty(lp_o, batch.ref, name)
    (g_v,) = torch.autograd.grad((v * w).sum(), lp_v)
    (g_o,) = torch.autograd.grad((o * w).sum(), lp_o)
    assert_close(o, v, rtol=1e-12, atol=1e-12)
    assert_close(g_o, g_v, rtol=1e-12, atol=1e-12)
    if name.rstrip("+") in ("low_var_kl", "k3"):
        assert (v.detach() == 10.0).any()  # the inputs reach verl's clamp at 10


@pytest.mark.parametrize("agg", VERL_MODES)
@pytest.mark.parametrize("kl_type", ["low_var_kl", "k1", "k2", "k3+"])
def test_actor_loss_with_kl_and_entropy_matches_ppo_loss(kl_type: str, agg: str) -> None:
    """``ppo_loss``'s composition: pg − entropy_coeff·agg(entropy) + kl_loss_coef·agg(kl), one agg mode for all.

    Reproduced from ``verl/workers/utils/losses.py::ppo_loss`` lines "add entropy loss" / "add kl loss" with
    verl's own functions (calling ``ppo_loss`` itself needs a no-padding TensorDict of a model's output).
    """
    batch = make_batch(9)
    cfg = actor_config(
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=3.0, loss_agg_mode=agg, entropy_coeff=0.01,
        use_kl_loss=True, kl_loss_type=kl_type, kl_loss_coef=0.05,
    )  # fmt: skip
    lp_v = batch.logp.clone().requires_grad_(True)
    ent_v = batch.entropy.clone().requires_grad_(True)
    pg, _ = core_algos.get_policy_loss_fn("vanilla")(
        old_log_prob=batch.old, log_prob=lp_v, advantages=batch.adv_tok, response_mask=batch.mask,
        loss_agg_mode=cfg.loss_agg_mode, config=cfg, rollout_is_weights=None,
    )  # fmt: skip
    ent_loss = core_algos.agg_loss(loss_mat=ent_v, loss_mask=batch.mask, loss_agg_mode=agg, **cfg.global_batch_info)
    kld = core_algos.kl_penalty(logprob=lp_v, ref_logprob=batch.ref, kl_penalty=cfg.kl_loss_type)
    kl_loss = core_algos.agg_loss(loss_mat=kld, loss_mask=batch.mask, loss_agg_mode=agg, **cfg.global_batch_info)
    v = pg - cfg.entropy_coeff * ent_loss + kl_loss * cfg.kl_loss_coef
    v_grads = torch.autograd.grad(v, (lp_v, ent_v))

    lp_o = batch.logp.clone().requires_grad_(True)
    ent_o = batch.entropy.clone().requires_grad_(True)
    out = policy_loss(
        lp_o, batch.old, batch.adv, batch.mask, ref_logp=batch.ref, entropy=ent_o,
        ratio=TokenRatio(), trust=PPOClip(0.2, 0.28, dual=3.0), kl=KL(kl_type, coef=0.05), entropy_coef=0.01,
        agg=agg, max_len=T if agg == "seq-mean-token-sum-norm" else None,  # type: ignore[arg-type]
    )  # fmt: skip
    o_grads = torch.autograd.grad(out.loss, (lp_o, ent_o))
    assert_close(out.loss, v, rtol=1e-7, atol=1e-10)
    for g_o, g_v in zip(o_grads, v_grads, strict=True):
        assert_close(g_o, g_v, rtol=1e-7, atol=1e-10)
    assert_close(out.metrics["pg_loss"], pg.detach(), rtol=1e-7, atol=1e-10)


def test_cispo_default_actor_config_has_a_lower_bound() -> None:
    """verl's ActorConfig defaults (clip_ratio_low=0.2) give CISPO a lower bound 0.8; our preset has none."""
    batch = make_batch(10)
    v_loss, v_grad, _ = run_verl("cispo", batch, actor_config(), "token-mean")
    o_loss, o_grad, _ = run_ours("cispo", batch, trust=CISPO(low=0.2, high=0.2))
    assert_close(o_loss, v_loss, rtol=1e-7, atol=1e-10)
    assert_close(o_grad, v_grad, rtol=1e-7, atol=1e-10)
    assert not torch.allclose(run_ours("cispo", batch)[0], v_loss)
