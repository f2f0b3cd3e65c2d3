"""Behaviour-policy corrections: hand oracles, properties, bad input.

Oracles computed by hand following verl's rollout correction (``volcengine/verl@b178a3cd5``
``verl/trainer/ppo/rollout_corr_helper.py``: ``compute_rollout_correction_weights``,
``compute_rollout_rejection_mask``) and TRL's vLLM importance-sampling modes (``huggingface/trl@f2cd577``
``trl/trainer/grpo_trainer.py``); see docs/methods/corrections.md.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.errors import InputError
from rolloutopt.losses import policy_loss
from rolloutopt.ratios import (
    MIS,
    OPSM,
    RS_OPTIONS,
    TIS,
    CorrectionOutput,
    MaskOutput,
    PPOClip,
    RejectionFilter,
    StageContext,
    fp8_token_mis,
    fp8_token_tis,
    from_trl_vllm_is,
    from_verl_rollout_is,
    mis_weight,
    offpolicy_metrics,
    opsm_keep,
    rejection_keep,
    rs_statistic,
    tis_weight,
)

D = torch.float64
LN = math.log


def t(x: object, **kw: Any) -> torch.Tensor:
    return torch.tensor(x, dtype=D, **kw)


def ones_mask(b: int, n: int) -> torch.Tensor:
    return torch.ones(b, n, dtype=torch.bool)


def ctx_of(old: torch.Tensor, behav: torch.Tensor | None, mask: torch.Tensor | None = None, **kw: Any) -> StageContext:
    m = ones_mask(*old.shape) if mask is None else mask
    logp = kw.pop("logp", old.clone())
    adv = kw.pop("advantages", torch.ones(old.shape[0], 1, dtype=old.dtype))
    return StageContext(logp=logp, old_logp=old, mask=m, advantages=adv, behav_logp=behav, **kw)


# ----------------------------------------------------------------------------------------------- TIS oracles

ORACLE_LR = t([[LN(3.0), 0.0, LN(0.5)]])  # TIS: token weights [2, 1, 0.5]; sequence min(1.5, 2) = 1.5


def w_of(out: CorrectionOutput) -> torch.Tensor:
    assert isinstance(out, CorrectionOutput)
    return out.weight


def test_tis_token_and_sequence_oracle() -> None:
    m = ones_mask(1, 3)
    out = tis_weight(ORACLE_LR, m)
    assert isinstance(out, CorrectionOutput) and out.keep is None
    torch.testing.assert_close(out.weight, t([[2.0, 1.0, 0.5]]))
    assert set(out.metrics) == set(TIS()(ctx_of(ORACLE_LR, torch.zeros_like(ORACLE_LR))).metrics)
    torch.testing.assert_close(out.metrics["tis_high_frac"], t(1 / 3))
    torch.testing.assert_close(w_of(tis_weight(ORACLE_LR, m, level="sequence")), t([[1.5, 1.5, 1.5]]))
    torch.testing.assert_close(w_of(tis_weight(ORACLE_LR, m, level="sequence", cap=1.2)), t([[1.2, 1.2, 1.2]]))
    # geometric (ROLL's weight_type="geometric"): (3 * 1 * 0.5)^(1/3) = 1.5^(1/3) = 1.1447
    torch.testing.assert_close(
        w_of(tis_weight(ORACLE_LR, m, level="geometric")), torch.full((1, 3), 1.5 ** (1 / 3), dtype=D)
    )


def test_tis_geometric_against_roll() -> None:
    """ROLL's ``train_infer_correction.is_weight`` with ``weight_type="geometric"``, by hand following
    ``alibaba/ROLL@8eb27cc2dc34`` ``roll/utils/train_infer_corrections.py``.

    ``_compute_all_granularity``: ``log_ratio = old_log_probs - infer_log_probs``, ``ratio_geometric =
    exp(masked_mean(log_ratio, response_mask, dim=-1))`` broadcast over the row, where ``masked_mean``
    (``roll/utils/functionals.py``) divides by ``mask_sum + 1e-8`` and gives 0 for an empty row;
    ``compute_train_infer_correction`` then clamps to ``[0, upper_bound]`` (default 1.2). Rows: [ln 1.2, ln 1.5,
    ln 0.9] → (1.2 · 1.5 · 0.9)^(1/3) = 1.62^(1/3) = 1.17451, under the cap; [ln 2, ln 2, pad] → 2, capped at
    1.2; [ln 0.5, pad, pad] → 0.5; an empty row → e^0 = 1 in ROLL, 0 here (weights are 0 outside the mask and
    the row carries no loss). ROLL's ``+1e-8`` changes the mean log-ratio by a relative 1e-8/L at most.
    """
    lr = t([[LN(1.2), LN(1.5), LN(0.9)], [LN(2.0), LN(2.0), 7.0], [LN(0.5), -3.0, 0.0], [0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 0, 0], [0, 0, 0]], dtype=torch.bool)
    out = tis_weight(lr, mask, cap=1.2, level="geometric")
    roll_rows = t([1.62 ** (1 / 3), 1.2, 0.5, 1.0])
    want = roll_rows[:, None].expand(4, 3) * mask
    torch.testing.assert_close(out.weight, want, rtol=1e-7, atol=0)
    torch.testing.assert_close(out.metrics["tis_high_frac"], t(1 / 3))  # over the 3 non-empty rows
    torch.testing.assert_close(out.metrics["tis_raw_max"], t(2.0))
    # the stage: TIS(level="geometric", cap=1.2) on old / behav log-probs gives the same weights
    behav = torch.full_like(lr, -1.0)
    stage = TIS(cap=1.2, level="geometric")(ctx_of(behav + lr, behav, mask))
    torch.testing.assert_close(stage.weight, want, rtol=1e-7, atol=0)


def test_roll_filter_has_no_effect_under_roll_token_mean_but_ours_removes() -> None:
    """ROLL's ratio filter (``TrainInferFilterConfig``, ``agg_type="geometric"``, ``ratio_low=0.8``,
    ``ratio_high=1.2``) zeroes ``final_response_mask`` for the row whose geometric ratio is 2; but ROLL's
    ``agg_loss`` ``token-mean`` (``alibaba/ROLL@8eb27cc2dc34`` ``roll/utils/functionals.py``) is
    ``(loss_mat * weights).sum() / batch_num_tokens`` without the mask, so the filtered row stays in the loss.

    Batch: two rows of 2 tokens, A = 1, r = 1 (on-policy), IS weight off: ROLL's loss is -(1 + 1 + 1 + 1) / 4 =
    -1 with or without the filter. rolloutopt's ``MIS(0.8, 1.2, level="geometric", in_band="one")`` removes the
    row: -(1 + 1) / 4 = -0.5 (the removed tokens stay in the denominator by default).
    """
    old = t([[-1.0, -1.0], [-1.0, -1.0]])
    behav = old - t([[0.0, 0.0], [LN(2.0), LN(2.0)]])  # row 1: old - behav = ln 2, geometric ratio 2
    mask = ones_mask(2, 2)
    filt = MIS(low=0.8, high=1.2, level="geometric", in_band="one")
    out = policy_loss(
        old.clone(), old, t([1.0, 1.0]), mask, behav_logp=behav, correction=filt, trust=None, agg="token-mean"
    )
    torch.testing.assert_close(out.loss, t(-0.5))
    roll_loss = -(torch.ones(2, 2, dtype=D)).sum() / mask.sum()  # ROLL: the mask never enters the numerator
    torch.testing.assert_close(roll_loss, t(-1.0))


def test_tis_lower_clamp_and_batch_normalisation_by_hand() -> None:
    m = ones_mask(1, 3)
    torch.testing.assert_close(w_of(tis_weight(ORACLE_LR, m, lower=0.8)), t([[2.0, 1.0, 0.8]]))
    # token mean of [2, 1, 0.5] is 7/6
    torch.testing.assert_close(w_of(tis_weight(ORACLE_LR, m, batch_normalize=True)), t([[12 / 7, 6 / 7, 3 / 7]]))
    # sequence level: rows with weights 1.5 (3 tokens) and 2 (capped e^1, 1 token): mean over rows 1.75
    lr = t([[LN(3.0), 0.0, LN(0.5)], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    w = w_of(tis_weight(lr, mask, level="sequence", batch_normalize=True))
    torch.testing.assert_close(w, t([[1.5 / 1.75] * 3, [2 / 1.75, 0.0, 0.0]]))
    # geometric level, same rows: 1.5^(1/3) and e^1 capped at 2, mean over rows
    geo = w_of(tis_weight(lr, mask, level="geometric", batch_normalize=True))
    mean = (1.5 ** (1 / 3) + 2.0) / 2
    torch.testing.assert_close(geo, t([[1.5 ** (1 / 3) / mean] * 3, [2 / mean, 0.0, 0.0]]))


def test_tis_sequence_is_a_product_and_masked_positions_do_not_count() -> None:
    lr = t([[0.5, 0.25, 9.0]])
    mask = torch.tensor([[True, True, False]])
    w = w_of(tis_weight(lr, mask, level="sequence", cap=10.0))
    torch.testing.assert_close(w, t([[math.exp(0.75), math.exp(0.75), 0.0]]))  # not the geometric mean e^0.375
    geo = w_of(tis_weight(lr, mask, level="geometric", cap=10.0))
    torch.testing.assert_close(geo, t([[math.exp(0.375), math.exp(0.375), 0.0]]))


def test_tis_stage_metrics_by_hand() -> None:
    old = t([[LN(3.0), 0.0, LN(0.5)]])
    out = TIS(lower=0.6)(ctx_of(old, torch.zeros_like(old)))
    torch.testing.assert_close(out.weight, t([[2.0, 1.0, 0.6]]))
    assert out.keep is None and not out.weight.requires_grad
    m = out.metrics
    torch.testing.assert_close(m["tis_high_frac"], t(1 / 3))
    torch.testing.assert_close(m["tis_low_frac"], t(1 / 3))
    torch.testing.assert_close(m["tis_raw_mean"], t((3 + 1 + 0.5) / 3))
    torch.testing.assert_close(m["tis_raw_max"], t(3.0))
    torch.testing.assert_close(m["tis_raw_min"], t(0.5))
    torch.testing.assert_close(m["tis_log_ratio_mean"], t(LN(1.5) / 3))
    seq = TIS(level="sequence", batch_normalize=True)(ctx_of(old, torch.zeros_like(old))).metrics
    torch.testing.assert_close(seq["tis_raw_mean"], t(1.5))
    torch.testing.assert_close(seq["tis_high_frac"], t(0.0))
    torch.testing.assert_close(seq["tis_batch_norm_factor"], t(1.5))


def test_tis_source_current_uses_the_policy_log_probs_detached() -> None:
    old = t([[0.0, 0.0]])
    logp = t([[LN(1.5), LN(4.0)]], requires_grad=True)
    behav = torch.zeros_like(old)
    out = TIS(source="current")(ctx_of(old, behav, logp=logp))
    torch.testing.assert_close(out.weight, t([[1.5, 2.0]]))
    assert not out.weight.requires_grad
    torch.testing.assert_close(TIS()(ctx_of(old, behav, logp=logp)).weight, t([[1.0, 1.0]]))


def test_tis_clamps_before_exp() -> None:
    # +inf and -inf partial sums must not meet in the sequence sum (tokens are bounded at 1e6 before it)
    huge = t([[1e308, 1e308, -1e308, -1e308] * 4])  # torch's vectorised sum of these is NaN
    for level in ("sequence", "geometric"):
        assert torch.isfinite(w_of(tis_weight(huge, ones_mask(1, 16), level=level))).all()  # type: ignore[arg-type]
        assert torch.isfinite(w_of(mis_weight(huge, ones_mask(1, 16), level=level))).all()  # type: ignore[arg-type]
    assert opsm_keep(huge, -huge, t([-1.0]), ones_mask(1, 16)).keep.shape == (1, 16)
    lr = t([[1e6, -1e6, 30.0]])
    w = w_of(tis_weight(lr, ones_mask(1, 3), cap=1e12))
    torch.testing.assert_close(w, t([[math.exp(20.0), math.exp(-20.0), math.exp(20.0)]]))
    torch.testing.assert_close(w_of(tis_weight(lr, ones_mask(1, 3), cap=1e12, clamp=25.0))[0, 2], t(math.exp(25.0)))


# ----------------------------------------------------------------------------------------------- MIS oracles


def test_icepop_oracle() -> None:
    lr = torch.log(t([[0.4, 1.2, 6.0]]))  # IcePop (0.5, 5), in-band weight = ratio as in verl -> [0, 1.2, 0]
    out = mis_weight(lr, ones_mask(1, 3))
    assert isinstance(out, CorrectionOutput) and out.keep is not None
    w, keep = out.weight, out.keep
    torch.testing.assert_close(w, t([[0.0, 1.2, 0.0]]))
    assert keep.tolist() == [[False, True, False]]
    torch.testing.assert_close(out.metrics["mis_oob_frac"], t(2 / 3))
    assert set(out.metrics) == set(MIS()(ctx_of(lr, torch.zeros_like(lr))).metrics)
    w1 = w_of(mis_weight(lr, ones_mask(1, 3), in_band="one"))
    torch.testing.assert_close(w1, t([[0.0, 1.0, 0.0]]))
    up = mis_weight(lr, ones_mask(1, 3), low=None, high=5.0)  # one-sided
    w_up, keep_up = up.weight, up.keep
    assert keep_up is not None
    torch.testing.assert_close(w_up, t([[0.4, 1.2, 0.0]]))
    assert keep_up.tolist() == [[True, True, False]]


def test_sequence_and_geometric_mis_oracle() -> None:
    lr = t([[0.3, 0.3, 0.3]])  # MIS: product e^0.9 = 2.46 rejected by [0.5, 2]; geometric e^0.3 kept
    out = mis_weight(lr, ones_mask(1, 3), low=0.5, high=2.0, level="sequence")
    assert out.keep is not None and not out.keep.any() and (out.weight == 0).all()
    torch.testing.assert_close(out.metrics["mis_seq_oob_frac"], t(1.0))
    out = mis_weight(lr, ones_mask(1, 3), low=0.5, high=2.0, level="geometric")
    assert out.keep is not None and out.keep.all()
    torch.testing.assert_close(out.weight, torch.full((1, 3), math.exp(0.3), dtype=D))


def test_mis_stage_metrics_and_keep() -> None:
    old = torch.log(t([[0.4, 1.2, 6.0], [1.0, 1.0, 1.0]]))
    mask = torch.tensor([[True, True, True], [True, False, False]])
    out = MIS()(ctx_of(old, torch.zeros_like(old), mask))
    assert out.keep is not None and out.keep[0].tolist() == [False, True, False]
    m = out.metrics
    torch.testing.assert_close(m["mis_high_frac"], t(1 / 4))
    torch.testing.assert_close(m["mis_low_frac"], t(1 / 4))
    torch.testing.assert_close(m["mis_oob_frac"], t(2 / 4))
    seq = MIS(low=0.5, high=2.0, level="sequence")(ctx_of(old, torch.zeros_like(old), mask))
    # row 0: product 0.4 * 1.2 * 6 = 2.88 > 2, dropped; row 1 (one token, ratio 1) kept
    assert seq.keep is not None and seq.keep.tolist() == [[False] * 3, [True, False, False]]  # within mask
    torch.testing.assert_close(seq.metrics["mis_seq_oob_frac"], t(0.5))
    torch.testing.assert_close(seq.metrics["mis_oob_frac"], t(3 / 4))  # token-weighted, as verl's oob ratio


def test_mis_removes_tokens_from_the_loss_and_keeps_the_denominator() -> None:
    old = torch.log(t([[0.4, 1.2, 6.0]])) - 3.0  # log-probs; rho = exp(old - behav) = [0.4, 1.2, 6.0]
    behav = torch.full_like(old, -3.0)
    logp = old.clone().requires_grad_(True)
    kw: dict[str, Any] = {"behav_logp": behav, "correction": MIS(), "trust": None, "agg": "token-mean"}
    out = policy_loss(logp, old, t([1.0]), ones_mask(1, 3), **kw)
    torch.testing.assert_close(out.loss, t(-1.2 / 3))  # -A * r * w on the kept token, over the 3 tokens
    out2 = policy_loss(logp, old, t([1.0]), ones_mask(1, 3), removed_in_denominator=False, **kw)
    torch.testing.assert_close(out2.loss, t(-1.2))
    torch.testing.assert_close(out.metrics["masked_frac"], t(2 / 3))


# ----------------------------------------------------------------------------------------------- FP8-RL


def test_fp8_constructors() -> None:
    assert fp8_token_tis() == TIS(cap=2.0, level="token")
    assert fp8_token_mis(experimental=True) == MIS(low=None, high=2.0, level="token", in_band="ratio")
    assert fp8_token_mis(3.0, variant="band", low=0.4, experimental=True) == MIS(low=0.4, high=3.0, in_band="one")
    with pytest.raises(InputError, match="experimental"):
        fp8_token_mis()
    with pytest.raises(InputError, match="variant"):
        fp8_token_mis(variant="lower", experimental=True)  # type: ignore[arg-type]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_rho_one_leaves_the_loss_bit_identical(agg: str) -> None:
    """The FP8-RL invariant (arXiv 2601.18150): no mismatch (behav = old) leaves the loss and its gradient
    bit-identical."""
    gen = torch.Generator().manual_seed(0)
    old = -torch.rand(4, 6, generator=gen, dtype=torch.float32) * 3
    logp0 = (old + 0.3 * torch.randn(4, 6, generator=gen, dtype=torch.float32)).clamp(max=0.0)
    mask = torch.rand(4, 6, generator=gen) < 0.8
    adv = torch.randn(4, generator=gen)
    base_lp = logp0.clone().requires_grad_(True)
    base = policy_loss(base_lp, old, adv, mask, agg=agg)
    (g0,) = torch.autograd.grad(base.loss, base_lp)
    corrections = [
        fp8_token_tis(),
        fp8_token_mis(experimental=True),
        fp8_token_mis(variant="band", experimental=True),
        TIS(level="sequence"),
        MIS(level="geometric", low=0.999, high=1.001),
    ]
    for corr in corrections:
        lp = logp0.clone().requires_grad_(True)
        out = policy_loss(lp, old, adv, mask, behav_logp=old.clone(), correction=corr, agg=agg)
        (g,) = torch.autograd.grad(out.loss, lp)
        assert torch.equal(out.loss, base.loss), corr
        assert torch.equal(g, g0), corr
        assert out.loss.dtype == torch.float32


# ----------------------------------------------------------------------------------------------- OPSM


def test_opsm_oracle() -> None:
    # row means of (behav - logp): row 0 (0.2 + 0.0) / 2 = 0.1; row 1 0.0; row 2 (one token) 0.3
    logp = t([[-1.0, -2.0, 0.0], [-1.0, -1.0, -1.0], [-0.5, 0.0, 0.0]])
    behav = t([[-0.8, -2.0, 5.0], [-1.0, -1.0, -1.0], [-0.2, 9.0, 9.0]])
    mask = torch.tensor([[True, True, False], [True, True, True], [True, False, False]])
    adv = t([-1.0, -1.0, 2.0])
    out = opsm_keep(logp, behav, adv, mask, delta=0.05)
    assert isinstance(out, MaskOutput)
    assert out.keep.tolist() == [[False, False, False], [True] * 3, [True, False, False]]  # row 2 has A >= 0
    torch.testing.assert_close(out.metrics["opsm_masked_frac"], t(2 / 6))
    torch.testing.assert_close(out.metrics["opsm_seq_masked_frac"], t(1 / 3))
    torch.testing.assert_close(out.metrics["opsm_kl_mean"], t((0.1 + 0.0 + 0.3) / 3))
    assert torch.equal(opsm_keep(logp, behav, adv, mask, delta=0.1).keep, mask)  # <= delta keeps
    tok_adv = t([[-1.0, 0.0, 1.0], [-1.0, -1.0, -1.0], [-1.0, 1.0, 1.0]])
    keep_t = opsm_keep(logp, behav, tok_adv, mask, delta=0.05).keep
    assert keep_t.tolist() == [[False, True, False], [True] * 3, [False, False, False]]


def test_opsm_stage_source_and_metrics() -> None:
    old = t([[-1.0, -1.0], [-1.0, -1.0]])
    logp = t([[-1.5, -1.5], [-1.0, -1.0]], requires_grad=True)
    behav = t([[-1.0, -1.0], [-0.5, -0.5]])
    adv = t([[-1.0], [-1.0]])
    ctx = ctx_of(old, behav, logp=logp, advantages=adv)
    # auto with behav: divergences 0.5 and 0.5 -> both dropped at delta 0.1
    out = OPSM(delta=0.1)(ctx)
    assert out.keep is not None and not out.keep.any()
    torch.testing.assert_close(out.metrics["opsm_masked_frac"], t(1.0))
    torch.testing.assert_close(out.metrics["opsm_kl_mean"], t(0.5))
    # old as source: divergences 0.5 and 0.0 -> row 0 dropped
    out_old = OPSM(delta=0.1, source="old")(ctx)
    assert out_old.keep is not None and out_old.keep.tolist() == [[False, False], [True, True]]
    torch.testing.assert_close(out_old.metrics["opsm_seq_masked_frac"], t(0.5))
    torch.testing.assert_close(out_old.weight, torch.ones(2, 2, dtype=D))
    # auto without behav falls back to old (TRL); source="behav" requires it
    no_behav = ctx_of(old, None, logp=logp, advantages=adv)
    assert torch.equal(OPSM(delta=0.1)(no_behav).keep, out_old.keep)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="behav_logp"):
        OPSM(source="behav")(no_behav)


# ----------------------------------------------------------------------------------------------- rejection


def test_rs_statistics_by_hand() -> None:
    lr = t([[LN(2.0), LN(2.0), 0.5], [0.5, -0.2, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    k3 = lambda x: math.exp(x) - 1 - x  # noqa: E731
    torch.testing.assert_close(rs_statistic(lr, mask, "token_k1")[1], t([-0.5, 0.2, 0.0]))
    torch.testing.assert_close(rs_statistic(lr, mask, "token_k2")[1], t([0.125, 0.02, 0.0]))
    torch.testing.assert_close(rs_statistic(lr, mask, "seq_sum_k1")[:, 0], t([-2 * LN(2.0), -0.3]))
    torch.testing.assert_close(rs_statistic(lr, mask, "seq_mean_k1")[:, 0], t([-LN(2.0), -0.1]))
    torch.testing.assert_close(rs_statistic(lr, mask, "seq_mean_k3")[:, 0], t([k3(LN(2.0)), (k3(0.5) + k3(-0.2)) / 3]))
    torch.testing.assert_close(rs_statistic(lr, mask, "seq_max_k2")[:, 0], t([0.5 * LN(2.0) ** 2, 0.125]))
    torch.testing.assert_close(rs_statistic(lr, mask, "seq_sum_k3")[:, 0], t([2 * k3(LN(2.0)), k3(0.5) + k3(-0.2)]))
    torch.testing.assert_close(rs_statistic(lr, mask, "catastrophic")[:, 0], t([0.0, -0.2]))


def test_rejection_keep_by_hand() -> None:
    lr = t([[LN(2.0), LN(2.0)], [0.5, -0.2]])
    m = ones_mask(2, 2)
    # seq_sum_k1: pi_beh/pi_old = 1/4 and e^-0.3 = 0.74 -> bounds (0.4, 2.5) drop row 0 only
    out = rejection_keep(lr, m, options=("seq_sum_k1",), thresholds=(0.4, 2.5))
    assert isinstance(out, MaskOutput)
    assert out.keep.tolist() == [[False] * 2, [True] * 2]
    torch.testing.assert_close(out.metrics["rs_masked_frac"], t(0.5))
    torch.testing.assert_close(out.metrics["rs_seq_sum_k1_mean"], t((2 * -2 * LN(2.0) + 2 * -0.3) / 4))
    # seq_mean_k1: 1/2 and e^-0.15 -> both kept
    assert rejection_keep(lr, m, options=("seq_mean_k1",), thresholds=(0.4, 2.5)).keep.all()
    # token_k2 0.1: 0.5 ln2^2 = 0.24 dropped, 0.125 dropped, 0.02 kept
    keep = rejection_keep(lr, m, options=("token_k2",), thresholds=0.1).keep
    assert keep.tolist() == [[False, False], [False, True]]
    # chain = AND
    chain = rejection_keep(lr, m, options=("seq_mean_k1", "token_k2"), thresholds=((0.4, 2.5), 0.2)).keep
    assert chain.tolist() == [[False, False], [True, True]]
    # a single u means [1/u, u]
    keep = rejection_keep(lr, m, options=("token_k1",), thresholds=1.9).keep
    assert keep.tolist() == [[False, False], [True, True]]
    # keep is a subset of mask
    part = torch.tensor([[True, False], [True, True]])
    assert rejection_keep(lr, part, options=("token_k1",), thresholds=1.9).keep.tolist() == [[False] * 2, [True] * 2]


def test_k1_bounds_apply_to_the_inverse_ratio() -> None:
    """verl's k1 = -log rho: asymmetric bounds (0.5, 4) reject rho = 3 (pi_beh/pi_old = 1/3 < 0.5)."""
    lr = t([[LN(3.0), LN(1 / 3)]])
    keep = rejection_keep(lr, ones_mask(1, 2), options=("token_k1",), thresholds=((0.5, 4.0),)).keep
    assert keep.tolist() == [[False, True]]


