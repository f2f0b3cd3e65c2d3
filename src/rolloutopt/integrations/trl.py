"""TRL adapter: :class:`GRPOTrainer`, TRL 1.16's ``GRPOTrainer`` with a rolloutopt objective and advantage.

``rolloutopt.integrations.trl.GRPOTrainer(..., objective=rolloutopt.losses.get("m2po"),
advantage=rolloutopt.advantages.get("mc_grpo"))`` trains with TRL's generation, rewards, reference model,
optimizer and logging, and with rolloutopt's policy loss and advantage estimator in place of TRL's
``loss_type`` and group normalisation; with ``allocator=`` a one-round allocator chooses each generation
batch's prompts (a selector: DPS, PromptGDRO, GRESO without dynamic sampling) and, for Uniform, Rollout-GDRO,
CoBA, Knapsack, HIVE and DOTS, their rollout counts (DEPO is refused: it needs response entropies). It overrides three methods of TRL's trainer
(``docs/integrations/trl.md``):

- ``_calculate_rewards``: stores the rewards TRL gathered over every process, ``[N, n_funcs]``;
- ``_generate_and_score_completions``: with an allocator, first replaces the generation batch by the rows it
  plans over a candidate pool of dataset indices, and afterwards feeds it TRL's gathered rewards
  (``observe``/``finish``/``update``); after TRL's own, recomputes the advantages from those rewards with the
  rolloutopt estimator and TRL's prompt grouping (consecutive blocks of ``num_generations`` rows of the
  gathered batch; a per-prompt-count allocator's own groups and weights), and slices this process's rows;
- ``_compute_loss``: the per-token log-probs from TRL's ``_get_per_token_logps_and_entropies``, then the
  objective on TRL's tensors, with TRL's denominators (:func:`trl_denominators`).

``trl`` is imported when ``GRPOTrainer`` is first looked up (a module ``__getattr__`` builds the subclass then),
so importing this module, and ``import rolloutopt``, work without TRL installed. See ``docs/integrations/trl.md`` for the option table.
"""

from __future__ import annotations

import functools
import inspect
import math
from dataclasses import dataclass
from typing import Any

import torch
from jaxtyping import Shaped
from torch import Tensor

import rolloutopt.advantages as _advantages
import rolloutopt.losses as _losses
from rolloutopt.errors import InputError
from rolloutopt.losses import KL, Denominators
from rolloutopt.losses.aggregation import AGG_MODES
from rolloutopt.typing import BoolBT, FloatBT

__all__ = ["UNSUPPORTED_OPTIONS", "GRPOTrainer", "trl_denominators"]

GRPOTrainer: type  # built on first access by __getattr__ below (imports TRL then)

# Keys of TRL's inputs that the parent's _compute_loss forwards to the model (TRL 1.16, VLM support).
_MM_KEYS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)
_SEQ_WEIGHT = "rolloutopt_seq_weight"  # extra key carried through TRL's shuffle and split (first dim B)

# loss_type values that name each aggregation's normalisation ("dapo", TRL's default, is accepted with any).
_LOSS_TYPE_FOR_AGG: dict[str, tuple[str, ...]] = {
    "token-mean": ("dapo", "bnpo"),
    "seq-mean-token-mean": ("dapo", "grpo"),
    "seq-mean-token-sum-norm": ("dapo", "dr_grpo"),
    "seq-mean-token-sum": ("dapo", "luspo"),
    "token-sum": ("dapo",),
}

UNSUPPORTED_OPTIONS: dict[str, str] = {
    "loss_type": "sapo, cispo and vespo (and any loss_type that does not name the objective's aggregation): the "
    "per-token form comes from the objective; use objective=rolloutopt.losses.get('sapo') / get('cispo')",
    "importance_sampling_level": "'sequence': use objective=rolloutopt.losses.get('gspo')",
    "delta": "TRL's two-sided clip: use an objective whose trust is PPOClip(low, high, dual=delta)",
    "top_entropy_quantile": "< 1 (TRL's high-entropy token mask) is not reimplemented",
    "off_policy_mask_threshold": "use objective=rolloutopt.losses.get('opsm') (OPSM(delta=...) as its correction)",
    "use_adaptive_entropy": "the adaptive entropy controller is not reimplemented (a static entropy_coef is)",
    "epsilon / epsilon_high": "values other than TRL's defaults must equal the objective's trust.low / trust.high",
    "scale_rewards": "other than 'group' with advantage=...: configure the estimator instead",
    "multi_objective_aggregation": "'normalize_then_sum' with a single-reward estimator: use advantage='gdpo'",
    "vllm_importance_sampling_correction": "True with a preset that requires behav_logp (it corrects for the "
    "rollout engine itself; TRL's ratio would be a second correction): set it to False",
}
"""TRL options the adapter refuses when ``objective`` (or ``advantage``) is given, and what to use instead."""


