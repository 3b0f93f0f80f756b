"""The first command on a GPU: the Triton scans checked, timed and profiled on the device.

    python -m benchmarks.gpu_kernels [--T 16384,65536] [--B 1 --H 8 --F 64 --D 64 --S 32]
                                     [--train vort-125m,pmnet-119m --train-T 16384] [--json gpu.json]

1. Correctness at the production tiles (12 heads, 18 terms, 64-wide features and values; PMNet's
   4-level tree, 64 wide) with document starts and initial states, the SOE scan, the phasor scan,
   the sequence-parallel entering-state read and VORT's fused feature map, fp32 and bf16, against the
   float64 reference on the same rounded inputs (benchmarks/gpu_checks.py).
2. Per Triton kernel, device milliseconds of one layer's scan (forward + backward, batch 1,
   --kernel-T tokens) of each --train config with fp32 and with bf16 inputs (torch profiler), beside
   the roofline's modelled milliseconds per layer for the replaced span kernels and the kernels
   as built (benchmarks/roofline.py).
3. Forward and forward+backward in bf16 for every --T next to torch's causal SDPA and, when
   installed, flash-linear-attention's chunk_simple_gla.
4. Per --train config, at --train-T tokens in bf16: timed training steps (tokens/s, MFU against
   --peak-tflops, peak memory beside pretrain.plan's prediction), and one profiled forward and
   backward: the scans' share of its kernel time, its host syncs (torch.cuda.set_sync_debug_mode), and
   whether two runs from the same weights and tokens give bitwise-equal loss and gradients.
5. With two GPUs or more, one NCCL sequence-parallel step of the first --train config over 2 GPUs,
   its loss beside the one-GPU loss.

Prints the tables and writes everything to --json. Exit status: 0 when every check passes, 1 when a
correctness check fails or two runs differ bitwise, 2 when there is no CUDA device (nothing is run).
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
from model import family
from model.config import ModelConfig

COLUMNS = ("soe_fwd", "soe_fwdbwd", "phasor_fwd", "phasor_fwdbwd", "sdpa_fwd", "sdpa_fwdbwd", "fla_fwd", "fla_fwdbwd")
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
MODEL_DIR = CONFIG_DIR / "model"
NO_GPU = 2  # exit status without a CUDA device


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
    fla = _fla_simple_gla() if torch.device(dev).type == "cuda" else None  # fla's kernels launch on a GPU only
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
    """flash-linear-attention's chunk_simple_gla, or None where fla is not installed (the `bench` extra)."""
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
    p.add_argument("--T", default="16384,65536", help="comma-separated sequence lengths of the SDPA comparison")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--F", type=int, default=64, help="feature dim of the SOE scan and SDPA head dim")
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--S", type=int, default=32)
    p.add_argument("--skip-check", action="store_true", help="skip the correctness checks (step 1)")
    p.add_argument("--check-T", type=int, default=2048, help="tokens of the correctness checks")
    p.add_argument("--kernel-T", type=int, default=65536, help="tokens of the per-kernel timings (step 2)")
    p.add_argument("--train", default="vort-125m,pmnet-119m", help="configs/<name>.yaml to time training steps of")
    p.add_argument("--train-T", type=int, default=16384, help="tokens per training sequence (batch 1)")
    p.add_argument("--steps", type=int, default=3, help="timed training steps per config")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="the accelerator's dense bf16 peak")
    p.add_argument("--json", type=Path, default=Path("gpu_kernels.json"), help="where to write all results")
    args = p.parse_args(argv)
    try:
        args.T = [int(t) for t in args.T.split(",") if t]
    except ValueError:
        p.error(f"--T must be comma-separated integers, got {args.T!r}")
    args.train = [c for c in args.train.split(",") if c]
    missing = [c for c in args.train if not (CONFIG_DIR / f"{c}.yaml").exists()]
    if missing:
        p.error(f"--train: no configs/{missing[0]}.yaml")
    if args.train_T < 2 or args.steps < 1:
        p.error("--train-T must be >= 2 and --steps >= 1")
    if args.check_T < 2 or args.kernel_T < 1 or any(t < 1 for t in args.T):
        p.error("--check-T must be >= 2, --kernel-T and every --T >= 1")
    return args


def _model_config(config: str) -> ModelConfig:
    from pretrain.config import load_config

    return load_config(CONFIG_DIR / f"{config}.yaml", []).model


