"""Issue 54's goals for VORT's scans, predicted at every shape it names, on an H100.

    python -m benchmarks.predict.goals [--json out.json]

Shapes: vort-125m and vort-350m at 1 x 16,384 and 1 x 65,536 tokens per rank, and the per-rank shapes
of the long-context recipes (configs/vort-125m-128k.yaml: 131,072 tokens over 8 ranks; vort-125m-256k
and vort-350m-256k: 262,144 over 8). Per shape: `benchmarks.predict step`'s numbers and whether each goal
holds: the scans' forward + backward at most GOALS["scan_vs_fla"] x fla's chunk retention on the same
work, at most GOALS["scan_share"] of the step, and an MFU of at least GOALS["mfu"] (the goals are judged on
the eager step; the table prints the compiled step's beside it).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.predict.__main__ import resolve_config
from benchmarks.predict.gpu import H100
from benchmarks.predict.step_model import predict_step

GOALS = {"scan_vs_fla": 0.5, "scan_share": 0.30, "mfu": 0.35}
SHAPES = (("vort-125m", 16_384), ("vort-125m", 65_536), ("vort-125m-128k", 131_072 // 8),
          ("vort-125m-256k", 262_144 // 8), ("vort-350m", 16_384), ("vort-350m", 65_536),
          ("vort-350m-256k", 262_144 // 8))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args(argv)
    rows = []
    print(f"{'config':16} {'tokens':>7} {'scan ms':>8} {'step ms':>8} {'share':>6} {'mfu':>6} {'fla ret ms':>10} "
          f"{'scan/fla':>8} {'compiled ms':>11} {'share':>6} {'mfu':>6}")
    for name, tokens in SHAPES:
        cfg, checkpointing = resolve_config(name)
        out = predict_step(cfg, 1, tokens, checkpointing, H100)
        ratio = out["scan_ms"] / out["fla_retention_ms"]
        row = {"config": name, "tokens": tokens, **out, "scan_vs_fla": round(ratio, 3),
               "goals_met": {"scan_vs_fla": ratio <= GOALS["scan_vs_fla"],
                             "scan_share": out["scan_share"] <= GOALS["scan_share"], "mfu": out["mfu"] >= GOALS["mfu"]}}
        rows.append(row)
        compiled = out["compiled"]
        print(f"{name:16} {tokens:7d} {out['scan_ms']:8.1f} {out['step_ms']:8.1f} {out['scan_share']:6.1%} "
              f"{out['mfu']:6.1%} {out['fla_retention_ms']:10.1f} {ratio:8.2f} {compiled['step_ms']:11.1f} "
              f"{compiled['scan_share']:6.1%} {compiled['mfu']:6.1%}", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"gpu": "h100", "goals": GOALS, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
