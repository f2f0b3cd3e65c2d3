"""Multi-reward estimators GDPO (arXiv 2601.05242) and GD²PO (arXiv 2606.16771).

Oracles computed by hand following the authors' code (GDPO: ``NVlabs/GDPO@41f74c53``, the ``apply_gdpo``
branch of ``trl-GDPO/.../grpo_trainer.py``; GD²PO: ``Qwen-Applications/GD2PO@f1ad765``,
``tool-calling/verl/trainer/ppo/ray_trainer.py``) and our own, singleton / zero-variance / valid conventions,
hypothesis properties against a float64 per-group Python loop written from those formulas, gradchecks and one test
per class of bad input. Parity with verl and TRL is in tests/integration/test_gdpo_parity.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import rolloutopt
from rolloutopt.advantages._base import REGISTRY
from rolloutopt.advantages.gdpo import gd2po, gdpo
from rolloutopt.advantages.reference import grpo
from rolloutopt.errors import InputError
from rolloutopt.groups import Groups

from .helpers import SINGLETON_WARNING, D, close, group_ids, relabel_map, t

S3 = math.sqrt(3) / 2  # 0.866: (1 - 0.5) / std([1, 0, 1, 0]) with the unbiased std sqrt(1/3)


# ---------------------------------------------------------------------------------- independent oracle


def naive_components(
    r: list[list[float]], group: list[int], ok: list[list[bool]], eps: float, singleton: str
) -> list[list[float]]:
    b, k = len(r), len(r[0])
    out = [[0.0] * k for _ in range(b)]
    for c in range(k):
        members: dict[int, list[int]] = {}
        for i in range(b):
            if ok[i][c]:
                members.setdefault(group[i], []).append(i)
        for rows in members.values():
            xs = [r[i][c] for i in rows]
            n = len(xs)
            mu = sum(xs) / n
            for i in rows:
                if n == 1:
                    out[i][c] = 0.0 if singleton == "zero" else r[i][c] / (1 + eps)
                else:
                    sd = math.sqrt(sum((x - mu) ** 2 for x in xs) / (n - 1))
                    out[i][c] = (r[i][c] - mu) / (sd + eps)
    return out


def naive(
    method: str,
    r: list[list[float]],
    group: list[int],
    *,
    lengths: list[int] | None = None,
    valid: list[list[bool]] | None = None,
    weights: list[float] | None = None,
    singleton: str = "zero",
    eps: float | None = None,
    threshold: float = 0.8,
    filt: str = "snr",
) -> tuple[list[float], list[float]]:
    """Per-group float64 loop of the codes' formulas. Returns (per-sequence advantages, weights); token mode when
    lengths."""
    b, k = len(r), len(r[0])
    ok = valid if valid is not None else [[True] * k for _ in range(b)]
    w = weights if weights is not None else [1.0] * k
    token = lengths is not None
    e = eps if eps is not None else (1e-6 if token or method == "gd2po" else 1e-4)
    comp = naive_components(r, group, ok, e, singleton)
    rows = [any(x) for x in ok]
    s = [sum(wk * a for wk, a in zip(w, comp[i], strict=True)) for i in range(b)]
    keep = list(rows)
    ln = lengths if lengths is not None else [1] * b
    if method == "gd2po":
        for i in range(b):
            a = [x * ln[i] for x in comp[i]]
            mixed = any(x > 1e-8 for x in a) and any(x < -1e-8 for x in a)
            ratio = sum(a) / (sum(abs(x) for x in a) + 1e-8)
            conflict = mixed and (abs(ratio) < threshold if filt == "snr" else True)
            keep[i] = rows[i] and not conflict
        for i in range(b):
            n_g = sum(1 for j in range(b) if group[j] == group[i] and rows[j])
            kept = sum(1 for j in range(b) if group[j] == group[i] and keep[j])
            s[i] = s[i] * (kept / max(n_g, 1)) * keep[i]
    cnt = [ln[i] for i in range(b)]
    xs = [(s[i], cnt[i]) for i in range(b) if keep[i]]
    total = sum(c for _, c in xs)
    mu = sum(x * c for x, c in xs) / max(total, 1)
    var = sum((x - mu) ** 2 * c for x, c in xs) / (total - 1) if total > 1 else 0.0
    out = []
    for i in range(b):
        if not keep[i]:
            out.append(0.0)
        elif token:
            out.append((s[i] - mu) / math.sqrt(var + 1e-8))
        else:
            out.append((s[i] - mu) / (math.sqrt(var) + 1e-4))
        n_rows = sum(1 for j in range(b) if group[j] == group[i] and rows[j])
        if singleton == "zero" and n_rows == 1:
            out[-1] = 0.0
    return out, [float(x) for x in keep]


# ---------------------------------------------------------------------------------------- hand oracles

R = t([[1.0, 1.0], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])  # r1 = [1,0,1,0], r2 = [1,1,0,0]
G = torch.tensor([3, 3, 3, 3])
M = torch.ones(4, 5, dtype=torch.bool)


def test_gdpo_spec_oracle() -> None:
    a1 = 0.5 / (math.sqrt(1 / 3) + 1e-4)  # per-component advantage +-0.866, NVlabs eps
    assert abs(a1 - S3) < 1e-3
    comp = gdpo(R[:, :1], G).advantages  # K = 1: batch z-score of [a, -a, a, -a], unbiased std 2a / sqrt(3)
    s = [2 * a1, 0.0, 0.0, -2 * a1]  # by hand: pre-batch-norm S = [1.732, 0, 0, -1.732]
    close(t(s), [1.732, 0.0, 0.0, -1.732], atol=1e-3)
    z = a1 / (2 * a1 / math.sqrt(3) + 1e-4)
    close(comp, [z, -z, z, -z])
    close(comp, [0.866, -0.866, 0.866, -0.866], atol=1e-3)
    sd = math.sqrt(2 * s[0] ** 2 / 3)
    out = gdpo(R, G)
    close(out.advantages, [s[0] / (sd + 1e-4), 0.0, 0.0, -s[0] / (sd + 1e-4)])
    close(out.metrics["combined_std"], sd)
    # plain GRPO on the summed reward [2, 1, 1, 0] gives rollouts 2 and 3 the identical advantage 0
    close(grpo(R.sum(1), G).advantages[1:3], [0.0, 0.0])
    assert torch.equal(out.weight, torch.ones(4))


def test_gdpo_separates_combinations_that_grpo_collapses() -> None:
    # component 1 is binary, component 2 has a large scale: GRPO on the sum is dominated by component 2
    r = t([[1.0, 0.0], [0.0, 10.0], [0.0, 0.0], [1.0, 10.0]])
    a1 = 0.5 / (math.sqrt(1 / 3) + 1e-4)
    a2 = 5.0 / (math.sqrt(100 / 3) + 1e-4)
    s = [a1 - a2, -a1 + a2, -a1 - a2, a1 + a2]
    mu = sum(s) / 4
    sd = math.sqrt(sum((x - mu) ** 2 for x in s) / 3)
    close(gdpo(r, G).advantages, [(x - mu) / (sd + 1e-4) for x in s])
    # equal weight for both components regardless of scale: rollouts 1 and 2 are mirror images
    out = gdpo(r, G).advantages
    close(out[0], -out[1])


def test_gdpo_weights_and_token_mode_oracle() -> None:
    a1 = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    s = [a1 * 1.5, a1 * (-1 + 0.5), a1 * (1 - 0.5), -1.5 * a1]  # weights [1, 0.5]
    lengths = [1, 2, 3, 4]
    mask = torch.arange(5)[None, :] < torch.tensor(lengths)[:, None]
    toks = [x for x, n in zip(s, lengths, strict=True) for _ in range(n)]
    mu = sum(toks) / len(toks)
    var = sum((x - mu) ** 2 for x in toks) / (len(toks) - 1)
    expected = torch.tensor([[(x - mu) / math.sqrt(var + 1e-8)] * 5 for x in s]) * mask
    out = gdpo(R, G, weights=[1.0, 0.5], final="token", mask=mask)
    assert out.advantages.shape == (4, 5)
    close(out.advantages, expected)
    close(gdpo(R, G, weights=torch.tensor([1.0, 0.5]), final="token", mask=mask).advantages, expected)


def test_gd2po_spec_oracle() -> None:
    out = gd2po(R, G, M)
    # rollouts 2, 3 conflicted (s = 0 < 0.8), kappa = 0.5, pre-whitening [0.866, 0, 0, -0.866]; whitened over the
    # 10 kept tokens: mean 0, var = 10 * 0.75 / 9
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert abs(a - S3) < 1e-5
    pre = 0.5 * 2 * a
    z = pre / math.sqrt(10 * pre**2 / 9 + 1e-8)
    close(out.advantages, torch.tensor([[z] * 5, [0.0] * 5, [0.0] * 5, [-z] * 5]))
    assert torch.equal(out.weight, t([1.0, 0.0, 0.0, 1.0]))
    close(out.metrics["masked_frac"], 0.5)
    close(out.metrics["excluded_frac"], 0.5)
    close(out.metrics["downweighted_frac"], 0.5)
    close(out.metrics["mixed_sign_frac"], 0.5)
    close(out.metrics["query_weight_mean"], 0.5)
    close(out.metrics["zero_weight_group_frac"], 0.0)
    # the same in sequence mode, z-scored over the two kept sequences
    seq = gd2po(R, G, final="sequence")
    sd = math.sqrt(2 * pre**2)
    close(seq.advantages, [pre / (sd + 1e-4), 0.0, 0.0, -pre / (sd + 1e-4)])


def test_gd2po_threshold_oracle() -> None:
    # two rollouts, opposite components: s = 0, both masked at any threshold, so the query weight is 0
    r = t([[1.0, 0.0], [0.0, 1.0]])
    g = torch.tensor([0, 0])
    out = gd2po(r, g, final="sequence")
    assert torch.equal(out.weight, t([0.0, 0.0]))
    assert torch.equal(out.advantages, t([0.0, 0.0]))
    close(out.metrics["zero_weight_group_frac"], 1.0)
    close(out.metrics["query_weight_mean"], 0.0)
    # three components (+a, +a, -a) with a = 1/sqrt(2): s = 1/3 -> masked at tau 0.8, kept at tau 0.2
    r3 = t([[1.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    assert torch.equal(gd2po(r3, g, final="sequence").weight, t([0.0, 0.0]))
    assert torch.equal(gd2po(r3, g, final="sequence", threshold=0.2).weight, t([1.0, 1.0]))
    assert torch.equal(gd2po(r3, g, final="sequence", filter="hard", threshold=0.0).weight, t([0.0, 0.0]))
    # components (+0.9, -0.1): s = 0.8 is kept at tau = 0.8, the test is strict (|s| < tau). The ratio uses
    # unweighted component advantages of equal |A| here, so build s from agreeing / disagreeing counts:
    r10 = t([[1.0] * 9 + [0.0], [0.0] * 9 + [1.0]])  # nine agree, one disagrees: s = 0.8
    assert torch.equal(gd2po(r10, g, final="sequence", threshold=0.79).weight, t([1.0, 1.0]))
    assert torch.equal(gd2po(r10, g, final="sequence", threshold=0.81).weight, t([0.0, 0.0]))
    r4 = t([[1.0] * 3 + [0.0], [0.0] * 3 + [1.0]])  # three agree, one disagrees: s = 2a / 4a = 0.5 exactly
    assert torch.equal(gd2po(r4, g, final="sequence", threshold=0.5, ratio_eps=0.0).weight, t([1.0, 1.0]))
    assert torch.equal(gd2po(r4, g, final="sequence", threshold=0.5001, ratio_eps=0.0).weight, t([0.0, 0.0]))


def test_gd2po_default_threshold_is_the_released_scripts() -> None:
    import inspect

    assert inspect.signature(gd2po).parameters["threshold"].default == 0.8
    assert inspect.signature(gd2po).parameters["final"].default == "token"


def test_gd2po_empty_response_has_no_sign() -> None:
    # L_i = 0 makes a_i = 0: never conflicted (code: a = A * L)
    mask = M.clone()
    mask[1] = False
    out = gd2po(R, G, mask)
    assert out.weight[1].item() == 1.0
    assert torch.equal(out.advantages[1], torch.zeros(5))


# ------------------------------------------------------------------------------------ edge conventions


def test_constant_component_contributes_zero_and_all_equal_is_zero() -> None:
    r = t([[1.0, 0.1], [0.0, 0.1], [0.3, 0.1]])
    g = torch.tensor([0, 0, 0])
    one = gdpo(r[:, :1], g).advantages
    close(gdpo(r, g).advantages, one)
    out = gdpo(torch.full((16, 2), 0.1), torch.zeros(16, dtype=torch.long))
    assert torch.equal(out.advantages, torch.zeros(16))
    close(out.metrics["zero_variance_group_frac"], 1.0)
    close(out.metrics["component_zero_variance_frac"], 1.0)
    tok = gdpo(torch.full((16, 2), 0.1), torch.zeros(16, dtype=torch.long), final="token", mask=torch.ones(16, 3))
    assert torch.equal(tok.advantages, torch.zeros(16, 3))
    assert torch.equal(gd2po(torch.full((16, 2), 0.1), torch.zeros(16, dtype=torch.long), torch.ones(16, 3)).advantages,
                       torch.zeros(16, 3))  # fmt: skip


def test_singletons() -> None:
    r = t([[1.0, 0.0], [0.0, 1.0], [5.0, 2.0], [1.0, 1.0], [0.0, 0.0]])
    g = torch.tensor([0, 0, 9, 4, 4])
    with pytest.warns(UserWarning, match="size 1"):
        out = gdpo(r, g)
    assert out.advantages[2].item() == 0.0
    close(out.metrics["singleton_group_frac"], 1 / 3)
    raw = gdpo(r, g, singleton="raw", final="token", mask=torch.ones(5, 2))
    assert raw.advantages[2, 0].abs().item() > 0.1  # verl: the singleton's raw rewards enter the sum


def test_valid_entries_and_rows() -> None:
    r = t([[1.0, math.nan], [0.0, 2.0], [1.0, 1.0], [math.nan, math.nan], [0.0, 0.0], [3.0, 1.0]])
    g = torch.tensor([0, 0, 0, 0, 1, 1])
    valid = ~r.isnan()
    out = gdpo(r, g, valid=valid)
    exp, w = naive("gdpo", r.nan_to_num().tolist(), g.tolist(), valid=valid.tolist())
    close(out.advantages, exp)
    assert torch.equal(out.weight, t(w))
    assert out.advantages[3].item() == 0.0
    close(out.metrics["invalid_frac"], 1 / 6)
    # a [B] row mask: the row leaves every statistic
    rows = torch.tensor([True, True, True, False, True, True])
    clean = r.nan_to_num()
    keep = rows.nonzero().squeeze(1)
    close(gdpo(clean, g, valid=rows).advantages[keep], gdpo(clean[keep], g[keep]).advantages)
    none = gdpo(clean, g, valid=torch.zeros(6, dtype=torch.bool))
    assert torch.equal(none.advantages, torch.zeros(6))
    assert all(torch.isfinite(m) for m in none.metrics.values())
    g2 = gd2po(clean, g, torch.ones(6, 2), valid=torch.zeros(6, dtype=torch.bool))
    assert torch.equal(g2.advantages, torch.zeros(6, 2))
    assert all(torch.isfinite(m) for m in g2.metrics.values())


def test_one_kept_token_gives_zero() -> None:
    mask = torch.zeros(4, 3, dtype=torch.bool)
    mask[0, 0] = True
    out = gd2po(R, G, mask)
    assert torch.equal(out.advantages, torch.zeros(4, 3))


def test_metrics_are_detached_scalars_and_dtypes() -> None:
    r = R.clone().requires_grad_(True)
    for out in (gdpo(r, G), gd2po(r, G, M)):
        assert all(m.ndim == 0 and not m.requires_grad for m in out.metrics.values())
    assert gdpo(R.bfloat16(), G).advantages.dtype == torch.float32
    assert gdpo(R.double(), G).advantages.dtype == torch.float64
    assert gd2po(R.half(), G, M).advantages.dtype == torch.float32


def test_groups_object_and_registry() -> None:
    gen = torch.Generator().manual_seed(0)
    r = torch.randn(30, 3, generator=gen)
    g = torch.randint(-4, 5, (30,), generator=gen)
    mask = torch.rand(30, 4, generator=gen) > 0.3
    groups = Groups(g)
    assert torch.equal(gdpo(r, groups, singleton="raw").advantages, gdpo(r, g, singleton="raw").advantages)
    assert torch.equal(
        gd2po(r, groups, mask, singleton="raw").advantages, gd2po(r, g, mask, singleton="raw").advantages
    )
    assert REGISTRY.get("gdpo").fn is gdpo
    assert REGISTRY.get("gd2po").fn is gd2po


# ------------------------------------------------------------------------------------------- bad input


def _raises(argument: str, fn: Callable[[], Any]) -> None:
    with pytest.raises(InputError) as err:
        fn()
    assert err.value.argument == argument, str(err.value)


@pytest.mark.parametrize(
    ("argument", "call"),
    [
        ("rewards", lambda: gdpo(R[:, 0], G)),
        ("rewards", lambda: gdpo(R.long(), G)),
        ("rewards", lambda: gdpo(t([[1.0, math.nan]] * 4), G)),
        ("rewards", lambda: gd2po(t([[1.0, math.inf]] * 4), G, M)),
        ("group", lambda: gdpo(R, torch.tensor([0, 0, 1]))),
        ("group", lambda: gd2po(R, G.float(), M)),
        ("weights", lambda: gdpo(R, G, weights=[1.0, 2.0, 3.0])),
        ("weights", lambda: gdpo(R, G, weights=[1.0, math.nan])),
        ("weights", lambda: gdpo(R, G, weights="ab")),
        ("final", lambda: gdpo(R, G, final="batch")),  # type: ignore[arg-type]
        ("mask", lambda: gdpo(R, G, final="token")),
        ("mask", lambda: gdpo(R, G, mask=M)),
        ("mask", lambda: gd2po(R, G)),
        ("mask", lambda: gd2po(R, G, torch.ones(3, 5))),
        ("mask", lambda: gd2po(R, G, torch.full((4, 5), 2.0))),
        ("valid", lambda: gdpo(R, G, valid=torch.ones(4, 3, dtype=torch.bool))),
        ("valid", lambda: gdpo(R, G, valid=torch.ones(3, dtype=torch.bool))),
        ("eps", lambda: gdpo(R, G, eps=-1.0)),
        ("final_eps", lambda: gdpo(R, G, final_eps=math.nan)),
        ("singleton", lambda: gdpo(R, G, singleton="mean")),  # type: ignore[arg-type]
        ("filter", lambda: gd2po(R, G, M, filter="soft")),  # type: ignore[arg-type]
        ("threshold", lambda: gd2po(R, G, M, threshold=-0.1)),
        ("ratio_eps", lambda: gd2po(R, G, M, ratio_eps=-1.0)),
        ("sign_eps", lambda: gd2po(R, G, M, sign_eps=math.nan)),
    ],
)
def test_bad_input_names_the_argument(argument: str, call: Callable[[], Any]) -> None:
    _raises(argument, call)


def test_checks_off_computes() -> None:
    with rolloutopt.checks(False):
        close(gdpo(R, G).advantages, gdpo(R.double(), G).advantages.float())


# ------------------------------------------------------------------------------------------ properties


@st.composite
def batches(draw: st.DrawFn, *, equal: bool = False) -> dict[str, Any]:
    k = draw(st.integers(1, 3))
    group = draw(group_ids(equal=equal))
    b = len(group)
    binary = draw(st.booleans())
    values = st.sampled_from([0.0, 1.0]) if binary else st.floats(-10, 10, width=32)
    rewards = draw(st.lists(st.lists(values, min_size=k, max_size=k), min_size=b, max_size=b))
    perm = draw(st.permutations(list(range(b))))
    group = [group[i] for i in perm]
    valid = draw(
        st.one_of(st.none(), st.lists(st.lists(st.booleans(), min_size=k, max_size=k), min_size=b, max_size=b))
    )
    lengths = draw(st.lists(st.integers(0, 4), min_size=b, max_size=b))
    weights = draw(st.lists(st.floats(-2, 2, width=32), min_size=k, max_size=k))
    return {"rewards": rewards, "group": group, "valid": valid, "lengths": lengths, "weights": weights}


def _run(method: str, batch: dict[str, Any], final: str, dtype: torch.dtype = D, **kw: Any) -> Any:
    r = torch.tensor(batch["rewards"], dtype=dtype)
    g = torch.tensor(batch["group"])
    v = None if batch["valid"] is None else torch.tensor(batch["valid"])
    mask = None
    if final == "token":
        mask = torch.arange(4)[None, :] < torch.tensor(batch["lengths"])[:, None]
    fn = gdpo if method == "gdpo" else gd2po
    return fn(r, g, mask=mask, final=final, valid=v, weights=batch["weights"], **kw)  # type: ignore[arg-type]


CONFIGS: list[tuple[str, str, dict[str, Any]]] = [
    ("gdpo", "sequence", {}),
    ("gdpo", "sequence", {"singleton": "raw"}),
    ("gdpo", "token", {}),
    ("gd2po", "token", {}),
    ("gd2po", "sequence", {"filter": "hard"}),
    ("gd2po", "token", {"threshold": 0.2, "singleton": "raw"}),
]


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@given(batch=batches())
def test_matches_naive_loop(batch: dict[str, Any]) -> None:
    for method, final, kw in CONFIGS:
        out = _run(method, batch, final, **kw)
        lengths = batch["lengths"] if final == "token" else None
        filt = kw.get("filter", "snr")
        nkw = {k: v for k, v in kw.items() if k in ("singleton", "threshold")}
        exp, w = naive(
            method, batch["rewards"], batch["group"], lengths=lengths, valid=batch["valid"],
            weights=batch["weights"], filt=filt, **nkw,
        )  # fmt: skip
        e = torch.tensor(exp, dtype=D)
        if final == "token":
            mask = torch.arange(4)[None, :] < torch.tensor(batch["lengths"])[:, None]
            e = e[:, None] * mask
        torch.testing.assert_close(out.advantages, e, atol=1e-7, rtol=1e-7, msg=f"{method} {final} {kw}")
        assert torch.equal(out.weight, torch.tensor(w, dtype=D))


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@given(batch=batches(), data=st.data())
def test_permutation_and_relabelling(batch: dict[str, Any], data: st.DataObject) -> None:
    b = len(batch["rewards"])
    perm = data.draw(st.permutations(list(range(b))))
    labels = sorted(set(batch["group"]))
    relabel = relabel_map(data, labels)
    permuted = {
        **batch,
        "rewards": [batch["rewards"][i] for i in perm],
        "group": [relabel[batch["group"][i]] for i in perm],
        "valid": None if batch["valid"] is None else [batch["valid"][i] for i in perm],
        "lengths": [batch["lengths"][i] for i in perm],
    }
    idx = torch.tensor(perm)
    for method, final, kw in CONFIGS:
        base = _run(method, batch, final, **kw)
        moved = _run(method, permuted, final, **kw)
        torch.testing.assert_close(moved.advantages, base.advantages[idx], atol=1e-8, rtol=1e-8)
        assert torch.equal(moved.weight, base.weight[idx])


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@settings(max_examples=20)  # five estimator calls per configuration
@given(batch=batches(equal=True), shift=st.floats(-50, 50), scale=st.floats(0.1, 20))
def test_ragged_equals_dense_and_invariances(batch: dict[str, Any], shift: float, scale: float) -> None:
    batch = {**batch, "valid": None}
    everything = {**batch, "valid": [[True] * len(batch["rewards"][0])] * len(batch["rewards"])}
    assert Groups(torch.tensor(batch["group"])).dense_size is not None
    moved = {**batch, "rewards": [[x * scale + shift for x in row] for row in batch["rewards"]]}
    # The shift invariance is a float32 statement only while the shift does not swallow a group's spread
    # (a spread of 1e-38 next to a shift of 1 rounds to 0): keep spreads of 0 or at least 1e-3.
    spreads = [
        max(col) - min(col)
        for lab in set(batch["group"])
        for col in zip(*[r for r, g in zip(batch["rewards"], batch["group"], strict=True) if g == lab], strict=True)
    ]
    assume(all(d == 0 or d >= 1e-3 for d in spreads))
    for method, final, kw in CONFIGS:
        base = _run(method, batch, final, **kw).advantages
        torch.testing.assert_close(_run(method, everything, final, **kw).advantages, base, atol=1e-8, rtol=1e-8)
        if kw.get("singleton") != "raw":  # shift- and scale-invariant per component up to eps
            torch.testing.assert_close(_run(method, moved, final, eps=0.0, **kw).advantages,
                                       _run(method, batch, final, eps=0.0, **kw).advantages,
                                       atol=1e-6, rtol=1e-6)  # fmt: skip
        # a positive scale of all weights changes nothing (exactly so with final_eps = 0)
        heavier = {**batch, "weights": [w * scale for w in batch["weights"]]}
        torch.testing.assert_close(_run(method, heavier, final, final_eps=0.0, **kw).advantages,
                                   _run(method, batch, final, final_eps=0.0, **kw).advantages,
                                   atol=1e-6, rtol=1e-6)  # fmt: skip


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@given(
    rewards=st.lists(
        st.lists(st.floats(-(2.0**60), 2.0**60, width=32), min_size=2, max_size=2), min_size=1, max_size=16
    ),
    group=st.lists(st.integers(0, 3), min_size=16, max_size=16),
    valid=st.lists(st.booleans(), min_size=16, max_size=16),
)
def test_finite_for_every_finite_input(rewards: list[list[float]], group: list[int], valid: list[bool]) -> None:
    b = len(rewards)
    r = torch.tensor(rewards)
    g = torch.tensor(group[:b])
    v = torch.tensor(valid[:b])
    mask = torch.ones(b, 2, dtype=torch.bool)
    for vv in (None, v):
        for out in (
            gdpo(r, g, valid=vv),
            gdpo(r, g, valid=vv, final="token", mask=mask, singleton="raw"),
            gd2po(r, g, mask, valid=vv),
            gd2po(r, g, final="sequence", valid=vv, singleton="raw"),
        ):
            assert torch.isfinite(out.advantages).all()
            assert all(torch.isfinite(m) for m in out.metrics.values())


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@pytest.mark.parametrize("seed", [0, 1])
def test_gradcheck(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    g = torch.tensor([0, 0, 0, 4, 4, 9, 2, 2, 2, 2])
    valid = torch.rand(10, 2, generator=gen) > 0.2
    mask = torch.rand(10, 3, generator=gen) > 0.3
    mask[:, 0] = True
    r = torch.randn(10, 2, dtype=D, generator=gen, requires_grad=True)
    w = torch.tensor([1.0, 0.5], dtype=D, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, ww: gdpo(x, g, weights=ww, valid=valid).advantages, (r, w))
    assert torch.autograd.gradcheck(lambda x: gdpo(x, g, final="token", mask=mask).advantages, (r,))
    assert torch.autograd.gradcheck(lambda x: gd2po(x, g, mask, singleton="raw").advantages, (r,))


# ------------------------------------------------------------------------------ fast paths (no valid mask)


def _run_rows(method: str, batch: dict[str, Any], final: str, **kw: Any) -> Any:
    """As :func:`_run`, with an all-true ``[B]`` row mask."""
    r = torch.tensor(batch["rewards"], dtype=D)
    mask = torch.arange(4)[None, :] < torch.tensor(batch["lengths"])[:, None] if final == "token" else None
    fn = gdpo if method == "gdpo" else gd2po
    rows = torch.ones(len(batch["rewards"]), dtype=torch.bool)
    return fn(r, torch.tensor(batch["group"]), mask=mask, final=final, valid=rows, weights=batch["weights"], **kw)  # type: ignore[arg-type]


@pytest.mark.filterwarnings(SINGLETON_WARNING)
@settings(max_examples=40)
@given(batch=batches())
def test_no_valid_mask_equals_all_valid_on_ragged_groups(batch: dict[str, Any]) -> None:
    # Without a valid mask the estimators skip every all-true mask and centre on a group's first row; with one
    # they take the masked path. Ragged groups include singletons (the "zero" / "raw" special cases).
    batch = {**batch, "valid": None}
    entries = {**batch, "valid": [[True] * len(batch["rewards"][0])] * len(batch["rewards"])}
    for method, final, kw in CONFIGS:
        base = _run(method, batch, final, **kw)
        for other in (_run(method, entries, final, **kw), _run_rows(method, batch, final, **kw)):
            torch.testing.assert_close(other.advantages, base.advantages, atol=1e-10, rtol=1e-10)
            assert torch.equal(other.weight, base.weight)
            for name, value in base.metrics.items():
                torch.testing.assert_close(other.metrics[name], value, atol=1e-10, rtol=1e-10, msg=name)


@pytest.mark.filterwarnings(SINGLETON_WARNING)
def test_token_output_with_and_without_autograd_and_mask_layouts() -> None:
    gen = torch.Generator().manual_seed(3)
    r = torch.randn(40, 3, generator=gen)
    g = torch.randint(0, 9, (40,), generator=gen)
    mask_t = torch.rand(6, 40, generator=gen) > 0.4
    mask = mask_t.t()  # a non-contiguous bool mask
    before = mask.clone()
    for fn in (lambda x, mm: gdpo(x, g, final="token", mask=mm), lambda x, mm: gd2po(x, g, mm)):
        plain = fn(r, mask).advantages
        assert torch.equal(mask, before)  # the caller's mask is never written
        graded = fn(r.clone().requires_grad_(True), mask).advantages
        assert graded.requires_grad
        assert torch.equal(graded.detach(), plain)
        assert torch.equal(fn(r, mask.contiguous()).advantages, plain)
        assert torch.equal(fn(r, mask.float()).advantages, plain)  # 0/1 float mask
        assert torch.equal(plain * ~mask, torch.zeros_like(plain))


def test_large_finite_rewards_pass_the_finiteness_check() -> None:
    # the sum overflows to inf although every entry is finite: the check must fall back to the entrywise test
    r = torch.full((8, 2), 3e38)
    g = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])
    assert torch.equal(gdpo(r, g).advantages, torch.zeros(8))  # constant components: exactly 0
    assert torch.equal(gd2po(r, g, final="sequence").advantages, torch.zeros(8))
    # NaN only where valid is False passes; NaN at a valid entry raises
    r2 = torch.tensor([[1.0, math.nan], [0.0, 1.0], [1.0, 0.0], [0.0, 0.0]])
    gdpo(r2, G, valid=~r2.isnan())
    _raises("rewards", lambda: gdpo(r2, G, valid=torch.ones(4, dtype=torch.bool)))
