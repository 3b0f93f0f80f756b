"""What the two kernel changes the performance model kept are worth by it: vort-125m's scans at 16,384
tokens per rank on an H100 with the fewest spans and unpipelined loads (the kernels before), with spans
for whole waves, and with both (kernels/soe/gpu/launches.py: `wave_spans`, `TILES[True].stages`).

    python -m benchmarks.predict.span_changes [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path

import kernels.soe.gpu.launches as launches
from benchmarks.predict.capture import Captured
from benchmarks.predict.gpu import H100
from benchmarks.predict.launch_model import Constants
from benchmarks.predict.price import cost
from benchmarks.predict.step import capture_step_ops
from model.config import load_model_config

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "model" / "vort-125m.yaml"


def scan_ms(tokens: int = 16_384) -> float:
    """The scans' predicted milliseconds in one vort-125m training step with the launch table as set."""
    step = capture_step_ops(load_model_config(CONFIG), 1, tokens, True)
    scans = cost(Captured(step.launches, [op for op in step.ops if op.origin == "kernels"]), H100)
    return round(scans.seconds(Constants()) * 1e3, 2)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    waves, tiles = launches.wave_spans, launches.TILES[True]
    variants = (("fewest spans, stages 1", lambda rows, n, span, walks: span, 1),
                ("whole waves, stages 1", waves, 1), ("whole waves, stages 2", waves, 2))
    out = {}
    try:
        for name, spans, stages in variants:
            launches.wave_spans = spans
            launches.TILES[True] = dataclasses.replace(tiles, stages=stages)
            out[name] = scan_ms()
            print(f"{name:24} {out[name]:9.1f} ms", flush=True)
    finally:
        launches.wave_spans, launches.TILES[True] = waves, tiles
    if args.json:
        args.json.write_text(json.dumps(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