def test_catastrophic_reject() -> None:
    old = t([[0.0, LN(1e-5), 0.0], [LN(1e-3), 0.0, 0.0]])
    out = RejectionFilter(options=("catastrophic",), thresholds=1e-4)(ctx_of(old, torch.zeros_like(old)))
    assert out.keep is not None and out.keep.tolist() == [[False] * 3, [True] * 3]
    torch.testing.assert_close(out.metrics["rs_masked_frac"], t(0.5))
    torch.testing.assert_close(out.metrics["rs_seq_masked_frac"], t(0.5))
    torch.testing.assert_close(out.metrics["rs_catastrophic_masked_frac"], t(0.5))


def test_rejection_filter_stage_metrics() -> None:
    old = t([[LN(2.0), LN(2.0)], [0.5, -0.2]])
    mask = torch.tensor([[True, True], [True, False]])
    f = RejectionFilter(options=("seq_mean_k1", "token_k2"), thresholds=((0.4, 2.5), 0.1))
    out = f(ctx_of(old, torch.zeros_like(old), mask))
    assert out.keep is not None
    assert (out.keep & mask).tolist() == [[False, False], [False, False]]
    torch.testing.assert_close(out.metrics["rs_seq_mean_k1_masked_frac"], t(0.0))
    torch.testing.assert_close(out.metrics["rs_token_k2_masked_frac"], t(1.0))
    torch.testing.assert_close(out.metrics["rs_seq_masked_frac"], t(1.0))
    torch.testing.assert_close(out.metrics["rs_seq_mean_k1_mean"], t((2 * -LN(2.0) + -0.5) / 3))