def trl_denominators(
    agg: str,
    *,
    loss_type: str,
    num_items_in_batch: float | Shaped[Tensor, ""],
    rows: float | Shaped[Tensor, ""],
    tokens: float | Shaped[Tensor, ""],
    grad_accum: int,
    steps_per_generation: int,
    num_processes: int,
    training: bool,
) -> Denominators:
    r"""The :class:`~rolloutopt.losses.Denominators` that reproduce TRL 1.16's ``loss_type`` normalisation.

    With :math:`S = \sum_{i,t} m_{i,t}\ell_{i,t}` the masked sum of one micro-batch, GA the gradient
    accumulation steps (1 in eval), spg ``steps_per_generation`` (not applied in eval), P the processes and
    N ``num_items_in_batch`` (loss tokens of the whole generation batch, all processes):

    .. math::
        \texttt{dapo}:\ \frac{S}{N/P \cdot GA/\mathrm{spg}} \qquad
        \texttt{bnpo}:\ \frac{S}{n_{tok} \cdot GA} \qquad
        \texttt{grpo}:\ \frac{\sum_i \bar\ell_i}{B \cdot GA} \qquad
        \texttt{dr\_grpo}:\ \frac{S}{B \cdot L_{max} \cdot GA}

    that is ``Denominators(tokens=N·GA/spg, world_size=P)`` for a global token mean (``dapo``, TRL's
    default), ``Denominators(tokens=n_tok·GA)`` for ``bnpo`` and ``Denominators(sequences=B·GA)`` for the
    per-sequence modes (``grpo``, ``dr_grpo`` with ``max_len=max_completion_length``, ``luspo``), where B counts
    every row of the micro-batch, empty completions included (TRL's ``.mean()`` over rows), and ``token-sum``
    gets ``Denominators(world_size=P)``. Reference: TRL ``GRPOTrainer._compute_loss`` (1.16); the token mean is
    DAPO's (arXiv 2503.14476), the ``B · L_max`` denominator Dr.GRPO's (arXiv 2503.20783);
    ``docs/integrations/trl.md``. Masked tokens stay in TRL's denominators; rolloutopt's presets keep
    them with ``removed_in_denominator=True`` (the default).

    Args:
        agg: the objective's aggregation mode (one of :data:`rolloutopt.losses.AGG_MODES` but ``prompt-mean``).
        loss_type: TRL's ``loss_type``; only ``"bnpo"`` changes the token-mean denominator (local tokens).
        num_items_in_batch: TRL's ``inputs["num_items_in_batch"]`` (a scalar).
        rows: rows of the micro-batch that carry a loss (every row, or those of non-zero sequence weight).
        tokens: loss tokens of the micro-batch (for ``bnpo``).
        grad_accum: ``current_gradient_accumulation_steps``.
        steps_per_generation: ``args.steps_per_generation``.
        num_processes: ``accelerator.num_processes``.
        training: ``model.training`` (eval divides by neither GA nor spg).

    Edge cases: an empty generation batch (N = 0) gives a denominator clamped at 1, as TRL clamps N.
    """
    if agg not in _LOSS_TYPE_FOR_AGG:
        raise InputError(
            "objective",
            f"an aggregation TRL can normalise ({', '.join(_LOSS_TYPE_FOR_AGG)})",
            repr(agg),
            "prompt-mean needs whole groups in one micro-batch, which TRL's shuffle breaks; use seq-mean-token-mean",
        )
    ga = grad_accum if training else 1
    if agg == "token-mean":
        if loss_type == "bnpo":
            return Denominators(tokens=tokens * ga)
        spg = steps_per_generation if training else 1
        return Denominators(tokens=num_items_in_batch * ga / spg, world_size=num_processes)
    if agg == "token-sum":
        return Denominators(world_size=num_processes)
    return Denominators(sequences=rows * ga)


@dataclass(frozen=True)
class _RatioWeightedKL(KL):
    """TRL's ``use_bias_correction_kl``: the k3 term times the token ratio ``exp(logp - old)`` (with its gradient).

    ``old`` is the proximal log-prob tensor of this micro-batch; positions outside the mask get ratio 1.
    """

    old: FloatBT | None = None

    def per_token(self, logp: FloatBT, ref_logp: FloatBT, mask: BoolBT) -> FloatBT:
        """k3 (unclamped, as TRL) times the importance ratio to the proximal policy."""
        base = super().per_token(logp, ref_logp, mask)
        assert self.old is not None
        log_r = torch.where(mask, logp - self.old.to(logp.dtype), torch.zeros_like(logp))
        return base * torch.exp(log_r)


def _unwrap(fn: Any) -> tuple[Any, dict[str, Any]]:
    """The function under ``functools.partial`` layers and their bound keywords."""
    kw: dict[str, Any] = {}
    while isinstance(fn, functools.partial):
        kw = {**fn.keywords, **kw}
        fn = fn.func
    return fn, kw


def _objective_config(objective: Any) -> dict[str, Any]:
    """The bound keywords of an objective: a Preset's config (plus partial keywords), else partial keywords."""
    fn, kw = _unwrap(objective)
    base = dict(fn.config) if isinstance(fn, _losses.Preset) else {}
    return {**base, **kw}


def _fail(argument: str, expected: str, got: Any, fix: str) -> InputError:
    return InputError(argument, expected, repr(got), fix)


_REFUSED_ALLOCATORS: dict[str, str] = {
    "VIGOR": "tops up prompts in several generation rounds",
    "PilotCommit": "samples a pilot round, then a commit round",
    "DAPODynamicSampling": "samples again until enough groups have variance (several generation rounds)",
    "DARS": "tops up hard prompts in several generation rounds",
    "E3Budget": "tops up in several generation rounds",
    "AR3PO": "samples in rounds and reuses stored responses TRL cannot present",
    "AERO": "samples in rounds",
    "XRPO": "tops up in several generation rounds",
    "V05Budget": "tops up in several generation rounds",
    "DEPO": "requires each response's mean token entropy with the rewards, which TRL's generation step does not "
    "compute (it has no forward pass over the completions before the rewards)",
}


def _allocator_mode(allocator: Any) -> str:
    """``"select"`` for a fixed-count prompt selector, ``"counts"`` for a one-request per-prompt-count allocator."""
    from rolloutopt.allocators import (
        DOTS,
        DPS,
        GRESO,
        HIVE,
        CoBA,
        Knapsack,
        PromptGDRO,
        RolloutGDRO,
        Uniform,
    )

    if isinstance(allocator, (DPS, GRESO, PromptGDRO)):
        return "select"
    if isinstance(allocator, (Uniform, RolloutGDRO, CoBA, Knapsack, HIVE, DOTS)):
        return "counts"
    name = type(allocator).__name__
    why = _REFUSED_ALLOCATORS.get(name, "is not a known one-request allocator")
    raise _fail(
        "allocator",
        "an allocator whose plan is one request (TRL generates once per generation batch): a prompt selector "
        "(DPS, PromptGDRO, GRESO(filter_zero_variance=False)) or a per-prompt-count allocator (Uniform, "
        "RolloutGDRO, CoBA, Knapsack, HIVE, DOTS(replay=False))",
        f"{name}, which {why}",
        "use one of those, or run this allocator in a loop that can generate several rounds (verl, your own)",
    )


def _build_allocator(name: str, kwargs: dict[str, Any] | None, num_generations: Any) -> Any:
    """``rolloutopt.allocators.get(name)(**kwargs)``; a prompt selector defaults to ``n=num_generations`` (and
    GRESO to ``filter_zero_variance=False``), the settings TRL can run."""
    import rolloutopt.allocators as _alloc

    if kwargs is not None and not isinstance(kwargs, dict):
        raise _fail("allocator_kwargs", "a dict of keyword arguments", kwargs, "pass e.g. {'seed': 0}")
    cls = _alloc.get(name)
    kw = dict(kwargs or {})
    if cls in (_alloc.DPS, _alloc.GRESO, _alloc.PromptGDRO):
        kw.setdefault("n", num_generations)
    if cls is _alloc.GRESO:
        kw.setdefault("filter_zero_variance", False)
    return cls(**kw)


