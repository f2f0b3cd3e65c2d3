"""A verifiable toy task: reverse a short digit string, with a tokenizer-free vocabulary built in code.

A prompt is ``<bos> d1 … dL =``; the correct response is ``dL … d1 <eos>``. The reward is the fraction of the
``L`` target positions answered correctly, divided by the longer of the answer and the target (so that a too
long answer is not free), which gives partial credit: a uniformly random policy earns about 5–10 %.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Int
from torch import Tensor

from rolloutopt.errors import InputError
from rolloutopt.typing import BoolBT, FloatB, IntB, IntBT

__all__ = ["BOS", "DIGITS", "EOS", "PAD", "SEP", "VOCAB", "VOCAB_SIZE", "ReverseTask", "decode", "encode"]

DIGITS = 10
"""Digit tokens are ids ``0 … 9``."""
EOS = 10
"""End of the response; it counts as a response token (mask True)."""
BOS = 11
"""Start of the prompt."""
SEP = 12
"""Ends the prompt (``=``)."""
PAD = 13
"""Right padding after ``EOS``; never counted."""
VOCAB: tuple[str, ...] = (*(str(d) for d in range(DIGITS)), "<eos>", "<bos>", "=", "<pad>")
"""Token strings indexed by token id."""
VOCAB_SIZE = len(VOCAB)


def encode(text: str) -> list[int]:
    """Token ids of a string of digits (other characters raise :class:`~rolloutopt.errors.InputError`)."""
    if not text.isdigit() or not text.isascii():
        raise InputError("text", "a non-empty string of ASCII digits", repr(text), "pass e.g. '123'")
    return [int(c) for c in text]


def decode(tokens: Any) -> str:
    """Readable string of a token sequence: digits as themselves, special tokens by name, padding dropped."""
    ids = tokens.tolist() if isinstance(tokens, Tensor) else list(tokens)
    return "".join(VOCAB[int(t)] for t in ids if int(t) != PAD)


@dataclass(frozen=True)
class ReverseTask:
    """Reverse a string of ``length`` digits; every one of the ``10**length`` strings is a prompt.

    ``holdout`` prompts, chosen with ``seed``, are never trained on and serve as the evaluation set.
    """

    length: int = 3
    holdout: int = 200
    seed: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.length, int) or not 1 <= self.length <= 6:
            raise InputError("length", "an int in [1, 6]", repr(self.length), "use a short digit string")
        n = DIGITS**self.length
        if not isinstance(self.holdout, int) or not 0 <= self.holdout < n:
            raise InputError("holdout", f"an int in [0, {n})", repr(self.holdout), "hold out fewer prompts")

    @property
    def num_prompts(self) -> int:
        """Number of distinct prompts, ``10**length``."""
        return int(DIGITS**self.length)

    @property
    def prompt_len(self) -> int:
        """Prompt length in tokens: ``<bos>``, the digits, ``=``."""
        return self.length + 2

    @property
    def max_response_len(self) -> int:
        """Response budget: the answer plus ``<eos>``, plus one spare token."""
        return self.length + 2

    def split(self) -> tuple[Int[Tensor, " P"], Int[Tensor, " H"]]:
        """Prompt ids ``(train, eval)``: int64 ``[P]`` and ``[H]`` (``H = holdout``), disjoint, together all prompts."""
        gen = torch.Generator().manual_seed(self.seed)
        perm = torch.randperm(self.num_prompts, generator=gen)
        return perm[self.holdout :].sort().values, perm[: self.holdout].sort().values

    def digits(self, prompt_ids: Int[Tensor, " N"]) -> Int[Tensor, "N length"]:
        """The digit strings of prompts as an int64 ``[N, length]`` tensor (most significant digit first)."""
        powers = DIGITS ** torch.arange(self.length - 1, -1, -1, dtype=torch.int64)
        return (prompt_ids.to(torch.int64)[:, None] // powers) % DIGITS

    def prompts(self, prompt_ids: Int[Tensor, " N"]) -> Int[Tensor, "N prompt_len"]:
        """Prompt tokens ``[N, prompt_len]``: ``<bos> d1 … dL =``."""
        d = self.digits(prompt_ids)
        n = d.shape[0]
        bos = torch.full((n, 1), BOS, dtype=torch.int64)
        sep = torch.full((n, 1), SEP, dtype=torch.int64)
        return torch.cat([bos, d, sep], dim=1)

    def targets(self, prompt_ids: Int[Tensor, " N"]) -> Int[Tensor, "N length"]:
        """Correct answers ``[N, length]`` (the reversed digits, without ``<eos>``)."""
        return self.digits(prompt_ids).flip(1)

    def reward(self, prompt_ids: IntB, tokens: IntBT, mask: BoolBT) -> FloatB:
        """Reward ``[B]`` in ``[0, 1]`` of responses ``tokens [B, T]`` (mask ``[B, T]``) to ``prompt_ids [B]``.

        The answer is the masked tokens before the first ``<eos>``; the reward is the number of positions
        ``i < length`` where answer and target agree, divided by ``max(length, len(answer))``. A response
        cut off without ``<eos>`` is scored the same way.
        """
        if tokens.ndim != 2 or mask.shape != tokens.shape or prompt_ids.shape != tokens.shape[:1]:
            raise InputError(
                "tokens/mask/prompt_ids",
                "tokens and mask [B, T], prompt_ids [B]",
                f"{tuple(tokens.shape)}, {tuple(mask.shape)}, {tuple(prompt_ids.shape)}",
                "pass the Rollouts of one batch",
            )
        m = mask.to(torch.bool)
        is_eos = (tokens == EOS) & m
        # Tokens strictly before the first <eos> (and inside the mask) form the answer.
        answer = m & (is_eos.to(torch.int64).cumsum(1) == 0)
        ans_len = answer.sum(1)
        target = self.targets(prompt_ids)
        width = min(self.length, tokens.shape[1])
        hits = (tokens[:, :width] == target[:, :width]) & answer[:, :width]
        denom = ans_len.clamp(min=self.length).to(torch.float32)
        return hits.sum(1).to(torch.float32) / denom