def test_from_verl_parsers() -> None:
    f = RejectionFilter.from_verl("token_k1, seq_mean_k3,token_k1", "0.5_2.0,0.01")
    assert f.options == ("token_k1", "seq_mean_k3") and f.thresholds == ((0.5, 2.0), 0.01)
    assert RejectionFilter.from_verl("seq_mean_k1", "0.999_1.001") == RejectionFilter()
    assert RejectionFilter.from_verl("seq_mean_k2,seq_max_k3", 0.2).thresholds == (0.2,)
    assert from_verl_rollout_is("token", 2.0) == TIS(cap=2.0)
    assert from_verl_rollout_is("sequence", "3.0", batch_normalize=True) == TIS(3.0, "sequence", batch_normalize=True)
    assert from_verl_rollout_is("token", "0.5_5.0") == MIS()
    assert from_trl_vllm_is() == MIS(low=None, high=3.0, level="sequence")
    assert from_trl_vllm_is("token_truncate", 0.5, None) == TIS(cap=None, lower=0.5)
    with pytest.raises(InputError, match="rollout_rs_threshold"):
        RejectionFilter.from_verl("token_k1", "a_b")
    with pytest.raises(InputError, match="rollout_is_threshold"):
        from_verl_rollout_is("token", "x")
    with pytest.raises(InputError, match="rollout_is"):
        from_verl_rollout_is("geometric", 2.0)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="mode"):
        from_trl_vllm_is("token")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------------------------- edge cases


