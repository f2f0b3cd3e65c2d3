"""GPU benchmark of the fused kernels (``docs/methods/kernels.md``) for one H100 / H200: correctness, then time and
peak memory.

    python benchmarks/kernels_gpu.py [--out PATH] [--budget SECONDS]   # on a CUDA machine, ~10 minutes at most
    python benchmarks/kernels_gpu.py --dry-run [--out PATH]            # every section at tiny shapes on CPU

Sections (each time-boxed and wrapped so that one failure does not lose the others; progress is flushed):

1. ``correct/logits_logprobs`` — the Triton path of :func:`rolloutopt.kernels.logits_logprobs` against the
   float64 reference ``log_softmax(logits.double() / T).gather(...)`` and its entropy (fp32 and bf16 logits,
   V = 32,000 and 151,936), values and d/dlogits for random cotangents on both outputs.
2. ``correct/fused_policy_loss`` — :func:`rolloutopt.losses.fused_policy_loss` (the Triton kernel, then
   ``policy_loss``) against the float64 reference ``policy_loss(log_softmax(logits.double() / T).gather(...))``
   for every registered preset (fp32 and bf16 logits), value and d/dlogits.
3. ``correct/token_logprobs`` — :func:`rolloutopt.kernels.token_logprobs` (Triton) against the
   float64 reference, value and gradients to ``hidden`` and ``weight``; skipped with a message if absent.
4. ``bench/logits`` — fused_policy_loss (Triton, in place) against naive torch (fp32 log_softmax + gather +
   ``policy_loss``), ``torch.compile`` of it, and Liger-Kernel's ``triton_grpo_loss`` when importable, at
   [16384, 151936] and [4096, 131072] bf16: fwd+bwd time (CUDA events, warm-up), peak extra memory
   (``max_memory_allocated`` minus the allocation before the step), ratio to naive, % of HBM bandwidth
   (3 passes over the logits: read, read, write; H200 4.8 TB/s, H100 3.35 TB/s by device name).
5. ``bench/fused_linear`` — token_logprobs + policy_loss against naive (``h @ W.T`` + the above), compile, and
   Liger's ``LigerFusedLinearGRPOLoss`` at N=16384, d=4096, V=151936 and N=4096, d=4096, V=131072 bf16:
   time, peak extra memory beyond dh and dW, ratio, effective TFLOP/s counting the 3 matmuls of fwd+bwd
   (6·N·d·V FLOP; a recomputing backward does 4, so its hardware rate is 4/3 of the figure).

The objective everywhere: DAPO's token-level clip (0.2 / 0.28), k3 KL to precomputed reference log-probs
(coef 0.001), entropy computed (as a metric), temperature 0.7, token-mean; validation off (``checks(False)``)
as in production. A markdown table goes to ``--out``, else ``$OUT/kernels_gpu.md`` (``$OUT`` set), else
``benchmarks/results/kernels_gpu.md`` (not in dry runs).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

import rolloutopt  # noqa: E402
from rolloutopt.kernels import logits_logprobs  # noqa: E402
from rolloutopt.losses import KL, fused_policy_loss, policy_loss  # noqa: E402
from rolloutopt.losses.presets import PRESETS  # noqa: E402
from rolloutopt.ratios import PPOClip  # noqa: E402

TEMP = 0.7
KL_COEF = 0.001
GIB = 2**30
HBM = {"H200": 4.8e12, "H100": 3.35e12}
DENSE_BF16 = 989e12  # H100 / H200 SXM dense bf16 peak (NVIDIA's figure; both chips have the same tensor throughput)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


class Run:
    """Shared state: device, shapes, deadline and the rows of the result table."""

    def __init__(self, dry: bool, budget: float) -> None:
        self.dry = dry
        self.t0 = time.monotonic()
        self.deadline = self.t0 + budget
        self.dev = torch.device("cpu" if dry else "cuda")
        self.backend = "torch" if dry else "triton"
        self.rows: list[dict[str, str]] = []
        self.notes: list[str] = []
        name = "cpu (dry run)" if dry else torch.cuda.get_device_name()
        self.device_name = name
        self.hbm = next((bw for k, bw in HBM.items() if k in name), None)

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def row(self, section: str, variant: str, shape: str, **cols: str) -> None:
        self.rows.append({"section": section, "variant": variant, "shape": shape, **cols})
        log(f"{section} | {variant} | {shape} | " + " | ".join(f"{k}={v}" for k, v in cols.items()))

    def sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    @contextlib.contextmanager
    def section(self, name: str, budget: float) -> Iterator[float]:
        """Run a section until ``budget`` seconds (or the global deadline); a failure is recorded, not raised."""
        end = min(time.monotonic() + budget, self.deadline)
        log(f"== {name} (time box {end - time.monotonic():.0f} s)")
        try:
            yield end
        except Exception as e:  # one section's failure must not lose the others
            self.row(name, "-", "-", status=f"FAILED: {type(e).__name__}: {str(e)[:200]}")
            traceback.print_exc()
            sys.stdout.flush()
        finally:
            self.free()

    def free(self) -> None:
        import gc

        gc.collect()
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()

    def measure(
        self, step: Callable[[], Any], reset: Callable[[], Any], end: float, warmup: int = 2, reps: int = 5
    ) -> tuple[float, float | None]:
        """Median time (ms) of ``step`` and its peak extra memory (bytes) over the allocation before it."""
        cuda = self.dev.type == "cuda"
        if self.dry:
            warmup, reps = 1, 1
        for _ in range(warmup):
            reset()
            step()
        self.sync()
        times: list[float] = []
        peak: float | None = 0.0 if cuda else None
        for _ in range(reps):
            reset()
            self.sync()
            if cuda:
                base = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                step()
                b.record()
                torch.cuda.synchronize()
                times.append(a.elapsed_time(b))
                assert peak is not None
                peak = max(peak, torch.cuda.max_memory_allocated() - base)
            else:
                t = time.perf_counter()
                step()
                times.append((time.perf_counter() - t) * 1e3)
            if time.monotonic() > end:
                break
        return statistics.median(times), peak


def gib(x: float | None) -> str:
    return "n/a" if x is None else f"{x / GIB:.3f}"


# ------------------------------------------------------------------------------------------------ inputs


def token_inputs(run: Run, b: int, t: int, lp: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Per-token inputs near on-policy (old/ref = logp + noise); every token valid (N valid tokens)."""
    g = torch.Generator(device=run.dev).manual_seed(0)
    base = torch.zeros(b, t, device=run.dev) if lp is None else lp.detach().float().view(b, t)
    mask = torch.ones(b, t, dtype=torch.bool, device=run.dev)
    return {
        "old": base + 0.1 * torch.randn(b, t, generator=g, device=run.dev),
        "ref": base + 0.1 * torch.randn(b, t, generator=g, device=run.dev),
        "behav": base + 0.2 * torch.randn(b, t, generator=g, device=run.dev),
        "adv": torch.randn(b, generator=g, device=run.dev),
        "mask": mask,
    }


