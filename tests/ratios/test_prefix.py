"""Prefix ratios: cumulative and PNPO (arXiv 2608.01418): oracle, gradients, length behaviour."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.errors import InputError
from rolloutopt.losses import policy_loss
from rolloutopt.ratios import (
    CumulativeRatio,
    PNPORatio,
    PPOClip,
    cumulative_log_ratio,
    pnpo_log_ratio,
    sequence_log_ratio,
)

D = torch.float64


def t(x: object, **kw: object) -> torch.Tensor:
    return torch.tensor(x, dtype=D, **kw)  # type: ignore[arg-type]


def ones(b: int, n: int) -> torch.Tensor:
    return torch.ones(b, n, dtype=torch.bool)


# ------------------------------------------------------------------------------------------------- oracle


def test_spec_oracle_pnpo_cumulative_gspo() -> None:
    # by hand from PNPO's prefix weight (arXiv 2608.01418, as a digest quotes it): lambda = [0.2, -0.4, 0.5]
    lam = t([[0.2, -0.4, 0.5]])
    z = torch.zeros_like(lam)
    m = ones(1, 3)
    pnpo = pnpo_log_ratio(lam, z, m)
    # prefix means: 0.2, (0.2-0.4)/2 = -0.1, (0.2-0.4+0.5)/3 = 0.1
    torch.testing.assert_close(pnpo, t([[0.2, -0.1, 0.1]]))
    torch.testing.assert_close(pnpo.exp(), t([[1.2214, 0.9048, 1.1052]]), atol=5e-5, rtol=0)
    # prefix sums: 0.2, -0.2, 0.3
    torch.testing.assert_close(cumulative_log_ratio(lam, z, m), t([[0.2, -0.2, 0.3]]))
    # GSPO = e^{0.1} for all; PNPO at the last token equals it
    torch.testing.assert_close(pnpo[0, -1], sequence_log_ratio(lam, z, m)[0])
    torch.testing.assert_close(pnpo_log_ratio(lam, z, m, grad="token"), pnpo)


def test_masked_gaps_are_skipped_and_t_counts_valid_tokens() -> None:
    # the same three valid tokens with a gap holding garbage (and garbage padding)
    logp = t([[0.2, math.nan, -0.4, 0.5, math.inf], [0.0, 0.0, 0.0, 0.0, 0.0]])
    old = t([[0.0, 3.0, 0.0, 0.0, -math.inf], [0.0, 0.0, 0.0, 0.0, 0.0]])
    m = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    pnpo = pnpo_log_ratio(logp, old, m)
    cum = cumulative_log_ratio(logp, old, m)
    torch.testing.assert_close(pnpo, t([[0.2, 0.0, -0.1, 0.1, 0.0], [0.0] * 5]))
    torch.testing.assert_close(cum, t([[0.2, 0.0, -0.2, 0.3, 0.0], [0.0] * 5]))
    for grad in ("prefix", "token"):
        lp = logp.clone().requires_grad_()
        pnpo_log_ratio(lp, old, m, grad=grad).sum().backward()  # type: ignore[arg-type]
        assert lp.grad is not None and torch.isfinite(lp.grad).all()
        assert torch.equal(lp.grad[~m], torch.zeros(7, dtype=D))


def test_clamp_in_log_space() -> None:
    logp = t([[30.0, 30.0, -100.0]])
    z = torch.zeros_like(logp)
    m = ones(1, 3)
    # each token clamped at ±20 first, then the sum: 20, 40 -> 20, -60 -> ... clamp(20+20-20) = 20
    torch.testing.assert_close(cumulative_log_ratio(logp, z, m), t([[20.0, 20.0, 20.0]]))
    torch.testing.assert_close(cumulative_log_ratio(logp, z, m, clamp=5.0), t([[5.0, 5.0, 5.0]]))
    # prefix means of the clamped tokens: 20, 20, 20/3
    torch.testing.assert_close(pnpo_log_ratio(logp, z, m), t([[20.0, 20.0, 20.0 / 3]]))
    big = torch.full((2, 4), 3e38)  # fp32: lp - old overflows to inf before the clamp would see it
    assert torch.isfinite(cumulative_log_ratio(big, -big, ones(2, 4)).exp()).all()
    assert torch.isfinite(pnpo_log_ratio(big, -big, ones(2, 4)).exp()).all()


# ---------------------------------------------------------------------------------------------- gradients


def test_gradients_prefix_token_and_cumulative() -> None:
    lam = t([[0.2, -0.4, 0.5]])
    z = torch.zeros_like(lam)
    c = t([[1.0, 2.0, 4.0]])
    m = ones(1, 3)

    lp = lam.clone().requires_grad_()
    (pnpo_log_ratio(lp, z, m) * c).sum().backward()
    # d mean_t / d l_k = 1/t for k <= t: token k gets sum_{t>=k} c_t / t
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, t([[1 + 2 / 2 + 4 / 3, 2 / 2 + 4 / 3, 4 / 3]]))

    lp = lam.clone().requires_grad_()
    (pnpo_log_ratio(lp, z, m, grad="token") * c).sum().backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, c)  # GSPO-token routing: each token its own weight

    lp = lam.clone().requires_grad_()
    (cumulative_log_ratio(lp, z, m) * c).sum().backward()
    assert lp.grad is not None
    torch.testing.assert_close(lp.grad, t([[1 + 2 + 4, 2 + 4, 4.0]]))


def test_stages_equal_pure_functions_and_dtypes() -> None:
    torch.manual_seed(0)
    logp, old = -torch.rand(3, 6), -torch.rand(3, 6)
    m = torch.rand(3, 6) > 0.3
    assert torch.equal(CumulativeRatio().log_ratio(logp, old, m), cumulative_log_ratio(logp, old, m))
    for grad in ("prefix", "token"):
        stage = PNPORatio(grad=grad, experimental=True)  # type: ignore[arg-type]
        out = stage.log_ratio(logp, old, m)
        assert out.dtype == torch.float32
        assert torch.equal(out, pnpo_log_ratio(logp, old, m, grad=grad))  # type: ignore[arg-type]
    assert pnpo_log_ratio(logp.double(), old.double(), m).dtype == D
    assert cumulative_log_ratio(logp.bfloat16(), old.bfloat16(), m).dtype == torch.float32


# ------------------------------------------------------------------------------------ length: the evidence


def test_pnpo_range_stays_bounded_while_cumulative_grows_like_sqrt_t() -> None:
    """Per-token log-ratios i.i.d. N(0, σ²), σ = 0.1, 64 rows of 2,048 tokens, generator seed 0 (float64).

    Hand derivation: PNPO's log-weight at t is a mean of t draws, N(0, σ²/t); the cumulative one a sum,
    N(0, σ² t). So |log w^PNPO_t| · √t / σ is a standard normal's modulus (measured max over all 131,072
    entries: 3.59; the bound 5 asserted below holds with prob. > 0.98 even by a union bound over all entries);
    it implies max |log w^PNPO| ≤ 5σ = 0.5 everywhere (measured 0.232, attained at t = 1) and ≤ 5σ/√1024 =
    0.0156 for t ≥ 1,024 (measured 0.0075). The cumulative log-weight's RMS over rows is σ√t: 0.566 at
    t = 32 (measured 0.553) and 4.53 at t = 2,048 (measured 4.22), a ratio √64 = 8 (measured 7.64); its max
    at t = 2,048 is 9.26, 40× PNPO's overall max.
    """
    g = torch.Generator().manual_seed(0)
    b, n, sigma = 64, 2048, 0.1
    lam = sigma * torch.randn(b, n, generator=g, dtype=D)
    z, m = torch.zeros_like(lam), ones(b, n)
    pnpo = pnpo_log_ratio(lam, z, m)
    cum = cumulative_log_ratio(lam, z, m)
    pos = torch.arange(1, n + 1, dtype=D)

    assert (pnpo.abs() * pos.sqrt() / sigma).max() < 5.0
    assert pnpo.abs().max() < 5 * sigma
    assert pnpo[:, 1023:].abs().max() < 5 * sigma / math.sqrt(1024)

    rms = cum.pow(2).mean(0).sqrt()
    for i in (32, 2048):
        assert 0.75 < rms[i - 1] / (sigma * math.sqrt(i)) < 1.25  # chi_64 / 8: s.d. ≈ 0.09
    assert 5.0 < rms[-1] / rms[31] < 12.0  # ~ sqrt(2048 / 32) = 8
    assert cum[:, -1].abs().max() > 10 * pnpo.abs().max()


# ------------------------------------------------------------------------------------- inside policy_loss


def _small_batch(seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(3, 5, generator=g, dtype=D) - 0.5
    logp = old + 0.02 * torch.randn(3, 5, generator=g, dtype=D)  # small drift: no clip kink nearby
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=D)
    return logp, old, mask, adv


@pytest.mark.parametrize("ratio", [CumulativeRatio(), PNPORatio(experimental=True)], ids=["cumulative", "pnpo-prefix"])
def test_gradcheck_through_policy_loss_with_ppo_clip(ratio: object) -> None:
    logp, old, mask, adv = _small_batch(0)
    trust = PPOClip(low=0.2, high=0.28, dual=3.0)

    def f(lp: torch.Tensor) -> torch.Tensor:
        return policy_loss(lp, old, adv, mask, ratio=ratio, trust=trust, agg="seq-mean-token-mean").loss  # type: ignore[arg-type]

    assert torch.autograd.gradcheck(f, (logp.clone().requires_grad_(),))


def test_pnpo_token_routing_gradient_through_policy_loss() -> None:
    # grad="token" is a surrogate (value w_t, gradient through l_t only), so gradcheck does not apply; its
    # gradient is by construction: d/dl_t of mean_i (1/L_i) sum_t -A_i w_t  =  -A_i w_t / (L_i * n_rows).
    logp, old, mask, adv = _small_batch(1)
    lp = logp.clone().requires_grad_()
    ratio = PNPORatio(grad="token", experimental=True)
    out = policy_loss(lp, old, adv, mask, ratio=ratio, trust=PPOClip(), agg="seq-mean-token-mean")
    out.loss.backward()
    w = pnpo_log_ratio(logp, old, mask).exp()
    lengths = mask.sum(-1, keepdim=True).to(D)
    expected = torch.where(mask, -adv[:, None] * w / (lengths * 3), torch.zeros_like(w))
    assert float(out.metrics["clipfrac"]) == 0.0
    torch.testing.assert_close(lp.grad, expected)


def test_ppo_clip_clips_on_the_prefix_weight() -> None:
    # cumulative log-weights [0.2, 0.4, 0.6] -> ratios e^.2=1.22 (inside 1.28), e^.4, e^.6 (clipped, A > 0)
    logp = t([[-0.8, -0.8, -0.8]]).requires_grad_()
    old = torch.full((1, 3), -1.0, dtype=D)
    out = policy_loss(logp, old, t([1.0]), ones(1, 3), ratio=CumulativeRatio(), trust=PPOClip(0.2, 0.28))
    torch.testing.assert_close(out.per_token.detach(), -t([[math.exp(0.2), 1.28, 1.28]]))
    torch.testing.assert_close(out.metrics["clipfrac"], t(2 / 3))
    out.loss.backward()
    # only position 1 carries gradient: d e^{l1} / d l1 = e^{0.2}, / 3 tokens, and it reaches token 1 only
    assert logp.grad is not None
    torch.testing.assert_close(logp.grad, t([[-math.exp(0.2) / 3, 0.0, 0.0]]))


@settings(max_examples=25, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.floats(1e-3, 1e3),
    st.floats(0.5, 30.0),
)
def test_finite_and_bounded_by_clamp_for_any_finite_input(seed: int, scale: float, clamp: float) -> None:
    g = torch.Generator().manual_seed(seed)
    logp = scale * torch.randn(4, 9, generator=g)
    old = scale * torch.randn(4, 9, generator=g)
    m = torch.rand(4, 9, generator=g) > 0.3
    for out in (
        cumulative_log_ratio(logp, old, m, clamp=clamp),
        pnpo_log_ratio(logp, old, m, clamp=clamp),
        pnpo_log_ratio(logp, old, m, clamp=clamp, grad="token"),
    ):
        assert torch.isfinite(out.exp()).all()
        assert out.abs().max() <= clamp * (1 + 1e-6)
        assert torch.equal(out[~m], torch.zeros(int((~m).sum())))


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_pnpo_last_valid_token_is_gspo_and_first_is_token_ratio(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    logp, old = -torch.rand(5, 8, generator=g, dtype=D), -torch.rand(5, 8, generator=g, dtype=D)
    m = torch.rand(5, 8, generator=g) > 0.4
    out = pnpo_log_ratio(logp, old, m)
    pos = torch.arange(8)
    last = torch.where(m, pos, -1).amax(-1)
    first = torch.where(m, pos, 8).amin(-1)
    rows = last >= 0
    got = out[rows, last[rows]]
    torch.testing.assert_close(got, sequence_log_ratio(logp, old, m)[rows])
    torch.testing.assert_close(out[rows, first[rows]], (logp - old)[rows, first[rows]])


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 2**31 - 1))
def test_on_policy_gives_ratio_one_and_the_plain_loss(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    base = -torch.rand(3, 6, generator=g, dtype=D)
    m = torch.rand(3, 6, generator=g) > 0.3
    adv = torch.randn(3, generator=g, dtype=D)
    plain_lp = base.clone().requires_grad_()
    plain = policy_loss(plain_lp, base, adv, m)
    plain.loss.backward()
    for ratio in (CumulativeRatio(), PNPORatio(experimental=True), PNPORatio(grad="token", experimental=True)):
        lp = base.clone().requires_grad_()
        out = policy_loss(lp, base, adv, m, ratio=ratio)
        assert torch.equal(ratio.log_ratio(base, base, m), torch.zeros_like(base))
        torch.testing.assert_close(out.loss, plain.loss)
        if isinstance(ratio, PNPORatio) and ratio.grad == "token":
            out.loss.backward()  # GSPO-token routing: on-policy gradient is the token-level PPO gradient
            torch.testing.assert_close(lp.grad, plain_lp.grad)


# ----------------------------------------------------------------------------------------------- bad input


def test_bad_inputs() -> None:
    lp, m = torch.zeros(2, 3), ones(2, 3)
    with pytest.raises(InputError, match="experimental"):
        PNPORatio()
    with pytest.raises(InputError, match=r"PNPORatio\.grad"):
        PNPORatio(grad="sequence", experimental=True)  # type: ignore[arg-type]
    with pytest.raises(InputError, match=r"PNPORatio\.clamp"):
        PNPORatio(clamp=0.0, experimental=True)
    with pytest.raises(InputError, match=r"CumulativeRatio\.clamp"):
        CumulativeRatio(clamp=-1.0)
    with pytest.raises(InputError, match=r"^grad"):
        pnpo_log_ratio(lp, lp, m, grad="mean")  # type: ignore[arg-type]
    for fn in (cumulative_log_ratio, pnpo_log_ratio):
        with pytest.raises(InputError, match=r"^clamp"):
            fn(lp, lp, m, clamp=0.0)
        with pytest.raises(InputError, match=r"^old_logp"):
            fn(lp, torch.zeros(2, 4), m)
        with pytest.raises(InputError, match=r"^mask"):
            fn(lp, lp, torch.full((2, 3), 0.5))
        with pytest.raises(InputError, match=r"^logp"):
            fn(torch.full((2, 3), math.nan), lp, m)
        with pytest.raises(InputError, match=r"^logp"):
            fn(torch.zeros(2, 3, dtype=torch.long), lp, m)
