"""Errors raised by rolloutopt.

Every error the library raises on bad input is an :class:`InputError`. Its message names the argument, what
was expected, what was given, and how to fix it, so that a trainer log line is enough to repair the call.
"""

from __future__ import annotations

__all__ = ["InputError", "RolloutOptError"]


class RolloutOptError(Exception):
    """Base class of every error raised by rolloutopt."""


class InputError(RolloutOptError, ValueError):
    """Bad input to a public function: shape, dtype, device or value.

    Args:
        argument: name of the offending argument, e.g. ``"mask"``.
        expected: what the function needs, e.g. ``"a bool tensor of shape [B, T]"``.
        got: what it was given, e.g. ``"float32 tensor of shape (4, 7)"``.
        fix: how to repair the call.
    """

    def __init__(self, argument: str, expected: str, got: str, fix: str) -> None:
        self.argument = argument
        self.expected = expected
        self.got = got
        self.fix = fix
        # args set directly rather than through super().__init__, which torch.compile cannot trace: an InputError
        # raised while compiling (e.g. with checks left on) then reaches the user with its message.
        self.args = (f"{argument}: expected {expected}, got {got}. Fix: {fix}",)
