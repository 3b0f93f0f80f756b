"""Parameter counts and training FLOPs per token of model configs.

    python -m model.summary configs/model/vort-125m.yaml configs/model/pl-125m.yaml ... [--seq-len N]

Reads each file's `model:` section (following `extends`, as a run does), builds the
model on the CPU and prints one Markdown table row per config: total parameters, parameters without
the embedding, and training FLOPs per token (forward + backward, the number the trainer divides by
for MFU) at the given context length (default: each config's max_seq_len).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from model import build_model
from model.config import ModelConfig, load_model_config


def summarize(config: ModelConfig, seq_len: int | None = None) -> dict[str, Any]:
    """kind, parameters (all / without embedding) and training FLOPs per token at `seq_len`."""
    model = build_model(config)
    context = seq_len or config.max_seq_len
    return {
        "kind": config.kind,
        "params": model.num_parameters(),
        "params_no_embed": model.num_parameters(exclude_embeddings=True),
        "seq_len": context,
        "flops_per_token": model.flops_per_token(context),
    }


def format_table(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """Markdown table of (name, summary) rows."""
    lines = [
        "| config | kind | params | params w/o embedding | seq len | train FLOPs/token |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name, s in rows:
        lines.append(
            f"| {name} | {s['kind']} | {s['params']:,} | {s['params_no_embed']:,} "
            f"| {s['seq_len']} | {s['flops_per_token']:.4g} |"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+", type=Path, help="YAML files with a model: section")
    parser.add_argument("--seq-len", type=int, default=None, help="context length for FLOPs (default: max_seq_len)")
    args = parser.parse_args(argv)
    rows = [(path.stem, summarize(load_model_config(path), args.seq_len)) for path in args.configs]
    print(format_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
