"""Roofline model of the Triton kernels: FLOPs and bytes per token, and the H100 time they imply.

    python -m benchmarks.roofline [--config vort-125m,pmnet-119m] [--target 90]

A model, not a measurement: it counts the products and the global-memory traffic each kernel's
program does per token with the blocks the launch table picks for bf16 inputs on ``--target``
(kernels.soe.triton.soe_launches, kernels.phasor.triton.phasor_launches), and converts them to time at
an H100's dense bf16 peak (989 TFLOP/s) and HBM bandwidth (3.35 TB/s): time = max(FLOPs / peak,
bytes / bandwidth). Counted: every tl.dot (2 FLOPs per multiply-add, with padding and the work each
value block repeats), loads of inputs and gradients, stores, and atomic adds (read + write, 8 bytes per
fp32 element). Not counted: elementwise work, caches (each program's loads are counted even when
another program has just read the same rows), the TF32 products of the backward running at half the
bf16 rate, and launch overheads. The span passes (kernels/span.py) are elementwise: they count bytes
only, and their intensity prints as "-".
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from benchmarks.kernel_compile import SEQ_LEN, shipped_configs
from kernels._common import Launch
from model import family

PEAK_FLOPS = 989e12  # H100 SXM dense bf16
PEAK_BYTES = 3.35e12  # H100 SXM HBM3
ELT = 2  # bytes of a bf16 input element; outputs, states and gradients are fp32 (4)


def _soe_costs(sizes: tuple[int, ...], span: int, launches: dict[str, Launch]) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) per token of each SOE kernel, for the scan sizes of `CausalLM.scan_shape`: per
    (head, term, value block) program, times their count; a state tile read or written once per span
    counts 1/span of its bytes per token."""
    n_heads, n_terms, F, head_dim, _chunk_size = sizes
    state = n_heads * n_terms * F * (head_dim + 1) * 4  # one span slot of packed fp32 states
    out = {}
    for name, launch in launches.items():
        if name.endswith("_pass"):  # per span: read a contribution, write a state, per element
            out[f"soe_{name}"] = (0.0, 2 * state / span)
            continue
        bt, bd = launch.constexprs["BT"], launch.constexprs["BD"]
        programs = n_heads * n_terms * launch.grid[1]  # per token: every (head, term, value block)
        tile = 4 * F * (bd + 1) / span  # the program's state tile, once per span
        loads = 2 * F * ELT + bd * ELT + 4  # q, k, v block, coef
        if name == "fwd_spans":
            flops = 2 * F * bd  # the span's state contribution
            traffic = F * ELT + bd * ELT + 4 + tile  # k, v block, coef; store the tile
        elif name == "bwd_spans":
            flops = 2 * F * bd
            traffic = F * ELT + 4 * bd + 4 + tile  # q, dO block, dz; store the tile
        elif name == "fwd":
            flops = 2 * bt * F + 2 * bt * bd + 4 * F * bd  # QK^T, PV, read of G, update of G
            traffic = loads + 8 * bd + 8 + tile  # atomic o block and z; the entering tile
        elif name == "bwd_forward_order":
            flops = 2 * bt * (3 * F + 2 * bd) + 4 * F * bd  # QK^T, dO V^T, dQ, dK, dV intra; dQ inter, G update
            traffic = loads + 4 * bd + 4 + 16 * F + 8 * bd + 8 + tile  # + dO block, dz; atomic dq, dk, dv, dcoef
        else:
            flops = 6 * F * bd  # dK and dV from dG, dG update
            traffic = loads + 4 * bd + 4 + 8 * F + 8 * bd + 8 + tile  # + dO block, dz; atomic dk, dv, dcoef
        out[f"soe_{name}"] = (programs * flops, programs * traffic)
    return out


def _phasor_costs(sizes: tuple[int, ...], span: int, launches: dict[str, Launch]) -> dict[str, tuple[float, float]]:
    """(FLOPs, bytes) per token of the phasor kernels, for the scan sizes of `CausalLM.scan_shape`:
    one-hot products over the padded slot block; the phases of all slots read or written once per span
    count 1/span of their bytes per token."""
    levels, width, n_slots = sizes
    state = n_slots * width * 4 / span
    out = {}
    for name, launch in launches.items():
        if name.endswith("_pass"):
            out[f"phasor_{name}"] = (0.0, 2 * state)
            continue
        bt, bm, bn = launch.constexprs["BT"], launch.constexprs["BM"], launch.constexprs["BN"]
        blocks = launch.grid[1]
        in_bytes = ELT if name.startswith("fwd") else 4  # increments (input dtype) or fp32 read gradients
        rows = levels * (width * in_bytes + 4 * blocks)  # a row in, a slot id per program
        if name.endswith("_spans"):
            flops = levels * blocks * 2 * bn * bm  # the span's sums per slot
            traffic = rows + state
        else:
            flops = levels * blocks * (4 * bn * bm + 2 * bt * bm)  # read from state, same-slot, state update
            traffic = rows + levels * width * 4 + state  # + a row out; the entering phases
        out[f"phasor_{name}"] = (flops, traffic)
    return out


def roofline(names: Sequence[str], target: int = 90) -> list[dict[str, float | str]]:
    """One row per (config, kernel): FLOPs and bytes per token, intensity and the modelled H100 time."""
    from kernels.phasor.triton import phasor_launches
    from kernels.soe.triton import soe_launches

    configs = shipped_configs()
    rows = []
    for name in names:
        cfg = configs[name]
        scan = family(cfg.kind).scan_shape(cfg)
        if scan is None:
            raise ValueError(f"{name} has no scan")
        if scan.kernel == "soe":
            span, launches = soe_launches(1, SEQ_LEN, *scan.sizes, torch.bfloat16, target)
            costs = _soe_costs(scan.sizes, span, launches)
        else:
            span, launches = phasor_launches(1, SEQ_LEN, *scan.sizes, torch.bfloat16, target)
            costs = _phasor_costs(scan.sizes, span, launches)
        for kernel, (flops, traffic) in costs.items():
            seconds = max(flops / PEAK_FLOPS, traffic / PEAK_BYTES)
            rows.append(
                {
                    "config": name,
                    "kernel": kernel,
                    "flops_per_token": flops,
                    "bytes_per_token": traffic,
                    "intensity": flops / traffic,
                    "bound": "compute" if flops / PEAK_FLOPS >= traffic / PEAK_BYTES else "memory",
                    "h100_ms_per_64k_tokens_per_layer": seconds * SEQ_LEN * 1e3,
                }
            )
    return rows


def format_rows(rows: Sequence[dict[str, float | str]]) -> str:
    head = "| config | kernel | MFLOP/token | kB/token | FLOP/byte | bound | H100 ms / 65,536 tokens / layer |"
    lines = [head, "|---|---|---|---|---|---|---|"]
    for r in rows:
        intensity = f"{r['intensity']:.0f}" if r["flops_per_token"] else "-"
        lines.append(
            f"| {r['config']} | {r['kernel']} | {r['flops_per_token'] / 1e6:.2f} | {r['bytes_per_token'] / 1e3:.1f} "
            f"| {intensity} | {r['bound']} | {r['h100_ms_per_64k_tokens_per_layer']:.3f} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="vort-125m,pmnet-119m", help="comma-separated configs/model stems")
    parser.add_argument("--target", type=int, default=90, help="compute capability whose launch table to model")
    args = parser.parse_args(argv)
    print(format_rows(roofline([c for c in args.config.split(",") if c], args.target)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
