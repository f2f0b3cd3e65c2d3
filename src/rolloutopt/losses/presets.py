"""Named loss presets: prepared compositions of :func:`~rolloutopt.losses.policy_loss`, and their registry.

A preset is ``policy_loss`` with a configuration bound; calling it takes ``policy_loss``'s arguments and
any keyword overrides the bound value (``rolloutopt.losses.get("dapo")(..., trust=PPOClip(0.1, 0.2))``).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, cast

from rolloutopt.errors import InputError
from rolloutopt.losses import policy
from rolloutopt.losses.policy import OPTIONAL_INPUTS, LossOutput, declared_inputs, policy_loss
from rolloutopt.ratios import (
    CISPO,
    DPPO,
    MIS,
    OPSM,
    SAPO,
    TBPO,
    TIS,
    CoPRISProximal,
    CumulativeRatio,
    ECHOClip,
    GSPORatio,
    M2POClip,
    M2POMask,
    PNPORatio,
    PPOClip,
    SATClip,
    TokenRatio,
)
from rolloutopt.registry import Registry, check_inputs
from rolloutopt.typing import BoolBT, FloatBT, PerSeqOrToken

__all__ = ["PRESETS", "Preset"]


_STAGE_KEYS = ("ratio", "trust", "correction", "proximal", "kl", "entropy_coef", "agg")


@dataclass(frozen=True)
class Preset:
    """``policy_loss`` with keyword arguments bound; keywords given at call time override them.

    Attributes:
        name: the registry name.
        reference: where the configuration comes from (arXiv id, authors' code, trainer names).
        config: the bound keyword arguments of :func:`~rolloutopt.losses.policy_loss`.
        experimental: why the preset is experimental (a reconstructed part), or None.
        requires: the optional inputs the preset cannot run without (``behav_logp``, ``versions``,
            ``topk_logp``, ``max_len``, ...), derived from its stages by
            :func:`~rolloutopt.losses.policy.declared_inputs`, never written by hand.
        accepts: the further inputs its stages consume when given (always ``seq_weight``, ``is_weights`` and
            ``denominators``).
    """

    name: str
    reference: str
    config: dict[str, Any] = field(default_factory=dict)
    experimental: str | None = None

    def _declared(self, overrides: dict[str, Any] | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
        merged = {**self.config, **(overrides or {})}
        return declared_inputs(**{k: merged[k] for k in _STAGE_KEYS if k in merged})

    @property
    def requires(self) -> tuple[str, ...]:
        """Inputs the preset cannot run without (derived from its stages)."""
        return self._declared()[0]

    @property
    def accepts(self) -> tuple[str, ...]:
        """Further inputs the preset's stages consume when given."""
        return self._declared()[1]

    def __call__(
        self,
        logp: FloatBT,
        old_logp: FloatBT | None,
        advantages: PerSeqOrToken,
        mask: BoolBT,
        *,
        experimental: bool = False,
        **kwargs: Any,
    ) -> LossOutput:
        """Compute :func:`~rolloutopt.losses.policy_loss` with this preset's configuration.

        A preset whose method is partly reconstructed (``self.experimental`` says what) raises unless called
        with ``experimental=True``. An input the preset requires and is not given, or one that none of its
        stages consumes, raises an :class:`InputError` naming it (``allow_unused=True`` lets the latter pass,
        for trainer adapters that always pass everything).
        """
        if self.experimental is not None and experimental is not True:
            raise InputError(
                "experimental",
                f"experimental=True for the {self.name!r} preset: {self.experimental}",
                repr(experimental),
                "pass experimental=True to acknowledge the reconstruction (see the preset's docs page)",
            )
        unknown = sorted(set(kwargs) - _POLICY_KEYWORDS)
        if unknown:
            raise InputError(
                unknown[0],
                f"a keyword of policy_loss for the {self.name!r} preset",
                f"{unknown[0]}=...",
                "check the spelling; the keywords are those of rolloutopt.losses.policy_loss",
            )
        requires, accepts = self._declared({k: v for k, v in kwargs.items() if k in _STAGE_KEYS})
        given = {k: v for k, v in kwargs.items() if k in OPTIONAL_INPUTS}
        given.update(kwargs.get("stage_inputs") or {})
        check_inputs(
            given,
            requires=requires,
            accepts=accepts,
            by=f"the {self.name!r} preset",
            users=lambda n: [u for u in PRESETS.users(n) if u != self.name],
            kind="preset",
            allow_unused=kwargs.get("allow_unused", False) is True,
        )
        return policy_loss(logp, old_logp, advantages, mask, **{**self.config, **kwargs})


PRESETS = cast(Registry[Preset], policy.PRESETS)
"""The loss presets by name (the registry lives beside :func:`policy_loss`, which names presets in its errors)."""

_POLICY_KEYWORDS = frozenset(inspect.signature(policy_loss).parameters) - {"logp", "old_logp", "advantages", "mask"}


for _preset in (
    Preset(
        "grpo",
        "DeepSeekMath arXiv 2402.03300: symmetric clip 0.2, per-sequence token mean (TRL loss_type='grpo', "
        "verl loss_agg_mode='seq-mean-token-mean')",
        {"ratio": TokenRatio(), "trust": PPOClip(low=0.2, high=0.2, dual=None), "agg": "seq-mean-token-mean"},
    ),
    Preset(
        "dapo",
        "DAPO arXiv 2503.14476: clip-higher 0.2/0.28, token-level mean (TRL loss_type='dapo', verl default)",
        {"ratio": TokenRatio(), "trust": PPOClip(low=0.2, high=0.28, dual=None), "agg": "token-mean"},
    ),
    Preset(
        "dr_grpo",
        "Dr.GRPO arXiv 2503.20783: symmetric clip 0.2, sum over tokens divided by B·L_max (pass max_len)",
        {"ratio": TokenRatio(), "trust": PPOClip(low=0.2, high=0.2, dual=None), "agg": "seq-mean-token-sum-norm"},
    ),
    Preset(
        "gspo",
        "GSPO arXiv 2507.18071: sequence geometric-mean ratio (GSPO-token form), clip 3e-4/4e-4, per-sequence "
        "token mean (verl policy_loss='gspo', TRL importance_sampling_level='sequence')",
        {"ratio": GSPORatio(), "trust": PPOClip(low=3e-4, high=4e-4, dual=None), "agg": "seq-mean-token-mean"},
    ),
    Preset(
        "cispo",
        "MiniMax-M1 arXiv 2506.13585: stop-gradient clipped IS weight (upper 1+0.2, no lower bound), token mean",
        {"ratio": TokenRatio(), "trust": CISPO(), "agg": "token-mean"},
    ),
    Preset(
        "sapo",
        "SAPO arXiv 2511.20347: soft sigmoid gate, tau_pos 1.0 / tau_neg 1.05, per-sequence token mean",
        {"ratio": TokenRatio(), "trust": SAPO(), "agg": "seq-mean-token-mean"},
    ),
    # --- rollout-engine / trainer mismatch (docs/methods/corrections.md)
    Preset(
        "tis",
        "Truncated importance sampling (blog 'Your efficient RL framework secretly brings you off-policy RL "
        "training'; verl decoupled_token_is): token weight min(exp(old - behav), 2) on verl's default PPO loss "
        "(clip 0.2/0.2, dual clip 3), token mean",
        {
            "ratio": TokenRatio(),
            "trust": PPOClip(low=0.2, high=0.2, dual=3.0),
            "correction": TIS(cap=2.0),
            "agg": "token-mean",
        },
    ),
    Preset(
        "icepop",
        "IcePop / masked IS (Ring-1T report; verl decoupled_token_icepop): token weight exp(old - behav) inside "
        "[0.5, 5], tokens outside masked, on verl's default PPO loss (clip 0.2/0.2, dual clip 3), token mean",
        {
            "ratio": TokenRatio(),
            "trust": PPOClip(low=0.2, high=0.2, dual=3.0),
            "correction": MIS(low=0.5, high=5.0, in_band="ratio"),
            "agg": "token-mean",
        },
    ),
    Preset(
        "opsm",
        "Off-policy sequence masking (DeepSeek-V3.2 arXiv 2512.02556; TRL off_policy_mask_threshold, slime "
        "--opsm-delta 1e-4): negative-advantage sequences whose mean log(behav / current) exceeds 1e-4 are "
        "masked, on the dapo loss; uses behav_logp when given, else old_logp (TRL's fallback)",
        {
            "ratio": TokenRatio(),
            "trust": PPOClip(low=0.2, high=0.28, dual=None),
            "correction": OPSM(delta=1e-4),
            "agg": "token-mean",
        },
    ),
    # --- stale and partial rollouts (docs/methods/offpolicy.md)
    Preset(
        "decoupled_ppo",
        "Decoupled PPO (AReaL arXiv 2505.24298): PPO clip 0.2 against the proximal policy, behaviour weight "
        "exp(prox - behav) with tokens above 5.0 masked (AReaL's rejection sampling), original token count in "
        "the denominator; add proximal=A3POProximal() to interpolate the proximal log-probs (A-3PO)",
        {
            "ratio": TokenRatio(),
            "trust": PPOClip(low=0.2, high=0.2, dual=None),
            "correction": MIS(low=None, high=5.0, level="token"),
            "agg": "token-mean",
            "removed_in_denominator": True,
        },
    ),
    Preset(
        "copris",
        "CoPRIS arXiv 2511.05589: cross-stage importance sampling for partial rollouts (each token's old "
        "log-prob from the policy version that generated it), clip 0.2/0.28, dual clip 10, token mean",
        {
            "ratio": TokenRatio(),
            "trust": PPOClip(low=0.2, high=0.28, dual=10.0),
            "proximal": CoPRISProximal(),
            "agg": "token-mean",
        },
    ),
    Preset(
        "cumulative",
        "Cumulative (prefix-product) importance ratio exp(sum_{k<=t} lambda_k) inside PPO clip (arXiv 2608.01418 "
        "baseline; CTPO arXiv 2605.07331): ratio band [0.2, 5], dual clip 10, token mean",
        {"ratio": CumulativeRatio(), "trust": PPOClip(low=0.8, high=4.0, dual=10.0), "agg": "token-mean"},
    ),
    Preset(
        "pnpo",
        "PNPO arXiv 2608.01418 (loss wiring reconstructed): prefix-normalised ratio exp(mean_{k<=t} lambda_k) "
        "inside DAPO's clip 0.2/0.28, per-sequence token mean",
        {
            "ratio": PNPORatio(experimental=True),
            "trust": PPOClip(low=0.2, high=0.28, dual=None),
            "agg": "seq-mean-token-mean",
        },
        experimental="PNPO's loss wiring (clipped surrogate, gradient routing) is reconstructed (see "
        "docs/methods/offpolicy.md)",
    ),
    # --- adaptive trust regions (docs/methods/trust_regions.md)
    Preset(
        "m2po",
        "M2PO arXiv 2510.01161 (paper / AReaL m2_threshold): mask the tokens with the largest squared "
        "behaviour-vs-proximal log-ratio until the batch's second moment is below tau = 0.04; unclipped r·A on "
        "the kept tokens, token mean over all loss tokens (the paper's 1/sum|o_i|, exact under data-parallel "
        "global denominators); AReaL's code divides by the M2PO-kept count instead: removed_in_denominator=False "
        "(with a masking correction added, denominators=Denominators(tokens=<M2PO-kept count>))",
        {
            "ratio": TokenRatio(),
            "trust": M2POMask(tau=0.04, pair="behav_old", clip=None),
            "agg": "token-mean",
            "removed_in_denominator": True,
        },
    ),
    Preset(
        "m2po_clip",
        "M2PO arXiv 2510.01161, official code (Infini-AI-Lab/M2PO@af54a3e compute_m2po_policy_loss): PPO clip "
        "whose bounds adapt so the harmful tokens' capped second moment stays within tau = 0.04, token mean",
        {"ratio": TokenRatio(), "trust": M2POClip(tau=0.04), "agg": "token-mean"},
    ),
    Preset(
        "sat",
        "SAT arXiv 2607.18722 (reconstructed): DAPO's clip 0.2/0.28 with the sign-selected endpoint contracted "
        "for the 5% most stale tokens (|old - behav| tail), token mean",
        {
            "ratio": TokenRatio(),
            "trust": SATClip(low=0.2, high=0.28, tail=0.05, experimental=True),
            "agg": "token-mean",
        },
        experimental="SAT's formula (staleness proxy, tail fraction, contraction) is reconstructed (see "
        "docs/methods/trust_regions.md)",
    ),
    Preset(
        "tbpo",
        "TBPO / QaRL arXiv 2604.07853 (reconstructed): GSPO-style sequence ratio with two-sided clipping for "
        "negative samples, geometric-mean mismatch weight, sequences outside the trust band [1/2, 2] dropped",
        {"ratio": GSPORatio(), "trust": TBPO(experimental=True), "agg": "seq-mean-token-mean"},
        experimental="TBPO's band, epsilons and band width are reconstructed (see docs/methods/trust_regions.md)",
    ),
    # --- divergence masks and confidence clipping (docs/methods/dppo.md)
    Preset(
        "dppo_tv",
        "DPPO arXiv 2602.04879 (sail-sg/Stable-RL dppo_binary_tv): binary total-variation divergence mask, "
        "delta 0.15, truncated IS weight min(r, 10); pass the rollout engine's log-probs as old_logp (the "
        "paper's form) and max_len; the sum over tokens is divided by N_seqs * max_len (Stable-RL divides by "
        "max_len only: add denominators=Denominators(sequences=1) for its number)",
        {
            "ratio": TokenRatio(),
            "trust": DPPO(divergence="tv", low=0.15, high=0.15, c=10.0),
            "agg": "seq-mean-token-sum-norm",
        },
    ),
    Preset(
        "dppo_kl",
        "DPPO arXiv 2602.04879 (sail-sg/Stable-RL dppo_binary_kl): binary KL divergence mask, delta 0.05, "
        "truncated IS weight min(r, 10); rollout log-probs as old_logp, max_len and denominators as for dppo_tv",
        {
            "ratio": TokenRatio(),
            "trust": DPPO(divergence="kl", low=0.05, high=0.05, c=10.0),
            "agg": "seq-mean-token-sum-norm",
        },
    ),
    Preset(
        "dppo_predictive",
        "Predictive Divergence Mask arXiv 2607.10848 (closed form reconstructed): top-K KL proximity test, "
        "direction from the predicted first-order change of KL(mu || pi), token mean",
        {
            "ratio": TokenRatio(),
            "trust": DPPO(divergence="topk_kl", predictive=True, experimental=True),
            "agg": "token-mean",
        },
        experimental="the predictive mask's closed form and its top-K tail estimates are reconstructed (see "
        "docs/methods/dppo.md)",
    ),
    Preset(
        "echo_clip",
        "ECHO arXiv 2602.02150 (user683/ECHO): per-rollout clip width eps_min + (eps_max - eps_min) "
        "sigmoid(kappa (1 - tail confidence)), 0.05 / 0.2 / 4.0, dual clip 3, token mean",
        {"ratio": TokenRatio(), "trust": ECHOClip(eps_min=0.05, eps_max=0.2, kappa=4.0, dual=3.0), "agg": "token-mean"},
    ),
):
    PRESETS.register(_preset.name, _preset)
