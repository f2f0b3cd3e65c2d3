"""What each method's paper claims, beside what the arena measures: :data:`CLAIMS`, keyed by (family, method).

Every claim paraphrases the paper's headline claim as this repository documents it (``docs/methods/*.md`` and the
modules' docstrings, which quote the papers' abstracts, summaries and code); nothing here comes from outside the
repository. Where the repository quotes a number, the claim carries it and :attr:`Claim.quantitative` is True;
the number was measured on the paper's models and tasks, not on the arena's. Where it quotes none, the claim is
the qualitative one the docs state (what the method is for) and :attr:`Claim.quantitative` is False. The
baselines the others are compared with (``uniform``, the ``grpo`` estimator and loss, and the stop family's
``none``) make no claim against themselves: :data:`NO_CLAIM` lists them. The arXiv ids are the registries'
(``rolloutopt.allocators.entry(name).reference`` and the like); an empty id means the registry names no arXiv
paper (VIGOR, IcePop, TIS, the soft compression penalty).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["CLAIMS", "NO_CLAIM", "Claim", "registered"]


@dataclass(frozen=True)
class Claim:
    """One paper's claim: ``arxiv`` id (empty when the method has none), ``text`` a short paraphrase, and
    whether the repository documents a number for it (``quantitative``)."""

    arxiv: str
    text: str
    quantitative: bool = False


def _q(arxiv: str, text: str) -> Claim:
    return Claim(arxiv, text, quantitative=True)


CLAIMS: dict[tuple[str, str], Claim] = {
    # ---------------------------------------------------------------- allocators (docs/methods: adaptive_alloc,
    # budget, difficulty, dps, dynamic_sampling, filters, gdro, greso, replay, topup)
    ("allocator", "aero"): _q(
        "2602.14338", "about 48% less training compute and 45% less wall-clock per step at equal rollout budget"
    ),
    ("allocator", "ar3po"): _q(
        "2509.25808", "DAPO-level accuracy with up to 4.2x lower rollout cost (about 5.7 responses per prompt)"
    ),
    ("allocator", "coba"): Claim(
        "2602.03048", "per-prompt budgets from past success rates, moving from easy to hard prompts as capability grows"
    ),
    ("allocator", "dapo_dynamic_sampling"): Claim(
        "2503.14476", "dropping zero-variance groups and refilling keeps every batch full of gradient signal"
    ),
    ("allocator", "dars"): Claim("2508.13755", "extra rollouts for hard prompts (first-stage accuracy below 1/2)"),
    ("allocator", "depo"): Claim("2509.01321", "an online explorability filter drops prompts not worth rolling out"),
    ("allocator", "dots"): Claim(
        "2506.05316", "prompts of predicted success near 1/2 plus replayed recent groups make RL more data-efficient"
    ),
    ("allocator", "dps"): Claim(
        "2603.10887", "picks the prompts predicted to be partially solved, the only ones with a non-zero GRPO advantage"
    ),
    ("allocator", "e3_budget"): Claim("2505.18573", "a difficulty-ranked budget gives hard prompts more rollouts"),
    ("allocator", "greso"): Claim(
        "2506.02177", "skipping prompts whose recent groups had zero variance saves rollouts that give no gradient"
    ),
    ("allocator", "hive"): Claim(
        "2603.25184", "history-informed, online-verified prompt selection keeps the informative prompts"
    ),
    ("allocator", "knapsack"): Claim(
        "2509.25849",
        "a knapsack over per-prompt success rates moves rollouts to hard prompts (the paper: 93 for the hardest)",
    ),
    ("allocator", "pilot_commit"): Claim(
        "2605.26606", "a small pilot per prompt, then the budget committed to prompts whose pilot shows a signal"
    ),
    ("allocator", "prompt_gdro"): _q("2601.19280", "+10.6% relative pass@8 over GRPO (Qwen3-Base 1.7B-8B)"),
    ("allocator", "rollout_gdro"): _q("2601.19280", "+10.1% relative pass@8 over GRPO at GRPO's compute"),
    ("allocator", "v05_budget"): Claim(
        "2603.10848", "a one-step look-ahead grants extra rollouts where the baseline is still uncertain"
    ),
    ("allocator", "vigor"): Claim(
        "", "variance-guided top-ups speed learning up over uniform allocation at a fixed budget (abstract only)"
    ),
    ("allocator", "xrpo"): Claim(
        "2510.06672", "rollouts go where one more shrinks the confidence interval of the mean reward most"
    ),
    # ---------------------------------------------------------------- advantage estimators (confidence, median,
    # multi_reward, prior, reference, selection, shaping)
    ("estimator", "ace"): Claim(
        "2602.21420", "penalising wrong answers that grew more confident keeps the Pass@k curve from narrowing"
    ),
    ("estimator", "dler_normalise"): Claim(
        "2510.15110", "batch-wise instead of group-wise normalisation (part of DLER's length-penalty recipe)"
    ),
    ("estimator", "dr_grpo"): Claim(
        "2503.20783", "group-mean centring without GRPO's std scaling, token sum over a constant length"
    ),
    ("estimator", "drpo"): Claim(
        "2510.04474", "a length reward that reaches correct rollouts only, leaving incorrect ones untouched"
    ),
    ("estimator", "gapo"): Claim("2510.21830", "the densest interval's median is a baseline robust to outlier rewards"),
    ("estimator", "gd2po"): Claim(
        "2606.16771", "masking rollouts whose rewards conflict avoids gradients that fight themselves"
    ),
    ("estimator", "gdpo"): Claim(
        "2601.05242", "normalising each reward in its group keeps a large-scale reward from drowning the others"
    ),
    ("estimator", "latent_mask"): Claim(
        "2604.27998", "invalid rollouts leave the advantages and their group's statistics"
    ),
    ("estimator", "mc_grpo"): Claim("2601.22582", "a median baseline flips fewer advantage signs at small group sizes"),
    ("estimator", "reinforce_pp_baseline"): Claim(
        "2501.03262", "group-centred rewards whitened over the batch instead of per group"
    ),
    ("estimator", "rloo"): Claim("2402.14740", "a leave-one-out baseline: each rollout against the others' mean"),
    ("estimator", "v05"): Claim(
        "2603.10848",
        "with small groups (the paper's 4) a value prior fused with the group mean is a less noisy baseline",
    ),
    ("estimator", "xrpo_sharpen"): Claim(
        "2510.06672", "boosting correct but unlikely answers reinforces rare solution paths before they vanish"
    ),
    # ---------------------------------------------------------------- loss presets (reference, corrections,
    # offpolicy, trust_regions, dppo)
    ("loss", "cispo"): Claim("2506.13585", "a clipped stop-gradient IS weight: every token keeps its gradient"),
    ("loss", "copris"): Claim(
        "2511.05589", "partial rollouts take each token's old log-prob from the policy version that generated it"
    ),
    ("loss", "cumulative"): Claim("2605.07331", "the exact prefix-product ratio inside PPO's clip"),
    ("loss", "dapo"): Claim("2503.14476", "clip-higher (0.2/0.28) and a token-level mean"),
    ("loss", "decoupled_ppo"): Claim(
        "2505.24298", "clipping against a proximal policy, not the stale behaviour policy, keeps async RL stable"
    ),
    ("loss", "dppo_kl"): Claim(
        "2602.04879",
        "a divergence mask instead of the one-token ratio clip; anchoring to the rollout policy is stabler",
    ),
    ("loss", "dppo_predictive"): Claim(
        "2607.10848", "the mask's direction from the predicted first-order change of the KL"
    ),
    ("loss", "dppo_tv"): Claim(
        "2602.04879",
        "a divergence mask instead of the one-token ratio clip; anchoring to the rollout policy is stabler",
    ),
    ("loss", "dr_grpo"): Claim("2503.20783", "token sum over a constant length instead of a per-sequence mean"),
    ("loss", "echo_clip"): Claim(
        "2602.02150", "a narrower clip for confident rollouts keeps spurious early pseudo-labels from dominating"
    ),
    ("loss", "gspo"): Claim("2507.18071", "a sequence-level (geometric-mean) ratio and clip"),
    ("loss", "icepop"): Claim(
        "", "masking tokens whose engine/trainer ratio leaves [0.5, 5] keeps the mismatch out of the update"
    ),
    ("loss", "m2po"): _q(
        "2510.01161", "at 256 updates of staleness, clipped tokens 1.22% -> 0.06% and on-policy-level training"
    ),
    ("loss", "m2po_clip"): _q(
        "2510.01161", "at 256 updates of staleness, clipped tokens 1.22% -> 0.06% and on-policy-level training"
    ),
    ("loss", "opsm"): Claim("2512.02556", "masking negative-advantage sequences that drifted off-policy"),
    ("loss", "pnpo"): Claim("2608.01418", "a prefix-normalised ratio, between the token and the sequence ratio"),
    ("loss", "sapo"): Claim("2511.20347", "a soft sigmoid gate instead of a hard clip"),
    ("loss", "sat"): Claim("2607.18722", "contracting the clip for the most stale tokens: stale but stable"),
    ("loss", "tbpo"): Claim(
        "2604.07853", "for quantised rollouts, a trust band on the mismatch weight drops sequences too far off"
    ),
    ("loss", "tis"): Claim("", "truncated importance weights correct the rollout-engine/trainer mismatch"),
    # ---------------------------------------------------------------- stop, truncation and length rules
    # (early_stop, truncation_rules, opd_horizon, length_rules, control_benchmark)
    ("stop", "abstention"): Claim(
        "2604.18419", "abstaining mid-generation once the value falls below the abstention reward is optimal"
    ),
    ("stop", "adwin_horizon"): _q("2605.28396", "up to 4.1x lower end-to-end training cost (OPD)"),
    ("stop", "arrol"): Claim("2603.24840", "a learned quality head prunes over-generated rollouts early"),
    ("stop", "deer"): Claim("2504.15895", "ending the chain at a transition marker once a trial answer is confident"),
    ("stop", "duet_abort"): Claim("2605.08441", "a marker-gated abort with importance reweighting of the survivors"),
    ("stop", "echo_pruning"): Claim("2602.02150", "online pruning of persistently low-confidence branches"),
    ("stop", "espo"): Claim(
        "2605.29860", "stopping rollouts whose surrogate regret runs away, as absorbing failures, saves generation"
    ),
    ("stop", "espo_critic_free"): Claim("2605.29860", "ESPO's early stop without a critic"),
    ("stop", "esr"): Claim("2605.27028", "only the first N response tokens avoid off-policy teacher decay (OPD)"),
    ("stop", "prune_opd"): _q("2605.07804", "37.6-68.0% less training time at equal or better AMC/AIME/HMMT (OPD)"),
    ("stop", "prune_opd_window"): _q(
        "2605.07804", "37.6-68.0% less training time at equal or better AMC/AIME/HMMT (OPD)"
    ),
    ("stop", "stable_opd"): _q("2604.08527", "+7.2% on average across math datasets (OPD)"),
    ("stop", "step_grpo_truncation"): Claim(
        "2604.16890", "stopping at a step boundary once a probe's answer is confident"
    ),
    ("stop", "dler_difficulty_penalty"): Claim(
        "2510.15110", "per-prompt truncation lengths from the group's pass rate (difficulty-aware DLER)"
    ),
    ("stop", "dler_truncation_penalty"): Claim(
        "2510.15110", "truncation works as a length penalty once the optimisation is done right"
    ),
    ("stop", "dot"): _q("2601.03969", "up to 78% fewer tokens on AIME-24 (a training effect on easy prompts)"),
    ("stop", "jet_reward"): Claim(
        "2509.23392", "truncated-prefix variants and a length reward teach just-enough thinking"
    ),
    ("stop", "soft_compression_penalty"): Claim(
        "", "penalising long rollouts only on mastered prompts compresses without hurting the rest"
    ),
    ("stop", "step_aware_reward"): Claim("2604.16890", "penalising redundant steps in correct responses"),
}
"""(family, method) -> the paper's claim (see the module docstring)."""

NO_CLAIM: dict[tuple[str, str], str] = {
    ("allocator", "uniform"): "the baseline (GRPO's fixed group size)",
    ("estimator", "grpo"): "the baseline",
    ("loss", "grpo"): "the baseline",
    ("stop", "none"): "the baseline (no rule; not a registered method)",
}
"""The methods without a claim, and why: the baselines."""


def registered(family: str) -> list[str]:
    """The registered method names of an arena family: the allocators, the advantage estimators, the loss presets,
    or the stop, truncation and length rules (the rule classes and the post-hoc rule functions of
    :mod:`rolloutopt.control`)."""
    from rolloutopt import advantages, allocators, control, losses
    from rolloutopt.control import posthoc
    from rolloutopt.errors import InputError

    if family == "allocator":
        return allocators.names()
    if family == "estimator":
        return advantages.names()
    if family == "loss":
        return losses.names()
    if family == "stop":
        return sorted(control.names() + posthoc.names())
    raise InputError("family", "'allocator', 'estimator', 'loss' or 'stop'", repr(family), "pick one")
