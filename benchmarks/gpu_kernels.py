"""GPU check of the Triton scans: correctness against the reference, then bf16 timings against SDPA.

    python -m benchmarks.gpu_kernels [--T 4096,16384,65536,131072] [--B 1 --H 8 --F 64 --D 64 --S 32]
                                     [--train vort-125m,pmnet-119m --train-T 16384] [--json gpu.json]

Step 1 runs each Triton kernel at a small shape in fp32 and in bf16 and compares outputs and gradients
with the float64 sequential reference. Step 2 times forward and forward+backward in bf16 for every T,
next to torch's causal scaled_dot_product_attention (FlashAttention on recent GPUs) with the same
B, H and head dimension F, and flash-linear-attention's chunk_simple_gla when fla is installed. Step 3
times a few training steps (bf16 weights, AdamW, batch 1) of each --train config at --train-T tokens:
tokens/s, MFU against --peak-tflops, and peak memory next to pretrain.plan's prediction for one rank
without activation checkpointing. Prints the tables and writes everything to --json; exits with
status 1 if a check fails. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from kernels import phasor_scan, soe_scan
from kernels.testing import angle_err, phasor_inputs, phasor_run, rel_err, soe_inputs, soe_run

COLUMNS = ("soe_fwd", "soe_fwdbwd", "phasor_fwd", "phasor_fwdbwd", "sdpa_fwd", "sdpa_fwdbwd", "fla_fwd", "fla_fwdbwd")
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
TOLERANCES = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (3e-2, 6e-2)}


def check_correctness(
    device: str = "cuda",
    dtypes: Sequence[torch.dtype] = (torch.float32, torch.bfloat16),
    seq_len: int = 300,
    width: int = 32,
    n_terms: int = 8,
) -> list[tuple[str, float, float, bool]]:
    """(case, worst forward error, worst gradient error, passed) for each scan and dtype."""
    results = []
    soe = soe_inputs(2, seq_len, 2, width, width, n_terms, True, seed=0)
    soe_ref, soe_ref_grads = soe_run(soe, "reference", dtype=torch.float64)
    ph, n_slots = phasor_inputs(2, seq_len, 3, 2 * width, 4, True, seed=0)
    (ph_read, ph_final), ph_ref_grads = phasor_run(ph, n_slots, "reference", dtype=torch.float64)
    for dtype in dtypes:
        fwd_tol, grad_tol = TOLERANCES[dtype]
        outs, grads = soe_run(soe, "triton", dtype=dtype, device=device)
        fwd = max(rel_err(a, b) for a, b in zip(outs, soe_ref))
        bwd = max(rel_err(grads[n], soe_ref_grads[n]) for n in grads)
        results.append((f"soe {str(dtype)[6:]}", fwd, bwd, fwd <= fwd_tol and bwd <= grad_tol))
        (read, final), grads = phasor_run(ph, n_slots, "triton", dtype=dtype, device=device)
        # bf16 inputs round the increments themselves; compare phases in radians against 2*pi.
        fwd = max(angle_err(read, ph_read), angle_err(final, ph_final)) / (2 * torch.pi)
        bwd = max(rel_err(grads[n], ph_ref_grads[n]) for n in grads)
        results.append((f"phasor {str(dtype)[6:]}", fwd, bwd, fwd <= fwd_tol and bwd <= grad_tol))
    return results


def cuda_ms(fn: Callable[[], object], repeats: int = 5) -> float:
    """Median milliseconds of ``fn`` on the GPU after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def _fwd_bwd(run: Callable[[], Sequence[torch.Tensor]], leaves: Sequence[torch.Tensor]) -> Callable[[], None]:
    def call() -> None:
        for x in leaves:
            x.grad = None
        sum(o.float().sum() for o in run() if o is not None).backward()

    return call


def time_row(
    args: argparse.Namespace,
    seq_len: int,
    dev: str = "cuda",
    bf: torch.dtype = torch.bfloat16,
    timer: Callable[[Callable[[], object]], float] = cuda_ms,
) -> dict[str, float]:
    """Forward and forward+backward milliseconds of both scans and of SDPA at one length (bf16 by default)."""
    b, h, f, d, s = args.B, args.H, args.F, args.D, args.S
    q = (torch.rand(b, seq_len, h, f, device=dev) / f).to(bf).requires_grad_()
    k = (torch.rand(b, seq_len, h, f, device=dev) / f).to(bf).requires_grad_()
    v = torch.randn(b, seq_len, h, d, device=dev, dtype=bf, requires_grad=True)
    coef = torch.randn(b, seq_len, h, s, device=dev, dtype=bf, requires_grad=True)
    log_lam = (-torch.rand(h, s, device=dev) * 3).requires_grad_()
    soe_leaves = (q, k, v, coef, log_lam)

    def soe():
        return soe_scan(q, k, v, coef, log_lam, backend="triton")[:2]

    delta = torch.randn(b, seq_len, 3, 64, device=dev, dtype=bf, requires_grad=True)
    slots = torch.stack(
        [off + torch.randint(0, 4**lvl, (b, seq_len), device=dev) for lvl, off in ((1, 1), (2, 5), (3, 21))], -1
    )

    def phasor():
        return phasor_scan(delta, slots, 85, output_final_state=True, backend="triton")

    qs, ks, vs = (torch.randn(b, h, seq_len, f, device=dev, dtype=bf, requires_grad=True) for _ in range(3))

    def sdpa():
        return (torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True),)

    row = {"T": seq_len}
    with torch.no_grad():
        row["soe_fwd"] = timer(soe)
        row["phasor_fwd"] = timer(phasor)
        row["sdpa_fwd"] = timer(sdpa)
    row["soe_fwdbwd"] = timer(_fwd_bwd(soe, soe_leaves))
    row["phasor_fwdbwd"] = timer(_fwd_bwd(phasor, (delta,)))
    row["sdpa_fwdbwd"] = timer(_fwd_bwd(sdpa, (qs, ks, vs)))
    fla = _fla_simple_gla()
    if fla is None:
        row["fla_fwd"] = row["fla_fwdbwd"] = math.nan
    else:  # one exponential decay per head: fla's chunked retention, the usual linear-attention yardstick
        qf, kf, vf = (torch.randn(b, seq_len, h, f, device=dev, dtype=bf, requires_grad=True) for _ in range(3))
        g = torch.full((b, seq_len, h), -0.01, device=dev)

        def gla():
            return (fla(qf, kf, vf, g)[0],)

        with torch.no_grad():
            row["fla_fwd"] = timer(gla)
        row["fla_fwdbwd"] = timer(_fwd_bwd(gla, (qf, kf, vf)))
    return row


