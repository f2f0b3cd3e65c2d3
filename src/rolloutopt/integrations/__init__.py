"""Thin adapters for trainers (TRL, verl); the only modules that import a trainer package."""
