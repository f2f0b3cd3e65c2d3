"""Placeholder: filled in by the rollout-control issue."""

from __future__ import annotations

__all__: list[str] = []
