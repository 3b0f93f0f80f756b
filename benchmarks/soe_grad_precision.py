"""How far the chunked SOE scan's fp32 gradients drift from its own float64 run as T grows.

    python -m benchmarks.soe_grad_precision --T 4096,32768

Same inputs in fp32 and float64 (B=1, H=4, F=D=64, S=32, the benchmark's distributions), one backward
with random output gradients each; prints, per input, the norm-wise relative error of the fp32
gradient, and for log_lam also the worst entry. The decay gradient sums reader and writer positions
separately across chunks, which is where fp32 loses precision at long T (docs/kernels.md).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from kernels import soe_scan

NAMES = ("q", "k", "v", "coef", "log_lam")


def gradients(inputs: Sequence[torch.Tensor], seeds: Sequence[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
    leaves = [x.to(dtype).requires_grad_() for x in inputs]
    o, z, _ = soe_scan(*leaves, backend="torch")
    torch.autograd.backward([o, z], [s.to(dtype) for s in seeds])
    return [x.grad.double() for x in leaves]


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--T", default="4096,32768", help="comma-separated sequence lengths")
    args = parser.parse_args(argv)
    rows = []
    for seq_len in (int(t) for t in args.T.split(",") if t):
        gen = torch.Generator().manual_seed(0)
        b, h, f, d, s = 1, 4, 64, 64, 32
        f64 = {"generator": gen, "dtype": torch.float64}
        inputs = (
            torch.rand(b, seq_len, h, f, **f64) / f,
            torch.rand(b, seq_len, h, f, **f64) / f,
            torch.randn(b, seq_len, h, d, **f64),
            torch.randn(b, seq_len, h, s, **f64),
            -torch.rand(h, s, **f64) * 3,
        )
        seeds = (torch.randn(b, seq_len, h, d, **f64), torch.randn(b, seq_len, h, **f64))
        low, high = gradients(inputs, seeds, torch.float32), gradients(inputs, seeds, torch.float64)
        row = {"T": seq_len}
        row.update({n: ((a - e).norm() / e.norm()).item() for n, a, e in zip(NAMES, low, high)})
        row["log_lam_worst"] = ((low[4] - high[4]).abs() / high[4].abs()).max().item()
        rows.append(row)
        print("  ".join(f"{k} {v:.1e}" if k != "T" else f"T {v}" for k, v in row.items()), flush=True)
    return rows


if __name__ == "__main__":
    main()
