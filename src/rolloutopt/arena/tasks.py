"""The arena's task suite: verifiable digit-string tasks at graded difficulties, with binary rewards.

Four operations, each at several lengths ``L`` (the difficulty):

- ``reverse``: ``d1 … dL`` → ``dL … d1``;
- ``sort``: the digits in increasing order;
- ``add``: ``a + b`` for two ``L``-digit numbers → their sum, ``L + 1`` digits (a leading 0 kept), carries
  included;
- ``count``: how many of ``d2 … dL`` equal ``d1``, as one digit (``L <= 10``).

A prompt is ``<pad>… <bos> OP digits [+ digits] =``, left-padded to one width for the whole suite (so every
response starts at the same position); the response is the answer then ``<eos>``. The reward is binary: 1 when
the tokens before the first ``<eos>`` are exactly the answer and an ``<eos>`` follows, 0 otherwise (a response
that never stops, rambling to the length limit, earns 0). Binary rewards make the regime the rollout allocators
are built for: early in RL most prompts are solved by every rollout or by none, and a minority is informative.

Prompt ids are int64 and stable: ``(op << 56) | (L << 48) | index``, where ``index`` numbers the ``10**L`` (or
``10**(2L)`` for ``add``) inputs of that operation and length; a suite draws a fixed pool of prompts per
(operation, length) from a seed and splits it into train and held-out prompts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt._validation import check_int, describe
from rolloutopt.errors import InputError
from rolloutopt.testbed.task import BOS, EOS, PAD, SEP, VOCAB, VOCAB_SIZE
from rolloutopt.typing import BoolBT, FloatB, IntB, IntBT

__all__ = ["ARENA_VOCAB", "ARENA_VOCAB_SIZE", "OPS", "TaskSuite"]

OPS: tuple[str, ...] = ("reverse", "sort", "add", "count")
"""The operations, in token order."""
_OP_TOKEN = {op: VOCAB_SIZE + i for i, op in enumerate(OPS)}
PLUS = VOCAB_SIZE + len(OPS)
"""The ``+`` token of ``add`` prompts."""
ARENA_VOCAB: tuple[str, ...] = (*VOCAB, "R", "S", "A", "C", "+")
"""Token strings: the testbed's 14, then the operation tokens and ``+``."""
ARENA_VOCAB_SIZE = len(ARENA_VOCAB)
_MAX_LEN = {"reverse": 6, "sort": 6, "add": 4, "count": 10}


def _answer_len(op: str, length: int) -> int:
    return length + 1 if op == "add" else 1 if op == "count" else length


def _input_len(op: str, length: int) -> int:
    return 2 * length + 1 if op == "add" else length