ALL_STAGES = [
    TIS(),
    TIS(level="sequence", batch_normalize=True),
    TIS(level="geometric", lower=0.5),
    MIS(),
    MIS(level="sequence", batch_normalize=True),
    MIS(level="geometric"),
    OPSM(),
    OPSM(source="old"),
    RejectionFilter(),
    RejectionFilter.from_verl("token_k1,seq_max_k3,seq_sum_k2", "1.5,0.1,0.1"),
    RejectionFilter(options=("catastrophic",), thresholds=1e-4),
]


def test_empty_mask_and_all_masked_rows() -> None:
    old = t([[0.3, -0.2], [5.0, 1.0]]) - 6.0
    mask = torch.tensor([[True, True], [False, False]])
    empty = torch.zeros(2, 2, dtype=torch.bool)
    behav = torch.full_like(old, -6.0)
    for corr in ALL_STAGES:
        for m in (mask, empty):
            out = corr(ctx_of(old, behav, m, advantages=t([[-1.0], [-1.0]])))
            assert torch.isfinite(out.weight).all()
            assert (out.weight[~m] == 0).all() or isinstance(corr, (OPSM, RejectionFilter))
            for v in out.metrics.values():
                assert v.ndim == 0 and torch.isfinite(v)
            lp = old.clone().requires_grad_(True)
            behav_kw = {"behav_logp": behav} if "behav_logp" in corr.requires + corr.accepts else {}
            loss = policy_loss(lp, old, t([-1.0, -1.0]), m, correction=corr, **behav_kw)  # type: ignore[arg-type]
            assert torch.isfinite(loss.loss)


