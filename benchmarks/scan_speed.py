"""Benchmark of the scans against causal scaled_dot_product_attention, on the current machine.

    python -m benchmarks.scan_speed [--T 1024,4096,16384] [--ops soe,phasor] [--modes fwd,fwdbwd] [--out bench.json]

Prints one table and writes JSON. Every row is the best of ``--repeats`` runs after a warm-up, and the
runs of a row alternate between the scan, causal SDPA (same B, H and head dimension F) and a 2048^3
fp32 matmul, so all three see the same machine: the achieved GFLOP/s is read against that matmul rate.
FLOPs are the products of the chunked algorithm (see :func:`soe_flops`), not of the sequential recurrence.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import time
from collections.abc import Callable, Sequence

import torch

from kernels.phasor import phasor_scan
from kernels.soe import soe_scan

CONFIG_KEYS = ("B", "H", "F", "D", "S", "chunk", "L", "M", "branching", "backend")


def best_times(fns: Sequence[Callable[[], object]], repeats: int, long_s: float = 5.0) -> list[float]:
    """Smallest wall time of each call over ``repeats`` rounds, after one warm-up call each. The rounds
    alternate between the calls, so that the machine's slow and fast spells fall on all of them; a call
    whose warm-up took longer than ``long_s`` seconds is timed once (quadratic SDPA gets slow)."""
    warm = []
    for fn in fns:
        start = time.perf_counter()
        fn()
        warm.append(time.perf_counter() - start)
    best = [float("inf")] * len(fns)
    for round_ in range(repeats):
        for i, fn in enumerate(fns):
            if round_ and warm[i] > long_s:
                continue
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def matmul_call(n: int = 2048) -> tuple[Callable[[], object], float]:
    """An n x n x n fp32 matmul and its FLOPs: the machine's matmul rate, timed beside the scans."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    return (lambda: a @ b), 2.0 * n**3


def soe_flops(tokens: int, heads: int, feat: int, dim_v: int, n_terms: int, chunk: int, backward: bool) -> float:
    """Multiply-add FLOPs of the products of the chunked SOE scan (kernels/soe/chunk.py), forward or
    forward + backward; elementwise work is not counted."""
    state = 2 * n_terms * feat * dim_v  # one [c, S*F] x [S*F, D] product (read or update), per token
    norm = 2 * n_terms * feat  # one normaliser product ([c, F] x [F, S] or [S, c] x [c, F]), per token
    intra = 2 * chunk * (feat + dim_v + n_terms)  # Q K^T, P V, coef E, per token
    fwd = 2 * state + 2 * norm + intra
    bwd = 5 * state + 6 * norm + 2 * chunk * (3 * feat + 2 * dim_v + 3 * n_terms)
    return tokens * heads * (fwd + (bwd if backward else 0))


def sdpa_flops(tokens: int, heads: int, seq_len: int, dim: int, backward: bool) -> float:
    """FLOPs of causal attention (half of the T x T score and value products; backward counted as 2.5x)."""
    fwd = 2 * 2 * tokens * seq_len * dim * heads / 2
    return fwd * (3.5 if backward else 1.0)


def _timed(run: Callable[[], Sequence[torch.Tensor]], inputs: Sequence[torch.Tensor], backward: bool) -> Callable:
    """One forward (and backward) call. The backward is seeded with random output gradients made once,
    outside the timing, as a loss upstream of the op would deliver them (dense, materialised)."""
    seeds: list[torch.Tensor] = []

    def call() -> None:
        for x in inputs:
            x.grad = None
        with torch.set_grad_enabled(backward):
            outs = [o for o in run() if o is not None]
        if backward:
            if not seeds:
                seeds.extend(torch.randn_like(o) for o in outs)
            torch.autograd.backward(outs, seeds)

    return call


def soe_call(args: argparse.Namespace, seq_len: int, backward: bool) -> Callable[[], None]:
    b, h, f, d, s = args.B, args.H, args.F, args.D, args.S
    q = (torch.rand(b, seq_len, h, f) / f).requires_grad_(backward)
    k = (torch.rand(b, seq_len, h, f) / f).requires_grad_(backward)
    v = torch.randn(b, seq_len, h, d).requires_grad_(backward)
    coef = torch.randn(b, seq_len, h, s).requires_grad_(backward)
    log_lam = (-torch.rand(h, s) * 3).requires_grad_(backward)
    inputs = (q, k, v, coef, log_lam)

    def run():
        o, z, _ = soe_scan(q, k, v, coef, log_lam, chunk_size=args.chunk, backend=args.backend)
        return o, z

    return _timed(run, inputs, backward)


def sdpa_call(args: argparse.Namespace, seq_len: int, backward: bool) -> Callable[[], None]:
    q, k, v = (torch.randn(args.B, args.H, seq_len, args.F).requires_grad_(backward) for _ in range(3))

    def run():
        return (torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True),)

    return _timed(run, (q, k, v), backward)


