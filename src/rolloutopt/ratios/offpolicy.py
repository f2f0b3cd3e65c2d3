"""Placeholder: filled in by issue 4 work."""

from __future__ import annotations

__all__: list[str] = []
