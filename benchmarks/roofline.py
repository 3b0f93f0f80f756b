"""Roofline model of the scans, today's kernels beside the chunk form, and their share of a training step.

    python -m benchmarks.roofline [--config vort-125m,pmnet-119m] [--json roofline.json]

A model, not a measurement. Per config it counts, per token and layer, the FLOPs and the global-memory
bytes of each scan kernel in two designs, converts them to H100 SXM time (time = max(FLOPs / rate,
bytes / 3.35 TB/s) per kernel), and puts the scans of every layer beside the rest of a training step
at 65,536 tokens per rank:

- "today": the kernels the models launch now. The models hand the scans fp32 under bf16 precision
  (kernels.work_dtype), so every tl.dot is an fp32 IEEE product on CUDA cores (67 TFLOP/s). SOE: one
  program per (head, term, value block) reads q, k, v once per term (S-fold), and adds its outputs
  and gradients atomically (read + write, 8 bytes per fp32 element); the blocks are the sm_90 launch
  table's (TODAY_SOE_BLOCKS). Phasor: kernels.phasor.triton.phasor_launches for fp32 increments.
- "chunk": chunks of 64 tokens with the S terms folded into the contraction ([c, S*F] @ [S*F, D+1],
  b riding as column D+1), bf16 operands on tensor cores (989 TFLOP/s), fp32 accumulation. q, k, v and
  the coefficients are read once per chunk by each kernel that needs them; each chunk's fp32 state is
  written once and read once in the forward (chunk-state kernel with the sequential pass, output
  kernel), and the backward writes each chunk's state gradient once and reads it and the saved state
  once. Outputs and gradients are plain fp32 stores. The phasor kernels keep their products, run as
  three bf16 tensor-core passes (an exact bf16x3 split of the fp32 operand: the other operand is a
  0/1 matrix).
- "chunk-span16": the chunk form with each program keeping a [S*F, 16] block of the state on chip
  across 16 chunks, so an fp32 state crosses memory once per 1,024 tokens; each of the ceil((D+1)/16)
  value-block programs reads q, k and the coefficients.

The rest of the step is its parameter matmuls, 6 FLOPs per matmul parameter per token, at
MATMUL_EFFICIENCY of the bf16 peak; attention, norms and other elementwise work are not modelled (so
the scans' share is an upper bound on that count and the step a lower bound). MFU is the model's own
`flops_per_token` (the trainer's numerator) over the modelled step time at the bf16 peak. Not counted
in the kernels: elementwise work, caches, launch overheads.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import torch

from kernels.span import span_chunks
from model import build_model, family
from model.config import ModelConfig, load_model_config

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "model"
SEQ_LEN = 65_536  # tokens per rank
PEAK = {"bf16": 989e12, "fp32": 67e12}  # H100 SXM: dense bf16 tensor cores, fp32 CUDA cores
PEAK_BYTES = 3.35e12  # H100 SXM HBM3
MATMUL_EFFICIENCY = 0.6  # of the bf16 peak, for the parameter matmuls of the rest of the step
CHUNK = 64
TODAY_SOE_BLOCKS = {"fwd": (32, 64), "bwd": (16, 64)}  # (tokens, value columns) per program, sm_90 table
GOAL_SHARE, GOAL_MFU = 0.30, 0.40

Costs = dict[str, tuple[float, float]]  # kernel: (FLOPs, bytes) per token and layer


def soe_today(sizes: tuple[int, ...], seq_len: int) -> Costs:
    """Today's SOE kernels: per (head, term, value block) program, times their count; a state tile
    read or written once per span counts 1/span of its bytes per token; inputs are fp32 (4 bytes)."""
    heads, terms, F, D, _chunk = sizes
    (bt_f, bd), (bt_b, _) = TODAY_SOE_BLOCKS["fwd"], TODAY_SOE_BLOCKS["bwd"]
    blocks = -(-D // bd)
    span = bt_f * span_chunks(seq_len, bt_f, heads * terms * blocks)
    state = heads * terms * F * (D + 1) * 4  # one span slot of packed fp32 states
    programs = heads * terms * blocks
    tile = 4 * F * (bd + 1) / span
    loads = 4 * (2 * F + bd + 1)  # q, k, v block, coef
    per_program = {
        "soe_fwd_spans": (2 * F * bd, 4 * (F + bd + 1) + tile),
        "soe_fwd": (2 * bt_f * F + 2 * bt_f * bd + 4 * F * bd, loads + 8 * bd + 8 + tile),
        "soe_bwd_spans": (2 * F * bd, 4 * (F + bd + 1) + tile),
        "soe_bwd_forward_order": (2 * bt_b * (3 * F + 2 * bd) + 4 * F * bd, loads + 4 * bd + 4 + 16 * F + 8 * bd + 8
                                  + tile),
        "soe_bwd_reverse_order": (6 * F * bd, loads + 4 * bd + 4 + 8 * F + 8 * bd + 8 + tile),
    }
    out = {k: (programs * f, programs * b) for k, (f, b) in per_program.items()}
    return out | {"soe_fwd_pass": (0.0, 2 * state / span), "soe_bwd_pass": (0.0, 2 * state / span)}


def soe_chunk(sizes: tuple[int, ...], chunk: int = CHUNK, state_every: int = 1, value_block: int = 0) -> Costs:
    """The chunk form, per head and token times the heads (see the module docstring). ``state_every``
    > 1 keeps the state on chip across that many chunks (one fp32 state to memory per span of them);
    ``value_block`` > 0 splits the value columns over programs, each reading q, k and the coefficients."""
    heads, terms, F, D, _chunk = sizes
    fold = terms * F * (D + 1)  # the folded state [S*F, D+1] of one head
    state = 4 * fold / (chunk * state_every)  # one fp32 state per chunk (or span of chunks), per token
    reads = -(-(D + 1) // value_block) if value_block else 1  # programs along the value columns
    qkc = 2 * (2 * F + terms) * reads + 2 * D  # bf16 q, k, coefficients per program; v once
    intra = 2 * chunk * (F + D + 1)  # QK^T and A @ [V, 1] over the chunk
    per_head = {
        "chunk_fwd_states": (2 * fold, qkc - 2 * F * reads + state),  # K~^T V per chunk; write its state
        "chunk_fwd_output": (2 * fold + intra, qkc + state + 4 * (D + 1)),  # Q~ H + intra; write o, z
        "chunk_bwd_states": (2 * fold, 2 * (F + terms) * reads + 2 * (D + 1) + state),  # Q~^T dO; write dH
        # dQ, dK, dV, dcoef: inter from H and dH, intra from dA; read both states, write fp32 gradients
        "chunk_bwd_grads": (6 * fold + 2 * intra + 2 * terms * F, qkc + 2 * (D + 1) + 2 * state
                            + 4 * (2 * F + D + terms)),
    }
    return {k: (heads * f, heads * b) for k, (f, b) in per_head.items()}


def phasor_today(sizes: tuple[int, ...], seq_len: int) -> Costs:
    """The phasor kernels of phasor_launches for fp32 increments: one-hot products over the padded slot
    block; the phases of all slots read or written once per span count 1/span of their bytes."""
    from kernels.phasor.triton import phasor_launches

    levels, width, n_slots = sizes
    span, launches = phasor_launches(1, seq_len, levels, width, n_slots, torch.float32, 90)
    state = n_slots * width * 4 / span
    out = {}
    for name, launch in launches.items():
        if name.endswith("_pass"):
            out[f"phasor_{name}"] = (0.0, 2 * state)
            continue
        bt, bm, bn = (launch.constexprs[k] for k in ("BT", "BM", "BN"))
        blocks = launch.grid[1]
        rows = levels * (width * 4 + 4 * blocks)  # a row in, a slot id per program
        if name.endswith("_spans"):
            out[f"phasor_{name}"] = (levels * blocks * 2 * bn * bm, rows + state)
        else:  # read from the state, same-slot sums, state update; a row out, the entering phases
            out[f"phasor_{name}"] = (levels * blocks * (4 * bn * bm + 2 * bt * bm), rows + levels * width * 4 + state)
    return out


DESIGNS = {"today": {}, "chunk": {}, "chunk-span16": {"state_every": 16, "value_block": 16}}
"""The designs modelled: today's kernels; the chunk form with an fp32 state per chunk of 64; the chunk
form keeping [S*F, 16] state blocks on chip across 16 chunks (one state per 1,024 tokens to memory)."""


def kernel_costs(cfg: ModelConfig, design: str, seq_len: int = SEQ_LEN) -> tuple[Costs, str]:
    """(costs per kernel, the rate they run at: a key of PEAK) of one layer's scan in ``design``."""
    if design not in DESIGNS:
        raise ValueError(f"design must be one of {sorted(DESIGNS)}, got {design!r}")
    scan = family(cfg.kind).scan_shape(cfg)
    if scan is None:
        raise ValueError(f"model.kind={cfg.kind!r} with these settings has no scan to model")
    if scan.kernel == "soe":
        if design == "today":
            return soe_today(scan.sizes, seq_len), "fp32"
        return soe_chunk(scan.sizes, **DESIGNS[design]), "bf16"
    costs = phasor_today(scan.sizes, seq_len)
    if design == "today":
        return costs, "fp32"
    return {k.replace("phasor_", "phasor_tc_"): (3 * f, b) for k, (f, b) in costs.items()}, "bf16"


