"""T-PPO's extended GAE (our reconstruction): hand oracles, a hypothesis property against a backward GAE loop,
long sequences, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rolloutopt.control import (
    egae,
)
from rolloutopt.errors import InputError

from .length_rules_helpers import PROPS, X, prefix, t


def naive_egae(
    values: np.ndarray, rewards: list[float], lengths: list[int], finished: list[bool], gamma: float, lam: float
) -> tuple[np.ndarray, np.ndarray]:
    """Per-row backward loop of EGAE (our reconstruction) in float64; outcome rewards on finished rows' last token."""
    b, t1 = values.shape
    adv = np.zeros((b, t1 - 1))
    ret = np.zeros((b, t1 - 1))
    for i in range(b):
        n = lengths[i]
        r = np.zeros(n)
        if n and finished[i]:
            r[n - 1] = rewards[i]
        gae, g_ret = 0.0, 0.0 if finished[i] else values[i, n]
        for k in range(n - 1, -1, -1):
            nxt = values[i, k + 1] if (k + 1 < n or not finished[i]) else 0.0
            delta = r[k] + gamma * nxt - values[i, k]
            gae = delta + gamma * lam * gae
            g_ret = r[k] + gamma * g_ret
            adv[i, k], ret[i, k] = gae, g_ret
    return adv, ret


def test_egae_oracle() -> None:
    # gamma = lambda = 1, zero intermediate rewards: unfinished -> V(s_l) - V(s_t); finished -> R - V(s_t)
    values = t([[0.1, 0.2, 0.3, 0.9, 7.0], [0.5, -0.5, 2.0, 0.0, 0.0]], torch.float64)
    mask = prefix([3, 2], width=4)
    out = egae(values, t([5.0, 2.0], torch.float64), mask, torch.tensor([False, True]), **X)
    torch.testing.assert_close(out.advantages[0, :3], 0.9 - values[0, :3])
    torch.testing.assert_close(out.advantages[1, :2], 2.0 - values[1, :2])
    assert (out.advantages[0, 3:] == 0).all() and (out.advantages[1, 2:] == 0).all()
    assert out.value_mask.tolist() == [[False] * 4, [True, True, False, False]]
    torch.testing.assert_close(out.returns[1, :2], t([2.0, 2.0], torch.float64))  # Monte-Carlo return
    # [B, T] values with bootstrap = V(s_l) give the same numbers
    same = egae(values[:, :4], t([5.0, 2.0], torch.float64), mask, torch.tensor([False, True]),
                bootstrap=t([0.9, 123.0], torch.float64), **X)  # fmt: skip
    torch.testing.assert_close(same.advantages, out.advantages)
    torch.testing.assert_close(same.returns, out.returns)
    lam_ret = egae(values, t([5.0, 2.0], torch.float64), mask, torch.tensor([False, True]), returns="lambda", **X)
    torch.testing.assert_close(lam_ret.returns[0, :3], t([0.9, 0.9, 0.9], torch.float64))


@PROPS
@given(
    st.integers(1, 5),
    st.integers(0, 9),
    st.floats(0, 1),
    st.floats(0, 1),
    st.integers(0, 2**31 - 1),
)
def test_egae_matches_backward_loop(b: int, t_len: int, gamma: float, lam: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, t_len + 1, (b,), generator=gen).tolist()
    finished = (torch.rand(b, generator=gen) < 0.5).tolist()
    values = torch.randn(b, t_len + 1, generator=gen, dtype=torch.float64)
    rewards = torch.randn(b, generator=gen, dtype=torch.float64)
    out = egae(
        values, rewards, prefix(lengths, t_len), torch.tensor(finished, dtype=torch.bool), gamma=gamma, lam=lam, **X
    )
    adv, ret = naive_egae(values.numpy(), rewards.tolist(), lengths, finished, gamma, lam)
    np.testing.assert_allclose(out.advantages.numpy(), adv, rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(out.returns.numpy(), ret, rtol=1e-9, atol=1e-9)


def test_egae_long_sequences_use_chunks() -> None:
    # gamma * lam = 0.01: chunks of 140 tokens; 400 tokens cross two chunk boundaries
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(3, 401, generator=gen, dtype=torch.float64)
    lengths, finished = [400, 333, 141], [False, True, False]
    out = egae(values, t([1.0, 2.0, 3.0], torch.float64), prefix(lengths, 400), torch.tensor(finished),
               gamma=0.1, lam=0.1, **X)  # fmt: skip
    adv, ret = naive_egae(values.numpy(), [1.0, 2.0, 3.0], lengths, finished, 0.1, 0.1)
    np.testing.assert_allclose(out.advantages.numpy(), adv, rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(out.returns.numpy(), ret, rtol=1e-9, atol=1e-12)
    f32 = egae(values.float(), t([1.0, 2.0, 3.0]), prefix(lengths, 400), torch.tensor(finished), gamma=0.99, **X)
    assert f32.advantages.dtype == torch.float32 and torch.isfinite(f32.advantages).all()


def test_egae_bad_input() -> None:
    v, r, fin = torch.zeros(2, 4), t([1.0, 1.0]), torch.tensor([True, False])
    with pytest.raises(InputError, match=r"^mask"):
        egae(v, r, torch.tensor([[True, False, True], [True, True, True]]), fin, **X)
    with pytest.raises(InputError, match="values"):
        egae(torch.zeros(2, 6), r, prefix([2, 3], 3), fin, **X)
    with pytest.raises(InputError, match="bootstrap"):
        egae(v[:, :3], r, prefix([2, 3], 3), fin, **X)
    with pytest.raises(InputError, match="bootstrap"):
        egae(v, r, prefix([2, 3], 3), fin, bootstrap=t([0.0, 0.0]), **X)
    with pytest.raises(InputError, match="values"):
        egae(t([[0.0, float("inf"), 0, 0], [0, 0, 0, 0]]), r, prefix([2, 3], 3), fin, **X)
    with pytest.raises(InputError, match="gamma"):
        egae(v, r, prefix([2, 3], 3), fin, gamma=1.5, **X)
    with pytest.raises(InputError, match=r"^returns"):
        egae(v, r, prefix([2, 3], 3), fin, returns="td", **X)  # type: ignore[arg-type]
    with pytest.raises(InputError, match="finished"):
        egae(v, r, prefix([2, 3], 3), torch.tensor([True]), **X)
