"""The arena's base policy: a short, seeded supervised warm-up of the testbed transformer on the easy cells of the
suite, cached on disk and rebuilt deterministically when absent.

LLM RL starts from a model that already solves the easy prompts. The warm-up trains
:class:`~rolloutopt.testbed.TinyPolicy` by teacher forcing (cross-entropy on the answer and its ``<eos>``) on the
train prompts of the cells whose length is at most ``warm_length``; the other cells are left to RL. The result is
cached under ``cache_dir`` (default ``$ROLLOUTOPT_CACHE/arena``, else ``~/.cache/rolloutopt/arena``) in a file
named by a hash of the suite and the warm-up settings, written atomically, and loaded with
``torch.load(weights_only=True)``: the same settings give the same weights on any machine with the same torch.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import Tensor

from rolloutopt._validation import check_int, check_real
from rolloutopt.arena.tasks import ARENA_VOCAB_SIZE, TaskSuite
from rolloutopt.errors import InputError
from rolloutopt.testbed.policy import TinyPolicy
from rolloutopt.testbed.task import EOS

__all__ = ["BaseConfig", "base_policy", "build_policy", "cache_dir"]


@dataclass(frozen=True)
class BaseConfig:
    """The base policy: architecture and supervised warm-up settings.

    ``warm_length``: the train prompts of cells of length at most this are warmed up, and ``next_fraction`` of
    those of the next length (default 2 and 0.25: the policy starts solving the shortest reverse/sort/add/count
    prompts, some of the next length, and none of the long ones).

    ``ramble``: the fraction of the train prompts of the longer cells (length above ``warm_length + 1``) that are
    warmed up on a *rambling* response: the prompt's digits repeated to the response limit, with no ``<eos>``. A
    base policy warmed up so keeps generating to the limit on many prompts beyond it, as an LLM does on problems
    beyond its competence, which gives token budgets and stop rules something to save. Default 0.5 (the base of
    the committed default results; 0: a base policy that ends every response with ``<eos>``, the one of
    ``benchmarks/results/arena/noramble`` and of the 150-step runs).
    """

    hidden: int = 64
    arch: str = "transformer"
    warm_length: int = 2
    next_fraction: float = 0.25
    steps: int = 300
    batch_size: int = 128
    lr: float = 3e-3
    seed: int = 0
    ramble: float = 0.5

    def __post_init__(self) -> None:
        check_int(self.hidden, "hidden", 1, "pass e.g. 64")
        if self.arch not in ("gru", "transformer"):
            raise InputError("arch", "'gru' or 'transformer'", repr(self.arch), "pick one")
        check_int(self.warm_length, "warm_length", 0, "pass e.g. 2 (0: no warm-up, a blank policy)")
        check_real(self.next_fraction, "next_fraction", 0.0, 1.0, "pass e.g. 0.25")
        check_int(self.steps, "steps", 0, "pass e.g. 300")
        check_int(self.batch_size, "batch_size", 1, "pass e.g. 128")
        check_real(self.lr, "lr", 0.0, 1.0, "pass e.g. 3e-3", open_low=True)
        check_int(self.seed, "seed", 0, "pass e.g. 0")
        check_real(self.ramble, "ramble", 0.0, 1.0, "pass e.g. 0.5 (0: no rambling responses)")


def cache_dir() -> Path:
    """``$ROLLOUTOPT_CACHE/arena`` if the variable is set, else ``~/.cache/rolloutopt/arena``."""
    root = os.environ.get("ROLLOUTOPT_CACHE")
    return (Path(root) if root else Path.home() / ".cache" / "rolloutopt") / "arena"


def build_policy(suite: TaskSuite, config: BaseConfig) -> TinyPolicy:
    """A fresh (untrained) policy sized for ``suite``, initialised from ``config.seed``."""
    return TinyPolicy(
        config.hidden,
        arch=config.arch,
        max_len=suite.prompt_width + suite.response_limit + 1,
        vocab_size=ARENA_VOCAB_SIZE,
        generator=torch.Generator().manual_seed(config.seed),
    )


def _key(suite: TaskSuite, config: BaseConfig) -> str:
    settings = asdict(config)
    if settings["ramble"] == 0.0:  # the key of the settings before the option existed: the same cached policy
        del settings["ramble"]
    blob = json.dumps({"suite": asdict(suite), "base": settings, "torch": torch.__version__}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _rambling(suite: TaskSuite, prompt_ids: Tensor) -> Tensor:
    """Rambling targets ``[N, response_limit]``: each prompt's digits (the operands, in order) repeated cyclically
    to the response limit, no ``<eos>``."""
    prompts = suite.prompts(prompt_ids)
    digits = prompts < 10  # the digit tokens come first in the vocabulary
    count = digits.sum(1, keepdim=True)
    order = torch.where(digits, torch.arange(prompts.shape[1]), prompts.shape[1]).sort(1).values  # digit positions
    pos = torch.arange(suite.response_limit)[None, :] % count
    return prompts.gather(1, order.gather(1, pos))


def _warm_up(suite: TaskSuite, config: BaseConfig) -> TinyPolicy:
    policy = build_policy(suite, config)
    train, _ = suite.split()
    _, length, _ = suite.decode_ids(train)
    gen = torch.Generator().manual_seed(config.seed + 1)
    nxt = (length == config.warm_length + 1) & (torch.rand(train.shape, generator=gen) < config.next_fraction)
    pool = train[(length <= config.warm_length) | nxt]
    if config.steps == 0 or pool.numel() == 0:
        return policy
    prompts, (answers, lens) = suite.prompts(pool), suite.answers(pool)
    width = max(answers.shape[1] + 1, suite.response_limit if config.ramble > 0 else 0)
    targets = torch.cat([answers, torch.full((pool.numel(), width - answers.shape[1]), EOS)], dim=1)
    targets.scatter_(1, lens[:, None], EOS)
    keep = torch.arange(width)[None, :] <= lens[:, None]  # the answer and its <eos>
    if config.ramble > 0:
        far = train[(length > config.warm_length + 1) & (torch.rand(train.shape, generator=gen) < config.ramble)]
        prompts = torch.cat([prompts, suite.prompts(far)])
        targets = torch.cat([targets, _rambling(suite, far)])
        keep = torch.cat([keep, torch.ones((far.numel(), width), dtype=torch.bool)])
        pool = torch.cat([pool, far])
    opt = torch.optim.Adam(policy.parameters(), lr=config.lr)
    policy.train()
    for _ in range(config.steps):
        rows = torch.randint(0, pool.numel(), (config.batch_size,), generator=gen)
        tgt = targets[rows]
        logsm = policy.log_softmax(prompts[rows], tgt)
        nll = -logsm.gather(-1, tgt[..., None]).squeeze(-1)
        m = keep[rows].float()
        loss = (nll * m).sum() / m.sum()
        opt.zero_grad()
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    policy.eval()
    return policy


def base_policy(suite: TaskSuite, config: BaseConfig | None = None, *, directory: Path | None = None) -> TinyPolicy:
    """The warmed-up base policy for ``suite``: loaded from the cache, or trained (deterministically) and cached.

    ``directory`` overrides :func:`cache_dir`. Training takes seconds to a minute on a CPU.
    """
    config = BaseConfig() if config is None else config
    where = cache_dir() if directory is None else Path(directory)
    path = where / f"base-{_key(suite, config)}.pt"
    policy = build_policy(suite, config)
    if path.exists():
        policy.load_state_dict(torch.load(path, weights_only=True))
        policy.eval()
        return policy
    policy = _warm_up(suite, config)
    where.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    torch.save(policy.state_dict(), tmp)
    tmp.replace(path)
    return policy