def _seconds(flops: float, traffic: float, rate: str) -> float:
    return max(flops / PEAK[rate], traffic / PEAK_BYTES)


def step_model(name: str, cfg: ModelConfig, design: str, seq_len: int = SEQ_LEN) -> dict:
    """The modelled training step of ``cfg`` at ``seq_len`` tokens per rank with the scans in ``design``:
    per-kernel rows and the scans' share and MFU."""
    model = build_model(cfg)
    layers = len(model.memories()) if hasattr(model, "memories") else cfg.n_layers
    costs, rate = kernel_costs(cfg, design, seq_len)
    kernels = []
    for kernel, (flops, traffic) in costs.items():
        seconds = _seconds(flops, traffic, rate) * seq_len * layers
        compute_bound = flops / PEAK[rate] >= traffic / PEAK_BYTES
        kernels.append({"kernel": kernel, "flops_per_token_layer": flops, "bytes_per_token_layer": traffic,
                        "bound": "compute" if compute_bound else "memory", "step_ms": seconds * 1e3})
    scan_ms = sum(k["step_ms"] for k in kernels)
    other_ms = 6 * model.matmul_params() * seq_len / (PEAK["bf16"] * MATMUL_EFFICIENCY) * 1e3
    step_ms = scan_ms + other_ms
    mfu = model.flops_per_token(seq_len) * seq_len / (step_ms * 1e-3 * PEAK["bf16"])
    return {"config": name, "design": design, "rate": rate, "scan_layers": layers, "kernels": kernels,
            "scan_flops_per_token": sum(f for f, _ in costs.values()) * layers,
            "scan_bytes_per_token": sum(b for _, b in costs.values()) * layers,
            "scan_ms": scan_ms, "other_ms": other_ms, "step_ms": step_ms, "scan_share": scan_ms / step_ms, "mfu": mfu}