EMPTY_SHAPES = [(0, 4), (3, 0), (0, 0), (2, 3)]  # B = 0, T = 0, both, all-masked rows


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
@pytest.mark.parametrize("corr", ALL_STAGES, ids=repr)
def test_stages_on_empty_batches_give_zero_loss(shape: tuple[int, int], corr: Any) -> None:
    lp = torch.full(shape, -1.0, dtype=D, requires_grad=True)
    mask = torch.zeros(shape, dtype=torch.bool)
    behav_kw = {"behav_logp": lp.detach() - 0.5} if "behav_logp" in corr.requires + corr.accepts else {}
    for agg in ("token-mean", "seq-mean-token-mean"):
        out = policy_loss(
            lp, lp.detach() - 0.2, -torch.ones(shape[0], dtype=D), mask, correction=corr, agg=agg, **behav_kw
        )
        assert float(out.loss.detach()) == 0.0
        assert all(bool(torch.isfinite(v)) for v in out.metrics.values())
        (g,) = torch.autograd.grad(out.loss, lp)
        assert not g.any()


@pytest.mark.parametrize("shape", EMPTY_SHAPES)
def test_pure_functions_on_empty_batches(shape: tuple[int, int]) -> None:
    lr, m = torch.zeros(shape, dtype=D), torch.zeros(shape, dtype=torch.bool)
    for level in ("token", "sequence", "geometric"):
        out = tis_weight(lr, m, level=level, batch_normalize=True)  # type: ignore[arg-type]
        assert torch.equal(out.weight, torch.zeros(shape, dtype=D)) and out.keep is None
        assert all(float(v) == 0 for k, v in out.metrics.items() if k != "tis_batch_norm_factor")
        out = mis_weight(lr, m, level=level)  # type: ignore[arg-type]
        assert out.keep is not None and out.keep.shape == shape and not out.keep.any()
        assert all(float(v) == 0 for v in out.metrics.values())
    for opt in RS_OPTIONS:
        keep = rejection_keep(lr, m, options=(opt,), thresholds=1e-4 if opt == "catastrophic" else 1.5)
        assert keep.keep.shape == shape and all(float(v) == 0 for v in keep.metrics.values())
        assert rs_statistic(lr, m, opt).shape[0] == shape[0]
    keep = opsm_keep(lr - 1.0, lr - 1.0, torch.ones(shape[0], dtype=D), m)
    assert keep.keep.shape == shape and all(float(v) == 0 for v in keep.metrics.values())
    assert all(float(v) == 0 for v in offpolicy_metrics(lr - 1.0, lr - 1.0, m).values())