def _fla_simple_gla() -> Callable | None:
    """flash-linear-attention's chunk_simple_gla, or None where fla is not installed."""
    try:
        from fla.ops.simple_gla import chunk_simple_gla
    except ImportError:
        return None
    return chunk_simple_gla


def train_steps(
    config: str, seq_len: int, steps: int, dev: str, peak_tflops: float, predict: bool = True
) -> dict[str, float | str]:
    """Time ``steps`` training steps (after one warm-up step) of configs/<config>.yaml at batch 1 and
    ``seq_len`` tokens: bf16 weights on a GPU (fp32 elsewhere), AdamW, random tokens. Returns tokens/s,
    MFU (model FLOPs per token x tokens/s over ``peak_tflops``), peak memory and, if ``predict``,
    pretrain.plan's bytes for one rank without activation checkpointing."""
    from model import build_model
    from pretrain.config import load_config

    overrides = [f"data.seq_len={seq_len}", "train.micro_batch=1", "engine.kind=single"]
    cfg = load_config(CONFIG_DIR / f"{config}.yaml", overrides)
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = build_model(cfg.model).to(dev, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.model.vocab_size, (1, seq_len + 1), device=dev)

    def step() -> None:
        loss, _ = model.loss(tokens[:, :-1], tokens[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    rate = seq_len / seconds
    row: dict[str, float | str] = {
        "config": config,
        "T": seq_len,
        "step_s": seconds,
        "tokens_per_s": rate,
        "mfu": model.flops_per_token(seq_len) * rate / (peak_tflops * 1e12),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else math.nan,
        "plan_gib": math.nan,
    }
    if predict:
        from pretrain.plan.memory import plan

        row["plan_gib"] = plan(cfg, world=1, model=model.float().cpu())[0].total / 2**30
    return row


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", default="4096,16384,65536,131072", help="comma-separated sequence lengths")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--F", type=int, default=64, help="feature dim of the SOE scan and SDPA head dim")
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--S", type=int, default=32)
    p.add_argument("--skip-check", action="store_true", help="time only")
    p.add_argument("--train", default="vort-125m,pmnet-119m", help="configs/<name>.yaml to time training steps of")
    p.add_argument("--train-T", type=int, default=16384, help="tokens per training sequence (batch 1)")
    p.add_argument("--steps", type=int, default=3, help="timed training steps per config")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the accelerator's dense bf16 peak")
    p.add_argument("--json", type=Path, default=Path("gpu_kernels.json"), help="where to write all results")
    args = p.parse_args(argv)
    args.T = [int(t) for t in args.T.split(",") if t]
    args.train = [c for c in args.train.split(",") if c]
    if args.train_T < 2 or args.steps < 1:
        p.error("--train-T must be >= 2 and --steps >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (this script is for a GPU machine)")
        return 0
    shape = f"B={args.B} H={args.H} F={args.F} D={args.D} S={args.S}"
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {shape}")
    ok = True
    report: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": shape}
    checks = [] if args.skip_check else check_correctness()
    for case, fwd, bwd, passed in checks:
        ok &= passed
        print(f"check {case:16} fwd rel err {fwd:.1e}  grad rel err {bwd:.1e}  {'ok' if passed else 'FAIL'}")
    report["checks"] = [{"case": c, "fwd_err": f, "grad_err": g, "passed": p} for c, f, g, p in checks]
    print(f"{'T':>7} " + " ".join(f"{c + '_ms':>16}" for c in COLUMNS))
    report["timings"] = []
    for seq_len in args.T:
        row = time_row(args, seq_len)
        report["timings"].append(row)
        print(f"{seq_len:7d} " + " ".join(f"{row[c]:16.2f}" for c in COLUMNS), flush=True)
    print(f"{'config':>12} {'T':>7} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'plan GiB':>9}")
    report["training"] = []
    for config in args.train:
        row = train_steps(config, args.train_T, args.steps, "cuda", args.peak_tflops)
        report["training"].append(row)
        print(
            f"{config:>12} {args.train_T:7d} {row['tokens_per_s']:10.0f} {row['mfu']:6.1%} "
            f"{row['peak_gib']:9.2f} {row['plan_gib']:9.2f}",
            flush=True,
        )
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