def format_report(steps: Sequence[dict]) -> str:
    """The per-kernel table, then one summary line per config and design."""
    lines = ["| config | design | kernel | MFLOP/token/layer | kB/token/layer | bound | ms/step (all layers) |",
             "|---|---|---|---|---|---|---|"]
    for s in steps:
        for k in s["kernels"]:
            lines.append(f"| {s['config']} | {s['design']} | {k['kernel']} | {k['flops_per_token_layer'] / 1e6:.2f} | "
                         f"{k['bytes_per_token_layer'] / 1e3:.1f} | {k['bound']} | {k['step_ms']:.1f} |")
    lines += ["", f"step at {SEQ_LEN:,} tokens per rank on an H100 (other work: parameter matmuls at "
              f"{MATMUL_EFFICIENCY:.0%} of the bf16 peak); goal: scans < {GOAL_SHARE:.0%}, MFU > {GOAL_MFU:.0%}",
              "| config | design | scan layers | scan MFLOP/token | scan kB/token | scans ms | other ms | scan share "
              "| MFU | goal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for s in steps:
        goal = "met" if s["scan_share"] < GOAL_SHARE and s["mfu"] > GOAL_MFU else "not met"
        lines.append(f"| {s['config']} | {s['design']} | {s['scan_layers']} | {s['scan_flops_per_token'] / 1e6:.0f} | "
                     f"{s['scan_bytes_per_token'] / 1e3:.0f} | {s['scan_ms']:.1f} | {s['other_ms']:.1f} | "
                     f"{s['scan_share']:.0%} | {s['mfu']:.0%} | {goal} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="vort-125m,pmnet-119m", help="comma-separated configs/model stems")
    parser.add_argument("--json", type=Path, help="also write the report to this JSON file")
    args = parser.parse_args(argv)
    steps = []
    for name in [c for c in args.config.split(",") if c]:
        path = CONFIG_DIR / f"{name}.yaml"
        if not path.exists():
            parser.error(f"--config: no configs/model/{name}.yaml")
        cfg = load_model_config(path)
        steps += [step_model(name, cfg, design) for design in DESIGNS]
    print(format_report(steps))
    if args.json:
        args.json.write_text(json.dumps(steps, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