def reference_logp(x: torch.Tensor, tgt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    lsm = torch.log_softmax(x / TEMP, -1)
    lp = lsm.gather(-1, tgt[..., None])[..., 0]
    p = lsm.exp()
    return lp, -(p * torch.where(p > 0, lsm, torch.zeros_like(lsm))).sum(-1)


def naive_loss(x: torch.Tensor, tgt: torch.Tensor, inp: dict[str, torch.Tensor]) -> torch.Tensor:
    """The materialised path: fp32 log_softmax of the logits, gather, entropy, policy_loss (DAPO + k3 KL)."""
    lp, ent = reference_logp(x.float(), tgt)
    out = policy_loss(
        lp, inp["old"], inp["adv"], inp["mask"], ref_logp=inp["ref"], entropy=ent, kl=KL("k3", KL_COEF),
        trust=PPOClip(0.2, 0.28, dual=None), agg="token-mean",
    )  # fmt: skip
    return out.loss


# ------------------------------------------------------------------------------------------------ correctness


def preset_inputs(run: Run, b: int, t: int, v: int, x64: torch.Tensor, lp: torch.Tensor) -> dict[str, Any]:
    """Every optional input a preset may read (behaviour / reference log-probs, versions, top-K log-probs,
    confidence, groups, max_len), near on-policy; passed with ``allow_unused=True``."""
    g = torch.Generator(device=run.dev).manual_seed(3)
    inp = token_inputs(run, b, t, lp)
    k = 4
    with torch.no_grad():
        lsm = torch.log_softmax(x64 / TEMP, -1)
        ids = (x64 + torch.randn(x64.shape, generator=g, device=run.dev, dtype=x64.dtype)).topk(k, -1).indices
        lsm_b = torch.log_softmax((x64 + 0.5 * torch.randn(x64.shape, generator=g, device=run.dev, dtype=x64.dtype))
                                  / TEMP, -1)  # fmt: skip
    return {
        "behav_logp": inp["behav"].clamp(max=0.0), "ref_logp": inp["ref"].clamp(max=0.0),
        "versions": torch.randint(0, 3, (b, t), generator=g, device=run.dev), "policy_version": 3,
        "topk_logp": lsm.gather(-1, ids).float(), "topk_behav_logp": lsm_b.gather(-1, ids).float(),
        "confidence": torch.rand(b, generator=g, device=run.dev), "group": torch.arange(b, device=run.dev) // 2,
        "max_len": t, "allow_unused": True,
    }  # fmt: skip


def correct_logits_logprobs(run: Run) -> None:
    sec = "correct/logits_logprobs"
    with run.section(sec, 45) as end:
        shapes = [(2, 5, 301), (1, 3, 4099)] if run.dry else [(4, 64, 32_000), (2, 16, 151_936)]
        for b, t, v in shapes:
            for dtype in (torch.float32, torch.bfloat16):
                shape = f"[{b}x{t}, {v}]"
                if time.monotonic() > end:
                    run.row(sec, str(dtype)[6:], shape, status="SKIPPED (time box)")
                    continue
                g = torch.Generator(device=run.dev).manual_seed(4)
                logits = (3 * torch.randn(b, t, v, generator=g, device=run.dev)).to(dtype)
                tgt = torch.randint(0, v, (b, t), generator=g, device=run.dev)
                mask = torch.rand(b, t, generator=g, device=run.dev) > 0.2
                gl = torch.randn(b, t, generator=g, device=run.dev, dtype=torch.float64)
                gh = torch.randn(b, t, generator=g, device=run.dev, dtype=torch.float64)
                x64 = logits.double().requires_grad_()
                lp64, ent64 = reference_logp(x64, tgt)
                zero = torch.zeros_like(lp64)
                lp64, ent64 = torch.where(mask, lp64, zero), torch.where(mask, ent64, zero)
                (lp64 * gl + ent64 * gh).sum().backward()
                x = logits.clone().requires_grad_()
                lp, ent = logits_logprobs(x, tgt, temperature=TEMP, mask=mask, backend=run.backend, inplace=True)
                (lp.double() * gl + ent.double() * gh).sum().backward()
                assert x.grad is not None and x64.grad is not None

                def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
                    return ((a.double() - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()

                errs = {"logp": rel(lp, lp64.detach()), "entropy": rel(ent, ent64.detach()),
                        "dlogits": rel(x.grad, x64.grad)}  # fmt: skip
                tol = 1e-5 if dtype == torch.float32 else 2e-2
                run.row(
                    sec, str(dtype)[6:], shape, **{f"{k}_rel_err": f"{e:.2e}" for k, e in errs.items()},
                    status="PASS" if max(errs.values()) < tol else "FAIL",
                )  # fmt: skip


def correct_fused(run: Run) -> None:
    with run.section("correct/fused_policy_loss", 90) as end:
        b, t, v = (4, 5, 301) if run.dry else (4, 64, 32_000)
        for dtype in (torch.float32, torch.bfloat16):
            for name in PRESETS.names():
                if time.monotonic() > end:
                    run.row("correct/fused_policy_loss", name, f"[{b}x{t}, {v}]", status="SKIPPED (time box)")
                    continue
                preset = PRESETS.get(name)
                experimental = preset.experimental is not None
                g = torch.Generator(device=run.dev).manual_seed(1)
                logits = (3 * torch.randn(b, t, v, generator=g, device=run.dev)).to(dtype)
                tgt = torch.randint(0, v, (b, t), generator=g, device=run.dev)
                x64 = logits.double().requires_grad_()
                lp, ent = reference_logp(x64, tgt)
                inp = token_inputs(run, b, t, lp)
                kw = {**preset_inputs(run, b, t, v, x64.detach(), lp), "kl": KL("k3", 0.05), "entropy_coef": 0.01}
                ref = preset(
                    lp, inp["old"].double(), inp["adv"].double(), inp["mask"], entropy=ent, experimental=experimental,
                    **{k: (w.double() if isinstance(w, torch.Tensor) and w.is_floating_point() else w)
                       for k, w in kw.items()},
                )  # fmt: skip
                ref.loss.backward()
                x = logits.clone().requires_grad_()
                out = fused_policy_loss(x, tgt, inp["old"], inp["adv"], inp["mask"], preset=name, temperature=TEMP,
                                        backend=run.backend, inplace=True, experimental=experimental, **kw)  # fmt: skip
                out.loss.backward()
                assert x.grad is not None and x64.grad is not None
                l_err = abs(out.loss.item() - ref.loss.item()) / max(abs(ref.loss.item()), 1e-6)
                g_err = ((x.grad.double() - x64.grad).abs().max() / x64.grad.abs().max().clamp(min=1e-30)).item()
                tol = 1e-4 if dtype == torch.float32 else 2e-2
                ok = l_err < tol and g_err < (1e-3 if dtype == torch.float32 else 2e-2)
                run.row(
                    "correct/fused_policy_loss", f"{name} {str(dtype)[6:]}", f"[{b}x{t}, {v}]",
                    loss_rel_err=f"{l_err:.2e}", grad_rel_err=f"{g_err:.2e}", status="PASS" if ok else "FAIL",
                )  # fmt: skip


def correct_token_logprobs(run: Run) -> None:
    with run.section("correct/token_logprobs", 45) as end:
        if importlib.util.find_spec("rolloutopt.kernels.token_logprobs") is None:
            run.row("correct/token_logprobs", "-", "-", status="SKIPPED: rolloutopt.kernels.token_logprobs absent")
            return
        from rolloutopt.kernels.token_logprobs import token_logprobs

        n, d, v = (24, 16, 301) if run.dry else (256, 256, 32_000)
        for dtype in (torch.float32, torch.bfloat16):
            if time.monotonic() > end:
                run.row("correct/token_logprobs", str(dtype)[6:], f"[{n}, {d}, {v}]", status="SKIPPED (time box)")
                continue
            g = torch.Generator(device=run.dev).manual_seed(2)
            h = torch.randn(n, d, generator=g, device=run.dev).to(dtype)
            w = (torch.randn(v, d, generator=g, device=run.dev) / math.sqrt(d)).to(dtype)
            tgt = torch.randint(0, v, (n,), generator=g, device=run.dev)
            gl, gh = torch.randn(n, generator=g, device=run.dev), torch.randn(n, generator=g, device=run.dev)
            h64, w64 = h.double().requires_grad_(), w.double().requires_grad_()
            lp64, ent64 = reference_logp(h64 @ w64.T, tgt)
            ((lp64 * gl).sum() + (ent64 * gh).sum()).backward()
            hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
            lp, ent = token_logprobs(hh, ww, tgt, temperature=TEMP, with_entropy=True, backend=run.backend)
            assert ent is not None
            ((lp.float() * gl).sum() + (ent.float() * gh).sum()).backward()
            assert hh.grad is not None and ww.grad is not None and h64.grad is not None and w64.grad is not None

            def rel(a: torch.Tensor, b: torch.Tensor) -> float:
                return ((a.double() - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()

            errs = {
                "logp": rel(lp, lp64.detach()), "entropy": rel(ent, ent64.detach()),
                "dhidden": rel(hh.grad, h64.grad), "dweight": rel(ww.grad, w64.grad),
            }  # fmt: skip
            tol = 1e-4 if dtype == torch.float32 else 3e-2
            run.row(
                "correct/token_logprobs", str(dtype)[6:], f"[{n}, {d}, {v}]",
                **{f"{k}_rel_err": f"{e:.2e}" for k, e in errs.items()},
                status="PASS" if max(errs.values()) < tol else "FAIL",
            )  # fmt: skip


# ------------------------------------------------------------------------------------------------ benchmarks


def bench_logits(run: Run) -> None:
    shapes = [(16, 16, 1000), (8, 8, 513)] if run.dry else [(16, 1024, 151_936), (4, 1024, 131_072)]
    with run.section("bench/logits", 200 if not run.dry else 60) as end:
        for b, t, v in shapes:
            bench_logits_shape(run, end, b, t, v)


def bench_logits_shape(run: Run, end: float, b: int, t: int, v: int) -> None:
    sec, shape = "bench/logits", f"N={b * t} V={v} bf16"
    n = b * t
    pristine = (3 * torch.randn(b, t, v, device=run.dev)).to(torch.bfloat16)
    tgt = torch.randint(0, v, (b, t), device=run.dev)
    inp = token_inputs(run, b, t)
    x = pristine.clone().requires_grad_()
    bytes_3pass = 3 * n * v * pristine.element_size()
    results: dict[str, float] = {}

    def reset() -> None:
        x.grad = None
        with torch.no_grad():
            x.copy_(pristine)

    def fused_step() -> None:
        out = fused_policy_loss(x, tgt, inp["old"], inp["adv"], inp["mask"], preset="dapo",
                                kl=KL("k3", KL_COEF), ref_logp=inp["ref"], temperature=TEMP,
                                backend=run.backend, inplace=True)  # fmt: skip
        out.loss.backward()

    def naive_step() -> None:
        naive_loss(x, tgt, inp).backward()

    compiled = torch.compile(naive_loss, dynamic=False, backend="eager" if run.dry else "inductor")

    def compiled_step() -> None:
        compiled(x, tgt, inp).backward()

    variants: list[tuple[str, Callable[[], None], float]] = [
        ("naive torch", naive_step, 5),
        ("torch.compile", compiled_step, 1 if run.dry else 90),
        ("rolloutopt fused (triton, in place)" if not run.dry else "rolloutopt fused (torch)", fused_step, 5),
    ]
    for name, step, need in variants:
        if time.monotonic() + need > end:
            run.row(sec, name, shape, status="SKIPPED (time box)")
            continue
        try:
            with rolloutopt.checks(False):
                ms, peak = run.measure(step, reset, end)
            results[name] = ms
            cols = {"ms": f"{ms:.2f}", "peak_extra_GiB": gib(peak)}
            if "fused" in name and run.hbm is not None:
                cols["hbm"] = f"{bytes_3pass / (ms * 1e-3) / run.hbm * 100:.0f}% of {run.hbm / 1e12:.2f} TB/s"
            run.row(sec, name, shape, **cols, status="ok")
        except torch.cuda.OutOfMemoryError as e:
            run.row(sec, name, shape, status=f"OOM: {str(e)[:120]}")
        except Exception as e:
            run.row(sec, name, shape, status=f"FAILED: {type(e).__name__}: {str(e)[:160]}")
            traceback.print_exc()
        finally:
            run.free()
    # forward only (no grad): one read of the logits
    if time.monotonic() + 5 < end:
        try:
            with rolloutopt.checks(False), torch.no_grad():
                ms, _ = run.measure(
                    lambda: fused_policy_loss(x, tgt, inp["old"], inp["adv"], inp["mask"], preset="dapo",
                                              temperature=TEMP, backend=run.backend),
                    reset, end,
                )  # fmt: skip
            cols = {"ms": f"{ms:.2f}"}
            if run.hbm is not None:
                cols["hbm"] = f"{n * v * 2 / (ms * 1e-3) / run.hbm * 100:.0f}% (1 pass)"
            run.row(sec, "rolloutopt fused, forward only", shape, **cols, status="ok")
        except Exception as e:
            run.row(sec, "rolloutopt fused, forward only", shape, status=f"FAILED: {e!s:.160}")
    liger_triton(run, sec, shape, b, t, v, pristine, tgt, inp, end, results)
    base = results.get("naive torch")
    if base:
        for name, ms in results.items():
            if name != "naive torch":
                run.row(sec, f"ratio naive / {name}", shape, ratio=f"{base / ms:.2f}x")
    del x, pristine
    run.free()


def liger_triton(
    run: Run, sec: str, shape: str, b: int, t: int, v: int, pristine: torch.Tensor, tgt: torch.Tensor,
    inp: dict[str, torch.Tensor], end: float, results: dict[str, float],
) -> None:  # fmt: skip
    name = "liger triton_grpo_loss"
    if importlib.util.find_spec("liger_kernel") is None:
        log("liger-kernel not installed")
        run.row(sec, name, shape, status="liger-kernel not installed")
        return
    if run.dry or time.monotonic() + 10 > end:
        run.row(sec, name, shape, status="SKIPPED (dry run / time box)")
        return
    try:
        from liger_kernel.transformers.grpo_loss import triton_grpo_loss

        x3 = torch.empty(b, t + 1, v, dtype=pristine.dtype, device=run.dev, requires_grad=True)
        mask_i = inp["mask"].int()

        def reset() -> None:
            x3.grad = None
            with torch.no_grad():
                x3[:, :t].copy_(pristine)

        def step() -> None:
            kw = {"completion_mask": mask_i, "temperature": TEMP, "beta": KL_COEF, "eps_low": 0.2, "eps_high": 0.28,
                  "inplace": True}  # fmt: skip
            try:
                out = triton_grpo_loss(x3, inp["old"], inp["ref"], tgt, inp["adv"], loss_type="dapo", reduce=True, **kw)
            except TypeError:  # older signature: per-token loss, kl, is_clipped
                out = triton_grpo_loss(x3, inp["old"], inp["ref"], tgt, inp["adv"], **kw)
            loss = out[0] if isinstance(out, tuple) else out
            if loss.ndim:
                loss = (loss * inp["mask"]).sum() / inp["mask"].sum()
            loss.backward()

        ms, peak = run.measure(step, reset, end)
        results[name] = ms
        cols = {"ms": f"{ms:.2f}", "peak_extra_GiB": gib(peak)}
        if run.hbm is not None:
            cols["hbm"] = f"{3 * b * t * v * 2 / (ms * 1e-3) / run.hbm * 100:.0f}% of {run.hbm / 1e12:.2f} TB/s"
        run.row(sec, name, shape, **cols, status="ok")
    except Exception as e:
        run.row(sec, name, shape, status=f"FAILED: {type(e).__name__}: {str(e)[:160]}")
        traceback.print_exc()
    finally:
        run.free()


def bench_fused_linear(run: Run) -> None:
    shapes = [(4, 16, 32, 1000)] if run.dry else [(16, 1024, 4096, 151_936), (4, 1024, 4096, 131_072)]
    with run.section("bench/fused_linear", 260 if not run.dry else 60) as end:
        for b, t, d, v in shapes:
            bench_fused_linear_shape(run, end, b, t, d, v)


def bench_fused_linear_shape(run: Run, end: float, b: int, t: int, d: int, v: int) -> None:
    have_tlp = importlib.util.find_spec("rolloutopt.kernels.token_logprobs") is not None
    sec, shape = "bench/fused_linear", f"N={b * t} d={d} V={v} bf16"
    n = b * t
    h = (torch.randn(n, d, device=run.dev) / 2).to(torch.bfloat16).requires_grad_()
    w = (torch.randn(v, d, device=run.dev) / math.sqrt(d)).to(torch.bfloat16).requires_grad_()
    tgt = torch.randint(0, v, (b, t), device=run.dev)
    inp = token_inputs(run, b, t)
    grads_bytes = (h.numel() + w.numel()) * h.element_size()
    flop = 6 * n * d * v
    results: dict[str, float] = {}

    def reset() -> None:
        h.grad = None
        w.grad = None

    def naive_step() -> None:
        naive_loss((h @ w.T).view(b, t, v), tgt, inp).backward()

    compiled = torch.compile(
        lambda hh, ww: naive_loss((hh @ ww.T).view(b, t, v), tgt, inp), dynamic=False,
        backend="eager" if run.dry else "inductor",
    )  # fmt: skip

    def compiled_step() -> None:
        compiled(h, w).backward()

    def ours_step() -> None:
        from rolloutopt.kernels.token_logprobs import token_logprobs

        lp, ent = token_logprobs(h, w, tgt.view(-1), temperature=TEMP, with_entropy=True, backend=run.backend)
        out = policy_loss(
            lp.view(b, t), inp["old"], inp["adv"], inp["mask"], ref_logp=inp["ref"],
            entropy=None if ent is None else ent.view(b, t), kl=KL("k3", KL_COEF),
            trust=PPOClip(0.2, 0.28, dual=None), agg="token-mean",
        )  # fmt: skip
        out.loss.backward()

    variants: list[tuple[str, Callable[[], None] | None, float]] = [
        ("naive torch", naive_step, 10),
        ("torch.compile", compiled_step, 1 if run.dry else 100),
        ("rolloutopt token_logprobs + policy_loss", ours_step if have_tlp else None, 10),
    ]
    for name, step, need in variants:
        if step is None:
            run.row(sec, name, shape, status="SKIPPED: rolloutopt.kernels.token_logprobs absent")
            continue
        if time.monotonic() + need > end:
            run.row(sec, name, shape, status="SKIPPED (time box)")
            continue
        try:
            with rolloutopt.checks(False):
                ms, peak = run.measure(step, reset, end, warmup=1, reps=3)
            results[name] = ms
            run.row(
                sec, name, shape, ms=f"{ms:.1f}", peak_extra_GiB=gib(peak),
                extra_beyond_dh_dW_GiB=gib(None if peak is None else peak - grads_bytes),
                tflops=f"{flop / (ms * 1e-3) / 1e12:.0f}"
                + ("" if run.dry else f" ({flop / (ms * 1e-3) / DENSE_BF16 * 100:.0f}% of 989)"),
                status="ok",
            )  # fmt: skip
        except torch.cuda.OutOfMemoryError as e:
            run.row(sec, name, shape, status=f"OOM: {str(e)[:120]}")
        except Exception as e:
            run.row(sec, name, shape, status=f"FAILED: {type(e).__name__}: {str(e)[:160]}")
            traceback.print_exc()
        finally:
            run.free()
    liger_fused_linear(run, sec, shape, b, t, h, w, tgt, inp, end, results, grads_bytes, flop)
    base = results.get("naive torch")
    if base:
        for name, ms in results.items():
            if name != "naive torch":
                run.row(sec, f"ratio naive / {name}", shape, ratio=f"{base / ms:.2f}x")
    del h, w
    run.free()


def liger_fused_linear(
    run: Run, sec: str, shape: str, b: int, t: int, h: torch.Tensor, w: torch.Tensor, tgt: torch.Tensor,
    inp: dict[str, torch.Tensor], end: float, results: dict[str, float], grads_bytes: int, flop: int,
) -> None:  # fmt: skip
    name = "liger LigerFusedLinearGRPOLoss"
    if importlib.util.find_spec("liger_kernel") is None:
        log("liger-kernel not installed")
        run.row(sec, name, shape, status="liger-kernel not installed")
        return
    if run.dry or time.monotonic() + 20 > end:
        run.row(sec, name, shape, status="SKIPPED (dry run / time box)")
        return
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

        try:
            mod = LigerFusedLinearGRPOLoss(beta=KL_COEF, use_ref_model=True, epsilon_low=0.2, epsilon_high=0.28,
                                           loss_type="dapo", temperature=TEMP)  # fmt: skip
        except TypeError:
            mod = LigerFusedLinearGRPOLoss(beta=KL_COEF, use_ref_model=True, epsilon_low=0.2, epsilon_high=0.28,
                                           temperature=TEMP)  # fmt: skip
        d = h.shape[-1]

        def reset() -> None:
            h.grad = None
            w.grad = None

        def step() -> None:
            out = mod(h.view(b, t, d), w, tgt, inp["mask"].int(), inp["adv"], ref_per_token_logps=inp["ref"],
                      old_per_token_logps=inp["old"])  # fmt: skip
            (out[0] if isinstance(out, tuple) else out).backward()

        ms, peak = run.measure(step, reset, end, warmup=1, reps=3)
        results[name] = ms
        run.row(sec, name, shape, ms=f"{ms:.1f}", peak_extra_GiB=gib(peak),
                extra_beyond_dh_dW_GiB=gib(None if peak is None else peak - grads_bytes),
                tflops=f"{flop / (ms * 1e-3) / 1e12:.0f}", status="ok")  # fmt: skip
    except Exception as e:
        run.row(sec, name, shape, status=f"FAILED: {type(e).__name__}: {str(e)[:160]}")
        traceback.print_exc()
    finally:
        run.free()


# ------------------------------------------------------------------------------------------------ main


def table(run: Run) -> str:
    """One markdown table per section (each with its own columns)."""
    lines = [
        "# Fused kernels on GPU (benchmarks/kernels_gpu.py)",
        "",
        f"Device: {run.device_name}; torch {torch.__version__}; triton "
        f"{'absent' if importlib.util.find_spec('triton') is None else __import__('triton').__version__}; "
        f"liger-kernel {'absent' if importlib.util.find_spec('liger_kernel') is None else 'present'}; "
        f"dry run: {run.dry}; wall {time.monotonic() - run.t0:.0f} s.",
        "",
        "Objective: DAPO clip 0.2/0.28 + k3 KL (0.001, precomputed ref log-probs) + entropy, T=0.7, token-mean, "
        "every token valid. Times: median fwd+bwd (CUDA events, after warm-up); peak_extra: max_memory_allocated minus "
        "the allocation before the step; fused_linear TFLOP/s count 6·N·d·V; ratio = naive time / variant time.",
    ]
    sections: dict[str, list[dict[str, str]]] = {}
    for r in run.rows:
        sections.setdefault(r["section"], []).append(r)
    for name, rows in sections.items():
        keys = ["variant", "shape"]
        for r in rows:
            keys += [k for k in r if k not in keys and k not in ("section", "status")]
        keys.append("status")
        lines += ["", f"## {name}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        lines += ["| " + " | ".join(r.get(k, "") for k in keys) + " |" for r in rows]
    lines += ["", *run.notes]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="every section at tiny shapes on CPU (torch backend)")
    ap.add_argument("--out", type=Path, default=None, help="markdown output path")
    ap.add_argument("--budget", type=float, default=570.0, help="global time box in seconds (default 570)")
    args = ap.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on CPU", flush=True)
        return 2
    run = Run(args.dry_run, args.budget)
    log(f"device {run.device_name}; backend {run.backend}; budget {args.budget:.0f} s")
    for fn in (correct_logits_logprobs, correct_fused, correct_token_logprobs, bench_logits, bench_fused_linear):
        fn(run)
    text = table(run)
    print(text, flush=True)
    out = args.out
    if out is None and os.environ.get("OUT"):
        out = Path(os.environ["OUT"]) / "kernels_gpu.md"
    if out is None and not args.dry_run:
        out = ROOT / "benchmarks" / "results" / "kernels_gpu.md"
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        log(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
