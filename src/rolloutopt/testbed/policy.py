"""A tiny autoregressive policy (a small causal transformer or a GRU) and batched sampling in the library convention.

Sampling returns right-padded ``[B, T]`` tokens, a bool mask (True up to and including ``<eos>``), and the
per-token log-probs and entropies of the tempered sampling distribution — exactly what
:func:`TinyPolicy.log_probs` recomputes with gradients, so ``old_logp`` can be taken from the sampler.

A rollout engine that is not the trained policy is simulated with the same class: :meth:`TinyPolicy.perturbed`
is a copy with seeded weight noise (an engine whose numerics differ from the trainer's), a ``copy.deepcopy`` of
an earlier policy is a stale engine, and :func:`sample_from` draws each token from one of several policies (partial
rollouts whose policy version changes inside a response). The sampler can also record the engine's top-K
log-probs and ids at every position.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from jaxtyping import Float, Int
from torch import Tensor, nn

from rolloutopt.errors import InputError
from rolloutopt.testbed.task import EOS, PAD, VOCAB_SIZE
from rolloutopt.typing import BoolBT, FloatBT, FloatBTK, IntBT

__all__ = ["Rollouts", "TinyPolicy", "sample_from"]


@dataclass(frozen=True)
class Rollouts:
    """A batch of sampled responses.

    Attributes:
        tokens: response tokens ``[B, T]`` int64, right-padded with ``PAD`` after ``<eos>``.
        mask: bool ``[B, T]``, True for the response tokens (``<eos>`` included).
        logp: log-prob of each sampled token under the tempered policy ``[B, T]`` (0 where masked out).
        entropy: entropy of the tempered next-token distribution ``[B, T]`` (0 where masked out).
        topk_ids: with ``topk=K`` in :func:`sample_from`, the K most likely token ids of the sampling distribution at
            every position ``[B, T, K]`` int64, most likely first (``PAD`` where masked out); else None.
        topk_logp: their log-probs ``[B, T, K]`` (0 where masked out); else None.
    """

    tokens: IntBT
    mask: BoolBT
    logp: FloatBT
    entropy: FloatBT
    topk_ids: Int[Tensor, "B T topk"] | None = None
    topk_logp: FloatBTK | None = None

    @property
    def num_tokens(self) -> int:
        """Number of generated (masked-in) tokens."""
        return int(self.mask.sum())


def _check_temperature(temperature: float) -> None:
    if not isinstance(temperature, (int, float)) or not math.isfinite(temperature) or temperature < 0:
        raise InputError("temperature", "a finite float >= 0 (0 = greedy)", repr(temperature), "pass e.g. 1.0")


class TinyPolicy(nn.Module):
    """Embedding → a single-layer GRU (``arch="gru"``) or a two-layer causal transformer (``"transformer"``) → a
    linear head over the testbed vocabulary (``vocab_size`` tokens: the testbed's 14, then any a task adds, as the
    arena's operation tokens); a few tens of thousands of parameters.

    Parameters are initialised from ``generator`` (the global RNG is never touched).
    """

    def __init__(
        self,
        hidden: int = 64,
        *,
        arch: str = "gru",
        max_len: int = 32,
        vocab_size: int = VOCAB_SIZE,
        generator: torch.Generator | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(hidden, int) or hidden < 1:
            raise InputError("hidden", "a positive int", repr(hidden), "pass e.g. 64")
        if arch not in ("gru", "transformer"):
            raise InputError("arch", "'gru' or 'transformer'", repr(arch), "pick one")
        if not isinstance(vocab_size, int) or vocab_size < VOCAB_SIZE:
            raise InputError(
                "vocab_size", f"an int >= {VOCAB_SIZE} (the testbed's tokens first)", repr(vocab_size), "pass more"
            )
        self.hidden = hidden
        self.arch = arch
        self.vocab_size = vocab_size
        self.max_len = max_len
        # Built on the meta device, so no draw from the global RNG; _init fills the parameters.
        meta = torch.device("meta")
        self.embed = nn.Embedding(vocab_size, hidden, device=meta)
        self.head = nn.Linear(hidden, vocab_size, device=meta)
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

    def forward(
        self, tokens: Int[Tensor, "N L"], state: Float[Tensor, "1 N d"] | None = None
    ) -> tuple[Float[Tensor, "N L V"], Float[Tensor, "1 N d"] | None]:
        """Next-token logits ``[N, L, V]`` after each position of ``tokens [N, L]``, and the recurrent state.

        For the GRU, ``state`` continues a sequence; the transformer takes whole sequences (state is None).
        """
        if self.arch == "gru":
            out, h = self.rnn(self.embed(tokens), state)
            return self.head(out), h
        n = tokens.shape[1]
        x = self.embed(tokens) + self.pos(torch.arange(n, device=tokens.device))
        causal = torch.triu(torch.full((n, n), float("-inf"), device=tokens.device), diagonal=1)
        x = self.blocks(x, mask=causal, is_causal=True)
        return self.head(self.norm(x)), None

    def log_softmax(
        self, prompts: Int[Tensor, "B L"], tokens: IntBT, *, temperature: float = 1.0
    ) -> Float[Tensor, "B T V"]:
        """Teacher-forced log-probabilities ``[B, T, V]`` of every vocabulary token at each response position of
        ``tokens [B, T]`` after ``prompts [B, L]``, for the tempered distribution (with grad).

        Values at padded positions are computed but meaningless; apply the rollout mask.
        """
        _check_temperature(temperature)
        if temperature == 0:
            raise InputError("temperature", "> 0 for log-probs", "0", "use the sampling temperature")
        inputs = torch.cat([prompts, tokens[:, :-1]], dim=1)
        logits, _ = self(inputs)
        logits = logits[:, prompts.shape[1] - 1 :] / temperature
        return torch.log_softmax(logits.float(), dim=-1)

    def log_probs(
        self, prompts: Int[Tensor, "B L"], tokens: IntBT, *, temperature: float = 1.0
    ) -> tuple[FloatBT, FloatBT]:
        """Teacher-forced log-probs and entropies ``[B, T]`` of ``tokens`` after ``prompts [B, L]`` (with grad).

        Values at padded positions are computed but meaningless; apply the rollout mask.
        """
        logsm = self.log_softmax(prompts, tokens, temperature=temperature)
        logp = logsm.gather(-1, tokens[..., None]).squeeze(-1)
        entropy = -(logsm.exp() * logsm).sum(-1)
        return logp, entropy

    @torch.no_grad()
    def perturbed(self, scale: float, generator: torch.Generator) -> TinyPolicy:
        r"""A frozen copy whose weights carry seeded Gaussian noise: a rollout engine that disagrees with the trainer.

        .. math::  \tilde W = W + \sigma\, \mathrm{rms}(W)\, \varepsilon, \qquad \varepsilon \sim \mathcal N(0, I)

        per parameter tensor, with :math:`\sigma` = ``scale`` (0 returns an exact copy) and
        :math:`\mathrm{rms}(W) = \sqrt{\operatorname{mean} W^2}`, so the noise is relative to each tensor's size.
        It stands for the numerical mismatch between an inference engine and the trainer (other kernels, reduced
        precision), the setting that truncated and masked importance sampling correct; a testbed device, not a
        published method. The noise is drawn from ``generator`` in parameter order, so a seed gives the same engine.
        """
        if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale) or scale < 0:
            raise InputError("scale", "a finite float >= 0", repr(scale), "pass e.g. 0.05 (0 = an exact copy)")
        engine = copy.deepcopy(self)
        engine.requires_grad_(False)
        if scale > 0:
            for p in engine.parameters():
                rms = float(p.pow(2).mean().sqrt())
                p.add_(torch.randn(p.shape, generator=generator, dtype=p.dtype), alpha=scale * rms)
        return engine

    @torch.no_grad()
    def quantized(self, dtype: torch.dtype = torch.float8_e4m3fn) -> TinyPolicy:
        r"""A frozen copy whose weight matrices are rounded to ``dtype``, as an FP8 (or bf16) rollout engine holds
        them; computation stays in float32. An 8-bit format gets a per-tensor scale, as FP8 engines use:

        .. math::  s = \max|W| / m_{dtype}, \qquad \tilde W = s \cdot \operatorname{round}_{dtype}(W / s)

        with :math:`m_{dtype}` the largest finite value of ``dtype`` (448 for ``float8_e4m3fn``); a wider format
        (bf16, fp16) is rounded directly, :math:`\tilde W = \operatorname{round}_{dtype}(W)`. Only parameters
        with two or more dimensions (embeddings, linear and attention weights) are rounded; biases and norms stay
        float32, as in FP8 inference engines. Deterministic (no randomness).
        """
        if not isinstance(dtype, torch.dtype) or dtype.is_complex or not dtype.is_floating_point:
            raise InputError("dtype", "a real floating torch dtype", repr(dtype), "pass e.g. torch.float8_e4m3fn")
        engine = copy.deepcopy(self)
        engine.requires_grad_(False)
        info = torch.finfo(dtype)
        for p in engine.parameters():
            if p.ndim >= 2 and info.bits <= 8:
                scale = p.abs().max().clamp(min=1e-12) / info.max
                p.copy_((p / scale).to(dtype).to(p.dtype) * scale)
            elif p.ndim >= 2:
                p.copy_(p.to(dtype).to(p.dtype))
        return engine

    def sample(
        self,
        prompts: Int[Tensor, "B L"],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        generator: torch.Generator,
        topk: int = 0,
    ) -> Rollouts:
        """Sample responses to ``prompts [B, L]`` (int64) until ``<eos>`` or ``max_new_tokens`` (:func:`sample_from`).

        ``temperature=0`` decodes greedily (log-probs are then those of the untempered policy).
        """
        return sample_from([self], prompts, max_new_tokens, temperature=temperature, generator=generator, topk=topk)


@torch.no_grad()
def sample_from(
    policies: Sequence[TinyPolicy],
    prompts: Int[Tensor, "B L"],
    max_new_tokens: int,
    *,
    temperature: float = 1.0,
    generator: torch.Generator,
    source: Int[Tensor, "B max_new_tokens"] | None = None,
    topk: int = 0,
    prefix: Int[Tensor, "B P"] | None = None,
    prefix_len: Int[Tensor, " B"] | None = None,
) -> Rollouts:
    """Sample responses to ``prompts [B, L]`` (int64) until ``<eos>`` or ``max_new_tokens``, token by token.

    With one policy, every token comes from it. With several (all of one architecture), ``source`` (int64
    ``[B, max_new_tokens]``, values in ``[0, len(policies))``) says which policy draws the token at each position
    of each row: a response whose generating policy changes mid-way (a partial rollout resumed after a weight
    update). Every policy reads the whole sequence so far, so a switch continues the same text. The returned
    log-probs and entropies are those of the policy that drew each token. ``topk=K`` (``1 <= K <= V``) also
    records that policy's K most likely tokens and their log-probs at every position (``Rollouts.topk_ids`` /
    ``topk_logp``). ``temperature=0`` decodes greedily (log-probs are then those of the untempered policy).
    Randomness comes only from ``generator`` (one multinomial draw per position).

    ``prefix`` (int64 ``[B, P]``) with ``prefix_len`` (int64 ``[B]``, each in ``[0, min(P, max_new_tokens))``)
    continues responses already begun (a partial rollout resumed by a buffer): the first ``prefix_len[i]`` tokens
    of row ``i`` are ``prefix[i, :prefix_len[i]]`` (forced, not drawn; they must not hold ``<eos>``), and sampling
    goes on from there, so that the row's tokens are its whole response. Forced positions still consume their draw,
    so the other rows' samples do not depend on the prefixes; their log-probs and top-K are the policies' own.
    """
    _check_temperature(temperature)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputError("max_new_tokens", "a positive int", repr(max_new_tokens), "pass e.g. 5")
    if prompts.ndim != 2 or prompts.dtype != torch.int64 or prompts.shape[1] < 1:
        raise InputError("prompts", "an int64 tensor [B, P] with P >= 1", repr(prompts.shape), "stack prompts")
    models = list(policies)
    if not models or not all(isinstance(p, TinyPolicy) for p in models):
        raise InputError("policies", "a non-empty sequence of TinyPolicy", repr(policies), "pass [policy]")
    if len({p.arch for p in models}) != 1:
        raise InputError(
            "policies", "policies of one architecture", repr([p.arch for p in models]), "use copies of one policy"
        )
    vocab = models[0].vocab_size
    if len({p.vocab_size for p in models}) != 1:
        raise InputError("policies", "policies of one vocabulary", repr([p.vocab_size for p in models]), "use copies")
    if not isinstance(topk, int) or isinstance(topk, bool) or not 0 <= topk <= vocab:
        raise InputError("topk", f"an int in [0, {vocab}] (0 = none)", repr(topk), "pass e.g. topk=8")
    b = prompts.shape[0]
    bad_source = source is None or (
        source.dtype != torch.int64
        or source.shape != (b, max_new_tokens)
        or bool(((source < 0) | (source >= len(models))).any())
    )
    if (len(models) > 1 or source is not None) and bad_source:
        raise InputError(
            "source",
            f"an int64 tensor [{b}, {max_new_tokens}] of policy indices in [0, {len(models)})",
            "None" if source is None else f"{source.dtype} {tuple(source.shape)}",
            "pass the index of the generating policy at each position",
        )
    if (prefix is None) != (prefix_len is None):
        raise InputError("prefix/prefix_len", "both or neither", "only one", "pass prefix_len with prefix")
    if prefix is not None and prefix_len is not None:
        ok_len = prefix_len.dtype == torch.int64 and prefix_len.shape == (b,)
        ok_prefix = prefix.dtype == torch.int64 and prefix.ndim == 2 and prefix.shape[0] == b
        if not (ok_len and ok_prefix) or bool(((prefix_len < 0) | (prefix_len >= max_new_tokens)).any()):
            raise InputError(
                "prefix/prefix_len",
                f"int64 [{b}, P] and [{b}] with 0 <= prefix_len < min(P + 1, max_new_tokens={max_new_tokens})",
                f"{prefix.dtype} {tuple(prefix.shape)}, {prefix_len.dtype} {tuple(prefix_len.shape)}",
                "pass each row's tokens so far and their count",
            )
        if bool((prefix_len > prefix.shape[1]).any()):
            raise InputError("prefix_len", f"at most P={prefix.shape[1]}", repr(prefix_len.max()), "pad prefix")
        forced = torch.arange(prefix.shape[1], device=prefix.device)[None, :] < prefix_len[:, None]
        if bool(((prefix == EOS) & forced).any()):
            raise InputError("prefix", "tokens before <eos>", "<eos> inside a prefix", "a finished row needs none")
    dev = prompts.device
    rows = torch.arange(b, device=dev)
    if source is not None:
        source = source.to(dev)
    if prefix is not None and prefix_len is not None:
        prefix, prefix_len = prefix.to(dev), prefix_len.to(dev)
    outs = [m(prompts) for m in models]
    states = [h for _, h in outs]
    lasts = [logits[:, -1] for logits, _ in outs]
    seq = prompts
    alive = torch.ones(b, dtype=torch.bool, device=dev)
    toks, lps, ents, masks, kids, klps = [], [], [], [], [], []
    for t in range(max_new_tokens):
        last = lasts[0] if len(lasts) == 1 else torch.stack(lasts)[source[:, t], rows]  # type: ignore[index]
        logsm = torch.log_softmax(last.float() / (temperature if temperature > 0 else 1.0), dim=-1)
        if temperature > 0:
            nxt = torch.multinomial(logsm.exp(), 1, generator=generator).squeeze(-1)
        else:
            nxt = logsm.argmax(-1)
        if prefix is not None and prefix_len is not None and t < prefix.shape[1]:
            nxt = torch.where(t < prefix_len, prefix[:, t], nxt)
        lp = logsm.gather(-1, nxt[:, None]).squeeze(-1)
        ent = -(logsm.exp() * logsm).sum(-1)
        nxt = torch.where(alive, nxt, torch.full_like(nxt, PAD))
        zero = torch.zeros_like(lp)
        toks.append(nxt)
        lps.append(torch.where(alive, lp, zero))
        ents.append(torch.where(alive, ent, zero))
        masks.append(alive)
        if topk > 0:
            top = logsm.topk(topk, dim=-1)
            kids.append(torch.where(alive[:, None], top.indices, torch.full_like(top.indices, PAD)))
            klps.append(torch.where(alive[:, None], top.values, torch.zeros_like(top.values)))
        alive = alive & (nxt != EOS)
        if not bool(alive.any()):
            break
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        for j, m in enumerate(models):
            step_logits, states[j] = m(nxt[:, None], states[j]) if m.arch == "gru" else m(seq)
            lasts[j] = step_logits[:, -1]
    return Rollouts(
        tokens=torch.stack(toks, 1),
        mask=torch.stack(masks, 1),
        logp=torch.stack(lps, 1),
        entropy=torch.stack(ents, 1),
        topk_ids=torch.stack(kids, 1) if topk > 0 else None,
        topk_logp=torch.stack(klps, 1) if topk > 0 else None,
    )