def _check_allocator(allocator: Any, num_generations: Any, pool: Any, advantage: Any) -> str:
    """Validate ``allocator`` for TRL and return its mode (see :func:`_allocator_mode`)."""
    from rolloutopt.allocators import DOTS, GRESO

    if pool is not None and (not isinstance(pool, int) or isinstance(pool, bool) or pool < 1):
        raise _fail("allocator_pool", "None or an int >= 1 (candidates per generation batch)", pool, "pass e.g. 64")
    mode = _allocator_mode(allocator)
    name = type(allocator).__name__
    if isinstance(allocator, GRESO) and allocator.filter_zero_variance:
        raise _fail(
            "allocator",
            "GRESO(filter_zero_variance=False): its dynamic-sampling rounds need several generations per step",
            "GRESO(filter_zero_variance=True)",
            "construct GRESO(..., filter_zero_variance=False) (the skip-before-rollout selection still runs)",
        )
    if isinstance(allocator, DOTS) and allocator.replay:
        raise _fail(
            "allocator",
            "DOTS(replay=False): replayed groups are stored rollouts TRL cannot present",
            "DOTS(replay=True)",
            "construct DOTS(..., replay=False) (the difficulty-targeted selection still runs)",
        )
    if mode == "select" and (allocator.n != num_generations or allocator.n_max != allocator.n):
        raise _fail(
            "allocator",
            f"a group size n = n_max = num_generations = {num_generations}",
            f"{name}(n={allocator.n}, n_max={allocator.n_max})",
            f"construct the allocator with n={num_generations} and the default n_max",
        )
    if mode == "counts" and advantage is None:
        raise _fail(
            "advantage",
            f"an advantage estimator with allocator={name}: its groups have unequal sizes, and TRL's own "
            "advantages assume blocks of num_generations rows",
            None,
            "pass advantage='grpo' (or functools.partial(rolloutopt.advantages.grpo, eps=1e-4) for TRL's numbers)",
        )
    return mode


