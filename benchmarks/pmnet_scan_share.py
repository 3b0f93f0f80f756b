"""What share of a PMNet memory block's forward+backward the phasor scan takes, on this machine.

    python -m benchmarks.pmnet_scan_share --config configs/model/pmnet-119m.yaml --T 4096,16384

Builds one block with phasor memory from the model config (random weights, batch 1), runs forward and
backward under the torch profiler, and reports the block's wall time and the time spent inside the
phasor scan's autograd functions (forward and backward); the scan should cost under 10% of a block.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import torch

from model.config import load_model_config
from model.pmnet import PMNetBlock

SCAN_EVENTS = ("PhasorScan",)  # the scan's autograd Functions and their backward nodes start with this


def measure(block: PMNetBlock, seq_len: int, d_model: int) -> dict:
    x = torch.randn(1, seq_len, d_model, requires_grad=True)
    grad = torch.randn(1, seq_len, d_model)
    embedded = torch.randn(1, seq_len, d_model)  # the token embeddings that route the memory (route_input)
    out, _ = block(x, None, embedded=embedded)  # warm-up (numba compiles on first use)
    out.backward(grad)
    with torch.profiler.profile() as prof:
        start = time.perf_counter()
        out, _ = block(x, None, embedded=embedded)
        out.backward(grad)
        total = time.perf_counter() - start
    scan = sum(e.cpu_time_total for e in prof.key_averages() if e.key.startswith(SCAN_EVENTS)) / 1e6
    return {"T": seq_len, "block_s": total, "scan_s": scan, "scan_share": scan / total}


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/model/pmnet-119m.yaml")
    parser.add_argument("--T", default="4096", help="comma-separated sequence lengths")
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: leave torch's default)")
    parser.add_argument("--out", default="", help="write the rows as JSON here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    config = load_model_config(args.config)
    torch.manual_seed(0)
    block = PMNetBlock(config, with_memory=True)
    rows = []
    print(f"{'T':>7} {'block_s':>9} {'scan_s':>9} {'share':>6}")
    for seq_len in (int(t) for t in args.T.split(",") if t):
        row = measure(block, seq_len, config.d_model)
        rows.append(row)
        print(f"{seq_len:7d} {row['block_s']:9.3f} {row['scan_s']:9.4f} {100 * row['scan_share']:5.1f}%", flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"config": args.config, "threads": torch.get_num_threads(), "rows": rows}, fh, indent=1)
    return rows


if __name__ == "__main__":
    main()
