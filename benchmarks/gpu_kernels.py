"""GPU check of the Triton scans: correctness against the reference, then bf16 timings against SDPA.

    python benchmarks/gpu_kernels.py [--T 4096,16384,65536,131072] [--B 1 --H 8 --F 64 --D 64 --S 32]

Step 1 runs each Triton kernel at a small shape in fp32 and in bf16 and compares outputs and gradients
with the float64 sequential reference. Step 2 times forward and forward+backward in bf16 for every T,
next to torch's causal scaled_dot_product_attention (FlashAttention on recent GPUs) with the same
B, H and head dimension F. Prints one short table; exits with status 1 if a check fails. Without a
GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

import torch

from kernels import phasor_scan, soe_scan
from kernels.testing import angle_err, phasor_inputs, phasor_run, rel_err, soe_inputs, soe_run

COLUMNS = ("soe_fwd", "soe_fwdbwd", "phasor_fwd", "phasor_fwdbwd", "sdpa_fwd", "sdpa_fwdbwd")
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
    args = p.parse_args(argv)
    args.T = [int(t) for t in args.T.split(",") if t]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check (this script is for a GPU machine)")
        return 0
    shape = f"B={args.B} H={args.H} F={args.F} D={args.D} S={args.S}"
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  {shape}")
    ok = True
    if not args.skip_check:
        for case, fwd, bwd, passed in check_correctness():
            ok &= passed
            print(f"check {case:16} fwd rel err {fwd:.1e}  grad rel err {bwd:.1e}  {'ok' if passed else 'FAIL'}")
    print(f"{'T':>7} " + " ".join(f"{c + '_ms':>16}" for c in COLUMNS))
    for seq_len in args.T:
        row = time_row(args, seq_len)
        print(f"{seq_len:7d} " + " ".join(f"{row[c]:16.2f}" for c in COLUMNS), flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