@pytest.mark.parametrize(
    ("corr", "requires", "accepts"),
    [
        (TIS(), ("behav_logp",), ()),
        (TIS(level="geometric", source="current"), ("behav_logp",), ()),
        (MIS(level="sequence"), ("behav_logp",), ()),
        (RejectionFilter(), ("behav_logp",), ()),
        (OPSM(), (), ("behav_logp",)),
        (OPSM(source="behav"), ("behav_logp",), ()),
        (OPSM(source="old"), (), ()),
    ],
    ids=repr,
)
def test_declared_inputs_match_what_the_stage_reads(
    corr: Any, requires: tuple[str, ...], accepts: tuple[str, ...]
) -> None:
    assert corr.requires == requires and corr.accepts == accepts
    old = t([[-1.0, -2.0], [-0.5, -0.3]])
    behav = old - t([[0.1, 0.3], [-0.2, 0.0]])
    full = ctx_of(old, behav, advantages=t([[-1.0], [1.0]]))
    assert isinstance(corr(full), CorrectionOutput)
    bare = ctx_of(old, None, advantages=t([[-1.0], [1.0]]))
    if "behav_logp" in requires:  # a context lacking a required input raises, naming it
        with pytest.raises(InputError) as e:
            corr(bare)
        assert e.value.argument == "behav_logp"
    else:  # runs without it
        assert isinstance(corr(bare), CorrectionOutput)
    if accepts:  # an accepted input changes what the stage computes when given (OPSM: behav instead of old)
        assert not torch.equal(corr(full).metrics["opsm_kl_mean"], corr(bare).metrics["opsm_kl_mean"])
    mask = ones_mask(2, 2)
    if requires or accepts:
        policy_loss(old, old, t([-1.0, 1.0]), mask, behav_logp=behav, correction=corr)
    else:  # policy_loss refuses an input nothing declares
        with pytest.raises(InputError) as e:
            policy_loss(old, old, t([-1.0, 1.0]), mask, behav_logp=behav, correction=corr)
        assert e.value.argument == "behav_logp"
    given = {"behav_logp": behav} if requires or accepts else {}
    with pytest.raises(InputError) as e:
        policy_loss(old, old, t([-1.0, 1.0]), mask, correction=corr, confidence=t([0.5, 0.5]), **given)
    assert e.value.argument == "confidence"


def test_garbage_in_padding_and_dtype() -> None:
    old = torch.tensor([[0.2, math.inf], [-0.1, math.nan]], dtype=torch.float32)
    behav = torch.tensor([[0.0, -math.inf], [0.0, 1.0]], dtype=torch.float32)
    mask = torch.tensor([[True, False], [True, False]])
    for corr in (
        TIS(),
        TIS(level="sequence"),
        MIS(level="sequence"),
        MIS(level="geometric"),
        RejectionFilter(),
        OPSM(),
    ):
        out = corr(ctx_of(old, behav, mask, logp=torch.zeros_like(old)))
        assert out.weight.dtype == torch.float32 and torch.isfinite(out.weight).all()
        assert all(torch.isfinite(v) for v in out.metrics.values())
    assert mis_weight(old.double(), mask, level="sequence").weight.dtype == D
    for level in ("sequence", "geometric"):
        out = tis_weight(old - behav, mask, level=level)  # type: ignore[arg-type]
        assert torch.isfinite(out.weight).all() and all(torch.isfinite(v) for v in out.metrics.values())


def test_missing_behaviour_log_probs_raise() -> None:
    old = t([[0.0, 0.0]])
    for corr in (TIS(), MIS(), RejectionFilter()):
        with pytest.raises(InputError, match="behav_logp"):
            corr(ctx_of(old, None))
    with pytest.raises(InputError, match="behav_logp"):
        policy_loss(old.clone().requires_grad_(True), old, t([1.0]), ones_mask(1, 2), correction=TIS())


# ----------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    ("make", "arg"),
    [
        (lambda: TIS(cap=0.0), "TIS.cap"),
        (lambda: TIS(cap=None), "TIS.cap"),
        (lambda: TIS(cap=2.0, lower=3.0), "TIS.lower"),
        (lambda: TIS(lower=-1.0), "TIS.lower"),
        (lambda: TIS(level="segment"), "TIS.level"),
        (lambda: TIS(batch_normalize=1), "TIS.batch_normalize"),
        (lambda: TIS(source="behav"), "TIS.source"),
        (lambda: TIS(clamp=0.0), "TIS.clamp"),
        (lambda: MIS(low=3.0, high=2.0), "MIS.low"),
        (lambda: MIS(low=0.0), "MIS.low"),
        (lambda: MIS(low=None, high=None), "MIS.high"),
        (lambda: MIS(high=-1.0), "MIS.high"),
        (lambda: MIS(in_band="half"), "MIS.in_band"),
        (lambda: MIS(level="segment"), "MIS.level"),
        (lambda: MIS(source=None), "MIS.source"),
        (lambda: OPSM(delta=math.nan), "OPSM.delta"),
        (lambda: OPSM(delta="0.1"), "OPSM.delta"),
        (lambda: OPSM(source="current"), "OPSM.source"),
        (lambda: RejectionFilter(options=("token_k4",)), "RejectionFilter.options"),
        (lambda: RejectionFilter(options=()), "RejectionFilter.options"),
        (lambda: RejectionFilter(options="seq_mean_k1"), "RejectionFilter.options"),
        (lambda: RejectionFilter(options=("token_k1", "token_k1"), thresholds=2.0), "RejectionFilter.options"),
        (
            lambda: RejectionFilter(options=("token_k1", "token_k2", "token_k3"), thresholds=(2.0, 0.1)),
            "RejectionFilter.thresholds",
        ),
        (
            lambda: RejectionFilter(options=("token_k2",), thresholds=((0.1, 0.2),)),
            "RejectionFilter.thresholds[token_k2]",
        ),
        (lambda: RejectionFilter(options=("token_k1",), thresholds=0.5), "RejectionFilter.thresholds[token_k1]"),
        (
            lambda: RejectionFilter(options=("token_k1",), thresholds=((2.0, 1.0),)),
            "RejectionFilter.thresholds[token_k1]",
        ),
        (lambda: RejectionFilter(options=("token_k3",), thresholds=-0.1), "RejectionFilter.thresholds[token_k3]"),
        (lambda: RejectionFilter(source="x"), "RejectionFilter.source"),
        (lambda: fp8_token_mis(cap=-1.0, experimental=True), "cap"),
    ],
)
def test_bad_hyper_parameters(make: Any, arg: str) -> None:
    with pytest.raises(InputError) as e:
        make()
    assert e.value.argument == arg


