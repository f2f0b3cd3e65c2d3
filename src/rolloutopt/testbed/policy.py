"""A tiny autoregressive policy (embedding → GRU → linear head) and batched sampling in the library convention.

Sampling returns right-padded ``[B, T]`` tokens, a bool mask (True up to and including ``<eos>``), and the
per-token log-probs and entropies of the tempered sampling distribution — exactly what
:func:`TinyPolicy.log_probs` recomputes with gradients, so ``old_logp`` can be taken from the sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from rolloutopt.errors import InputError
from rolloutopt.testbed.task import EOS, PAD, VOCAB_SIZE

__all__ = ["Rollouts", "TinyPolicy"]


@dataclass(frozen=True)
class Rollouts:
    """A batch of sampled responses.

    Attributes:
        tokens: response tokens ``[B, T]`` int64, right-padded with ``PAD`` after ``<eos>``.
        mask: bool ``[B, T]``, True for the response tokens (``<eos>`` included).
        logp: log-prob of each sampled token under the tempered policy ``[B, T]`` (0 where masked out).
        entropy: entropy of the tempered next-token distribution ``[B, T]`` (0 where masked out).
    """

    tokens: Tensor
    mask: Tensor
    logp: Tensor
    entropy: Tensor

    @property
    def num_tokens(self) -> int:
        """Number of generated (masked-in) tokens."""
        return int(self.mask.sum())


def _check_temperature(temperature: float) -> None:
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise InputError("temperature", "a finite float >= 0 (0 = greedy)", repr(temperature), "pass e.g. 1.0")


class TinyPolicy(nn.Module):
    """Embedding → single-layer GRU → linear head over the testbed vocabulary; a few tens of thousands of params.

    Parameters are initialised from ``generator`` (the global RNG is never touched).
    """

    def __init__(
        self, hidden: int = 64, *, arch: str = "gru", max_len: int = 32, generator: torch.Generator | None = None
    ) -> None:
        super().__init__()
        if not isinstance(hidden, int) or hidden < 1:
            raise InputError("hidden", "a positive int", repr(hidden), "pass e.g. 64")
        if arch not in ("gru", "transformer"):
            raise InputError("arch", "'gru' or 'transformer'", repr(arch), "pick one")
        self.hidden = hidden
        self.arch = arch
        self.max_len = max_len
        # Built on the meta device, so no draw from the global RNG; _init fills the parameters.
        meta = torch.device("meta")
        self.embed = nn.Embedding(VOCAB_SIZE, hidden, device=meta)
        self.head = nn.Linear(hidden, VOCAB_SIZE, device=meta)
        if arch == "gru":
            self.rnn = nn.GRU(hidden, hidden, batch_first=True, device=meta)
        else:
            self.pos = nn.Embedding(max_len, hidden, device=meta)
            layer = nn.TransformerEncoderLayer(
                hidden, 4, 2 * hidden, dropout=0.0, batch_first=True, norm_first=True, device=meta
            )
            self.blocks = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            self.norm = nn.LayerNorm(hidden, device=meta)
        self.to_empty(device="cpu")
        self._init(generator if generator is not None else torch.Generator().manual_seed(0))

    @torch.no_grad()
    def _init(self, gen: torch.Generator) -> None:
        bound = 1.0 / math.sqrt(self.hidden)
        for name, p in self.named_parameters():
            if name.startswith(("embed", "pos")):
                nn.init.normal_(p, 0.0, 1.0 if self.arch == "gru" else 0.5, generator=gen)
            elif "norm" in name and name.endswith("weight"):
                nn.init.ones_(p)
            elif name.endswith("bias") and (self.arch == "transformer" or name.startswith("head")):
                nn.init.zeros_(p)
            else:
                nn.init.uniform_(p, -bound, bound, generator=gen)

    def forward(self, tokens: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """Next-token logits ``[N, L, V]`` after each position of ``tokens [N, L]``, and the recurrent state.

        For the GRU, ``state`` continues a sequence; the transformer takes whole sequences (state is None).
        """
        if self.arch == "gru":
            out, h = self.rnn(self.embed(tokens), state)
            return self.head(out), h
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(n))
        causal = torch.triu(torch.full((n, n), float("-inf")), diagonal=1)
        x = self.blocks(x, mask=causal, is_causal=True)
        return self.head(self.norm(x)), None

    def log_probs(self, prompts: Tensor, tokens: Tensor, *, temperature: float = 1.0) -> tuple[Tensor, Tensor]:
        """Teacher-forced log-probs and entropies ``[B, T]`` of ``tokens`` after ``prompts [B, P]`` (with grad).

        Values at padded positions are computed but meaningless; apply the rollout mask.
        """
        _check_temperature(temperature)
        if temperature == 0:
            raise InputError("temperature", "> 0 for log-probs", "0", "use the sampling temperature")
        inputs = torch.cat([prompts, tokens[:, :-1]], dim=1)
        logits, _ = self(inputs)
        logits = logits[:, prompts.shape[1] - 1 :] / temperature
        logsm = torch.log_softmax(logits.float(), dim=-1)
        logp = logsm.gather(-1, tokens[..., None]).squeeze(-1)
        entropy = -(logsm.exp() * logsm).sum(-1)
        return logp, entropy

    @torch.no_grad()
    def sample(
        self, prompts: Tensor, max_new_tokens: int, *, temperature: float = 1.0, generator: torch.Generator
    ) -> Rollouts:
        """Sample responses to ``prompts [B, P]`` (int64) until ``<eos>`` or ``max_new_tokens``.

        ``temperature=0`` decodes greedily (log-probs are then those of the untempered policy).
        """
        _check_temperature(temperature)
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise InputError("max_new_tokens", "a positive int", repr(max_new_tokens), "pass e.g. 5")
        if prompts.ndim != 2 or prompts.dtype != torch.int64 or prompts.shape[1] < 1:
            raise InputError("prompts", "an int64 tensor [B, P] with P >= 1", repr(prompts.shape), "stack prompts")
        b = prompts.shape[0]
        logits, h = self(prompts)
        last = logits[:, -1]
        seq = prompts
        alive = torch.ones(b, dtype=torch.bool)
        toks, lps, ents, masks = [], [], [], []
        for _ in range(max_new_tokens):
            logsm = torch.log_softmax(last.float() / (temperature if temperature > 0 else 1.0), dim=-1)
            if temperature > 0:
                nxt = torch.multinomial(logsm.exp(), 1, generator=generator).squeeze(-1)
            else:
                nxt = logsm.argmax(-1)
            lp = logsm.gather(-1, nxt[:, None]).squeeze(-1)
            ent = -(logsm.exp() * logsm).sum(-1)
            nxt = torch.where(alive, nxt, torch.full_like(nxt, PAD))
            zero = torch.zeros_like(lp)
            toks.append(nxt)
            lps.append(torch.where(alive, lp, zero))
            ents.append(torch.where(alive, ent, zero))
            masks.append(alive)
            alive = alive & (nxt != EOS)
            if not bool(alive.any()):
                break
            seq = torch.cat([seq, nxt[:, None]], dim=1)
            step_logits, h = self(nxt[:, None], h) if self.arch == "gru" else self(seq)
            last = step_logits[:, -1]
        return Rollouts(
            tokens=torch.stack(toks, 1),
            mask=torch.stack(masks, 1),
            logp=torch.stack(lps, 1),
            entropy=torch.stack(ents, 1),
        )