@dataclass(frozen=True)
class TaskSuite:
    """A fixed pool of prompts over ``ops`` × ``lengths``: ``per_cell`` prompts per (operation, length), of which
    ``holdout`` are held out for evaluation (never trained on), drawn with ``seed``.

    ``lengths`` maps an operation to its lengths (default: reverse and sort 1-5, add 1-3, count 2-7), so the
    suite spans prompts a warmed-up policy solves always, sometimes and never. ``max_new_tokens`` is the response
    limit (default: the longest answer plus 4): a response that does not stop rambles to it.
    """

    ops: tuple[str, ...] = OPS
    lengths: tuple[tuple[str, tuple[int, ...]], ...] = (
        ("reverse", (1, 2, 3, 4, 5)),
        ("sort", (1, 2, 3, 4, 5)),
        ("add", (1, 2, 3)),
        ("count", (2, 3, 4, 5, 6, 7)),
    )
    per_cell: int = 64
    holdout: int = 16
    seed: int = 0
    max_new_tokens: int | None = None

    def __post_init__(self) -> None:
        if not self.ops or any(op not in OPS for op in self.ops) or len(set(self.ops)) != len(self.ops):
            raise InputError("ops", f"distinct operations of {OPS}", repr(self.ops), "pick from the list")
        table = dict(self.lengths)
        for op in self.ops:
            ls = table.get(op)
            if not ls or any(not isinstance(n, int) or not 1 <= n <= _MAX_LEN[op] for n in ls):
                raise InputError(
                    "lengths", f"lengths of {op!r} in [1, {_MAX_LEN[op]}]", repr(ls), f"give {op!r} some lengths"
                )
        check_int(self.per_cell, "per_cell", 2, "pass e.g. 64")
        check_int(self.holdout, "holdout", 1, "hold out at least one prompt per cell")
        if self.holdout >= self.per_cell:
            raise InputError("holdout", f"< per_cell = {self.per_cell}", repr(self.holdout), "hold out fewer")
        longest = max(_answer_len(op, n) for op, n in self.cells)
        if self.max_new_tokens is not None:
            check_int(self.max_new_tokens, "max_new_tokens", longest + 1, "allow the longest answer and <eos>")

    # -- structure ---------------------------------------------------------------------------------------------
    @property
    def cells(self) -> tuple[tuple[str, int], ...]:
        """The (operation, length) cells, in suite order."""
        table = dict(self.lengths)
        return tuple((op, n) for op in self.ops for n in table[op])

    @property
    def prompt_width(self) -> int:
        """Tokens of every prompt after left padding: ``<bos> OP input =`` of the longest input."""
        return 3 + max(_input_len(op, n) for op, n in self.cells)

    @property
    def response_limit(self) -> int:
        """``max_new_tokens``: the longest answer plus 4 unless given."""
        if self.max_new_tokens is not None:
            return self.max_new_tokens
        return max(_answer_len(op, n) for op, n in self.cells) + 4

    def _cell_ids(self, op: str, n: int, gen: torch.Generator) -> Tensor:
        space = 10 ** (2 * n if op == "add" else n)
        k = min(self.per_cell, space)
        if space <= 4 * self.per_cell:
            index = torch.randperm(space, generator=gen)[:k]
        else:  # rejection-free for large spaces: draw with replacement, keep the first k distinct
            draw = torch.randint(0, space, (4 * self.per_cell,), generator=gen)
            seen: dict[int, None] = {}
            for x in draw.tolist():
                seen.setdefault(x, None)
                if len(seen) == k:
                    break
            index = torch.tensor(list(seen), dtype=torch.long)
        return (OPS.index(op) << 56) | (n << 48) | index

    def split(self) -> tuple[Int[Tensor, " P"], Int[Tensor, " H"]]:
        """Prompt ids ``(train, eval)``, int64, sorted, disjoint: per cell ``per_cell`` prompts (fewer when the
        cell has fewer inputs), ``holdout`` of them held out (at most half a small cell)."""
        gen = torch.Generator().manual_seed(self.seed)
        train, held = [], []
        for op, n in self.cells:
            ids = self._cell_ids(op, n, gen)
            h = min(self.holdout, ids.numel() // 2)
            held.append(ids[:h])
            train.append(ids[h:])
        return torch.cat(train).sort().values, torch.cat(held).sort().values

    # -- prompts, answers, rewards -----------------------------------------------------------------------------
    @staticmethod
    def decode_ids(prompt_ids: IntB) -> tuple[IntB, IntB, IntB]:
        """``(op, length, index)`` int64 ``[N]`` of prompt ids."""
        ids = prompt_ids.to(torch.int64)
        return ids >> 56, (ids >> 48) & 0xFF, ids & ((1 << 48) - 1)

    def _check_ids(self, prompt_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        if not isinstance(prompt_ids, Tensor) or prompt_ids.is_floating_point() or prompt_ids.ndim != 1:
            raise InputError("prompt_ids", "int64 prompt ids [N] of this suite", describe(prompt_ids), "use split()")
        op, n, index = self.decode_ids(prompt_ids)
        known = torch.zeros(op.shape, dtype=torch.bool)
        for o, length in self.cells:
            known |= (op == OPS.index(o)) & (n == length)
        if not bool(known.all()):
            raise InputError("prompt_ids", "ids of this suite's cells", "ids of other cells", "use split()")
        return op, n, index

    def _digits(self, values: Tensor, width: int) -> Tensor:
        powers = 10 ** torch.arange(width - 1, -1, -1, dtype=torch.int64)
        return (values[:, None] // powers) % 10

    def prompts(self, prompt_ids: IntB) -> Int[Tensor, "N W"]:
        """Prompt tokens ``[N, prompt_width]``, left-padded with ``<pad>``."""
        op, n, index = self._check_ids(prompt_ids)
        w = self.prompt_width
        out = torch.full((prompt_ids.numel(), w), PAD, dtype=torch.int64)
        for o, length in self.cells:
            rows = ((op == OPS.index(o)) & (n == length)).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            if o == "add":
                a = self._digits(index[rows] // 10**length, length)
                b = self._digits(index[rows] % 10**length, length)
                body = torch.cat([a, torch.full((rows.numel(), 1), PLUS), b], dim=1)
            else:
                body = self._digits(index[rows], length)
            head = torch.tensor([BOS, _OP_TOKEN[o]]).expand(rows.numel(), 2)
            seq = torch.cat([head, body, torch.full((rows.numel(), 1), SEP)], dim=1)
            out[rows, w - seq.shape[1] :] = seq
        return out

    def answers(self, prompt_ids: IntB) -> tuple[Int[Tensor, "B A"], IntB]:
        """The correct answers, right-padded with ``<pad>`` ``[N, A]``, and their lengths ``[N]`` (without
        ``<eos>``)."""
        op, n, index = self._check_ids(prompt_ids)
        width = max(_answer_len(o, length) for o, length in self.cells)
        out = torch.full((prompt_ids.numel(), width), PAD, dtype=torch.int64)
        lens = torch.zeros(prompt_ids.numel(), dtype=torch.int64)
        for o, length in self.cells:
            rows = ((op == OPS.index(o)) & (n == length)).nonzero().squeeze(1)
            if rows.numel() == 0:
                continue
            d = self._digits(index[rows], 2 * length if o == "add" else length)
            if o == "reverse":
                ans = d.flip(1)
            elif o == "sort":
                ans = d.sort(dim=1).values
            elif o == "add":
                total = index[rows] // 10**length + index[rows] % 10**length
                ans = self._digits(total, length + 1)
            else:
                ans = (d[:, 1:] == d[:, :1]).sum(1, keepdim=True)
            out[rows, : ans.shape[1]] = ans
            lens[rows] = ans.shape[1]
        return out, lens

    def reward(self, prompt_ids: IntB, tokens: IntBT, mask: BoolBT) -> FloatB:
        """Binary rewards ``[B]``: 1.0 when the response ``tokens [B, T]`` (``mask [B, T]``) is exactly the answer
        followed by ``<eos>``, else 0.0."""
        if tokens.ndim != 2 or mask.shape != tokens.shape or prompt_ids.shape != tokens.shape[:1]:
            raise InputError(
                "tokens/mask/prompt_ids",
                "tokens and mask [B, T], prompt_ids [B]",
                f"{tuple(tokens.shape)}, {tuple(mask.shape)}, {tuple(prompt_ids.shape)}",
                "pass one batch of rollouts",
            )
        ans, lens = self.answers(prompt_ids)
        b, t = tokens.shape
        width = max(ans.shape[1] + 1, t)
        padded = torch.full((b, width), PAD, dtype=torch.int64)
        padded[:, :t] = torch.where(mask.to(torch.bool), tokens, PAD)
        want = torch.full((b, width), PAD, dtype=torch.int64)
        want[:, : ans.shape[1]] = ans
        want.scatter_(1, lens[:, None], EOS)
        pos = torch.arange(width)[None, :]
        upto = pos <= lens[:, None]  # the answer and its <eos>
        return ((padded == want) | ~upto).all(1).to(torch.float32)

    def describe_cells(self, prompt_ids: IntB) -> list[str]:
        """``"op/L"`` of each prompt (for tables and logs)."""
        op, n, _ = self._check_ids(prompt_ids)
        return [f"{OPS[int(o)]}/{int(length)}" for o, length in zip(op, n, strict=True)]