def test_bad_tensors_to_pure_functions() -> None:
    m = ones_mask(1, 3)
    with pytest.raises(InputError) as e:
        tis_weight(t([[0.0, 1.0]]), m)
    assert e.value.argument == "mask"
    with pytest.raises(InputError) as e:
        tis_weight(t([[0.0, math.nan, 0.0]]), m)
    assert e.value.argument == "log_ratio"
    tis_weight(t([[0.0, math.nan, 0.0]]), torch.tensor([[True, False, True]]))  # masked-out NaN is fine
    with pytest.raises(InputError) as e:
        mis_weight(torch.zeros(1, 3, dtype=torch.long), m)
    assert e.value.argument == "log_ratio"
    with pytest.raises(InputError) as e:
        opsm_keep(t([[0.0] * 3]), t([[0.0] * 3]), t([1.0, 2.0]), m)
    assert e.value.argument == "advantages"
    with pytest.raises(InputError) as e:
        opsm_keep(t([[0.0] * 3]), t([[0.0, math.inf, 0.0]]), t([1.0]), m)
    assert e.value.argument == "behav_logp"
    with pytest.raises(InputError) as e:
        rs_statistic(t([[0.0] * 3]), m, "seq_min_k1")
    assert e.value.argument == "option"
    with pytest.raises(InputError) as e:
        rejection_keep(t([[0.0] * 3]), m, options=("token_k2",), thresholds=0.0)
    assert e.value.argument == "thresholds[token_k2]"
    with pytest.raises(InputError) as e:
        opsm_keep(t([[0.0] * 3]), t([[0.0] * 3]), t([1.0]), m, delta=math.inf)
    assert e.value.argument == "delta"


# ----------------------------------------------------------------------------------------------- properties

finite = st.one_of(
    st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False), st.sampled_from([1e300, -1e300, 3e38, -3e38, 0.0])
)


@st.composite
def batches(draw: Any, max_b: int = 4, max_t: int = 6) -> tuple[torch.Tensor, torch.Tensor]:
    b = draw(st.integers(1, max_b))
    n = draw(st.integers(1, max_t))
    lr = t(draw(st.lists(st.lists(finite, min_size=n, max_size=n), min_size=b, max_size=b)))
    mask = torch.tensor(draw(st.lists(st.lists(st.booleans(), min_size=n, max_size=n), min_size=b, max_size=b)))
    return lr, mask


@settings(max_examples=40, deadline=None)
@given(
    batches(),
    st.floats(0.01, 100.0),
    st.one_of(st.none(), st.floats(0.0, 0.01)),
    st.sampled_from(["token", "sequence", "geometric"]),
    st.booleans(),
)
def test_prop_tis_weights_finite_and_bounded(
    batch: tuple[torch.Tensor, torch.Tensor], cap: float, lower: float | None, level: str, norm: bool
) -> None:
    lr, mask = batch
    w = tis_weight(lr, mask, cap=cap, lower=lower, level=level, batch_normalize=norm).weight  # type: ignore[arg-type]
    assert torch.isfinite(w).all() and (w[~mask] == 0).all()
    if not norm:
        assert (w <= cap).all() and (w[mask] >= (lower or 0.0)).all()
    if level != "token":  # constant within a row (verl's test)
        assert all(len(set(w[i][mask[i]].tolist())) <= 1 for i in range(w.shape[0]))


@settings(max_examples=40, deadline=None)
@given(
    batches(),
    st.floats(0.05, 1.0),
    st.floats(1.0, 20.0),
    st.floats(0.0, 0.5),
    st.floats(0.0, 5.0),
    st.sampled_from(["token", "sequence", "geometric"]),
)
def test_prop_mis_bounded_and_monotone_in_the_band(
    batch: tuple[torch.Tensor, torch.Tensor], low: float, high: float, dlow: float, dhigh: float, level: str
) -> None:
    lr, mask = batch
    out = mis_weight(lr, mask, low=low, high=high, level=level)  # type: ignore[arg-type]
    w, keep = out.weight, out.keep
    assert keep is not None and torch.isfinite(w).all() and not (keep & ~mask).any()
    nz = w[w != 0]
    assert (nz <= high).all() and (nz >= low).all()
    wider = mis_weight(lr, mask, low=low * (1 - dlow), high=high + dhigh, level=level).keep  # type: ignore[arg-type]
    assert wider is not None and (wider | ~keep).all()  # a wider band keeps a superset


@settings(max_examples=40, deadline=None)
@given(batches(), st.sampled_from(RS_OPTIONS), st.floats(1.0, 3.0), st.floats(0.0, 2.0))
def test_prop_rejection_monotone_in_threshold(
    batch: tuple[torch.Tensor, torch.Tensor], opt: str, u: float, du: float
) -> None:
    lr, mask = batch
    small = u - 1.0 + 1e-3 if not opt.endswith("k1") and opt != "catastrophic" else u
    if opt == "catastrophic":
        th, th_wide = 1.0 / u, 1.0 / (u + du)  # a lower ratio bound rejects less
    else:
        th, th_wide = small, small + du
    keep = rejection_keep(lr, mask, options=(opt,), thresholds=th).keep
    wide = rejection_keep(lr, mask, options=(opt,), thresholds=th_wide).keep
    assert (wide | ~keep).all() and not (keep & ~mask).any()


@settings(max_examples=40, deadline=None)
@given(batches(), st.lists(st.floats(-2.0, 2.0), min_size=4, max_size=4), st.floats(-0.5, 0.5), st.floats(0.0, 1.0))
def test_prop_opsm_monotone_in_delta(
    batch: tuple[torch.Tensor, torch.Tensor], adv: list[float], delta: float, dd: float
) -> None:
    lr, mask = batch
    a = t(adv[: lr.shape[0]])
    logp = lr.clamp(-50, 50) * 0.01
    keep = opsm_keep(logp, torch.zeros_like(logp), a, mask, delta=delta).keep
    wide = opsm_keep(logp, torch.zeros_like(logp), a, mask, delta=delta + dd).keep
    assert (wide | ~keep).all()
    assert torch.equal(keep[a >= 0], mask[a >= 0])


