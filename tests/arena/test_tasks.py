"""The arena's task suite: hand-computed prompts and answers, binary rewards, a deterministic split, bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rolloutopt.arena import ARENA_VOCAB, TaskSuite
from rolloutopt.arena.tasks import PLUS
from rolloutopt.errors import InputError
from rolloutopt.testbed.task import BOS, EOS, PAD, SEP

SUITE = TaskSuite()


def pid(op: int, length: int, index: int) -> int:
    return (op << 56) | (length << 48) | index


def text(row: torch.Tensor) -> str:
    return "".join(ARENA_VOCAB[int(t)] for t in row if int(t) != PAD)


def test_hand_examples_of_every_operation() -> None:
    """reverse 1485 -> 5841, sort 8920 -> 0289, add 28 + 74 -> 102, count: three of 3,1,3,3 after the leading 3."""
    ids = torch.tensor([pid(0, 4, 1485), pid(1, 4, 8920), pid(2, 2, 2874), pid(3, 5, 33133)])
    prompts = SUITE.prompts(ids)
    assert prompts.shape == (4, SUITE.prompt_width) and SUITE.prompt_width == 3 + 7  # <bos> A dd+dd... count/7
    assert [text(r) for r in prompts] == ["<bos>R1485=", "<bos>S8920=", "<bos>A28+74=", "<bos>C33133="]
    assert prompts[2].tolist() == [PAD, PAD, BOS, ARENA_VOCAB.index("A"), 2, 8, PLUS, 7, 4, SEP]
    answers, lens = SUITE.answers(ids)
    assert lens.tolist() == [4, 4, 3, 1]
    assert [answers[i, : int(n)].tolist() for i, n in enumerate(lens)] == [[5, 8, 4, 1], [0, 2, 8, 9], [1, 0, 2], [3]]
    assert SUITE.describe_cells(ids) == ["reverse/4", "sort/4", "add/2", "count/5"]


def _response(answer: list[int], width: int, stop: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.full((width,), PAD)
    tokens[: len(answer)] = torch.tensor(answer)
    n = len(answer)
    if stop:
        tokens[n] = EOS
        n += 1
    mask = torch.arange(width) < n
    return tokens, mask


def test_binary_reward_by_hand() -> None:
    ids = torch.tensor([pid(2, 2, 2874)] * 5)  # 28 + 74 = 102
    cases = [([1, 0, 2], True, 1.0), ([1, 0, 2], False, 0.0), ([1, 0, 3], True, 0.0), ([1, 0], True, 0.0),
             ([1, 0, 2, 5], True, 0.0)]  # fmt: skip
    rows = [_response(a, 9, stop) for a, stop, _ in cases]
    tokens, mask = torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])
    assert SUITE.reward(ids, tokens, mask).tolist() == [want for _, _, want in cases]


@settings(max_examples=40, deadline=None)
@given(row=st.integers(0, 10_000), corrupt=st.integers(0, 5), value=st.integers(0, 9))
def test_the_answer_earns_one_and_any_change_earns_zero(row: int, corrupt: int, value: int) -> None:
    train, _ = SUITE.split()
    ids = train[row % train.numel()].reshape(1)
    answers, lens = SUITE.answers(ids)
    answer = answers[0, : int(lens[0])].tolist()
    tokens, mask = _response(answer, SUITE.response_limit)
    assert SUITE.reward(ids, tokens[None], mask[None]).tolist() == [1.0]
    k = corrupt % (len(answer) + 1)
    bad = tokens.clone()
    bad[k] = value  # a digit where the answer or its <eos> belongs
    if not torch.equal(bad, tokens):
        assert SUITE.reward(ids, bad[None], mask[None]).tolist() == [0.0]


def test_split_is_deterministic_disjoint_and_covers_every_cell() -> None:
    train, held = SUITE.split()
    again = TaskSuite().split()
    assert torch.equal(train, again[0]) and torch.equal(held, again[1])
    assert not bool(torch.isin(train, held).any())
    assert set(SUITE.describe_cells(held)) == {f"{op}/{n}" for op, n in SUITE.cells}
    assert not torch.equal(TaskSuite(seed=1).split()[0], train)


@pytest.mark.parametrize(
    ("kwargs", "argument"),
    [
        ({"ops": ("reverse", "multiply")}, "ops"),
        ({"lengths": (("reverse", (7,)),), "ops": ("reverse",)}, "lengths"),
        ({"per_cell": 1}, "per_cell"),
        ({"holdout": 64}, "holdout"),
        ({"max_new_tokens": 3}, "max_new_tokens"),
    ],
)
def test_bad_suite(kwargs: dict[str, object], argument: str) -> None:
    with pytest.raises(InputError) as err:
        TaskSuite(**kwargs)  # type: ignore[arg-type]
    assert err.value.argument == argument


def test_ids_of_another_suite_are_refused() -> None:
    with pytest.raises(InputError, match="prompt_ids"):
        TaskSuite(ops=("reverse",), lengths=(("reverse", (1, 2)),)).prompts(torch.tensor([pid(1, 2, 3)]))
    with pytest.raises(InputError, match="tokens"):
        SUITE.reward(torch.tensor([pid(0, 1, 3)]), torch.zeros(1, 3, dtype=torch.long), torch.ones(2, 3).bool())