def kernel_rows(config: str, seq_len: int) -> list[dict]:
    """Step 2 for one config: per kernel, fp32 and bf16 milliseconds, and the roofline per layer."""
    from benchmarks import roofline
    from benchmarks.gpu_checks import scan_kernel_times

    cfg = _model_config(config)
    if family(cfg.kind).scan_shape(cfg) is None:
        return []
    fp32, bf16 = (scan_kernel_times(cfg, seq_len, dt) for dt in (torch.float32, torch.bfloat16))
    rows = [{"config": config, "kernel": k, "fp32_ms": fp32.get(k, math.nan), "bf16_ms": bf16.get(k, math.nan)}
            for k in sorted(fp32.keys() | bf16.keys())]
    model = {d: roofline.step_model(config, cfg, d, seq_len) for d in (roofline.SPAN, roofline.BUILT)}
    per_layer = {d: m["scan_ms"] / m["scan_layers"] for d, m in model.items()}
    rows.append({"config": config, "kernel": "total", "fp32_ms": sum(fp32.values()), "bf16_ms": sum(bf16.values()),
                 "roofline_span_ms": per_layer[roofline.SPAN], "roofline_built_ms": per_layer[roofline.BUILT]})
    return rows


def _print_checks(rows: list[dict]) -> bool:
    for r in rows:
        print(f"check {r['case']:13} {r['dtype']:9} fwd rel err {r['fwd_err']:.1e}  grad rel err {r['grad_err']:.1e}  "
              f"{'ok' if r['passed'] else 'FAIL'}")
    return all(r["passed"] for r in rows)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(f"no CUDA device: nothing checked (this script is for a GPU machine); exit status {NO_GPU}")
        return NO_GPU
    from benchmarks.gpu_checks import check_production, nccl_sequence_parallel, step_report

    shape = f"B={args.B} H={args.H} F={args.F} D={args.D} S={args.S}"
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {shape}", flush=True)
    report: dict[str, object] = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": shape}
    report["checks"] = [] if args.skip_check else check_production(seq_len=args.check_T)
    ok = _print_checks(report["checks"])
    print(f"\nper kernel, one layer's scan forward+backward, batch 1, {args.kernel_T} tokens (ms; roofline per layer)")
    report["kernels"] = [r for c in args.train for r in kernel_rows(c, args.kernel_T)]
    for r in report["kernels"]:
        model = (f"  roofline span {r['roofline_span_ms']:.2f}  built {r['roofline_built_ms']:.2f}"
                 if "roofline_span_ms" in r else "")
        times = f"fp32 {r['fp32_ms']:9.3f}  bf16 {r['bf16_ms']:9.3f}"
        print(f"{r['config']:>12} {r['kernel']:32} {times}{model}", flush=True)
    print(f"\n{'T':>7} " + " ".join(f"{c + '_ms':>16}" for c in COLUMNS))
    report["timings"] = []
    for seq_len in args.T:
        row = time_row(args, seq_len)
        report["timings"].append(row)
        print(f"{seq_len:7d} " + " ".join(f"{row[c]:16.2f}" for c in COLUMNS), flush=True)
    print(f"\n{'config':>12} {'T':>7} {'tokens/s':>10} {'MFU':>6} {'peak GiB':>9} {'plan GiB':>9} {'scan share':>10} "
          f"{'syncs':>6} {'bitwise':>8}")
    report["training"] = []
    for config in args.train:
        row = train_steps(config, args.train_T, args.steps, "cuda", args.peak_tflops)
        row |= step_report(config, _model_config(config), args.train_T)
        report["training"].append(row)
        same = row["loss_bitwise_equal"] and not row["grads_differing"]
        ok &= same
        print(f"{config:>12} {args.train_T:7d} {row['tokens_per_s']:10.0f} {row['mfu']:6.1%} {row['peak_gib']:9.2f} "
              f"{row['plan_gib']:9.2f} {row['scan_share']:10.1%} {row['host_syncs']:6d} {'yes' if same else 'NO':>8}",
              flush=True)
        for site, n in sorted(row["sync_sites"].items(), key=lambda x: -x[1])[:5]:
            print(f"{'':>12} sync x{n} at {site}")
    if args.train:
        report["sequence_parallel"] = nccl_sequence_parallel(_model_config(args.train[0]), args.train_T)
        print(f"\nNCCL sequence-parallel step ({args.train[0]}, 2 GPUs): {report['sequence_parallel']}")
    args.json.write_text(json.dumps(report, indent=1))
    print(f"wrote {args.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
