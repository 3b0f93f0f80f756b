"""What one SOE scan call allocates on a GPU, forward and backward, counted from the tensors it creates.

    python -m benchmarks.scan_memory [--config vort-125m,vort-350m] [--T 65536,1048576] [--json out.json]

The Triton autograd Function runs on meta tensors in bf16 at the config's scan sizes (batch 1), with
its launches captured instead of run (no GPU needed: kernels/soe/gpu/footprint.py). The rows give, per
token and layer, the bytes created in the forward (what the backward keeps included) and in the
backward (the input gradients included), and the largest single buffer of the call. Every buffer is
transient: the forward's saved span states live until the backward, the rest until the call returns.
The inputs and the output gradients are the caller's and are not counted. pretrain.plan counts the
same buffers at a run's length.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from kernels.soe.gpu.footprint import scan_allocations
from model import family
from model.config import load_model_config

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "model"


def rows(configs: Sequence[str], lengths: Sequence[int]) -> list[dict]:
    out = []
    for name in configs:
        cfg = load_model_config(CONFIG_DIR / f"{name}.yaml")
        shape = family(cfg.kind).scan_shape(cfg)
        if shape is None or shape.kernel != "soe":
            raise ValueError(f"{name}: model.kind={cfg.kind!r} has no SOE scan")
        for seq_len in lengths:
            counts = scan_allocations(shape.sizes, seq_len)
            out.append({"config": name, "tokens": seq_len, "forward_bytes": counts["forward"],
                        "backward_bytes": counts["backward"], "largest_bytes": counts["largest"],
                        "bytes_per_token_layer": (counts["forward"] + counts["backward"]) / seq_len})  # fmt: skip
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default="vort-125m,vort-350m", help="comma-separated configs/model stems")
    parser.add_argument("--T", default="65536,1048576", help="comma-separated tokens per rank")
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    try:
        lengths = [int(t) for t in args.T.split(",") if t]
        table = rows([c for c in args.config.split(",") if c], lengths)
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("| config | tokens | forward MB | backward MB | kB per token per layer | largest buffer MB |")
    print("|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['config']} | {r['tokens']:,} | {r['forward_bytes'] / 1e6:.1f} | {r['backward_bytes'] / 1e6:.1f} | "
              f"{r['bytes_per_token_layer'] / 1e3:.1f} | {r['largest_bytes'] / 1e6:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