def phasor_call(args: argparse.Namespace, seq_len: int, backward: bool) -> Callable[[], None]:
    gen = torch.Generator().manual_seed(0)
    delta = torch.randn(args.B, seq_len, args.L, args.M, generator=gen).requires_grad_(backward)
    # A tree with a root (slot 0): path level l = 1..L picks one of branching**l slots.
    n = args.branching
    offsets = [sum(n**i for i in range(lvl)) for lvl in range(1, args.L + 1)]
    slots = torch.stack(
        [off + torch.randint(0, n**lvl, (args.B, seq_len), generator=gen) for lvl, off in enumerate(offsets, 1)], -1
    )
    n_slots = sum(n**i for i in range(args.L + 1))

    def run():
        return phasor_scan(delta, slots, n_slots, output_final_state=True, backend=args.backend)

    return _timed(run, (delta,), backward)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--T", default="1024,4096,16384,65536", help="comma-separated sequence lengths")
    p.add_argument("--ops", default="soe,phasor", help="comma-separated: soe, phasor")
    p.add_argument("--modes", default="fwd,fwdbwd", help="comma-separated: fwd, fwdbwd")
    p.add_argument("--sdpa-max-T", type=int, default=65536, help="skip SDPA above this length (it is quadratic)")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--F", type=int, default=64, help="feature (and SDPA head) dimension")
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--S", type=int, default=32)
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--L", type=int, default=3, help="phasor levels")
    p.add_argument("--M", type=int, default=64, help="phasor width")
    p.add_argument("--branching", type=int, default=4, help="phasor tree branching (4 and L=3: 85 slots)")
    p.add_argument("--backend", default="auto")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave torch's default)")
    p.add_argument("--out", default="", help="write the rows as JSON here")
    args = p.parse_args(argv)
    args.T = [int(t) for t in args.T.split(",") if t]
    args.ops = [o for o in args.ops.split(",") if o]
    args.modes = [m for m in args.modes.split(",") if m]
    if not set(args.ops) <= {"soe", "phasor"} or not set(args.modes) <= {"fwd", "fwdbwd"}:
        p.error("--ops takes soe,phasor and --modes takes fwd,fwdbwd")
    return args


def main(argv: Sequence[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    # Large buffers on transparent huge pages, as the training launcher sets it: torch reads this at its
    # first multi-MB allocation. Without it every fresh buffer costs a page fault per 4 KB.
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if args.threads:
        torch.set_num_threads(args.threads)
    matmul, mm_flops = matmul_call()
    thp = os.environ["THP_MEM_ALLOC_ENABLE"]
    print(f"threads={torch.get_num_threads()}, torch {torch.__version__}, THP_MEM_ALLOC_ENABLE={thp}")
    print(
        f"{'op':7} {'mode':7} {'T':>7} {'time_s':>9} {'GFLOP/s':>8} {'mm_GF/s':>8} {'%mm':>5} {'ktok/s':>8} "
        f"{'sdpa_s':>9} x_sdpa"
    )
    rows = []
    for op in args.ops:
        for mode in args.modes:
            backward = mode == "fwdbwd"
            for seq_len in args.T:
                tokens = args.B * seq_len
                calls = [matmul, (soe_call if op == "soe" else phasor_call)(args, seq_len, backward)]
                if seq_len <= args.sdpa_max_T:
                    calls.append(sdpa_call(args, seq_len, backward))
                mm_s, secs, sdpa = [*best_times(calls, args.repeats), None][:3]
                mm = mm_flops / mm_s / 1e9
                flops = 0.0
                if op == "soe":
                    flops = args.B * soe_flops(seq_len, args.H, args.F, args.D, args.S, args.chunk, backward)
                row = {
                    "op": op,
                    "mode": mode,
                    "T": seq_len,
                    "time_s": secs,
                    "gflops": flops / secs / 1e9 if flops else None,
                    "frac_matmul": flops / secs / 1e9 / mm if flops else None,
                    "ktok_per_s": tokens / secs / 1e3,
                    "matmul_gflops": mm,
                    "sdpa_time_s": sdpa,
                    "sdpa_gflops": sdpa_flops(tokens, args.H, seq_len, args.F, backward) / sdpa / 1e9 if sdpa else None,
                    "speedup_vs_sdpa": sdpa / secs if sdpa else None,
                }
                rows.append(row)
                print(
                    f"{op:7} {mode:7} {seq_len:7d} {secs:9.4f} {row['gflops'] or 0:8.1f} {mm:8.1f} "
                    f"{100 * (row['frac_matmul'] or 0):5.0f} {row['ktok_per_s']:8.1f} "
                    f"{sdpa if sdpa else float('nan'):9.4f} {row['speedup_vs_sdpa'] or float('nan'):7.1f}",
                    flush=True,
                )
    if args.out:
        meta = {
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": platform.processor() or platform.machine(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "matmul_gflops": max((r["matmul_gflops"] for r in rows), default=None),  # each row has its own
            "thp_mem_alloc": thp,
            "config": {k: getattr(args, k) for k in CONFIG_KEYS},
        }
        with open(args.out, "w") as fh:
            json.dump({"meta": meta, "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
