"""Rollout control: stop rules, truncation and length rules, partial-rollout scheduling (``docs/api/control.md``).

Everything is engine-agnostic (it sees per-step log-probs, entropies, top-k log-probs, token ids and an ``active``
mask — never a model), vectorised over the live batch, and checkpointable.

- streaming stop rules (decide during generation; :class:`StopRule`: ``init`` → ``step``… → ``finalize``, whose
  :class:`StopResult` also carries what the rule implies for the loss: ``result.rewards(rewards)`` and
  ``result.loss_weights(mask)``): ESPO (:mod:`~rolloutopt.control.espo`; the critic-free variant
  :mod:`~rolloutopt.control.espo_critic_free`, the absorbing-failure rewrite :mod:`~rolloutopt.control.absorbing`),
  value-based abstention (:mod:`~rolloutopt.control.abstention`) and
  the ARRoL quality head (:mod:`~rolloutopt.control.arrol`), confidence- and marker-gated truncation (Step-GRPO
  :mod:`~rolloutopt.control.step_grpo`, :mod:`~rolloutopt.control.deer`, DUET :mod:`~rolloutopt.control.duet`,
  ECHO :mod:`~rolloutopt.control.echo_pruning`), the on-policy-distillation horizon rules (Prune-OPD
  :mod:`~rolloutopt.control.prune_opd`, Stable-OPD :mod:`~rolloutopt.control.stable_opd`, ADWIN
  :mod:`~rolloutopt.control.adwin`, ESR :mod:`~rolloutopt.control.esr`, POPD/TOPD
  :mod:`~rolloutopt.control.opd_schedules`);
- post-hoc truncation and length rules (decide after generation; return a :class:`TruncationOutput`): DOT
  (:mod:`~rolloutopt.control.dot`), JET (:mod:`~rolloutopt.control.jet`), the soft compression penalty
  (:mod:`~rolloutopt.control.soft_compression`), and DLER's penalties, which live with the rest of DLER in
  :mod:`rolloutopt.advantages.dler` and are re-exported here; the SIRI length schedule
  (:mod:`~rolloutopt.control.siri`) and T-PPO's extended GAE (:mod:`~rolloutopt.control.egae`);
- partial-rollout scheduling: the shared event API (:mod:`~rolloutopt.control.partial`), APRIL
  (:mod:`~rolloutopt.control.april`) and CoPRIS (:mod:`~rolloutopt.control.copris`).

Two registries, one shape (``get``/``entry``/``names``/``register``, as every family of the library):

- :data:`REGISTRY` (``rolloutopt.control.get``, ...): every rule *class*, constructed by ``get(name)(...)``: the
  streaming stop and truncation rules (subclasses of :class:`StopRule`, run ``init`` → ``step``… →
  ``finalize``) and the length/horizon controllers that a trainer calls once per training step
  (``prune_opd_window``, ``stable_opd``, ``adwin_horizon``: ``observe(...)``). ``requires`` names the inputs a
  rule cannot run without (``step`` and ``init`` keywords for a stop rule, ``observe`` keywords for a
  controller), ``accepts`` those it reads when given.
- ``rolloutopt.control.posthoc.REGISTRY`` (``rolloutopt.control.posthoc.get``, ...): the post-hoc rule
  *functions*, called once on a finished batch by ``get(name)(**inputs, **hyper_parameters)`` (``dot``,
  ``jet_reward``, the DLER penalties, ``soft_compression_penalty``, ``step_aware_reward``). They are a second
  registry because they are called differently: no construction, no state, one call per batch.

Schedules and helpers (``siri_max_length``, ``popd_horizon``, ``topd_horizon``, ``esr_mask``,
``absorbing_failure``, ``egae``, the measures) are plain functions and not registered. The partial-rollout
schedulers drive generation rather than decide on rollouts, and are not registered either.
"""

from __future__ import annotations

from rolloutopt.advantages.dler import (
    dler_difficulty_budget,
    dler_difficulty_penalty,
    dler_truncation_penalty,
)
from rolloutopt.control import (
    _base,
    _partial_records,
    absorbing,
    abstention,
    adwin,
    april,
    arrol,
    copris,
    deer,
    duet,
    echo_pruning,
    espo,
    espo_critic_free,
    esr,
    jet,
    opd_schedules,
    partial,
    posthoc,
    prune_opd,
    siri,
    soft_compression,
    stable_opd,
    step_grpo,
)
from rolloutopt.control import dot as _dot  # the modules dot and egae: the names dot and egae are their functions
from rolloutopt.control import egae as _egae
from rolloutopt.control._base import *  # noqa: F403
from rolloutopt.control._partial_records import *  # noqa: F403
from rolloutopt.control.absorbing import *  # noqa: F403
from rolloutopt.control.abstention import *  # noqa: F403
from rolloutopt.control.adwin import *  # noqa: F403
from rolloutopt.control.april import *  # noqa: F403
from rolloutopt.control.arrol import *  # noqa: F403
from rolloutopt.control.copris import *  # noqa: F403
from rolloutopt.control.deer import *  # noqa: F403
from rolloutopt.control.dot import *  # noqa: F403
from rolloutopt.control.duet import *  # noqa: F403
from rolloutopt.control.echo_pruning import *  # noqa: F403
from rolloutopt.control.egae import *  # noqa: F403
from rolloutopt.control.espo import *  # noqa: F403
from rolloutopt.control.espo_critic_free import *  # noqa: F403
from rolloutopt.control.esr import *  # noqa: F403
from rolloutopt.control.jet import *  # noqa: F403
from rolloutopt.control.opd_schedules import *  # noqa: F403
from rolloutopt.control.partial import *  # noqa: F403
from rolloutopt.control.prune_opd import *  # noqa: F403
from rolloutopt.control.siri import *  # noqa: F403
from rolloutopt.control.soft_compression import *  # noqa: F403
from rolloutopt.control.stable_opd import *  # noqa: F403
from rolloutopt.control.step_grpo import *  # noqa: F403

