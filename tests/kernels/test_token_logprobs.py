"""token_logprobs: both backends against the float64 reference (full logits, log_softmax, gather) in value and
gradient; float64 gradcheck; edge cases; bad input. Triton runs under TRITON_INTERPRET=1 (tests/kernels/conftest.py)
on small shapes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from rolloutopt.errors import InputError
from rolloutopt.kernels.token_logprobs import token_logprobs

F64 = torch.float64


def reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """The naive path in float64: full logits, log_softmax, gather; entropy -Σ p log p."""
    z = hidden.to(F64) @ weight.to(F64).t() / temperature
    lp = torch.log_softmax(z, -1)
    return lp.gather(1, targets[:, None]).squeeze(1), -(lp.exp() * lp).sum(-1)


def make(
    n: int, d: int, v: int, dtype: torch.dtype = torch.float32, scale: float = 1.0, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = (scale * torch.randn(n, d, generator=gen, dtype=F64)).to(dtype).requires_grad_()
    weight = torch.randn(v, d, generator=gen, dtype=F64).to(dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=gen)
    return hidden, weight, targets


def value_and_grads(
    fn: object, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float, **kw: object
) -> tuple[torch.Tensor, ...]:
    """(logp, entropy, d hidden, d weight) for the cotangent logp·g1 + entropy·g2 (random, fixed)."""
    gen = torch.Generator().manual_seed(1)
    g1, g2 = (
        torch.randn(hidden.shape[0], generator=gen, dtype=F64),
        torch.randn(hidden.shape[0], generator=gen, dtype=F64),
    )
    logp, ent = fn(hidden, weight, targets, temperature=temperature, **kw)  # type: ignore[operator]
    assert ent is not None
    loss = (logp.to(F64) * g1).sum() + (ent.to(F64) * g2).sum()
    dh, dw = torch.autograd.grad(loss, (hidden, weight))
    return logp.detach(), ent.detach(), dh, dw


def ref_value_and_grads(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, ...]:
    h = hidden.detach().to(F64).requires_grad_()
    w = weight.detach().to(F64).requires_grad_()
    return value_and_grads(reference, h, w, targets, temperature)


def close(got: torch.Tensor, want: torch.Tensor, rtol: float, atol: float) -> None:
    torch.testing.assert_close(got.to(F64), want.to(F64), rtol=rtol, atol=atol)


# --- torch backend ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.6])
@pytest.mark.parametrize(("n", "d", "v", "cn", "cv"), [(37, 16, 101, 8, 16), (5, 3, 7, 64, 64), (50, 9, 333, 7, 50)])
def test_torch_float64_matches_reference(n: int, d: int, v: int, cn: int, cv: int, temperature: float) -> None:
    hidden, weight, targets = make(n, d, v, F64)
    got = value_and_grads(
        token_logprobs, hidden, weight, targets, temperature, backend="torch", chunk_tokens=cn, chunk_vocab=cv
    )
    for g, w in zip(got, ref_value_and_grads(hidden, weight, targets, temperature), strict=True):
        close(g, w, rtol=1e-10, atol=1e-10)
    assert got[0].dtype == F64


def test_gradcheck_float64() -> None:
    hidden, weight, targets = make(6, 4, 11, F64)

    def both(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp, ent = token_logprobs(h, w, targets, temperature=0.8, backend="torch", chunk_tokens=4, chunk_vocab=3)
        assert ent is not None
        return logp, ent

    assert torch.autograd.gradcheck(both, (hidden, weight))


def test_entropy_gradient_alone_is_exact() -> None:
    """Entropy only (no logp cotangent): the dH/dz = -p (z - E z)/T path on its own, against autograd."""
    hidden, weight, targets = make(9, 5, 23, F64)
    ent = token_logprobs(hidden, weight, targets, temperature=0.5, backend="torch", chunk_vocab=6)[1]
    assert ent is not None
    got = torch.autograd.grad(ent.sum(), (hidden, weight))
    want = torch.autograd.grad(reference(hidden, weight, targets, 0.5)[1].sum(), (hidden, weight))
    for g, w in zip(got, want, strict=True):
        close(g, w, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize(("dtype", "rtol"), [(torch.float32, 2e-5), (torch.float16, 2e-3), (torch.bfloat16, 1.6e-2)])
def test_torch_low_precision_inputs(dtype: torch.dtype, rtol: float) -> None:
    """fp32 accumulation: values within fp32 rounding of the float64 truth on the same (rounded) inputs; gradients
    within one rounding to the input dtype."""
    hidden, weight, targets = make(33, 24, 301, dtype)
    logp, ent, dh, dw = value_and_grads(
        token_logprobs, hidden, weight, targets, 0.7, backend="torch", chunk_tokens=16, chunk_vocab=64
    )
    want = ref_value_and_grads(hidden, weight, targets, 0.7)
    assert logp.dtype == torch.float32 and ent.dtype == torch.float32
    assert dh.dtype == dtype and dw.dtype == dtype
    close(logp, want[0], rtol=1e-5, atol=2e-5)
    close(ent, want[1], rtol=1e-5, atol=2e-5)
    close(dh, want[2], rtol=rtol, atol=rtol * float(want[2].abs().max()))
    close(dw, want[3], rtol=rtol, atol=rtol * float(want[3].abs().max()))


@given(
    n=st.integers(0, 12),
    d=st.integers(1, 6),
    v=st.integers(1, 40),
    cn=st.integers(1, 16),
    cv=st.integers(1, 48),
    temperature=st.floats(0.25, 4.0),
    seed=st.integers(0, 2**16),
)
def test_property_any_chunking_matches_reference(
    n: int, d: int, v: int, cn: int, cv: int, temperature: float, seed: int
) -> None:
    hidden, weight, targets = make(n, d, v, F64, seed=seed)
    got = value_and_grads(
        token_logprobs, hidden, weight, targets, temperature, backend="torch", chunk_tokens=cn, chunk_vocab=cv
    )
    for g, w in zip(got, ref_value_and_grads(hidden, weight, targets, temperature), strict=True):
        close(g, w, rtol=1e-9, atol=1e-9)


def test_large_logits_stay_finite_and_exact() -> None:
    """|z| > 1e4: the online sums are centred on the running max, so H does not lose ~ulp(1e4) to cancellation."""
    hidden, weight, targets = make(16, 8, 97, torch.float32, scale=3e3)
    logp, ent = token_logprobs(hidden, weight, targets, backend="torch", chunk_vocab=16)
    assert ent is not None
    want_lp, want_h = reference(hidden.detach(), weight.detach(), targets)
    z = hidden.detach().to(F64) @ weight.detach().to(F64).t()
    assert float(z.abs().max()) > 1e4
    fp32_err = (torch.log_softmax(z.float(), -1).gather(1, targets[:, None]).squeeze(1) - want_lp).abs()
    assert torch.isfinite(logp).all() and torch.isfinite(ent).all()
    assert ((logp.to(F64) - want_lp).abs() <= 4 * fp32_err + 0.05).all()  # the fp32 logits' own rounding
    close(ent, want_h, rtol=0, atol=1e-4)  # lse - Σ p z in fp32 would be off by ~1e-3 here
    dh, dw = torch.autograd.grad((logp + ent).sum(), (hidden, weight))
    assert torch.isfinite(dh).all() and torch.isfinite(dw).all()


def test_edge_shapes() -> None:
    hidden, weight, targets = make(0, 4, 9)
    logp, ent = token_logprobs(hidden, weight, targets)
    assert logp.shape == (0,) and ent is not None and ent.shape == (0,)
    dh, dw = torch.autograd.grad((logp.sum() + ent.sum()), (hidden, weight), allow_unused=True)
    assert dh is not None and dh.shape == (0, 4)
    assert dw is not None and not dw.any()

    hidden, weight, targets = make(5, 3, 1)  # V = 1: logp = 0, H = 0, no gradient
    logp, ent = token_logprobs(hidden, weight, targets)
    assert ent is not None
    assert logp.abs().max() < 1e-6 and ent.abs().max() < 1e-6


def test_without_entropy_and_ignore_index() -> None:
    hidden, weight, targets = make(12, 5, 31, F64)
    targets[[2, 7]] = -100
    logp, ent = token_logprobs(hidden, weight, targets, with_entropy=False, ignore_index=-100, chunk_vocab=8)
    assert ent is None
    assert logp[2] == 0 and logp[7] == 0
    keep = targets != -100
    safe = targets.clamp(min=0)
    dh, dw = torch.autograd.grad(logp.sum(), (hidden, weight))
    want = torch.autograd.grad(reference(hidden, weight, safe)[0][keep].sum(), (hidden, weight))
    close(dh, want[0], rtol=1e-10, atol=1e-12)
    close(dw, want[1], rtol=1e-10, atol=1e-12)
    assert dh[2].abs().max() == 0


def test_gradient_only_to_what_requires_it() -> None:
    hidden, weight, targets = make(7, 4, 13, F64)
    frozen = weight.detach()
    logp, ent = token_logprobs(hidden, frozen, targets)
    assert ent is not None
    (dh,) = torch.autograd.grad((logp + ent).sum(), (hidden,))
    h = hidden.detach().requires_grad_()
    lp, h_ = reference(h, frozen, targets)
    close(dh, torch.autograd.grad((lp + h_).sum(), (h,))[0], rtol=1e-10, atol=1e-12)


# --- Triton backend (interpreter on CPU) ---------------------------------------------------------------------

triton_cases = [
    # (dtype, n, d, v, temperature, chunk_tokens, chunk_vocab): odd sizes, tails in every block dimension
    (torch.float32, 45, 72, 601, 0.7, 32, 256),
    (torch.float16, 37, 40, 513, 1.3, 64, 512),
    (torch.bfloat16, 21, 33, 300, 1.0, 16, 600),
]


@pytest.mark.parametrize(("dtype", "n", "d", "v", "temperature", "cn", "cv"), triton_cases)
def test_triton_matches_reference_and_torch(
    dtype: torch.dtype, n: int, d: int, v: int, temperature: float, cn: int, cv: int
) -> None:
    pytest.importorskip("triton")
    hidden, weight, targets = make(n, d, v, dtype)
    kw = {"chunk_tokens": cn, "chunk_vocab": cv}
    tri = value_and_grads(token_logprobs, hidden, weight, targets, temperature, backend="triton", **kw)
    tor = value_and_grads(token_logprobs, hidden, weight, targets, temperature, backend="torch", **kw)
    want = ref_value_and_grads(hidden, weight, targets, temperature)
    grad_rtol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    for i, (a, b, w) in enumerate(zip(tri, tor, want, strict=True)):
        if i < 2:  # logp, entropy: fp32 from any input dtype
            close(a, w, rtol=1e-5, atol=2e-5)
            close(a, b, rtol=1e-5, atol=1e-5)
        else:
            atol = grad_rtol * float(w.abs().max())
            close(a, w, rtol=grad_rtol, atol=atol)
            close(a, b, rtol=grad_rtol, atol=atol)


def test_triton_large_logits_strided_inputs_and_no_entropy() -> None:
    """Non-contiguous hidden (row stride 2d, storage offset) and a transposed weight view exercise the kernels'
    stride arithmetic; |z| > 1e4 exercises the max guard."""
    pytest.importorskip("triton")
    gen = torch.Generator().manual_seed(3)
    n, d, v = 20, 24, 290
    base = 2e3 * torch.randn(n + 1, 2 * d, generator=gen)
    hidden = base[1:, d:].requires_grad_(False)
    w_t = torch.randn(d, v, generator=gen)
    weight = w_t.t()
    targets = torch.randint(0, v, (n,), generator=gen)
    assert not hidden.is_contiguous() and not weight.is_contiguous()
    h = hidden.clone().requires_grad_()
    w = weight.clone().requires_grad_()
    for dtype_kw in ({"with_entropy": True}, {"with_entropy": False}):
        tri = token_logprobs(h, w, targets, backend="triton", chunk_vocab=256, **dtype_kw)
        tor = token_logprobs(h, w, targets, backend="torch", chunk_vocab=64, **dtype_kw)
        strided = token_logprobs(hidden, weight, targets, backend="triton", chunk_vocab=256, **dtype_kw)
        assert float((h.detach() @ w.detach().t()).abs().max()) > 1e4
        assert torch.isfinite(tri[0]).all()
        close(tri[0], tor[0], rtol=0, atol=5e-3)
        close(strided[0], tri[0], rtol=0, atol=5e-3)
        if dtype_kw["with_entropy"]:
            assert tri[1] is not None and tor[1] is not None and strided[1] is not None
            close(tri[1], tor[1], rtol=0, atol=1e-4)
            close(strided[1], tri[1], rtol=0, atol=1e-4)
            dh, dw = torch.autograd.grad((tri[0] + tri[1]).sum(), (h, w))
            dh2, dw2 = torch.autograd.grad((tor[0] + tor[1]).sum(), (h, w))
            close(dh, dh2, rtol=1e-4, atol=1e-3)
            close(dw, dw2, rtol=1e-4, atol=1e-3)
        else:
            assert tri[1] is None


@pytest.mark.parametrize("v", [151_936, 256_000])
def test_real_vocabulary_sizes(v: int) -> None:
    """Qwen's 151,936 and Gemma's 256,000 entries (Megatron #2206 saw fp32 trouble past 250k): both backends
    against the float64 reference, targets at both ends of the vocabulary."""
    if v == 256_000:
        pytest.importorskip("triton")
    hidden, weight, targets = make(4, 16, v, seed=v)
    targets[:2] = torch.tensor([0, v - 1])
    want = ref_value_and_grads(hidden, weight, targets, 0.9)
    kw = {"chunk_vocab": v}  # one split / one backward chunk: the interpreter pays per program and per tile
    backends = ("torch", "triton") if v == 256_000 else ("torch",)  # keep the interpreter to the larger one
    for backend in backends:
        got = value_and_grads(token_logprobs, hidden, weight, targets, 0.9, backend=backend, **kw)
        for g, w in zip(got, want, strict=True):
            close(g, w, rtol=2e-5, atol=2e-5 * max(float(w.abs().max()), 1.0))


def test_triton_int64_offsets() -> None:
    """Offsets are formed in int64: the kernels' pattern ``idx.to(tl.int64) * stride`` does not wrap for rows near
    20,000 times a 151,936 stride (> 2**31), and every ``* stride_*`` / ``* N`` in the kernels' source multiplies
    such an int64 value."""
    pytest.importorskip("triton")
    import inspect
    import re

    from rolloutopt.kernels import _token_logprobs_triton as tk

    out = torch.zeros(16, dtype=torch.int64)
    start, stride = 20_000, 151_936
    tk._offsets_probe[(1,)](out, start, stride, BLOCK=16)
    want = (torch.arange(16, dtype=torch.int64) + start) * stride
    assert int(want.max()) > 2**31
    assert torch.equal(out, want)

    source = inspect.getsource(tk)
    products = re.findall(r"(\w+)(?:\[[^\]]*\])?\)?\s*\*\s*(stride_\w+|N)\b", source)
    assert len(products) >= 10
    assert all(name.endswith("64") for name, _ in products), products


def test_triton_rejects_float64_and_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("triton")
    hidden, weight, targets = make(4, 3, 5, F64)
    with pytest.raises(InputError, match="hidden"):
        token_logprobs(hidden, weight, targets, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    hidden, weight, targets = make(4, 3, 5)
    with pytest.raises(InputError, match=r"backend.*TRITON_INTERPRET"):
        token_logprobs(hidden, weight, targets, backend="triton")
    assert token_logprobs(hidden, weight, targets, backend="auto")[0].shape == (4,)  # auto: torch on CPU


# --- bad input --------------------------------------------------------------------------------------------------


def test_bad_input() -> None:
    hidden, weight, targets = make(4, 3, 5)
    cases: list[tuple[str, dict[str, object]]] = [
        ("hidden", {"hidden": hidden[0]}),
        ("hidden", {"hidden": torch.ones(4, 3, dtype=torch.long)}),
        ("hidden", {"hidden": [[1.0]]}),
        ("weight", {"weight": weight[:, :2]}),
        ("weight", {"weight": weight.double()}),
        ("weight", {"weight": torch.ones(0, 3)}),
        ("weight", {"weight": torch.ones(5, 3, device="meta")}),
        ("targets", {"targets": targets.float()}),
        ("targets", {"targets": targets[:3]}),
        ("targets", {"targets": torch.tensor([0, 1, 5, 2])}),
        ("targets", {"targets": torch.tensor([0, -1, 4, 2])}),
        ("targets", {"targets": torch.tensor([0, -100, 4, 2]), "ignore_index": -1}),
        ("temperature", {"temperature": 0.0}),
        ("temperature", {"temperature": float("nan")}),
        ("temperature", {"temperature": True}),
        ("ignore_index", {"ignore_index": 1.5}),
        ("chunk_tokens", {"chunk_tokens": 0}),
        ("chunk_vocab", {"chunk_vocab": 2.0}),
        ("backend", {"backend": "cuda"}),
    ]
    for argument, change in cases:
        kw: dict[str, object] = {"hidden": hidden, "weight": weight, "targets": targets} | change
        with pytest.raises(InputError) as info:
            token_logprobs(**kw)  # type: ignore[arg-type]
        assert info.value.argument == argument, (argument, change)
    ok = token_logprobs(hidden, weight, torch.tensor([0, -100, 4, 2]), ignore_index=-100)[0]
    assert ok[1] == 0
