"""The arena: which methods help, measured on a real (tiny) policy, every method side by side (a tool, not part of
the core library; ``docs/arena.md``).

:class:`~rolloutopt.arena.tasks.TaskSuite` is the graded task suite (reverse, sort, add, count at several
lengths, binary rewards).
"""

from __future__ import annotations

from rolloutopt.arena.tasks import ARENA_VOCAB, ARENA_VOCAB_SIZE, OPS, TaskSuite

__all__ = ["ARENA_VOCAB", "ARENA_VOCAB_SIZE", "OPS", "TaskSuite"]
