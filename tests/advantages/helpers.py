"""Small helpers shared by the advantage estimator tests."""

from __future__ import annotations

import torch

D = torch.float64
SINGLETON_WARNING = "ignore:rolloutopt. a group of size 1"


def t(x: object, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.tensor(x, dtype=dtype)


def ids(x: list[int]) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.long)


def close(a: torch.Tensor, b: object, atol: float = 1e-5) -> None:
    b = b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=a.dtype)
    torch.testing.assert_close(a, b.to(a.dtype), atol=atol, rtol=1e-5)
