"""policy_loss's stage plumbing: StageContext, the proximal slot, chained corrections, and the added metrics."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.errors import InputError
from rolloutopt.losses import CorrectionOutput, policy_loss
from rolloutopt.ratios import PPOClip, StageContext, TrustOutput, masked_mean, masked_quantiles

D = torch.float64
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
ADV = torch.tensor([1.0, -1.0], dtype=D)


def t(x: object) -> torch.Tensor:
    return torch.tensor(x, dtype=D)


class Weight:
    """A correction with a fixed weight and keep mask that records the context it saw."""

    def __init__(self, weight: torch.Tensor, keep: torch.Tensor | None = None, tag: str = "w") -> None:
        self.weight, self.keep, self.tag = weight, keep, tag
        self.seen: list[StageContext] = []

    def __call__(self, ctx: StageContext) -> CorrectionOutput:
        self.seen.append(ctx)
        return CorrectionOutput(self.weight, self.keep, {f"{self.tag}_metric": torch.tensor(1.0)})


def test_chained_corrections_multiply_weights_and_and_keeps() -> None:
    logp = torch.zeros(2, 4, dtype=D, requires_grad=True)
    old = torch.zeros(2, 4, dtype=D)
    a = Weight(t([[2.0, 2.0, 2.0, 2.0], [1.0, 1.0, 1.0, 1.0]]), torch.tensor([[1, 0, 1, 1], [1, 1, 1, 1]]).bool(), "a")
    b = Weight(t([[0.5, 3.0, 1.0, 1.0], [4.0, 1.0, 1.0, 1.0]]), torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]]).bool(), "b")
    out = policy_loss(logp, old, ADV, MASK, trust=None, correction=(a, b), is_weights=t([1.0, 0.5]), agg="token-mean")
    # r = 1, loss = -A * w_a * w_b * is_w on kept tokens: row 0 tokens 0, 2 (1.0, 2.0); row 1 token 1 (0.5)
    expected = t([[-1.0, 0.0, -2.0, 0.0], [0.0, 0.5, 0.0, 0.0]])
    torch.testing.assert_close(out.per_token.detach(), expected)
    torch.testing.assert_close(out.loss.detach(), t((-3.0 + 0.5) / 5))  # removed tokens stay in the denominator
    assert float(out.metrics["a_metric"]) == 1.0 and float(out.metrics["b_metric"]) == 1.0
    torch.testing.assert_close(out.metrics["masked_frac"], t(2 / 5))
    # is_weight metrics over the 5 loss tokens of the combined weight 1, 6, 2 | 2, 0.5
    w = [1.0, 6.0, 2.0, 2.0, 0.5]
    torch.testing.assert_close(out.metrics["is_weight_mean"], t(sum(w) / 5))
    torch.testing.assert_close(out.metrics["is_weight_max"], t(6.0))
    torch.testing.assert_close(out.metrics["is_ess"], t(sum(w) ** 2 / (5 * sum(x * x for x in w))))
    # the context a correction sees is validated and shared
    ctx = a.seen[0]
    assert ctx is b.seen[0] and ctx.mask.dtype == torch.bool and ctx.advantages.shape == (2, 1)


def test_single_correction_equals_one_element_chain() -> None:
    logp = (0.1 * torch.randn(2, 4, dtype=D, generator=torch.Generator().manual_seed(0)) - 1).requires_grad_()
    c = Weight(t([[2.0, 1.0, 0.5, 1.0], [1.5, 1.0, 1.0, 1.0]]))
    old = torch.full((2, 4), -1.0, dtype=D)
    one = policy_loss(logp, old, ADV, MASK, correction=c)
    chain = policy_loss(logp, old, ADV, MASK, correction=[c])
    torch.testing.assert_close(one.loss, chain.loss)


def test_proximal_stage_builds_old_logp_and_the_ratio_uses_it() -> None:
    logp = t([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]]).requires_grad_()
    behav = t([[-1.5, -2.0, -0.5, 0.0], [-0.5, -1.0, 0.0, 0.0]])

    def behaviour_as_proximal(ctx: StageContext) -> torch.Tensor:
        assert ctx.old_logp is None  # old_logp=None with a proximal stage: nothing is invented
        return ctx.need("behav_logp", "the test stage")

    behaviour_as_proximal.requires = ("behav_logp",)  # type: ignore[attr-defined]
    out = policy_loss(logp, None, ADV, MASK, behav_logp=behav, proximal=behaviour_as_proximal, trust=None)
    direct = policy_loss(logp, behav, ADV, MASK, trust=None)
    torch.testing.assert_close(out.loss, direct.loss)
    (g,) = torch.autograd.grad(out.loss, logp)
    (g2,) = torch.autograd.grad(direct.loss, logp)
    torch.testing.assert_close(g, g2)


def test_missing_stage_input_names_argument_and_stage() -> None:
    def needs_versions(ctx: StageContext) -> torch.Tensor:
        ctx.need("versions", "CoPRISProximal")
        return ctx.logp

    needs_versions.requires = ("versions",)  # type: ignore[attr-defined]

    with pytest.raises(InputError, match=r"versions=\.\.\., required by"):
        policy_loss(torch.zeros(2, 4), None, ADV.float(), MASK, proximal=needs_versions)

    def needs_extra(ctx: StageContext) -> CorrectionOutput:
        return CorrectionOutput(ctx.need("my_weights", "MyCorrection"))

    needs_extra.requires = ("my_weights",)  # type: ignore[attr-defined]

    with pytest.raises(InputError, match=r"my_weights.*stage_inputs"):
        policy_loss(torch.zeros(2, 4), None, ADV.float(), MASK, correction=needs_extra)
    out = policy_loss(
        torch.zeros(2, 4),
        None,
        ADV.float(),
        MASK,
        correction=needs_extra,
        stage_inputs={"my_weights": torch.ones(2, 4)},
    )
    assert torch.isfinite(out.loss)


def test_trust_stage_receives_context() -> None:
    seen: list[StageContext | None] = []

    def trust(
        r: torch.Tensor, lr: torch.Tensor, a: torch.Tensor, lp: torch.Tensor, *, ctx: StageContext | None = None
    ) -> TrustOutput:
        seen.append(ctx)
        return TrustOutput(-a * r, None, {})

    trust.accepts = ("confidence", "topk_logp")  # type: ignore[attr-defined]
    conf = torch.tensor([0.2, 1.0])
    topk = torch.zeros(2, 4, 3)
    policy_loss(torch.zeros(2, 4), None, ADV.float(), MASK, trust=trust, confidence=conf, topk_logp=topk)
    ctx = seen[0]
    assert ctx is not None and torch.equal(ctx.confidence, conf) and ctx.topk_logp is not None
    assert ctx.topk_behav_logp is None and ctx.versions is None


def _reads_versions(
    r: torch.Tensor, lr: torch.Tensor, a: torch.Tensor, lp: torch.Tensor, *, ctx: StageContext | None = None
) -> TrustOutput:
    return TrustOutput(-a * r, None, {})


_reads_versions.accepts = ("versions", "policy_version")  # type: ignore[attr-defined]


def test_staleness_metrics() -> None:
    """Reported whenever a configured stage reads ``versions`` (here a plain surrogate that declares it)."""
    versions = torch.tensor([[5, 5, 7, 0], [6, 7, 0, 0]])
    kw = {"trust": _reads_versions}
    with pytest.raises(InputError) as err:  # a stage that does not read versions refuses them
        policy_loss(torch.zeros(2, 4), None, ADV.float(), MASK, versions=versions)
    assert err.value.argument == "versions"
    out = policy_loss(torch.zeros(2, 4), None, ADV.float(), MASK, versions=versions, policy_version=8, **kw)
    lags = [3, 3, 1, 2, 1]
    torch.testing.assert_close(out.metrics["staleness_mean"], torch.tensor(sum(lags) / 5))
    torch.testing.assert_close(out.metrics["staleness_max"], torch.tensor(3.0))
    torch.testing.assert_close(out.metrics["stale_frac"], torch.tensor(1.0))
    # without policy_version, lag is measured against the newest version among the loss tokens (7)
    out = policy_loss(torch.zeros(2, 4), None, ADV.float(), MASK, versions=versions, **kw)
    torch.testing.assert_close(out.metrics["staleness_mean"], torch.tensor((2 + 2 + 0 + 1 + 0) / 5))
    torch.testing.assert_close(out.metrics["stale_frac"], torch.tensor(3 / 5))


def test_ratio_quantiles_and_log_ratio_max() -> None:
    # 5 loss tokens with ratios 0.5, 1, 2, 4, 0.25 (sorted 0.25 0.5 1 2 4); padding holds a huge ratio
    lr = t([[math.log(0.5), 0.0, math.log(2.0), 9.0], [math.log(4.0), math.log(0.25), 9.0, 9.0]])
    out = policy_loss(lr - 3.0, torch.full((2, 4), -3.0, dtype=D), ADV, MASK, trust=None)
    # lower order statistic at floor(q * (n - 1)): q10 -> 0, q50 -> 2, q90 -> 3
    torch.testing.assert_close(out.metrics["ratio_q10"], t(0.25))
    torch.testing.assert_close(out.metrics["ratio_q50"], t(1.0))
    torch.testing.assert_close(out.metrics["ratio_q90"], t(2.0))
    torch.testing.assert_close(out.metrics["log_ratio_max"], t(math.log(4.0)))
    assert "is_ess" not in out.metrics  # no weights, no weight metrics


def test_empty_batch_metrics_are_finite() -> None:
    mask = torch.zeros(2, 4, dtype=torch.bool)
    out = policy_loss(
        torch.zeros(2, 4),
        None,
        ADV.float(),
        mask,
        is_weights=torch.ones(2),
        versions=torch.zeros(2, 4, dtype=torch.long),
        trust=_reads_versions,
    )
    for k, v in out.metrics.items():
        assert torch.isfinite(v), k
    assert float(out.metrics["is_ess"]) == 1.0


@settings(max_examples=60, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=40),
    keep=st.lists(st.booleans(), min_size=40, max_size=40),
    q=st.floats(0.0, 1.0),
)
def test_masked_quantiles_match_torch_quantile(values: list[float], keep: list[bool], q: float) -> None:
    x = torch.tensor(values, dtype=D)
    m = torch.tensor(keep[: len(values)])
    (got,) = masked_quantiles(x, m, (q,))
    if not bool(m.any()):
        assert float(got) == 0.0
        return
    want = torch.quantile(x[m], q, interpolation="lower")
    # torch.quantile's own index is rounded from q*(n-1) in float; both are order statistics of the kept set
    kept = x[m].sort().values
    assert float(got) in kept.tolist()
    assert abs(int((kept == got).nonzero()[0]) - int((kept == want).nonzero()[0])) <= 1
    torch.testing.assert_close(masked_mean(x, m), x[m].mean())


@pytest.mark.parametrize(
    ("kwargs", "arg"),
    [
        ({"policy_version": 1.5}, "policy_version"),
        ({"policy_version": True}, "policy_version"),
        ({"confidence": torch.tensor([0.5, 1.5])}, "confidence"),
        ({"confidence": torch.tensor([0.5])}, "confidence"),
        ({"versions": torch.zeros(2, 4)}, "versions"),
        ({"versions": torch.zeros(2, 3, dtype=torch.long)}, "versions"),
        ({"topk_logp": torch.zeros(2, 4)}, "topk_logp"),
        ({"topk_behav_logp": torch.full((2, 4, 2), math.nan)}, "topk_behav_logp"),
        ({"correction": 3}, "correction"),
        ({"correction": [lambda ctx: None, 3]}, r"correction\[1\]"),
    ],
)
def test_bad_stage_inputs(kwargs: dict[str, object], arg: str) -> None:
    with pytest.raises(InputError, match=arg):
        policy_loss(torch.zeros(2, 4), None, ADV.float(), MASK, trust=PPOClip(), **kwargs)  # type: ignore[arg-type]


def test_masked_quantiles_stride_sample_for_large_inputs() -> None:
    x = torch.arange(10, dtype=D)  # stride ceil(10 / 4) = 3 keeps positions 0, 3, 6, 9
    m = torch.ones(10, dtype=torch.bool)
    got = masked_quantiles(x, m, (0.0, 0.5, 1.0), max_samples=4)
    assert [float(v) for v in got] == [0.0, 3.0, 9.0]
    exact = masked_quantiles(x, m, (0.5,), max_samples=None)
    assert float(exact[0]) == 4.0


def test_trust_stage_batch_metrics_are_reported() -> None:
    def trust(
        r: torch.Tensor, lr: torch.Tensor, a: torch.Tensor, lp: torch.Tensor, *, ctx: StageContext | None = None
    ) -> TrustOutput:
        return TrustOutput(-a * r, None, {}, {"my_bound": torch.tensor(0.125, requires_grad=True)})

    out = policy_loss(torch.zeros(2, 4), None, ADV.float(), MASK, trust=trust)
    assert float(out.metrics["my_bound"]) == 0.125 and not out.metrics["my_bound"].requires_grad


@settings(max_examples=80, deadline=None)
@given(
    values=st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=60),
    keep=st.lists(st.booleans(), min_size=60, max_size=60),
    qs=st.lists(st.floats(0.5, 1.0), min_size=1, max_size=3),
)
def test_masked_quantiles_topk_path_equals_sort_path(values: list[float], keep: list[bool], qs: list[float]) -> None:
    """Upper quantiles use a top-k; adding a quantile below 0.5 forces the sort: both give the same values."""
    x = torch.tensor(values, dtype=D)
    m = torch.tensor(keep[: len(values)])
    top = masked_quantiles(x, m, tuple(qs), max_samples=None)
    via_sort = masked_quantiles(x, m, (*qs, 0.0), max_samples=None)[:-1]
    assert [float(v) for v in top] == [float(v) for v in via_sort]
