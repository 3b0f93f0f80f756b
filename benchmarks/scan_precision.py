"""What bf16 scan operands cost in precision: error tables by length, and a training comparison.

    python -m benchmarks.scan_precision table --T 4096,32768,131072,524288 --decay-T 4096,32768
    python -m benchmarks.scan_precision training --steps 300 --seeds 1,2,3 --out docs/results/scan_bf16_training.json
    TRITON_INTERPRET=1 python -m benchmarks.scan_precision training --compare triton --steps 20 train.global_batch=2

``table``, the SOE scan: inputs drawn in float64 and rounded to bf16, then run through the chunked CPU
path twice, with bf16 operands (what a bf16 model hands it; the CPU path computes in fp32 and returns
outputs and gradients in bf16) and with the same values in fp32; each against the float64 run on the
same rounded values. Printed per length: the norm-wise relative error of the outputs o and z and of the
gradients of q, k, v, coef and log_lam (one backward with random output gradients). Shape B=1, H=1,
F=D=64 and S=18 terms (the shipped VORT's tiles), decays exp(-1/tau) with tau geometric from 1 to 1e6
tokens and coefficients tau^-0.5 (a power law) times uniform(0.5, 1.5) per token. Beside each pair of
CPU rows, the Triton kernels' o, z, dq, dv, dk and dcoef on the same inputs, emulated on CPU in their order of fp32
operations with their bf16 rounding points (benchmarks/soe_emulation.py; the interpreter computes a bf16
``tl.dot`` as an fp32 one and cannot reach 512k tokens), as stored and before the store's rounding.

``table``, the phasor scan: every token writes one slot (as the root level does in PMNet) M=16 phase
increments pi*tanh(x), x ~ N(0, 1), drawn in float64; the CPU path runs on them rounded to fp32 and to
bf16, and the read phases are compared with the exact float64 sums: the largest circular error
(radians) at each length. bf16 increments drift by a large part of a radian, so PMNet keeps them fp32.
The Triton kernels' forward is emulated on CPU in their order of fp32 operations (the interpreter runs
tl.dot as a plain fp32 matmul, so it cannot show tensor-core rounding), with the spans the launch table
gives at batch 1: once with fp32 IEEE dots (FMA chains, rounding to nearest) and once with the tensor-
core form (three tf32 pieces of the fp32 operand, each piece's sum under a pessimistic model of the
tensor cores' fp32 accumulation, :func:`tensor_core_sum`); both against exact sums of the same fp32
increments, for these increments and for rotating ones, pi*tanh(1 + x) (~1.9 rad per token).

``table``, the decay gradient: the SOE scan's fp32 gradients against its own float64 run, at B=1,
H=4, F=D=64, S=32 with coefficients of both signs and decays log_lam ~ -uniform(0, 3) (what a trainable
log_lam sees; lengths from ``--decay-T``, 4096 and 32768 by default): norm-wise relative errors of the
gradients of q, k, v, coef and log_lam, and the worst single entry of log_lam's. The decay gradient
sums reader and writer positions apart across chunks, which is where fp32 loses precision at long T.

``training``: configs/tiny-vort.yaml on two demo plays (byte shards built in a scratch directory), once
as it is and once with the SOE scan's operands q, k, v, coef and its outputs o, z rounded to bf16 (the
gradients through them too) with the rest of the model fp32, for each seed; the same seed gives the
same initial weights and data in both. ``--compare triton``: the same, fp32, with the SOE scan's Triton
kernels (``model.vort.scan_backend=triton``; on a CPU under TRITON_INTERPRET=1) against the torch chunked
path. Writes every logged loss and a summary (mean loss over the last quarter of the steps per seed and
mode, the paired differences and the reference mode's seed-to-seed spread) as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

import kernels

SOE_NAMES = ("o", "z", "dq", "dk", "dv", "dcoef", "dlog_lam")
REPO = Path(__file__).resolve().parents[1]


def soe_inputs(seq_len: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(q, k, v, coef, log_lam) and the output gradients (d_o, d_z), float64; all but log_lam (which the
    models pass in fp32) rounded to bf16."""
    gen = torch.Generator().manual_seed(seed)
    heads, feat, dim, terms = 1, 64, 64, 18
    f64 = {"generator": gen, "dtype": torch.float64}
    tau = torch.logspace(0, 6, terms, dtype=torch.float64)
    coef = tau.pow(-0.5) * (0.5 + torch.rand(1, seq_len, heads, terms, **f64))
    operands = [
        torch.rand(1, seq_len, heads, feat, **f64) / feat,
        torch.rand(1, seq_len, heads, feat, **f64) / feat,
        torch.randn(1, seq_len, heads, dim, **f64),
        coef,
    ]
    rounded = [x.to(torch.bfloat16).double() for x in operands]
    log_lam = (-1.0 / tau).expand(heads, terms).contiguous()
    seeds = [torch.randn(1, seq_len, heads, dim, **f64), torch.randn(1, seq_len, heads, **f64)]
    return [*rounded, log_lam], [x.to(torch.bfloat16).double() for x in seeds]


