"""The composed policy loss: hand-computed examples, denominators, metrics, properties, bad inputs."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rolloutopt
from rolloutopt.errors import InputError
from rolloutopt.losses import KL, CorrectionOutput, LossOutput, aggregate, get, kl_penalty, policy_loss
from rolloutopt.ratios import CISPO, SAPO, GSPORatio, PPOClip, StageContext, TokenRatio, TrustOutput

D = torch.float64
PRESETS = ["grpo", "dapo", "dr_grpo", "gspo", "cispo", "sapo"]
PRESET_KW: dict[str, dict[str, Any]] = {"dr_grpo": {"max_len": 8}}


def t(x: object, dtype: torch.dtype = D) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


# ------------------------------------------------------------------------------------- hand-computed example

# ratios r = exp(logp - old) with old = -3 (log-probs are <= 0); the last column is padding holding garbage
R = [[1.5, 0.5, 1.0, 9.0], [0.7, 2.0, 5.0, 9.0]]
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 0]], dtype=torch.bool)
ADV = t([1.0, -1.0])


def _hand_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    logp = (t(R).log() - 3.0).requires_grad_()
    return logp, torch.full((2, 4), -3.0, dtype=D)


def test_hand_example_ppo_clip_token_mean() -> None:
    logp, old = _hand_inputs()
    out = policy_loss(logp, old, ADV, MASK, trust=PPOClip(low=0.2, high=0.2, dual=3.0), agg="token-mean")
    # row 0 (A=+1): r=1.5 clipped -> -1.2 (grad 0); r=0.5 -> -0.5; r=1 -> -1
    # row 1 (A=-1): r=0.7 clipped at 0.8 (grad 0); r=2 -> 2; r=5 -> dual clip 3 (grad 0)
    per_token = t([[-1.2, -0.5, -1.0, 0.0], [0.8, 2.0, 3.0, 0.0]])
    torch.testing.assert_close(out.per_token.detach(), per_token)
    torch.testing.assert_close(out.loss.detach(), t(3.1 / 6))
    out.loss.backward()
    # d(-A r)/dlogp = -A r on the unclipped tokens, / 6 tokens
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, t([[0.0, -0.5, -1.0, 0.0], [0.0, 2.0, 0.0, 0.0]]) / 6)

    m = out.metrics
    torch.testing.assert_close(m["pg_loss"], t(3.1 / 6))
    torch.testing.assert_close(m["ratio_mean"], t((1.5 + 0.5 + 1.0 + 0.7 + 2.0 + 5.0) / 6))
    torch.testing.assert_close(m["ratio_max"], t(5.0))
    approx_kl = -sum(math.log(x) for x in (1.5, 0.5, 1.0, 0.7, 2.0, 5.0)) / 6
    torch.testing.assert_close(m["approx_kl"], t(approx_kl))
    torch.testing.assert_close(m["clipfrac"], t(2 / 6))
    torch.testing.assert_close(m["clip_low_frac"], t(1 / 6))
    torch.testing.assert_close(m["clip_high_frac"], t(1 / 6))
    torch.testing.assert_close(m["dual_clip_frac"], t(1 / 6))
    torch.testing.assert_close(m["masked_frac"], t(0.0))
    assert "entropy" not in m and "kl" not in m


def test_hand_example_seq_mean_token_mean_and_defaults() -> None:
    logp, old = _hand_inputs()
    out = policy_loss(logp, old, ADV, MASK, trust=PPOClip(low=0.2, high=0.2, dual=3.0), agg="seq-mean-token-mean")
    torch.testing.assert_close(out.loss.detach(), t(((-2.7 / 3) + (5.8 / 3)) / 2))
    # defaults are GRPO's: TokenRatio + PPOClip(0.2, 0.2), no dual clip, seq-mean-token-mean; r=5 with A=-1 is no
    # longer capped at 3: row 1 sums 0.8 + 2 + 5
    out = policy_loss(logp, old, ADV, MASK)
    torch.testing.assert_close(out.loss.detach(), t(((-2.7 / 3) + (7.8 / 3)) / 2))


def test_trust_none_is_plain_surrogate() -> None:
    logp, old = _hand_inputs()
    out = policy_loss(logp, old, ADV, MASK, trust=None)
    torch.testing.assert_close(out.loss.detach(), t((-1.5 - 0.5 - 1.0 + 0.7 + 2.0 + 5.0) / 6))
    out.loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, t([[-1.5, -0.5, -1.0, 0.0], [0.7, 2.0, 5.0, 0.0]]) / 6)
    assert "clipfrac" not in out.metrics


def test_on_policy_old_logp_none() -> None:
    torch.manual_seed(0)
    logp = (-torch.rand(3, 4, dtype=D)).requires_grad_()
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    adv = t([0.5, -2.0, 1.0])
    out = policy_loss(logp, None, adv, mask, agg="token-mean")
    n = 7
    torch.testing.assert_close(out.metrics["ratio_mean"], t(1.0))
    torch.testing.assert_close(out.metrics["approx_kl"], t(0.0))
    torch.testing.assert_close(out.metrics["clipfrac"], t(0.0))
    torch.testing.assert_close(out.loss.detach(), -(adv[:, None] * mask).sum() / n)
    out.loss.backward()
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, -(adv[:, None] * mask) / n)


def test_sequence_and_token_advantages_agree() -> None:
    logp, old = _hand_inputs()
    a = policy_loss(logp, old, ADV, MASK)
    b = policy_loss(logp, old, ADV[:, None].expand(2, 4).clone(), MASK)
    torch.testing.assert_close(a.loss, b.loss)
    # genuinely per-token advantages: token (0, 1) changes sign
    adv_bt = ADV[:, None].expand(2, 4).clone()
    adv_bt[0, 1] = -1.0
    c = policy_loss(logp, old, adv_bt, MASK, trust=None)
    torch.testing.assert_close(c.per_token.detach()[0, 1], t(0.5))


def test_is_weights() -> None:
    logp, old = _hand_inputs()
    w_seq = t([2.0, 0.5])
    w_tok = t([[2.0, 2.0, 2.0, math.nan], [0.5, 0.5, 0.5, math.inf]]).requires_grad_()
    base = policy_loss(logp, old, ADV, MASK, trust=None)
    a = policy_loss(logp, old, ADV, MASK, trust=None, is_weights=w_seq)
    b = policy_loss(logp, old, ADV, MASK, trust=None, is_weights=w_tok)
    torch.testing.assert_close(a.per_token, base.per_token * w_seq[:, None])
    torch.testing.assert_close(a.loss.detach(), t((2 * -3.0 + 0.5 * 7.7) / 6))
    torch.testing.assert_close(b.loss, a.loss)
    b.loss.backward()
    assert w_tok.grad is None  # detached
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, t([[-3.0, -1.0, -2.0, 0.0], [0.35, 1.0, 2.5, 0.0]]) / 6)


def test_seq_weight_zero_removes_row_from_loss_and_denominators() -> None:
    torch.manual_seed(1)
    logp = -torch.rand(3, 4, dtype=D)
    old = logp + 0.1 * torch.randn(3, 4, dtype=D)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    adv = t([0.5, -2.0, 1.0])
    keep = [0, 2]
    for agg in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"):
        ml = 4 if agg == "seq-mean-token-sum-norm" else None
        w = policy_loss(logp, old, adv, mask, agg=agg, max_len=ml, seq_weight=t([1.0, 0.0, 1.0]))  # type: ignore[arg-type]
        ref = policy_loss(logp[keep], old[keep], adv[keep], mask[keep], agg=agg, max_len=ml)  # type: ignore[arg-type]
        torch.testing.assert_close(w.loss, ref.loss)
        assert torch.equal(w.per_token[1], torch.zeros(4, dtype=D))
    # non-zero weights scale the row
    w = policy_loss(logp, old, adv, mask, trust=None, seq_weight=t([2.0, 1.0, 1.0]))
    u = policy_loss(logp, old, adv * t([2.0, 1.0, 1.0]), mask, trust=None)
    torch.testing.assert_close(w.loss, u.loss)
    # masked_frac reports trust-region/correction masks only, not weighted-out rows
    torch.testing.assert_close(
        policy_loss(logp, old, adv, mask, seq_weight=t([1.0, 0.0, 1.0])).metrics["masked_frac"], t(0.0)
    )


class KeepCorrection:
    """A tiny off-policy correction: constant weight, fixed keep mask; reads behav_logp when given."""

    accepts = ("behav_logp",)

    def __init__(self, keep: torch.Tensor, weight: float = 1.0) -> None:
        self.keep = keep
        self.weight = weight
        self.calls: list[dict[str, Any]] = []

    def __call__(self, ctx: StageContext) -> CorrectionOutput:
        self.calls.append({"logp": ctx.logp, "old_logp": ctx.old_logp, "behav_logp": ctx.behav_logp, "mask": ctx.mask})
        w = torch.full_like(ctx.logp, self.weight)
        return CorrectionOutput(w, self.keep, {"tiny_metric": torch.tensor(7.0)})


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_removed_in_denominator(agg: str) -> None:
    logp, old = _hand_inputs()
    keep = torch.tensor([[True, False, True, True], [False, False, False, True]])  # row 1 loses every token
    corr = KeepCorrection(keep, weight=2.0)
    trust = None
    stay = policy_loss(logp, old, ADV, MASK, trust=trust, correction=corr, agg=agg)  # type: ignore[arg-type]
    leave = policy_loss(logp, old, ADV, MASK, trust=trust, correction=corr, agg=agg, removed_in_denominator=False)  # type: ignore[arg-type]
    kept = MASK & keep
    pt = (-(ADV[:, None]) * t(R) * 2.0) * kept
    torch.testing.assert_close(stay.per_token.detach(), pt)
    torch.testing.assert_close(stay.loss.detach(), aggregate(pt, kept, agg, denominator_mask=MASK))  # type: ignore[arg-type]
    torch.testing.assert_close(leave.loss.detach(), aggregate(pt, kept, agg))  # type: ignore[arg-type]
    numerator = -(1.5 + 1.0) * 2.0
    expected = {
        "token-mean": (numerator / 6, numerator / 2),
        "seq-mean-token-mean": (numerator / 3 / 2, numerator / 2 / 1),
        "seq-mean-token-sum": (numerator / 2, numerator / 1),
    }[agg]
    torch.testing.assert_close(stay.loss.detach(), t(expected[0]))
    torch.testing.assert_close(leave.loss.detach(), t(expected[1]))
    for out in (stay, leave):
        torch.testing.assert_close(out.metrics["masked_frac"], t(4 / 6))
        assert float(out.metrics["tiny_metric"]) == 7.0
    call = corr.calls[0]
    assert call["behav_logp"] is None and call["mask"].dtype == torch.bool


def test_correction_receives_behav_logp_and_combines_with_trust_keep() -> None:
    logp, old = _hand_inputs()
    behav = torch.full((2, 4), -0.1, dtype=D)

    class KeepTrust:
        def __call__(
            self,
            ratio: torch.Tensor,
            log_ratio: torch.Tensor,
            adv: torch.Tensor,
            lp: torch.Tensor,
            *,
            ctx: StageContext | None = None,
        ) -> TrustOutput:
            keep = torch.tensor([[True, True, False, True], [True, True, True, True]])
            return TrustOutput(-adv * ratio, keep, {})

    corr = KeepCorrection(torch.tensor([[True, True, True, True], [False, True, True, True]]))
    out = policy_loss(logp, old, ADV, MASK, behav_logp=behav, trust=KeepTrust(), correction=corr)
    assert torch.equal(corr.calls[0]["behav_logp"], behav)
    assert corr.calls[0]["old_logp"] is not None
    kept = MASK & torch.tensor([[True, True, False, True], [False, True, True, True]])
    torch.testing.assert_close(out.per_token.detach(), (-(ADV[:, None]) * t(R)) * kept)
    torch.testing.assert_close(out.loss.detach(), t((-1.5 - 0.5 + 2.0 + 5.0) / 6))
    torch.testing.assert_close(out.metrics["masked_frac"], t(2 / 6))
    # the trust keep alone, when the correction returns none
    out = policy_loss(logp, old, ADV, MASK, trust=KeepTrust(), correction=KeepCorrection(None))  # type: ignore[arg-type]
    torch.testing.assert_close(out.metrics["masked_frac"], t(1 / 6))


def test_kl_and_entropy_terms() -> None:
    logp, old = _hand_inputs()
    ref = t([[0.1, -0.2, 0.0, math.nan], [0.3, 0.0, 0.2, math.nan]]) - 3.0
    ent = t([[1.0, 2.0, 3.0, math.inf], [4.0, 5.0, 6.0, math.nan]])
    kl = KL(estimator="k2", coef=0.5)
    base = policy_loss(logp, old, ADV, MASK, trust=None, agg="token-mean")
    out = policy_loss(
        logp, old, ADV, MASK, trust=None, ref_logp=ref, kl=kl, entropy=ent, entropy_coef=0.1, agg="token-mean"
    )
    kl_tok = kl_penalty(t(R).log() - 3.0, ref, "k2")
    expected = base.per_token.detach() + (0.5 * kl_tok - 0.1 * ent) * MASK
    expected = torch.where(MASK, expected, torch.zeros_like(expected))
    torch.testing.assert_close(out.per_token.detach(), expected)
    torch.testing.assert_close(out.loss.detach(), expected.sum() / 6)
    torch.testing.assert_close(out.metrics["kl"], (kl_tok * MASK).nansum() / 6)
    torch.testing.assert_close(out.metrics["entropy"], t(21.0 / 6))
    torch.testing.assert_close(out.metrics["pg_loss"], base.loss.detach())  # pg_loss excludes regularisers
    out.loss.backward()
    assert logp.grad is not None and torch.isfinite(logp.grad).all()
    # entropy is reported even when its coefficient is 0 and does not change the loss then
    o2 = policy_loss(logp, old, ADV, MASK, trust=None, entropy=ent, agg="token-mean")
    torch.testing.assert_close(o2.loss, base.loss)
    torch.testing.assert_close(o2.metrics["entropy"], t(21.0 / 6))


def test_kl_requires_ref_logp_and_entropy_coef_requires_entropy() -> None:
    logp, old = _hand_inputs()
    with pytest.raises(InputError) as e:
        policy_loss(logp, old, ADV, MASK, kl=KL())
    assert e.value.argument == "ref_logp"
    with pytest.raises(InputError) as e:
        policy_loss(logp, old, ADV, MASK, entropy_coef=0.01)
    assert e.value.argument == "entropy"


@pytest.mark.parametrize("coef", ["0.1", None, True, math.nan, torch.tensor(0.1)])
def test_entropy_coef_not_a_number(coef: object) -> None:
    logp, old = _hand_inputs()
    with pytest.raises(InputError) as e:
        policy_loss(logp, old, ADV, MASK, entropy=torch.ones(2, 4, dtype=D), entropy_coef=coef)  # type: ignore[arg-type]
    assert e.value.argument == "entropy_coef"


def _random_inputs(seed: int, B: int = 3, T: int = 5, dtype: torch.dtype = D) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -3 * torch.rand(B, T, generator=g, dtype=D)
    logp = (old + 0.4 * torch.randn(B, T, generator=g, dtype=D)).clamp(max=0.0)
    mask = torch.rand(B, T, generator=g) > 0.3
    mask[:, 0] = True
    adv = torch.randn(B, generator=g, dtype=D)
    return {"logp": logp.to(dtype), "old_logp": old.to(dtype), "advantages": adv.to(dtype), "mask": mask}


@pytest.mark.parametrize("name", PRESETS)
def test_metrics_are_detached_0d(name: str) -> None:
    x = _random_inputs(0)
    logp = x["logp"].requires_grad_()
    out = get(name)(
        logp, x["old_logp"], x["advantages"], x["mask"], entropy=torch.rand(3, 5, dtype=D, requires_grad=True),
        ref_logp=x["old_logp"], kl=KL(), **PRESET_KW.get(name, {}),
    )  # fmt: skip
    assert isinstance(out, LossOutput)
    assert out.loss.shape == () and out.loss.requires_grad
    assert out.per_token.shape == (3, 5)
    assert {"pg_loss", "ratio_mean", "ratio_max", "approx_kl", "masked_frac", "entropy", "kl"} <= out.metrics.keys()
    for key, v in out.metrics.items():
        assert isinstance(v, torch.Tensor), key
        assert v.shape == (), key
        assert not v.requires_grad, key
        assert torch.isfinite(v), key


def test_bf16_inputs_give_fp32_results() -> None:
    x = _random_inputs(0, dtype=torch.bfloat16)
    logp = x["logp"].requires_grad_()
    out = policy_loss(
        logp, x["old_logp"], x["advantages"], x["mask"], ref_logp=x["old_logp"], kl=KL(),
        entropy=torch.ones(3, 5, dtype=torch.bfloat16), entropy_coef=0.01, is_weights=torch.ones(3, dtype=torch.float16),
    )  # fmt: skip
    assert out.loss.dtype == torch.float32 and out.per_token.dtype == torch.float32
    assert all(v.dtype == torch.float32 for v in out.metrics.values())
    out.loss.backward()
    assert logp.grad is not None and logp.grad.dtype == torch.bfloat16
    x32 = {k: (v.float() if v.is_floating_point() else v) for k, v in x.items()}
    ref = policy_loss(
        x32["logp"], x32["old_logp"], x32["advantages"], x32["mask"], ref_logp=x32["old_logp"], kl=KL(),
        entropy=torch.ones(3, 5), entropy_coef=0.01,
    )  # fmt: skip
    torch.testing.assert_close(out.loss, ref.loss)


def test_empty_and_all_masked_batches() -> None:
    out = policy_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.ones(2), torch.zeros(2, 3, dtype=torch.bool))
    assert float(out.loss) == 0.0
    assert all(torch.isfinite(v) for v in out.metrics.values())
    out = policy_loss(torch.zeros(0, 3), torch.zeros(0, 3), torch.ones(0), torch.zeros(0, 3, dtype=torch.bool))
    assert float(out.loss) == 0.0 and float(out.metrics["ratio_max"]) == 0.0


# ------------------------------------------------------------------------------------------------ properties


def _call(name: str, x: dict[str, torch.Tensor], **kw: Any) -> LossOutput:
    return get(name)(x["logp"], x["old_logp"], x["advantages"], x["mask"], **{**PRESET_KW.get(name, {}), **kw})


@settings(max_examples=20)
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 5),
    T=st.integers(1, 6),
    name=st.sampled_from(PRESETS),
    perm_seed=st.integers(0, 1000),
)
def test_row_permutation_leaves_loss_unchanged(seed: int, B: int, T: int, name: str, perm_seed: int) -> None:
    x = _random_inputs(seed, B, T)
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(perm_seed))
    px = {k: v[perm] for k, v in x.items()}
    a = _call(name, x)
    b = _call(name, px)
    torch.testing.assert_close(a.loss, b.loss)
    torch.testing.assert_close(a.per_token[perm], b.per_token)
    for key in a.metrics:
        torch.testing.assert_close(a.metrics[key], b.metrics[key])


@settings(max_examples=20)
@given(
    seed=st.integers(0, 2**31 - 1),
    B=st.integers(1, 6),
    ids=st.lists(st.integers(-5, 5), min_size=6, max_size=6),
    offset=st.integers(-(2**40), 2**40),
)
def test_prompt_mean_permutation_and_relabelling(seed: int, B: int, ids: list[int], offset: int) -> None:
    x = _random_inputs(seed, B, 4)
    group = torch.tensor(ids[:B])
    perm = torch.randperm(B, generator=torch.Generator().manual_seed(seed))
    a = policy_loss(x["logp"], x["old_logp"], x["advantages"], x["mask"], agg="prompt-mean", group=group)
    b = policy_loss(
        x["logp"][perm], x["old_logp"][perm], x["advantages"][perm], x["mask"][perm], agg="prompt-mean",
        group=group[perm] * 3 + offset,  # an injective relabelling
    )  # fmt: skip
    torch.testing.assert_close(a.loss, b.loss)
    # prompt-mean is the mean over prompts of each prompt's token mean
    pt, m = a.per_token.detach(), x["mask"]
    means = [pt[group == g].sum() / m[group == g].sum() for g in group.unique()]
    torch.testing.assert_close(a.loss.detach(), torch.stack(means).mean())


@settings(max_examples=25)
@given(
    seed=st.integers(0, 2**31 - 1),
    name=st.sampled_from(PRESETS),
    pad=st.integers(1, 3),
    garbage=st.sampled_from([0.0, -1e30, 1e4, math.inf, -math.inf, math.nan]),
    per_token_adv=st.booleans(),
)
def test_masked_out_garbage_does_not_change_loss_or_gradient(
    seed: int, name: str, pad: int, garbage: float, per_token_adv: bool
) -> None:
    x = _random_inputs(seed, 3, 4)
    ref = x["old_logp"] - 0.1
    ent = torch.rand(3, 4, dtype=D)
    isw = torch.rand(3, 4, dtype=D) + 0.5
    adv = x["advantages"][:, None].expand(3, 4).clone() if per_token_adv else x["advantages"]

    def padded(v: torch.Tensor) -> torch.Tensor:
        return torch.cat([v, torch.full((v.shape[0], pad), garbage, dtype=v.dtype)], 1)

    kw = {"kl": KL(estimator="k3", clamp=False), "entropy_coef": 0.01}
    lp0 = x["logp"].clone().requires_grad_()
    a = get(name)(
        lp0, x["old_logp"], adv, x["mask"], ref_logp=ref, entropy=ent, is_weights=isw, **PRESET_KW.get(name, {}), **kw
    )
    lp1 = padded(x["logp"]).requires_grad_()
    mask1 = torch.cat([x["mask"], torch.zeros(3, pad, dtype=torch.bool)], 1)
    b = get(name)(
        lp1, padded(x["old_logp"]), padded(adv) if per_token_adv else adv, mask1, ref_logp=padded(ref),
        entropy=padded(ent), is_weights=padded(isw), **PRESET_KW.get(name, {}), **kw,
    )  # fmt: skip
    torch.testing.assert_close(a.loss, b.loss)
    for key in a.metrics:
        torch.testing.assert_close(a.metrics[key], b.metrics[key], msg=key)
    a.loss.backward()
    b.loss.backward()
    assert lp0.grad is not None and lp1.grad is not None
    torch.testing.assert_close(lp1.grad[:, :4], lp0.grad)
    assert torch.equal(lp1.grad[:, 4:], torch.zeros(3, pad, dtype=D))


@settings(max_examples=30)
@given(
    logp=st.lists(st.floats(-1e3, 0.0), min_size=8, max_size=8),
    old=st.lists(st.floats(-1e3, 0.0), min_size=8, max_size=8),
    adv=st.lists(st.floats(-100, 100), min_size=2, max_size=2),
    mask=st.lists(st.booleans(), min_size=8, max_size=8),
    name=st.sampled_from(PRESETS),
)
def test_finite_loss_and_gradient_for_finite_inputs(
    logp: list[float], old: list[float], adv: list[float], mask: list[bool], name: str
) -> None:
    lp = torch.tensor(logp, dtype=torch.float32).reshape(2, 4).requires_grad_()
    old_t = torch.tensor(old, dtype=torch.float32).reshape(2, 4)
    out = get(name)(
        lp, old_t, torch.tensor(adv), torch.tensor(mask).reshape(2, 4), ref_logp=old_t, kl=KL(),
        **PRESET_KW.get(name, {}),
    )  # fmt: skip
    assert torch.isfinite(out.loss)
    assert all(torch.isfinite(v) for v in out.metrics.values())
    out.loss.backward()
    assert lp.grad is not None and torch.isfinite(lp.grad).all()


@settings(max_examples=8)
@given(seed=st.integers(0, 2**31 - 1), name=st.sampled_from(PRESETS), per_token_adv=st.booleans())
def test_gradcheck_every_preset(seed: int, name: str, per_token_adv: bool) -> None:
    x = _random_inputs(seed, 3, 4)
    old, mask, adv = x["old_logp"], x["mask"], x["advantages"]
    logp = x["logp"]
    if name == "cispo":
        # CISPO's weight is a stop-gradient: its gradient is the derivative of the loss only where the weight
        # is constant, i.e. clipped (r > 1 + high everywhere)
        old = old - 1.5  # keeps the log-probs below 0
        logp = old + 0.3 + torch.rand(3, 4, dtype=D, generator=torch.Generator().manual_seed(seed))
    if per_token_adv and name != "gspo":  # GSPO-token equals GSPO's gradient for per-sequence advantages
        adv = adv[:, None] + 0.1 * torch.randn(3, 4, dtype=D, generator=torch.Generator().manual_seed(seed))
    logp = logp.clone().requires_grad_()
    kw = PRESET_KW.get(name, {})

    def f(lp: torch.Tensor) -> torch.Tensor:
        return get(name)(lp, old, adv, mask, **kw).loss

    assert torch.autograd.gradcheck(f, (logp,), eps=1e-6, atol=1e-6)


def test_gradcheck_with_regularisers() -> None:
    x = _random_inputs(3)
    ref = x["old_logp"] - 0.2

    def f(lp: torch.Tensor) -> torch.Tensor:
        return policy_loss(
            lp, x["old_logp"], x["advantages"], x["mask"], trust=SAPO(), ref_logp=ref, kl=KL(coef=0.3)
        ).loss

    assert torch.autograd.gradcheck(f, (x["logp"].clone().requires_grad_(),), eps=1e-6, atol=1e-6)


# ------------------------------------------------------------------------------------------------ stage wiring


def test_gspo_and_cispo_stages_wire_through() -> None:
    x = _random_inputs(5)
    lp, old, adv, mask = x["logp"], x["old_logp"], x["advantages"], x["mask"]
    out = policy_loss(lp, old, adv, mask, ratio=GSPORatio(), trust=None, agg="seq-mean-token-mean")
    seq = ((lp - old) * mask).sum(-1) / mask.sum(-1)
    torch.testing.assert_close(out.loss, (-adv * seq.exp()).mean())
    out = policy_loss(lp, old, adv, mask, ratio=TokenRatio(), trust=CISPO(high=0.2), agg="token-mean")
    w = (lp - old).exp().clamp(max=1.2)
    torch.testing.assert_close(out.loss, (-(w * adv[:, None] * lp) * mask).sum() / mask.sum())


# ------------------------------------------------------------------------------------------------- bad input


def test_shape_mismatch_names_the_argument() -> None:
    x = _random_inputs(0)
    lp, old, adv, mask = x["logp"], x["old_logp"], x["advantages"], x["mask"]
    cases: list[tuple[dict[str, Any], str]] = [
        ({"old_logp": old[:, :4]}, "old_logp"),
        ({"advantages": adv[:2]}, "advantages"),
        ({"advantages": torch.zeros(3, 4, dtype=D)}, "advantages"),
        ({"advantages": torch.zeros(3, 5, 1, dtype=D)}, "advantages"),
        ({"mask": mask[:2]}, "mask"),
        ({"logp": lp[0]}, "logp"),
    ]
    for override, arg in cases:
        call = {"logp": lp, "old_logp": old, "advantages": adv, "mask": mask, **override}
        with pytest.raises(InputError) as e:
            policy_loss(call.pop("logp"), call.pop("old_logp"), call.pop("advantages"), call.pop("mask"))
        assert e.value.argument == arg, (override, e.value)
    for kw, arg in [
        ({"ref_logp": old[:, :4], "kl": KL()}, "ref_logp"),
        ({"entropy": old[:2]}, "entropy"),
        ({"behav_logp": old[:, :2]}, "behav_logp"),
        ({"is_weights": adv[:2]}, "is_weights"),
        ({"is_weights": old[:, :3]}, "is_weights"),
        ({"seq_weight": old}, "seq_weight"),
    ]:
        with pytest.raises(InputError) as e:
            policy_loss(lp, old, adv, mask, **kw)
        assert e.value.argument == arg, kw


def test_non_finite_masked_in_values_raise() -> None:
    x = _random_inputs(0)
    lp, old, adv, mask = x["logp"], x["old_logp"], x["advantages"], x["mask"]
    bad = lp.clone()
    bad[0, 0] = math.nan
    with pytest.raises(InputError) as e:
        policy_loss(bad, old, adv, mask)
    assert e.value.argument == "logp"
    with pytest.raises(InputError) as e:
        policy_loss(lp, bad, adv, mask)
    assert e.value.argument == "old_logp"
    with pytest.raises(InputError) as e:
        policy_loss(lp, old, t([math.inf, 0.0, 0.0]), mask)
    assert e.value.argument == "advantages"
    for kw, arg in [
        ({"ref_logp": bad, "kl": KL()}, "ref_logp"),
        ({"entropy": bad}, "entropy"),
        ({"behav_logp": bad}, "behav_logp"),
        ({"is_weights": bad}, "is_weights"),
        ({"seq_weight": t([math.nan, 1.0, 1.0])}, "seq_weight"),
    ]:
        with pytest.raises(InputError) as e:
            policy_loss(lp, old, adv, mask, **kw)
        assert e.value.argument == arg
    # with checks off, nothing is validated (the loss is NaN rather than an error)
    with rolloutopt.checks(False):
        assert torch.isnan(policy_loss(bad, old, adv, mask).loss)


def test_bad_dtypes_and_mask_values() -> None:
    x = _random_inputs(0)
    lp, old, adv, mask = x["logp"], x["old_logp"], x["advantages"], x["mask"]
    with pytest.raises(InputError) as e:
        policy_loss(lp.long(), old, adv, mask)
    assert e.value.argument == "logp"
    with pytest.raises(InputError) as e:
        policy_loss(lp, old, adv, mask.long() * 2)
    assert e.value.argument == "mask"
    with pytest.raises(InputError) as e:
        policy_loss(lp.tolist(), old, adv, mask)  # type: ignore[arg-type]
    assert e.value.argument == "logp"
    with pytest.raises(InputError) as e:
        policy_loss(lp, old, adv, mask, agg="mean")  # type: ignore[arg-type]
    assert e.value.argument == "agg"
    with pytest.raises(InputError) as e:
        policy_loss(lp, old, adv, mask, agg="seq-mean-token-sum-norm")
    assert e.value.argument == "max_len"
    with pytest.raises(InputError) as e:
        policy_loss(lp, old, adv, mask, agg="prompt-mean")
    assert e.value.argument == "group"
    # 0/1 float masks are accepted
    torch.testing.assert_close(policy_loss(lp, old, adv, mask.double()).loss, policy_loss(lp, old, adv, mask).loss)