@settings(max_examples=25, deadline=None)
@given(batches(max_b=3, max_t=5), st.sampled_from(["tis", "tis_seq", "tis_geo", "mis", "geo", "rs", "opsm"]))
def test_prop_on_policy_is_the_plain_loss(batch: tuple[torch.Tensor, torch.Tensor], kind: str) -> None:
    lr, mask = batch
    old = -(lr.abs() % 5.0) - 0.1
    logp = (old + 0.05 * torch.tanh(lr)).requires_grad_(True)
    adv = torch.linspace(-1, 1, lr.shape[0], dtype=D)
    corr = {
        "tis": TIS(),
        "tis_seq": TIS(level="sequence"),
        "tis_geo": TIS(level="geometric", cap=1.2),
        "mis": MIS(),
        "geo": MIS(level="geometric", low=0.999, high=1.001),
        "rs": RejectionFilter.from_verl("token_k1,seq_mean_k3,seq_max_k2", "1.01,0.001,0.001"),
        "opsm": OPSM(delta=0.0, source="old"),
    }[kind]
    plain = policy_loss(logp, old, adv, mask)
    if kind == "opsm":  # OPSM measures against the current policy: on-policy means logp = old
        plain = policy_loss(logp, logp.detach(), adv, mask)
        out = policy_loss(logp, logp.detach(), adv, mask, correction=corr)
    else:
        out = policy_loss(logp, old, adv, mask, behav_logp=old.clone(), correction=corr)
    assert torch.equal(out.loss, plain.loss)
    assert out.metrics["masked_frac"] == 0


@settings(max_examples=15, deadline=None)
@given(batches(max_b=3, max_t=4), st.sampled_from(["tis", "tis_seq_norm", "tis_geo", "mis", "rs"]))
def test_prop_gradcheck_through_policy_loss(batch: tuple[torch.Tensor, torch.Tensor], kind: str) -> None:
    lr, mask = batch
    old = -(lr.abs() % 3.0) - 1.1  # behav = old - tanh(lr) stays a log-prob
    behav = old - torch.tanh(lr)  # mismatch in [-1, 1]
    logp = (old + 0.1 * torch.tanh(lr / 7)).requires_grad_(True)
    adv = torch.linspace(-1, 1, lr.shape[0], dtype=D)
    corr = {
        "tis": TIS(cap=1.5),
        "tis_seq_norm": TIS(level="sequence", batch_normalize=True),
        "tis_geo": TIS(level="geometric", cap=1.2, lower=0.9),
        "mis": MIS(low=0.6, high=1.6),
        "rs": RejectionFilter.from_verl("token_k1,seq_mean_k2", "1.5,0.1"),
    }[kind]
    # trust=None: the surrogate -A r is smooth, so gradcheck tests the correction's wiring (weights detached)
    assert torch.autograd.gradcheck(
        lambda x: policy_loss(x, old, adv, mask, behav_logp=behav, correction=corr, trust=None).loss, (logp,)
    )
    out = policy_loss(logp, old, adv, mask, behav_logp=behav, correction=corr, trust=PPOClip())
    assert torch.isfinite(out.loss)


# ----------------------------------------------------------------------------------------------- compile


def test_chain_compiles_fullgraph() -> None:
    """Every stage compiles with torch.compile(fullgraph=True) when checks are off (no host sync, no break)."""
    import rolloutopt

    g = torch.Generator().manual_seed(0)
    old = -2 * torch.rand(3, 5, generator=g)
    behav = old - 0.2 * torch.randn(3, 5, generator=g)
    mask = torch.rand(3, 5, generator=g) > 0.3
    mask[:, 0] = True
    mask[2] = False
    adv = torch.randn(3, generator=g)
    chain = (
        RejectionFilter.from_verl("token_k1,seq_max_k3,catastrophic", "1.2,1.0,1e-4"),
        TIS(level="sequence", batch_normalize=True, lower=0.5),
        MIS(low=0.2, high=5.0, level="geometric"),
        OPSM(delta=0.5),
    )

    def fn(lp: torch.Tensor) -> Any:
        return policy_loss(lp, old, adv, mask, behav_logp=behav, correction=chain)

    results = []
    with rolloutopt.checks(False):
        torch._dynamo.reset()
        for f in (fn, torch.compile(fn, fullgraph=True)):
            lp = (old + 0.3 * torch.randn(3, 5, generator=torch.Generator().manual_seed(1))).requires_grad_()
            out = f(lp)
            results.append((out, torch.autograd.grad(out.loss, lp)[0]))
    (eager, g_eager), (comp, g_comp) = results
    torch.testing.assert_close(comp.loss, eager.loss)
    torch.testing.assert_close(g_comp, g_eager)
    for key in eager.metrics:
        torch.testing.assert_close(comp.metrics[key], eager.metrics[key], msg=key)
    assert g_eager.abs().sum() > 0 and 0 < float(eager.metrics["masked_frac"]) < 1


# ----------------------------------------------------------------------------------------------- diagnostics


def test_offpolicy_metrics_by_hand() -> None:
    old = t([[LN(0.5), LN(0.25)], [-1.0, 7.0]])
    behav = t([[LN(0.25), LN(0.25)], [0.0, math.nan]])
    mask = torch.tensor([[True, True], [False, False]])  # an empty row with garbage in it
    m = offpolicy_metrics(old, behav, mask)
    expected = {
        "kl": -LN(2.0) / 2,
        "k3_kl": (1 - LN(2.0)) / 2,
        "training_ppl": math.sqrt(8.0),
        "training_log_ppl": LN(8.0) / 2,
        "rollout_ppl": 4.0,
        "rollout_log_ppl": LN(4.0),
        "log_ppl_diff": -LN(2.0) / 2,
        "log_ppl_abs_diff": LN(2.0) / 2,
        "log_ppl_diff_max": -LN(2.0) / 2,
        "log_ppl_diff_min": -LN(2.0) / 2,
        "ppl_ratio": 1 / math.sqrt(2.0),
        "chi2_token": 1.5,
        "chi2_seq": 3.0,
    }
    assert set(m) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(m[key], t(value), msg=key)
    # verl's convention: the empty row counts as log-prob 0 (perplexity 1)
    torch.testing.assert_close(offpolicy_metrics(old, behav, mask, count_empty_rows=True)["rollout_ppl"], t(2.5))
    empty = offpolicy_metrics(old, behav, torch.zeros_like(mask))
    assert all(float(v) == 0 for v in empty.values())
    huge = offpolicy_metrics(t([[-1e6, 0.0]]), t([[0.0, -1e6]]), ones_mask(1, 2))
    assert all(torch.isfinite(v) for v in huge.values())
    with pytest.raises(InputError) as e:
        offpolicy_metrics(old, behav, mask, count_empty_rows=1)  # type: ignore[arg-type]
    assert e.value.argument == "count_empty_rows"
    with pytest.raises(InputError) as e:
        offpolicy_metrics(old, t([[0.0, math.inf], [0.0, 0.0]]), mask)
    assert e.value.argument == "behav_logp"