__all__: list[str] = []
__all__ += _base.__all__
__all__ += espo.__all__
__all__ += espo_critic_free.__all__
__all__ += absorbing.__all__
__all__ += abstention.__all__
__all__ += arrol.__all__
__all__ += step_grpo.__all__
__all__ += deer.__all__
__all__ += duet.__all__
__all__ += echo_pruning.__all__
__all__ += prune_opd.__all__
__all__ += stable_opd.__all__
__all__ += adwin.__all__
__all__ += esr.__all__
__all__ += opd_schedules.__all__
__all__ += _dot.__all__
__all__ += jet.__all__
__all__ += ["dler_difficulty_budget", "dler_difficulty_penalty", "dler_truncation_penalty"]
__all__ += soft_compression.__all__
__all__ += siri.__all__
__all__ += _egae.__all__
__all__ += _partial_records.__all__
__all__ += partial.__all__
__all__ += april.__all__
__all__ += copris.__all__

from rolloutopt.registry import Registry  # noqa: E402

REGISTRY: Registry[type] = Registry("control rule")
"""Rule classes by name (the snake_case of the class name): ``get("espo")()`` constructs ESPO."""

for _name, _cls in (
    ("espo", ESPO),  # noqa: F405
    ("espo_critic_free", ESPOCriticFree),  # noqa: F405
    ("abstention", Abstention),  # noqa: F405
    ("arrol", ARRoL),  # noqa: F405
    ("step_grpo_truncation", StepGRPOTruncation),  # noqa: F405
    ("deer", DEER),  # noqa: F405
    ("duet_abort", DUETAbort),  # noqa: F405
    ("echo_pruning", ECHOPruning),  # noqa: F405
    ("prune_opd", PruneOPD),  # noqa: F405
    ("esr", ESR),  # noqa: F405
    ("prune_opd_window", PruneOPDWindow),  # noqa: F405
    ("stable_opd", StableOPD),  # noqa: F405
    ("adwin_horizon", ADWINHorizon),  # noqa: F405
):
    REGISTRY.register(_name, _cls)

_LENGTH_RULE = ("rewards", "lengths", "group")
for _name, _fn, _requires, _reference, _experimental in (
    (
        "dot",
        dot,  # noqa: F405
        _LENGTH_RULE,
        "arXiv 2601.03969 (DOT: dynamic outlier truncation)",
        "the outlier threshold rule is reconstructed from DOT's abstract",
    ),
    (
        "jet_reward",
        jet_reward,  # noqa: F405
        ("accuracy", "has_format", "lengths", "group"),
        "arXiv 2509.23392 (JET: Just-Enough Thinking); code JinyiHan99/Just-Enough-Think",
        None,
    ),
    (
        "dler_truncation_penalty",
        dler_truncation_penalty,
        ("rewards", "lengths"),
        "arXiv 2510.15110 (DLER: Doing Length pEnalty Right)",
        "the truncation penalty is reconstructed from DLER's abstract",
    ),
    (
        "dler_difficulty_penalty",
        dler_difficulty_penalty,
        _LENGTH_RULE,
        "arXiv 2510.15110 (DLER, difficulty-aware variant)",
        "the difficulty-aware budget is reconstructed from DLER's abstract",
    ),
    (
        "soft_compression_penalty",
        soft_compression_penalty,  # noqa: F405
        _LENGTH_RULE,
        "sample-level soft RL compression (known from its abstract only)",
        "the mastery test and the penalty are reconstructed from the abstract",
    ),
    (
        "step_aware_reward",
        step_aware_reward,  # noqa: F405
        ("rewards", "steps", "group"),
        "arXiv 2604.16890 (Step-GRPO's step-aware relative reward)",
        "the step-aware reward is reconstructed from Step-GRPO's abstract and summaries",
    ),
):
    posthoc.REGISTRY.register(
        _name,
        _fn,
        requires=_requires,
        accepts=("mask",) if _name != "step_aware_reward" else (),
        reference=_reference,
        experimental=_experimental,
    )


# The family's four registry functions are the registry's own (rolloutopt.registry.Registry): get(name) returns the
# class, entry(name) its Entry (requires, accepts, reference, experimental), names() and register(name, cls).
get = REGISTRY.get
entry = REGISTRY.entry
names = REGISTRY.names
register = REGISTRY.register

__all__ += ["REGISTRY", "entry", "get", "names", "register"]