@functools.cache
def _trainer_class() -> type:
    """Build the :class:`GRPOTrainer` subclass (imports TRL; called on first access of ``GRPOTrainer``)."""
    from trl.trainer.grpo_config import GRPOConfig as _GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer as _TRLGRPOTrainer

    class GRPOTrainer(_TRLGRPOTrainer):
        r"""TRL 1.16's ``GRPOTrainer`` with a rolloutopt objective and advantage estimator.

        The loss of one micro-batch is the objective (:func:`rolloutopt.losses.policy_loss` or a preset),

        .. math::
            \mathcal L = \operatorname{agg}\big(w\, L^{trust}(r, A) + \beta\,\widehat{KL}, m\big)
                         - c_H\,\frac{\sum m H}{\sum m}\,\frac{1}{GA} + c_{aux}\,\frac{\mathrm{aux}}{GA}

        on TRL's tensors: ``logp`` from the model, ``old_logp`` = ``old_per_token_logps`` (None → ``logp.detach()``,
        TRL's on-policy shortcut), ``behav_logp`` = ``sampling_per_token_logps`` (vLLM or a ``rollout_func``; NaN
        entries, tokens vLLM could not score, are replaced by the proximal log-prob), ``is_weights`` =
        ``importance_sampling_ratio`` (vLLM IS correction), ``ref_logp`` = ``ref_per_token_logps`` with a KL stage
        ``KL("k3", coef=beta, clamp=False)`` when ``beta > 0`` (times the token ratio when
        ``use_bias_correction_kl``, TRL's default), ``mask`` = ``completion_mask × tool_mask`` and the advantages.
        The aggregation's denominators are TRL's for the matching ``loss_type`` (:func:`trl_denominators`), so
        gradient accumulation and several processes give TRL's gradients. The entropy bonus (static
        ``entropy_coef``) and the MoE router loss are added as TRL adds them. Reference: DeepSeekMath GRPO
        arXiv 2402.03300; TRL ``GRPOTrainer`` 1.16; the objective's and estimator's own papers.

        The advantage estimator runs on the rewards TRL gathered from every process, ``[N]`` (the weighted sum of
        the reward functions, TRL's ``sum_then_normalize``; ``[N, K]`` with ``weights=reward_weights`` for
        :func:`rolloutopt.advantages.gdpo`), with group ids ``arange(N) // num_generations`` (TRL's grouping), and
        ``valid`` = rows with at least one reward (TRL's unscorable rows). Its ``weight`` becomes
        ``policy_loss(seq_weight=...)``: a weight-0 rollout (MC-GRPO's pivot) leaves the loss and every
        denominator, ``num_items_in_batch`` included. With ``objective=None`` TRL's own loss runs and the weight
        multiplies the advantage instead (the row then stays in TRL's denominators).

        Args:
            *args, **kwargs: TRL's ``GRPOTrainer`` arguments (``model``, ``reward_funcs``, ``args``, ...).
            objective: a :class:`~rolloutopt.losses.Preset` (or its name), or any callable with
                :func:`~rolloutopt.losses.policy_loss`'s signature returning a ``LossOutput`` (a
                ``functools.partial`` of ``policy_loss`` with ``agg=...`` bound is read for its aggregation; a
                plain callable is assumed to aggregate with ``token-mean``). None keeps TRL's ``loss_type`` loss.
            advantage: an estimator from :mod:`rolloutopt.advantages` (or its name) taking ``(rewards, group)``
                plus keywords (bind others with ``functools.partial``), or None for TRL's group normalisation.
            allocator: None, an allocator, or its registered name. Each generation batch it plans over a
                candidate pool of dataset indices, TRL generates what it requested (one generation round), and it
                learns from TRL's rewards (see :meth:`_ro_select`). A prompt *selector*
                (:class:`~rolloutopt.allocators.DPS`, :class:`~rolloutopt.allocators.PromptGDRO`,
                :class:`~rolloutopt.allocators.GRESO` with ``filter_zero_variance=False``; ``n = num_generations``)
                chooses the prompts; a *per-prompt-count* allocator (:class:`~rolloutopt.allocators.Uniform`,
                :class:`~rolloutopt.allocators.RolloutGDRO`, :class:`~rolloutopt.allocators.CoBA`,
                :class:`~rolloutopt.allocators.Knapsack`, :class:`~rolloutopt.allocators.HIVE` (its prompt-entropy
                probe answered without a value: stage 2 skipped), :class:`~rolloutopt.allocators.DOTS` with
                ``replay=False``)
                also chooses how many rollouts each prompt gets, within the fixed generation batch (fixed-size
                presentation: its rows, then weight-0 padding rows; advantages over its groups, so ``advantage``
                is required). Allocators that sample in several rounds are refused, and so is DEPO (it requires
                response entropies, which TRL's generation step does not compute).
            allocator_kwargs: keyword arguments when ``allocator`` is a registered name
                (:func:`rolloutopt.allocators.names`), e.g. ``allocator="dps", allocator_kwargs={"seed": 0}``; a
                prompt selector named this way defaults to ``n=num_generations`` (GRESO also to
                ``filter_zero_variance=False``).
            allocator_pool: candidates offered to the allocator per generation batch: None (default) the whole
                training dataset, else that many dataset indices (>= prompts per generation batch), drawn without
                replacement with a generator seeded by ``args.seed`` (identical on every process).
            use_fused: compute the per-token log-probs and entropies with
                :func:`rolloutopt.kernels.token_logprobs` (Triton on CUDA, chunked torch elsewhere) from the
                model's last hidden states and LM-head weight instead of TRL's fused LM head (:meth:`_ro_fused_logps`);
                for causal LMs whose logits are ``lm_head(h)`` (no bias, rescaling or softcapping), text only, no
                PEFT. Needs ``objective`` (TRL's own loss keeps TRL's head).
            experimental: acknowledge an experimental preset or estimator (passed as ``experimental=True``).

        Raises:
            InputError: at construction, for the TRL options in :data:`UNSUPPORTED_OPTIONS`, for a preset whose
                ``requires`` the trainer cannot provide (``behav_logp`` needs ``use_vllm=True`` or a
                ``rollout_func`` that returns log-probs; ``versions``, ``topk_logp``, ``topk_behav_logp`` and
                ``confidence`` are not available from TRL), for an estimator that needs more than rewards and
                groups, for an experimental preset without ``experimental=True``, and for an allocator that is
                not a fixed-count prompt selector (or whose group size is not ``num_generations``).

        Metrics: every ``LossOutput.metrics`` entry is logged as ``rolloutopt/<name>`` and every
        ``AdvantageOutput.metrics`` entry as ``rolloutopt/adv/<name>`` through TRL's ``self._metrics[mode]``
        (means over processes; ``*_max`` entries take the max), beside TRL's own reward and completion metrics.

        Edge cases: empty completions count as rows in the per-sequence denominators (TRL's convention) and add
        nothing to the numerator; an all-masked micro-batch gives loss 0.
        """

        def __init__(
            self,
            *args: Any,
            objective: Any = None,
            advantage: Any = None,
            allocator: Any = None,
            allocator_pool: int | None = None,
            allocator_kwargs: dict[str, Any] | None = None,
            use_fused: bool = False,
            experimental: bool = False,
            **kwargs: Any,
        ) -> None:
            if not isinstance(use_fused, bool):
                raise _fail("use_fused", "a bool", use_fused, "pass use_fused=True or False")
            self._ro_fused = use_fused
            if use_fused and objective is None:
                raise _fail(
                    "use_fused", "an objective= (TRL's own loss keeps TRL's LM head)", use_fused, "pass objective="
                )
            if not isinstance(experimental, bool):
                raise _fail("experimental", "a bool", experimental, "pass experimental=True or False")
            self._ro_experimental = experimental
            self._ro_objective = _losses.get(objective) if isinstance(objective, str) else objective
            if isinstance(advantage, str) and advantage not in _advantages.REGISTRY:
                family = next((r.kind for r in (_advantages.SHAPERS, _advantages.SELECTORS) if advantage in r), None)
                raise _fail(
                    "advantage",
                    f"the name of an advantage estimator ({', '.join(_advantages.names())})",
                    advantage,
                    f"{advantage!r} is a {family}, not an estimator: apply it in a reward function or your training "
                    "loop and pass an estimator (e.g. 'grpo')"
                    if family is not None
                    else "use one of the listed names, or pass the estimator itself",
                )
            self._ro_advantage = _advantages.get(advantage) if isinstance(advantage, str) else advantage
            if self._ro_objective is not None and not callable(self._ro_objective):
                raise _fail(
                    "objective", "a loss Preset, its name or a policy_loss-like callable", objective, "see docs"
                )
            if self._ro_advantage is not None and not callable(self._ro_advantage):
                raise _fail("advantage", "an advantage estimator, its name or a callable", advantage, "see docs")
            args_ = kwargs.get("args", args[2] if len(args) > 2 else None)
            config = args_ if args_ is not None else _GRPOConfig("rolloutopt-GRPO")
            rollout_func = kwargs.get("rollout_func")
            self._ro_agg = "token-mean"
            self._ro_reads_behav = True
            self._ro_has_kl = _objective_config(self._ro_objective).get("kl") is not None
            self._ro_preset_call = False
            if self._ro_objective is not None:
                self._check_objective(config, rollout_func is not None)
            self._ro_multi_reward = False
            self._ro_adv_kwargs: dict[str, Any] = {}
            if self._ro_advantage is not None:
                self._check_advantage(config)
            self._ro_rewards: Tensor | None = None
            self._ro_pending: Any = None  # (plan, request, padded, group ids, weights) until the rewards arrive
            self._ro_alloc_rewards: Tensor | None = None
            if isinstance(allocator, str):
                allocator = _build_allocator(allocator, allocator_kwargs, config.num_generations)
            elif allocator_kwargs is not None:
                raise _fail(
                    "allocator_kwargs", "None unless allocator is a name", allocator_kwargs, "pass one or the other"
                )
            self._ro_allocator = allocator
            self._ro_pool = allocator_pool
            self._ro_alloc_mode = "none"
            if allocator is not None:
                self._ro_alloc_mode = _check_allocator(
                    allocator, config.num_generations, allocator_pool, self._ro_advantage
                )
            super().__init__(*args, **kwargs)
            if self._ro_fused:
                self._ro_check_fused()
            if allocator is not None:
                self._ro_init_allocator()

        # ------------------------------------------------------------------ validation
        def _check_objective(self, config: Any, has_rollout_func: bool) -> None:
            obj = self._ro_objective
            fn, _ = _unwrap(obj)
            cfg = _objective_config(obj)
            agg = cfg.get("agg", "token-mean")
            if agg not in AGG_MODES or agg not in _LOSS_TYPE_FOR_AGG:
                raise _fail(
                    "objective",
                    f"an aggregation TRL's micro-batches can normalise ({', '.join(_LOSS_TYPE_FOR_AGG)})",
                    agg,
                    "prompt-mean needs whole groups in one micro-batch, which TRL's shuffle breaks; use "
                    "agg='seq-mean-token-mean'",
                )
            self._ro_agg = agg
            # TRL hands over vLLM's (or a rollout_func's) sampling log-probs whenever it has them: they reach the
            # objective only when one of its stages reads behav_logp, which the objective would refuse otherwise.
            # A callable that is not a preset or a partial of policy_loss gets them whenever TRL has them.
            if isinstance(fn, _losses.Preset) or fn is _losses.policy_loss:
                stages = {k: cfg[k] for k in ("ratio", "trust", "correction", "proximal", "kl") if k in cfg}
                requires, accepts = _losses.declared_inputs(**stages, agg=agg)
                self._ro_reads_behav = "behav_logp" in requires or "behav_logp" in accepts
            else:
                self._ro_reads_behav = True
            if isinstance(fn, _losses.Preset):
                self._ro_preset_call = True
                if fn.experimental is not None and not self._ro_experimental:
                    raise _fail(
                        "experimental",
                        f"experimental=True for the {fn.name!r} preset: {fn.experimental}",
                        self._ro_experimental,
                        "pass GRPOTrainer(..., experimental=True) to acknowledge the reconstruction",
                    )
                # behav_logp comes from vLLM or a rollout_func (checked below); max_len is max_completion_length
                missing = [r for r in fn.requires if r not in ("behav_logp", "max_len")]
                if missing:
                    raise _fail(
                        "objective",
                        f"a preset whose inputs TRL provides; {fn.name!r} requires {', '.join(fn.requires)}",
                        f"no {', '.join(missing)} in TRL's GRPOTrainer",
                        "choose a preset without these requirements (rolloutopt.losses.get(name).requires)",
                    )
                if "behav_logp" in fn.requires and config.use_vllm and config.vllm_importance_sampling_correction:
                    raise _fail(
                        "vllm_importance_sampling_correction",
                        f"False with the {fn.name!r} preset, which corrects for the rollout engine itself from "
                        "behav_logp (TRL's importance_sampling_ratio would apply a second correction)",
                        True,
                        "set vllm_importance_sampling_correction=False (vLLM's log-probs still reach the objective)",
                    )
                if "behav_logp" in fn.requires and not (config.use_vllm or has_rollout_func):
                    raise _fail(
                        "behav_logp",
                        f"the rollout engine's log-probs for the {fn.name!r} preset (TRL's sampling_per_token_logps)",
                        "use_vllm=False and no rollout_func: TRL has no behaviour log-probs",
                        "set use_vllm=True, pass a rollout_func that returns 'logprobs', or choose a preset without "
                        "behav_logp in its requires",
                    )
            lt = config.loss_type
            if lt not in _LOSS_TYPE_FOR_AGG[agg]:
                raise _fail(
                    "loss_type",
                    f"'dapo' (TRL's default) or a loss_type that names the objective's aggregation {agg!r} "
                    f"({', '.join(_LOSS_TYPE_FOR_AGG[agg])}); the per-token form comes from the objective",
                    lt,
                    "leave loss_type at its default; for TRL's sapo/cispo use objective=rolloutopt.losses.get(...)",
                )
            if config.importance_sampling_level != "token":
                raise _fail(
                    "importance_sampling_level",
                    "'token' when objective is given (the ratio comes from the objective)",
                    config.importance_sampling_level,
                    "use objective=rolloutopt.losses.get('gspo') for sequence-level ratios",
                )
            if config.delta is not None:
                raise _fail(
                    "delta",
                    "None when objective is given (TRL's two-sided clip is not reimplemented)",
                    config.delta,
                    "use an objective whose trust is PPOClip(low, high, dual=delta)",
                )
            if config.top_entropy_quantile < 1.0:
                raise _fail(
                    "top_entropy_quantile",
                    "1.0 when objective is given (TRL's high-entropy token mask is not reimplemented)",
                    config.top_entropy_quantile,
                    "leave top_entropy_quantile=1.0",
                )
            if config.off_policy_mask_threshold is not None:
                raise _fail(
                    "off_policy_mask_threshold",
                    "None when objective is given",
                    config.off_policy_mask_threshold,
                    "use objective=rolloutopt.losses.get('opsm') (its OPSM(delta=...) correction)",
                )
            if config.use_adaptive_entropy:
                raise _fail(
                    "use_adaptive_entropy",
                    "False when objective is given (the adaptive entropy controller is not reimplemented)",
                    True,
                    "use a static entropy_coef",
                )
            trust = cfg.get("trust")
            for name, value, default, attr in (
                ("epsilon", config.epsilon, 0.2, "low"),
                ("epsilon_high", config.epsilon_high, None, "high"),
            ):
                if value != default and getattr(trust, attr, None) != value:
                    raise _fail(
                        name,
                        f"TRL's default ({default}) or the objective's trust.{attr} when objective is given (the "
                        "objective's trust stage does the clipping)",
                        value,
                        f"leave {name} at its default and set the bound in the objective "
                        "(e.g. functools.partial(preset, trust=PPOClip(low, high, dual=None)))",
                    )
            if config.beta == 0.0 and cfg.get("kl") is not None:
                raise _fail(
                    "beta",
                    "beta > 0 when the objective has a KL stage (TRL computes reference log-probs only then)",
                    config.beta,
                    "set beta to the KL coefficient, or drop kl from the objective",
                )
            kl = cfg.get("kl")
            if config.beta != 0.0 and kl is not None and getattr(kl, "coef", None) != config.beta:
                raise _fail(
                    "beta",
                    "the objective's kl.coef when both are given",
                    config.beta,
                    "set beta equal to kl.coef (or drop kl from the objective and let beta build TRL's k3 term)",
                )

        def _check_advantage(self, config: Any) -> None:
            fn, bound = _unwrap(self._ro_advantage)
            if isinstance(fn, _advantages.Estimator):  # a registered estimator: read its declarations
                names = ["rewards", "group", *fn.accepts, *fn.hyper, "experimental"]
                required = [p for p in (*fn.requires, *fn.hyper_required) if p not in bound]
                multi_reward = fn.reward_dims == "B K"
            else:
                try:
                    params = list(inspect.signature(fn).parameters.values())
                except (TypeError, ValueError) as exc:  # pragma: no cover - builtins without signatures
                    raise _fail(
                        "advantage", "a Python callable with a signature", self._ro_advantage, "wrap it"
                    ) from exc
                names = [p.name for p in params]
                if names[:2] != ["rewards", "group"]:
                    raise _fail(
                        "advantage",
                        "an estimator f(rewards, group, *, ...) -> AdvantageOutput",
                        f"{getattr(fn, '__name__', fn)}({', '.join(names[:3])}, ...)",
                        "choose an estimator from rolloutopt.advantages taking (rewards, group); reward shapers and "
                        "token-level selectors are not advantage estimators",
                    )
                required = [
                    p.name
                    for p in params[2:]
                    if p.default is inspect.Parameter.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                    and p.name not in bound
                ]
                multi_reward = fn in (_advantages.gdpo, _advantages.gd2po)
            if required:
                raise _fail(
                    "advantage",
                    "an estimator that needs only the rewards and the groups at TRL's advantage point",
                    f"{getattr(fn, '__name__', fn)} also requires {', '.join(required)}",
                    "choose another estimator or bind the extra arguments with functools.partial",
                )
            if isinstance(fn, _advantages.Estimator) and fn.experimental is not None and not self._ro_experimental:
                raise _fail(
                    "experimental",
                    f"experimental=True for the {fn.name!r} estimator: {fn.experimental}",
                    self._ro_experimental,
                    "pass experimental=True to GRPOTrainer to acknowledge the reconstruction",
                )
            self._ro_multi_reward = multi_reward
            if config.scale_rewards != "group":
                raise _fail(
                    "scale_rewards",
                    "'group' (TRL's default) when advantage is given: the estimator does the scaling",
                    config.scale_rewards,
                    "configure the estimator instead (e.g. functools.partial(rolloutopt.advantages.grpo, scale='batch'))",
                )
            if config.multi_objective_aggregation != "sum_then_normalize" and not self._ro_multi_reward:
                raise _fail(
                    "multi_objective_aggregation",
                    "'sum_then_normalize' with a single-reward estimator (it sees the weighted sum of the rewards)",
                    config.multi_objective_aggregation,
                    "use advantage='gdpo' to normalise each reward function separately",
                )
            if "valid" in names:
                self._ro_adv_kwargs["valid"] = True
            if "experimental" in names and self._ro_experimental:
                self._ro_adv_kwargs["experimental"] = True

        # ------------------------------------------------------------------ advantages
        def _calculate_rewards(self, inputs: Any, prompts: Any, completions: Any, completion_ids_list: Any) -> Tensor:
            rewards_per_func: Tensor = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
            self._ro_rewards = rewards_per_func
            self._ro_alloc_rewards = rewards_per_func
            return rewards_per_func

        # ------------------------------------------------------------------ allocator (prompt selection)
        def _ro_init_allocator(self) -> None:
            ds: Any = self.train_dataset
            if ds is None or not hasattr(ds, "__getitem__") or not hasattr(ds, "__len__"):
                raise _fail(
                    "train_dataset",
                    "a map-style dataset (indexable, with a length) when allocator is given",
                    type(ds).__name__,
                    "pass a datasets.Dataset (prompt ids are dataset indices)",
                )
            targs: Any = self.args
            prompts = int(targs.generation_batch_size) // int(self.num_generations)  # type: ignore[arg-type]
            size = len(ds)
            pool = size if self._ro_pool is None else self._ro_pool
            if not prompts <= pool <= size:
                raise _fail(
                    "allocator_pool",
                    f"between the prompts per generation batch ({prompts}) and the dataset size ({size})",
                    pool,
                    "pass allocator_pool=None (the whole dataset) or a pool size in that range",
                )
            sbs = getattr(self._ro_allocator, "sampling_batch_size", None)
            if sbs is not None and sbs < prompts:
                raise _fail(
                    "allocator",
                    f"GRESO with sampling_batch_size >= {prompts} (the prompts per generation batch)",
                    f"sampling_batch_size={sbs}",
                    f"construct GRESO(..., sampling_batch_size={prompts}) or larger",
                )
            self._ro_pool_size = pool
            self._ro_prompts_per_batch = prompts
            self._ro_gen = torch.Generator().manual_seed(int(targs.seed))
            self.last_allocation: Any = None  # the AllocationResult of the last generation batch

        def _ro_select(self, inputs: list[Any]) -> list[Any]:
            """Plan over a candidate pool and return this process's rows of the planned generation batch.

            Every process draws the same pool and the allocator plans identically, so every process knows the
            global generation batch (``generation_batch_size`` rows) and takes its contiguous slice, as TRL's
            sampler would give it. A selector's batch is the selected prompts (request order) each repeated
            ``num_generations`` times, then, if it selected fewer than the batch holds, the next unselected
            candidates (padding, trained but not reported to the allocator). A per-prompt-count allocator's batch
            is its request (prompt ``r`` repeated ``counts[r]`` times, one group per prompt), then, if it spent less
            than the batch holds, one row each of unselected candidates (padding rows: generated, weight 0, each
            its own group). The plan is fed the rewards after generation (:meth:`_ro_feed`).
            """
            g = int(self.num_generations)  # type: ignore[arg-type]
            b_prompts = self._ro_prompts_per_batch
            total = b_prompts * g
            pool = torch.randperm(len(self.train_dataset), generator=self._ro_gen)[: self._ro_pool_size]  # type: ignore[arg-type]
            plan = self._ro_allocator.plan(pool, total)
            req = plan.next()
            while req is not None and req.is_probe:  # HIVE's prompt-entropy probe: TRL has no prefill pass here
                plan.observe(req, None)  # answered without the signal, so the allocator goes on without it
                req = plan.next()
            empty = torch.zeros(0, dtype=torch.long)
            chosen, counts = (empty, empty) if req is None else (req.prompt_ids, req.counts)
            unselected = pool[~torch.isin(pool, chosen)]
            if self._ro_alloc_mode == "select":
                if bool((counts != g).any()) or chosen.numel() > b_prompts:
                    raise RuntimeError(
                        f"the allocator requested counts {counts.tolist()} for {chosen.numel()} prompts; the TRL "
                        f"adapter needs at most {b_prompts} prompts with num_generations={g} rollouts each"
                    )
                pad = unselected[: b_prompts - chosen.numel()]
                prompt_ids = torch.cat([chosen, pad]).repeat_interleave(g)
                padded, group, weight = int(pad.numel()), None, None
            else:
                rows = chosen.repeat_interleave(counts)
                padded = total - rows.numel()
                if padded < 0:
                    raise RuntimeError(f"the allocator requested {rows.numel()} rollouts over a budget of {total}")
                source = unselected if unselected.numel() else pool
                pad = source[torch.arange(padded) % max(source.numel(), 1)] if padded else empty
                prompt_ids = torch.cat([rows, pad])
                group = torch.cat(
                    [torch.arange(chosen.numel()).repeat_interleave(counts), chosen.numel() + torch.arange(padded)]
                )
                weight = torch.cat([torch.ones(rows.numel()), torch.zeros(padded)])
            self._ro_pending = (plan, req, padded, group, weight)
            b = len(inputs)
            start = self.accelerator.process_index * b
            local = prompt_ids[start : start + b].tolist()
            ds: Any = self.train_dataset
            return [ds[i] for i in local]

        def _ro_feed(self) -> tuple[Tensor | None, Tensor | None]:
            """Observe the planned rollouts' rewards (TRL's gathered, weighted sum), finish the plan, update;
            return the global group ids and allocation weights of a per-prompt-count plan (None for a selector)."""
            plan, req, padded, group, weight = self._ro_pending
            self._ro_pending = None
            rpf, self._ro_alloc_rewards = self._ro_alloc_rewards, None
            if rpf is None:
                raise RuntimeError("TRL did not call _calculate_rewards; the rolloutopt adapter needs TRL 1.16")
            if req is not None:
                rewards = (rpf * self.reward_weights.to(rpf.device).unsqueeze(0)).nansum(dim=1)
                plan.observe(req, rewards[: req.total].detach().float().cpu())  # fp32 result rows
                if plan.next() is not None:
                    raise RuntimeError("the allocator requested a second round; the TRL adapter generates once")
            result = plan.finish()
            self._ro_allocator.update(result)
            self.last_allocation = result
            unit = "padded_prompts" if group is None else "padded_rows"
            metrics = {**result.metrics, unit: torch.tensor(float(padded))}
            for name, value in metrics.items():
                self._metrics["train"][f"rolloutopt/alloc/{name}"].append(float(value))
            if weight is not None and req is not None:  # rollouts the allocator keeps out of the loss
                weight = weight.clone()
                weight[: req.total] = result.weight[: req.total].float()
            return group, weight

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            training = bool(getattr(self.model, "training", False))
            if self._ro_allocator is not None and training:
                inputs = self._ro_select(list(inputs))
            return self._ro_generate(inputs)

        def _ro_generate(self, inputs: Any) -> dict[str, Any]:
            out: dict[str, Any] = super()._generate_and_score_completions(inputs)
            plan_group, plan_weight = (None, None) if self._ro_pending is None else self._ro_feed()
            if self._ro_advantage is None:
                return out
            rpf, self._ro_rewards = self._ro_rewards, None
            if rpf is None:
                raise RuntimeError("TRL did not call _calculate_rewards; the rolloutopt adapter needs TRL 1.16")
            mode = "train" if getattr(self.model, "training", False) else "eval"
            num_generations: Any = self.num_generations if mode == "train" else self.num_generations_eval
            n = rpf.size(0)
            group = torch.arange(n, device=rpf.device) // num_generations if plan_group is None else plan_group
            group = group.to(rpf.device)
            valid = ~torch.isnan(rpf).all(dim=1)
            weights = self.reward_weights.to(rpf.device)
            kw: dict[str, Any] = {}
            if self._ro_multi_reward:
                rewards = rpf.nan_to_num(0.0)
                kw["weights"] = weights
            else:
                rewards = (rpf * weights.unsqueeze(0)).nansum(dim=1)
            if "valid" in self._ro_adv_kwargs:
                kw["valid"] = valid
            if "experimental" in self._ro_adv_kwargs:
                kw["experimental"] = True
            res = self._ro_advantage(rewards, group, **kw)
            adv = res.advantages
            if adv.dim() != 1:
                raise _fail(
                    "advantage",
                    "per-sequence advantages [N] (TRL pads each process's completions to its own width)",
                    f"a tensor of shape {tuple(adv.shape)}",
                    "use a sequence-level estimator",
                )
            b = out["prompt_ids"].size(0)
            local = slice(self.accelerator.process_index * b, (self.accelerator.process_index + 1) * b)
            weight = res.weight.to(adv.dtype)
            if plan_weight is not None:
                weight = weight * plan_weight.to(weight)
            if self._ro_objective is None:
                out["advantages"] = (adv * weight)[local].to(out["advantages"].dtype)
            else:
                out["advantages"] = adv[local].to(out["advantages"].dtype)
                out[_SEQ_WEIGHT] = weight[local]
                loss_mask = out["completion_mask"] * out.get("tool_mask", 1)
                lengths = self.accelerator.gather(loss_mask.sum(dim=1))
                out["num_items_in_batch"] = (lengths * (weight != 0).to(lengths.dtype)).sum()
            logged: Any = self._logs["advantages"]
            if len(logged) >= n:  # TRL logged its own advantages for the completions table: show ours
                shown = (adv * weight).tolist()
                for i in range(n):
                    logged[len(logged) - n + i] = shown[i]
            if res.metrics:
                values = torch.stack([v.detach().float() for v in res.metrics.values()]).tolist()
                for name, value in zip(res.metrics, values, strict=True):
                    self._metrics[mode][f"rolloutopt/adv/{name}"].append(value)
            return out

        # ------------------------------------------------------------------ loss
        def _compute_loss(self, model: Any, inputs: dict[str, Any]) -> Tensor:
            if self._ro_objective is None:
                loss: Tensor = super()._compute_loss(model, inputs)  # type: ignore[no-untyped-call]
                return loss
            prompt_ids, prompt_mask = inputs["prompt_ids"], inputs["prompt_mask"]
            completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
            input_ids = torch.cat([prompt_ids, completion_ids], dim=1)
            attention_mask = torch.cat([prompt_mask, completion_mask], dim=1)
            logits_to_keep = completion_ids.size(1)
            mask_int = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
            mask = mask_int.bool()
            per_token = self._ro_fused_logps if self._ro_fused else self._get_per_token_logps_and_entropies
            entropies: Tensor
            aux_loss: Any
            logps, entropies, aux_loss = per_token(
                model,
                input_ids,
                attention_mask,
                logits_to_keep,
                compute_entropy=True,
                compute_aux_loss=self.aux_loss_enabled,
                **{k: inputs.get(k) for k in _MM_KEYS},
            )
            training = bool(getattr(self.model, "training", False))
            targs: Any = self.args
            mode = "train" if training else "eval"
            ga = self.current_gradient_accumulation_steps if training else 1
            old = inputs.get("old_per_token_logps")
            proximal = logps.detach() if old is None else old
            kw: dict[str, Any] = {"entropy": entropies}
            behav = inputs.get("sampling_per_token_logps")
            if behav is not None and self._ro_reads_behav:  # NaN: a token vLLM could not score; neutral (ratio 1)
                kw["behav_logp"] = torch.where(torch.isnan(behav), proximal.to(behav.dtype), behav)
            if self.use_vllm and self.vllm_importance_sampling_correction:
                w = inputs["importance_sampling_ratio"]
                kw["is_weights"] = w.squeeze(-1) if w.dim() == 2 and w.size(1) == 1 and mask.size(1) != 1 else w
            if self.beta != 0.0:
                kw["ref_logp"] = inputs["ref_per_token_logps"]
                if not self._ro_has_kl:
                    if targs.use_bias_correction_kl:
                        kw["kl"] = _RatioWeightedKL("k3", coef=self.beta, clamp=False, old=proximal)
                    else:
                        kw["kl"] = KL("k3", coef=self.beta, clamp=False)
            seq_weight = inputs.get(_SEQ_WEIGHT)
            if seq_weight is not None:
                kw["seq_weight"] = seq_weight
                carries = seq_weight != 0
                rows: float | Tensor = carries.sum()
                tokens: float | Tensor = (mask & carries[:, None]).sum()
            else:
                rows, tokens = mask.size(0), mask.sum()
            kw["denominators"] = trl_denominators(
                self._ro_agg,
                loss_type=self.loss_type,
                num_items_in_batch=inputs["num_items_in_batch"].float(),
                rows=rows,
                tokens=tokens,
                grad_accum=ga,
                steps_per_generation=targs.steps_per_generation,
                num_processes=self.accelerator.num_processes,
                training=training,
            )
            if self._ro_agg == "seq-mean-token-sum-norm":
                kw["max_len"] = self.max_completion_length
            if self._ro_preset_call and self._ro_experimental:
                kw["experimental"] = True
            out = self._ro_objective(logps, old, inputs["advantages"], mask, **kw)
            loss = out.loss
            metrics = dict(out.metrics)
            if self._entropy_bonus_enabled:  # TRL: a token mean of its own, divided by GA only, whatever the loss
                mf = mask.to(entropies.dtype)
                bonus = (entropies * mf).sum() / mf.sum().clamp(min=1.0) / ga
                loss = loss - self.entropy_coef * bonus
                if mode == "train" and self.accelerator.sync_gradients:
                    self._metrics[mode]["entropy_coef"].append(self.entropy_coef)
            if self.aux_loss_enabled:
                loss = loss + self.router_aux_loss_coef * aux_loss / ga
                metrics["aux_loss"] = aux_loss.detach()
            self._log_rolloutopt(mode, metrics)
            return loss

        def _ro_check_fused(self) -> None:
            """``use_fused=True`` needs a plain causal LM head: ``lm_head(h) / temperature``, nothing else."""
            net: Any = self.accelerator.unwrap_model(self.model)
            if getattr(net, "peft_config", None) is not None:
                raise _fail("use_fused", "a model without PEFT wrappers", "a PEFT model", "pass use_fused=False")
            cfg = net.config.get_text_config()
            head = net.get_output_embeddings()
            rescaling = ("final_logit_softcapping", "logit_scale", "output_multiplier", "lm_head_multiplier")
            scaled = [a for a in (*rescaling, "logits_scaling") if getattr(cfg, a, None) not in (None, 1.0)]
            problem = None
            if head is None or not isinstance(head, torch.nn.Linear):
                problem = f"an output embedding of type {type(head).__name__}"
            elif head.bias is not None:
                problem = "an LM head with a bias"
            elif scaled:
                problem = f"a model that rescales its logits ({', '.join(scaled)})"
            elif cfg is not net.config:
                problem = "a vision-language model"
            elif getattr(self.args, "cast_lm_head_to_fp32", False):
                problem = "cast_lm_head_to_fp32=True"
            if problem is not None:
                raise _fail(
                    "use_fused",
                    "a causal LM whose logits are lm_head(h) (a bias-free nn.Linear, no rescaling or softcapping)",
                    problem,
                    "pass use_fused=False (TRL's own fused LM head handles it)",
                )

        def _ro_fused_logps(
            self,
            model: Any,
            input_ids: Tensor,
            attention_mask: Tensor,
            logits_to_keep: int,
            compute_entropy: bool = True,
            compute_aux_loss: bool = False,
            **mm: Any,
        ) -> tuple[Tensor, Tensor, Tensor | None]:
            """Per-token log-probs and entropies through :func:`rolloutopt.kernels.token_logprobs`.

            The model runs its plain forward (through the DDP wrapper, so gradients synchronise) with
            ``output_hidden_states=True`` and ``logits_to_keep=1`` (one position's logits, unused); the last
            hidden states of the positions that predict the completion tokens and the LM-head weight go to the
            kernel, which never materialises the ``[B, T, V]`` logits, divides by ``temperature`` as TRL does, and
            returns the entropy with an exact gradient. The backbone runs under the trainer's autocast; the head
            runs outside it, in the LM-head weight's dtype with fp32 accumulation (under bf16 autocast TRL's own
            head multiplies in bf16, so the two differ by bf16 rounding, ~1e-3).
            """
            from rolloutopt.kernels.token_logprobs import token_logprobs

            if any(v is not None for v in mm.values()):
                raise _fail("use_fused", "text-only inputs", "multimodal inputs", "pass use_fused=False")
            kwargs: dict[str, Any] = {"output_router_logits": True} if compute_aux_loss else {}
            with self.accelerator.autocast():
                out = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    output_hidden_states=True,
                    logits_to_keep=1,
                    **kwargs,
                )
            hidden = out.hidden_states[-1][:, -logits_to_keep - 1 : -1, :]
            weight = self.accelerator.unwrap_model(model).get_output_embeddings().weight
            targets = input_ids[:, -logits_to_keep:]
            b, t = targets.shape
            logp, ent = token_logprobs(
                hidden.reshape(b * t, -1).to(weight.dtype),
                weight,
                targets.reshape(-1),
                temperature=float(self.temperature),
                with_entropy=True,  # the entropy metric and bonus need it (compute_entropy is always True here)
            )
            if ent is None:
                raise RuntimeError("token_logprobs returned no entropy")
            return logp.view(b, t), ent.view(b, t), (out.aux_loss if compute_aux_loss else None)

        def _log_rolloutopt(self, mode: str, metrics: dict[str, Tensor]) -> None:
            """Append the metrics to TRL's ``_metrics[mode]`` (one gather for all of them: mean, or max for ``*_max``)."""
            if not metrics:
                return
            names = list(metrics)
            local = torch.stack([metrics[k].detach().float().reshape(()) for k in names])
            gathered = self.accelerator.gather(local).view(-1, len(names))
            mean = gathered.nanmean(dim=0)
            high = gathered.amax(dim=0)
            is_max = torch.tensor([k.endswith("_max") for k in names], device=local.device)
            values = torch.where(is_max, high, mean).tolist()
            for name, value in zip(names, values, strict=True):
                self._metrics[mode][f"rolloutopt/{name}"].append(value if math.isfinite(value) else float("nan"))

    GRPOTrainer.__module__ = __name__
    GRPOTrainer.__qualname__ = "GRPOTrainer"
    return GRPOTrainer


def __getattr__(name: str) -> Any:
    """``GRPOTrainer`` is built on first access, so that this module imports without TRL (PEP 562)."""
    if name == "GRPOTrainer":
        cls = _trainer_class()
        globals()["GRPOTrainer"] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