def soe_run(inputs: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    """o, z and the gradients of (q, k, v, coef, log_lam), float64 copies, with the operands in
    ``dtype`` (log_lam fp32 unless float64, as the models pass it)."""
    decay_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = [x.to(dtype, copy=True).requires_grad_() for x in inputs[:4]]
    leaves.append(inputs[4].to(decay_dtype, copy=True).requires_grad_())
    o, z, _ = kernels.soe_scan(*leaves, backend="torch")
    torch.autograd.backward([o, z], [s.to(o.dtype) for s in seeds])
    return [o.detach().double(), z.detach().double(), *(x.grad.double() for x in leaves)]


def soe_rows(lengths: Sequence[int]) -> list[dict[str, Any]]:
    """One row per (length, operand dtype, path): relative errors against the float64 run, of the CPU path
    (every output and gradient) and of the Triton kernels emulated (o, z, dq, dv, dk, dcoef: kernel_row)."""
    rows = []
    for seq_len in lengths:
        inputs, seeds = soe_inputs(seq_len)
        exact = soe_run(inputs, seeds, torch.float64)
        for dtype in (torch.bfloat16, torch.float32):
            started = time.perf_counter()
            got = soe_run(inputs, seeds, dtype)
            row: dict[str, Any] = {"T": seq_len, "operands": str(dtype).removeprefix("torch."), "path": "cpu"}
            row.update({n: ((a - e).norm() / e.norm()).item() for n, a, e in zip(SOE_NAMES, got, exact)})
            row["seconds"] = time.perf_counter() - started
            rows.append(row)
            print("  ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
        for dtype in (torch.bfloat16, torch.float32):
            rows.append(kernel_row(inputs, seeds, (*exact[:3], exact[4], exact[3], exact[5]), dtype))
        del exact
    return rows


def kernel_row(
    inputs: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor], exact: Sequence[torch.Tensor], dtype: torch.dtype
) -> dict[str, Any]:
    """The Triton kernels' o, z, dq, dv, dk and dcoef (for the output gradients ``seeds`` = (d_o, d_z) and
    a zero final-state gradient; dcoef as the launches for decays without a gradient make it) with
    ``dtype`` operands, emulated on CPU (benchmarks/soe_emulation.py), against the float64 run ``exact``
    (o, z, dq, dv, dk, dcoef): norm-wise relative errors as stored in ``dtype`` and before
    that rounding, and the span the launch table gives (chunks of 16 tokens; its border states are stored
    in fp32)."""
    from benchmarks.soe_emulation import (
        CAPABILITY,
        CHUNK,
        emulate_coef_grads,
        emulate_forward,
        emulate_key_grads,
        emulate_query_grads,
        emulate_value_grads,
    )
    from kernels.soe.gpu.launches import walk_span

    started = time.perf_counter()
    seq_len = inputs[0].shape[1]
    q, k, v, coef = (x[0, :, 0].to(dtype).float() for x in inputs[:4])
    log_lam = inputs[4][0].float()
    d_out, d_z = seeds[0][0, :, 0].to(dtype).float(), seeds[1][0, :, 0].float()
    got = (*emulate_forward(q, k, v, coef, log_lam, dtype),
           emulate_query_grads(k, v, coef, log_lam, d_out, d_z, dtype),
           emulate_value_grads(q, k, coef, log_lam, d_out, dtype),
           emulate_key_grads(q, v, coef, log_lam, d_out, d_z, dtype),
           emulate_coef_grads(q, k, v, coef, log_lam, d_out, d_z, dtype))  # fmt: skip
    row: dict[str, Any] = {"T": seq_len, "operands": str(dtype).removeprefix("torch."), "path": "triton_emulated"}
    for name, walked, e in zip(("o", "z", "dq", "dv", "dk", "dcoef"), got, exact, strict=True):
        e = e[0, :, 0]
        row[name] = ((walked.to(dtype).double() - e).norm() / e.norm()).item()
        row[f"{name}_before_store"] = ((walked.double() - e).norm() / e.norm()).item()
    span = walk_span(1, seq_len, 1, log_lam.shape[-1], q.shape[-1], v.shape[-1], CHUNK, CAPABILITY)
    row["span_chunks"], row["seconds"] = span, time.perf_counter() - started
    print("  ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    return row


def decay_inputs(seq_len: int, seed: int = 0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """float64 (q, k, v, coef, log_lam) and output gradients for the decay-gradient rows: B=1, H=4,
    F=D=64, S=32, coefficients of both signs and trainable-looking decays log_lam ~ -uniform(0, 3)."""
    gen = torch.Generator().manual_seed(seed)
    heads, feat, dim, terms = 4, 64, 64, 32
    f64 = {"generator": gen, "dtype": torch.float64}
    inputs = [
        torch.rand(1, seq_len, heads, feat, **f64) / feat,
        torch.rand(1, seq_len, heads, feat, **f64) / feat,
        torch.randn(1, seq_len, heads, dim, **f64),
        torch.randn(1, seq_len, heads, terms, **f64),
        -torch.rand(heads, terms, **f64) * 3,
    ]
    return inputs, [torch.randn(1, seq_len, heads, dim, **f64), torch.randn(1, seq_len, heads, **f64)]


def decay_rows(lengths: Sequence[int]) -> list[dict[str, Any]]:
    """Per length, the fp32 gradients of the SOE scan against its float64 run on decay_inputs: norm-wise
    relative errors, and the worst single entry of the log_lam gradient (where fp32 loses most: the
    reader and writer position sums of d log_lam are taken apart across chunks)."""
    rows = []
    for seq_len in lengths:
        started = time.perf_counter()
        inputs, seeds = decay_inputs(seq_len)
        exact, got = (soe_run(inputs, seeds, dtype)[2:] for dtype in (torch.float64, torch.float32))
        row: dict[str, Any] = {"T": seq_len}
        row.update({n: ((a - e).norm() / e.norm()).item() for n, a, e in zip(SOE_NAMES[2:], got, exact)})
        row["dlog_lam_worst"] = ((got[4] - exact[4]).abs() / exact[4].abs()).max().item()
        row["seconds"] = time.perf_counter() - started
        rows.append(row)
        print("  ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    return rows


TWO_PI_F32 = 6.2831854820251465  # 2*pi rounded to fp32, the first part of the kernels' subtraction
TWO_PI_REST = -1.7484555314695172e-07  # 2*pi minus it, the second part
INV_TWO_PI_F32 = 0.15915494
CHUNK = 16  # tokens per chunk of the phasor kernels (kernels/phasor/triton.py's table)


def _wrap(x: torch.Tensor) -> torch.Tensor:
    """kernels.span.wrap_phase in fp32: the product and floor in fp32, each part of 2*pi subtracted in
    one fused multiply-add (exact product, one rounding)."""
    k = torch.floor(x * INV_TWO_PI_F32).double()
    y = (x.double() - TWO_PI_F32 * k).float()
    y = (y.double() - TWO_PI_REST * k).float()
    y = torch.where(y < 0, y + TWO_PI_F32, y)
    return torch.where(y >= TWO_PI_F32, y - TWO_PI_F32, y)


def _toward_zero(x: torch.Tensor) -> torch.Tensor:
    """float64 -> fp32, rounded toward zero."""
    f = x.float()
    return torch.where(f.double().abs() > x.abs(), torch.nextafter(f, torch.zeros_like(f)), f)


def tf32_pieces(x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """kernels.phasor.triton._tf32_pieces in torch: fp32 x as hi + mid + lo, each exact in tf32."""
    hi = (x.view(torch.int32) & -8192).view(torch.float32)
    mid = ((x - hi).view(torch.int32) & -8192).view(torch.float32)
    return hi, mid, x - hi - mid


def tensor_core_sum(acc: torch.Tensor, rows: torch.Tensor, k: int = 8) -> torch.Tensor:
    """acc [..., M] plus the rows [..., K, M] (tf32-exact, selected by a 0/1 matrix, so every product is
    exact) as a model of a tensor core's fp32 accumulation, one mma of ``k`` rows at a time: the
    accumulator and the products aligned to the largest of them, each truncated to fp32's 24 bits at
    that exponent, summed, and the sum rounded toward zero (no guard bits: the pessimistic reading of
    Fasi et al. 2021, "Numerical behaviour of NVIDIA tensor cores", for the A100)."""
    for first in range(0, rows.shape[-2], k):
        terms = torch.cat([acc[..., None, :], rows[..., first : first + k, :]], -2).double()
        _, exponent = torch.frexp(terms.abs().amax(-2, keepdim=True))
        unit = torch.ldexp(torch.ones_like(terms[..., :1, :]), exponent - 24)
        acc = _toward_zero((torch.trunc(terms / unit) * unit).sum(-2))
    return acc


def select_sum(acc: torch.Tensor, rows: torch.Tensor, split: bool) -> torch.Tensor:
    """One product of the phasor kernels, ``acc + select @ x`` where ``rows`` holds the rows of x that
    the 0/1 matrix selects (zeros elsewhere): split, the kernels' three tf32 pieces on tensor cores
    (smallest first); otherwise the fp32 IEEE dot's FMA chain, rounding to nearest after each row."""
    if split:
        hi, mid, lo = (tensor_core_sum(torch.zeros_like(acc), piece) for piece in tf32_pieces(rows))
        return acc + (hi + (lo + mid))
    for j in range(rows.shape[-2]):
        acc = acc + rows[..., j, :]
    return acc


def kernel_reads(delta: torch.Tensor, span: int, split: bool) -> torch.Tensor:
    """The reads of the Triton phasor kernels' forward for one slot written by every token, emulated on
    CPU in their order of fp32 operations: fp32 ``delta`` [T, M] cut into spans of ``span`` tokens and
    chunks of CHUNK; per span the wrapped sum of its chunks' increments, the span pass (a wrapped prefix
    sum), then per chunk read = wrap(state + earlier increments of the chunk), state = wrap(state + chunk
    sum). All spans run at once, the chunks of a span in turn."""
    seq_len, width = delta.shape
    n_spans = -(-seq_len // span)
    x = torch.zeros(n_spans * span, width)
    x[:seq_len] = delta
    x = x.view(n_spans, span // CHUNK, CHUNK, width)
    zero = torch.zeros(n_spans, width)
    sums = zero
    for c in range(x.shape[1]):
        sums = _wrap(select_sum(sums, x[:, c], split))
    state = torch.zeros(n_spans, width)
    for i in range(1, n_spans):
        state[i] = _wrap(state[i - 1] + sums[i - 1])
    earlier = torch.tril(torch.ones(CHUNK, CHUNK), -1)[:, :, None]  # [t, j, 1]: j < t
    reads = torch.empty_like(x)
    for c in range(x.shape[1]):
        inner = select_sum(torch.zeros(n_spans, CHUNK, width), x[:, c, None] * earlier, split)
        slot_rows = torch.zeros(n_spans, CHUNK, CHUNK, width)  # the one-hot read of slot 0 of 16
        slot_rows[:, :, 0] = state[:, None]
        reads[:, c] = _wrap(select_sum(inner, slot_rows, split))
        state = _wrap(state + select_sum(zero, x[:, c], split))
    return reads.view(-1, width)[:seq_len]


def _circular(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest circular distance (radians) between phases a and b."""
    return (torch.remainder(a.double() - b.double() + torch.pi, 2 * torch.pi) - torch.pi).abs().max().item()


def phase_rows(lengths: Sequence[int], width: int = 16) -> list[dict[str, Any]]:
    """Largest circular error (radians) of the phases read after T tokens: the CPU path on fp32 and on
    bf16 increments against exact sums of the float64 ones; the Triton kernels (emulated, fp32 IEEE
    dots and the tf32 split on tensor cores) against exact sums of the same fp32 increments, for the
    zero-mean increments and for rotating ones (pi*tanh(1 + x), ~1.9 rad per token on average)."""
    from kernels.phasor.triton import phasor_launches

    rows = []
    gen = torch.Generator().manual_seed(0)
    longest = max(lengths)
    noise = torch.randn(1, longest, 1, width, generator=gen, dtype=torch.float64)
    increments = torch.pi * torch.tanh(noise)
    exact = torch.remainder(increments.cumsum(1) - increments, 2 * torch.pi)  # what each token reads
    slots = torch.zeros(1, longest, 1, dtype=torch.int32)
    reads = {
        dtype: kernels.phasor_scan(increments.to(dtype), slots, 1, backend="torch")[0].double()
        for dtype in (torch.float32, torch.bfloat16)
    }
    kinds = {"": increments[0, :, 0].float(), "rotating_": (torch.pi * torch.tanh(1 + noise[0, :, 0])).float()}
    for seq_len in lengths:
        started = time.perf_counter()
        row: dict[str, Any] = {"T": seq_len}
        for dtype, read in reads.items():
            row[f"{str(dtype).removeprefix('torch.')}_max_rad"] = _circular(read[:, :seq_len], exact[:, :seq_len])
        span, _ = phasor_launches(1, seq_len, 1, width, 1, torch.float32, 90)
        for kind, fp32 in kinds.items():
            delta = fp32[:seq_len]
            exact32 = torch.remainder(delta.double().cumsum(0) - delta.double(), 2 * torch.pi)
            for name, split in (("ieee", False), ("tf32_split", True)):
                row[f"{kind}triton_{name}_max_rad"] = _circular(kernel_reads(delta, span, split), exact32)
        row["span"], row["seconds"] = span, time.perf_counter() - started
        rows.append(row)
        print("  ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    return rows


@contextlib.contextmanager
def bf16_scan_operands() -> Iterator[None]:
    """Within the block, kernels.soe_scan sees q, k, v and coef rounded to bf16 and returns o and z
    rounded to bf16 (gradients through them rounded alike): a bf16 model's scan interface in an fp32
    model. Models call the scan as ``kernels.soe_scan``, so the wrapper is what they get."""
    real = kernels.soe_scan

    def rounded(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, coef: torch.Tensor, *args: Any, **kwargs: Any):
        q, k, v, coef = (x.to(torch.bfloat16).to(x.dtype) for x in (q, k, v, coef))
        o, z, final = real(q, k, v, coef, *args, **kwargs)
        return o.to(torch.bfloat16).to(o.dtype), z.to(torch.bfloat16).to(z.dtype), final

    kernels.soe_scan = rounded
    try:
        yield
    finally:
        kernels.soe_scan = real


def train_losses(shards: str, run_dir: Path, seed: int, steps: int, overrides: Sequence[str]) -> list[float]:
    """Train configs/tiny-vort.yaml in this process; the loss of every step."""
    from pretrain.config import load_config
    from pretrain.trainer import train

    cfg = load_config(
        REPO / "configs" / "tiny-vort.yaml",
        [
            f"data.train=[{{path: {shards}}}]",
            "data.valid=[]",
            f"run.dir={run_dir}",
            f"run.seed={seed}",
            f"train.steps={steps}",
            "train.log_every=1",
            *overrides,
        ],
    )
    if train(cfg) != 0:
        raise RuntimeError(f"training run {run_dir} failed")
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["train/loss"] for r in records if "train/loss" in r]


@dataclasses.dataclass(frozen=True)
class Mode:
    """One arm of a training comparison: its name, whether the scan operands are rounded to bf16, and
    the config overrides it adds."""

    name: str
    bf16_operands: bool = False
    overrides: tuple[str, ...] = ()


# --compare: the reference arm first. "triton" runs the SOE scan's Triton kernels (under TRITON_INTERPRET=1
# on CPU) against the torch chunked path, both fp32.
COMPARISONS = {
    "bf16": (Mode("fp32"), Mode("bf16_scan_operands", bf16_operands=True)),
    "triton": (Mode("torch", overrides=("model.vort.scan_backend=torch",)),
               Mode("triton", overrides=("model.vort.scan_backend=triton",))),
}  # fmt: skip


def training(seeds: Sequence[int], steps: int, overrides: Sequence[str], compare: str = "bf16") -> dict[str, Any]:
    """Loss curves of the two arms of ``compare`` (COMPARISONS) per seed, and their summary."""
    from data_pipeline.build import build_shards

    modes = COMPARISONS[compare]
    curves: dict[str, dict[str, list[float]]] = {mode.name: {} for mode in modes}
    with tempfile.TemporaryDirectory() as scratch:
        plays = [str(REPO / "data" / "demo" / "train" / n) for n in ("hamlet.txt", "macbeth.txt")]
        build_shards(plays, f"{scratch}/train", tokenizer="bytes", shard_tokens=60_000)
        for seed in seeds:
            for mode in modes:
                started = time.perf_counter()
                with bf16_scan_operands() if mode.bf16_operands else contextlib.nullcontext():
                    curves[mode.name][str(seed)] = train_losses(
                        f"{scratch}/train",
                        Path(scratch) / f"{mode.name}-{seed}",
                        seed,
                        steps,
                        [*mode.overrides, *overrides],
                    )
                print(
                    f"seed {seed} {mode.name}: {time.perf_counter() - started:.0f} s, "
                    f"final loss {curves[mode.name][str(seed)][-1]:.4f}",
                    flush=True,
                )
    return {
        "compare": compare,
        "seeds": list(seeds),
        "steps": steps,
        "overrides": list(overrides),
        "curves": curves,
        "summary": summarise(curves, steps),
    }


def summarise(curves: dict[str, dict[str, list[float]]], steps: int) -> dict[str, Any]:
    """Mean loss over the last quarter of the steps per mode and seed; paired (second - first mode)
    differences per seed, and the standard deviation across seeds of the first (reference) mode's
    means (the seed noise)."""
    tail = max(1, steps // 4)
    means = {mode: {s: statistics.fmean(c[-tail:]) for s, c in by_seed.items()} for mode, by_seed in curves.items()}
    first, second = curves
    ref, other = means[first], means[second]
    paired = {s: other[s] - ref[s] for s in ref}
    worst_step = {s: max(abs(a - b) for a, b in zip(curves[first][s], curves[second][s])) for s in ref}
    return {
        "tail_steps": tail,
        "tail_mean_loss": means,
        "paired_difference": paired,
        "seed_std_reference": statistics.stdev(ref.values()) if len(ref) > 1 else None,
        "largest_stepwise_difference": worst_step,
    }


def _ints(text: str) -> list[int]:
    return [int(t) for t in text.split(",") if t]


def main(argv: Sequence[str] | None = None) -> Any:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    table = commands.add_parser("table", help="SOE output and gradient errors, decay gradients, phase drift by length")
    table.add_argument("--T", default="4096,32768,131072,524288", type=_ints, help="comma-separated lengths")
    table.add_argument("--decay-T", default="4096,32768", type=_ints, help="lengths of the decay-gradient rows")
    table.add_argument("--out", default=None, help="also write the rows as JSON here")
    run = commands.add_parser(
        "training",
        help="tiny-vort loss curves, fp32 against bf16-rounded scan operands "
        "(--compare bf16) or the Triton scan against the torch one (--compare triton)",
    )
    run.add_argument("--compare", default="bf16", choices=sorted(COMPARISONS))
    run.add_argument("--seeds", default="1,2,3", type=_ints)
    run.add_argument("--steps", default=300, type=int)
    run.add_argument("--out", default=None, help="write the curves and summary as JSON here")
    run.add_argument("overrides", nargs="*", help="dotted config overrides, e.g. data.seq_len=128")
    args = parser.parse_args(argv)
    if args.command == "table":
        if not args.T or min(args.T) < 1 or not args.decay_T or min(args.decay_T) < 1:
            parser.error(f"--T and --decay-T need positive lengths, got {args.T} and {args.decay_T}")
        result: Any = {"soe": soe_rows(args.T), "soe_decay": decay_rows(args.decay_T), "phasor": phase_rows(args.T)}
    else:
        if not args.seeds or args.steps < 4:
            parser.error("training needs at least one seed and 4 steps")
        if args.compare == "triton" and not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
            parser.error("--compare triton on a CPU needs TRITON_INTERPRET=1 in the environment")
        result = training(args.seeds, args.steps, args.overrides, args.compare)
        print(json.dumps(result["summary"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return result


if __name__ == "__main__":
    main()
