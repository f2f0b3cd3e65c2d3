"""The arena's base policy: deterministic warm-up, cached once and loaded with weights_only, keyed by its settings."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from rolloutopt.arena import TaskSuite
from rolloutopt.arena.base import BaseConfig, base_policy, cache_dir
from rolloutopt.errors import InputError

SUITE = TaskSuite(ops=("reverse", "count"), lengths=(("reverse", (1, 2, 3)), ("count", (2, 3))), per_cell=16, holdout=4)
TINY = BaseConfig(hidden=16, steps=20, batch_size=16)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values(), strict=True))


def test_warm_up_is_deterministic_and_cached_once(tmp_path: Path) -> None:
    first = base_policy(SUITE, TINY, directory=tmp_path / "a")
    files = list((tmp_path / "a").glob("base-*.pt"))
    assert len(files) == 1
    stamp = files[0].stat().st_mtime_ns
    again = base_policy(SUITE, TINY, directory=tmp_path / "a")  # from the cache: the file is not rewritten
    assert _same(first, again) and files[0].stat().st_mtime_ns == stamp
    rebuilt = base_policy(SUITE, TINY, directory=tmp_path / "b")  # trained again elsewhere: the same weights
    assert _same(first, rebuilt)
    other = base_policy(SUITE, BaseConfig(hidden=16, steps=20, batch_size=16, seed=1), directory=tmp_path / "a")
    assert not _same(first, other) and len(list((tmp_path / "a").glob("base-*.pt"))) == 2


def test_warm_up_learns_the_warm_cells(tmp_path: Path) -> None:
    """300 steps on lengths <= 2: the greedy policy answers most warm train prompts (a blank one almost none)."""
    config = BaseConfig(hidden=32, steps=300, batch_size=64, next_fraction=0.0)
    policy = base_policy(SUITE, config, directory=tmp_path)
    blank = base_policy(SUITE, BaseConfig(hidden=32, steps=0), directory=tmp_path)
    train, _ = SUITE.split()
    warm = train[SUITE.decode_ids(train)[1] <= 2]
    gen = torch.Generator().manual_seed(0)

    def accuracy(p: torch.nn.Module) -> float:
        r = p.sample(SUITE.prompts(warm), SUITE.response_limit, temperature=0.0, generator=gen)  # type: ignore[operator]
        return float(SUITE.reward(warm, r.tokens, r.mask).mean())

    assert accuracy(policy) >= 0.8 > 0.2 >= accuracy(blank)


def test_cache_dir_follows_the_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ROLLOUTOPT_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path / "arena"
    monkeypatch.delenv("ROLLOUTOPT_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "rolloutopt" / "arena"


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"hidden": 0}, "hidden"),
        ({"arch": "lstm"}, "arch"),
        ({"next_fraction": 1.5}, "next_fraction"),
        ({"lr": 0.0}, "lr"),
        ({"steps": -1}, "steps"),
    ],
)
def test_bad_config(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InputError) as err:
        BaseConfig(**kwargs)  # type: ignore[arg-type]
    assert err.value.argument == argument


def test_rambling_targets_repeat_the_prompts_digits_to_the_limit() -> None:
    """By hand: ``count`` of 9 3 6 (length 3) rambles ``9 3 6 9 3 6 …`` to the response limit, with no <eos>."""
    from rolloutopt.arena.base import _rambling
    from rolloutopt.testbed.task import EOS

    suite = TaskSuite(ops=("count",), lengths=(("count", (3,)),), per_cell=8, holdout=2)
    ids = suite.split()[0][:3]
    prompts, out = suite.prompts(ids), _rambling(suite, ids)
    assert out.shape == (3, suite.response_limit) and not bool((out == EOS).any())
    for row, target in zip(prompts.tolist(), out.tolist(), strict=True):
        digits = [t for t in row if t < 10]
        assert target == [digits[i % len(digits)] for i in range(suite.response_limit)]


def test_the_cache_key_of_a_base_that_does_not_ramble_is_that_of_before_ramble_existed() -> None:
    """``ramble=0`` leaves the hash of the other settings (so caches built before it existed stay valid); any other
    fraction, the default 0.5 included, changes it."""
    from rolloutopt.arena.base import _key

    plain = BaseConfig(hidden=16, steps=20, batch_size=16, ramble=0.0)
    settings = {k: v for k, v in asdict(plain).items() if k != "ramble"}
    assert _key(SUITE, plain) == _key(SUITE, BaseConfig(**settings, ramble=0.0))
    assert BaseConfig().ramble == 0.5 and TINY.ramble == 0.5
    assert _key(SUITE, TINY) != _key(SUITE, plain)
    with pytest.raises(InputError) as err:
        BaseConfig(ramble=1.5)
    assert err.value.argument == "ramble"


def test_a_rambling_base_generates_longer_failures(tmp_path: Path) -> None:
    """Warmed up to ramble on every long prompt (here: reverse of length 3, beyond warm_length + 1 = 2), the
    policy's responses to those prompts are longer than the plain base policy's."""
    suite = TaskSuite(ops=("reverse",), lengths=(("reverse", (1, 3)),), per_cell=16, holdout=4)
    plain = BaseConfig(hidden=16, steps=60, batch_size=16, warm_length=1, next_fraction=0.0, ramble=0.0)
    rambling = BaseConfig(hidden=16, steps=60, batch_size=16, warm_length=1, next_fraction=0.0, ramble=1.0)
    ids = suite.split()[0]
    long = ids[suite.decode_ids(ids)[1] == 3]
    lengths = []
    for config in (plain, rambling):
        policy = base_policy(suite, config, directory=tmp_path)
        roll = policy.sample(suite.prompts(long), suite.response_limit, temperature=0.0, generator=torch.Generator())
        lengths.append(float(roll.mask.sum(1).float().mean()))
    assert lengths[1] >= lengths[0] + 2  # here 6.6 of at most 7 tokens against 2.0 (the answer and <eos>)
