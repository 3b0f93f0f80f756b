"""The launch shapes of a step's SOE chunk kernels, each priced by the launch model and checked for spills.

    python -m benchmarks.predict.shapes [--config vort-125m] [--tokens 16384] [--json out.json]

Captures one training step on the meta device (as `benchmarks.predict step` does, for an H100). For
each distinct chunk launch of VORT's scans (kernels/soe/gpu/launches.py) it compiles the launch for
sm_90 under every candidate shape (warps x stages x register cap; ptxas refuses some outright), reads
the registers and the bytes ptxas spilled, and prices it with the fitted constants. It prints, per
launch, the shipped shape and the fastest that spills nothing: the compile gate
(benchmarks.kernel_compile) refuses any spill, so only those are eligible. The sm_90 Shapes in
kernels/soe/gpu/launches.TILES were chosen so.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from triton.runtime.errors import PTXASError

from benchmarks.predict.__main__ import resolve_config
from benchmarks.predict.capture import Launch
from benchmarks.predict.gpu import H100
from benchmarks.predict.launch_model import Constants, launch_cost
from benchmarks.predict.sass import compile_launch
from benchmarks.predict.step import capture_step_ops

CHUNK_KERNELS = ("chunk_states_kernel", "chunk_output_kernel", "chunk_state_grads_kernel",
                 "chunk_query_grads_kernel", "chunk_key_value_grads_kernel")  # fmt: skip
WARPS = (4, 8, 16)
STAGES = (1, 2)
REGISTER_CAPS = (None, 64, 80, 96, 128, 168)


def reshaped(launch: Launch, warps: int, stages: int, registers: int | None) -> Launch:
    """``launch`` compiled with another shape."""
    options = tuple((k, v) for k, v in launch.options if k != "maxnreg")
    capped = (("maxnreg", registers),) if registers else ()
    return dataclasses.replace(launch, num_warps=warps, num_stages=stages, options=options + capped)


def shape_rows(launch: Launch, constants: Constants) -> list[dict]:
    """Every candidate shape of ``launch``: its predicted milliseconds on an H100 and its sm_90 spills."""
    rows = []
    for warps, stages, cap in itertools.product(WARPS, STAGES, REGISTER_CAPS):
        if cap is not None and cap * warps * 32 > 65_536:
            continue  # not even one program would fit an SM
        candidate = reshaped(launch, warps, stages, cap)
        try:
            binary = compile_launch(candidate, 90)
        except PTXASError:  # ptxas refuses some caps outright (wgmma needs its accumulators in registers)
            continue
        ms = launch_cost(candidate, H100).seconds(H100, constants) * 1e3
        rows.append({"warps": warps, "stages": stages, "cap": cap, "registers": binary.registers,
                     "spills": binary.spills, "ms": round(ms, 4)})
    return sorted(rows, key=lambda r: r["ms"])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="vort-125m")
    parser.add_argument("--tokens", type=int, default=16_384)
    parser.add_argument("--json", type=Path, help="write every candidate here")
    args = parser.parse_args(argv)
    cfg, checkpointing = resolve_config(args.config)
    capture = capture_step_ops(cfg, 1, args.tokens, checkpointing, 90)
    constants, seen, out = Constants(), set(), []
    for launch in capture.launches:
        if launch.name not in CHUNK_KERNELS or (launch.name, launch.config()) in seen:
            continue  # a config string names no kernel: the outputs and dq can share one
        seen.add((launch.name, launch.config()))
        rows = shape_rows(launch, constants)
        shipped = dict(launch.options).get("maxnreg")
        now = next(r for r in rows if (r["warps"], r["stages"], r["cap"]) == (launch.num_warps, launch.num_stages,
                                                                              shipped))  # fmt: skip
        best = next((r for r in rows if r["spills"] == 0), None)
        out.append({"launch": launch.name, "config": launch.config(), "shipped": now, "best": best, "rows": rows})
        print(f"{launch.name} {launch.config()}")
        for label, row in (("shipped", now), ("best", best)):
            if row is not None:
                print(f"  {label:8} {row['warps']:2d} warps {row['stages']} stages cap {row['cap']!s:4} "
                      f"{row['registers']:3d} regs {row['spills']:4d} B spilled {row['ms']:.3f} ms")
    if args.json:
        args.json.write_text(json.dumps({"gpu": "h100", "config": args.config, "tokens": args.tokens,
                                         "launches": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
