"""Parameter counts and training FLOPs per token of model configs, and optionally one pass's time.

    python -m model.summary configs/model/vort-125m.yaml configs/model/pl-125m.yaml ... [--seq-len N] [--fwd-bwd]

Reads each file's `model:` section (following `extends`, as a run does), builds the
model on the CPU and prints one Markdown table row per config: total parameters, parameters without
the embedding, parameters of a separate memory module (PMNet's phasor memories; 0 elsewhere), and
training FLOPs per token (forward + backward, the number the trainer divides by for MFU) at the
given context length (default: each config's max_seq_len). `--fwd-bwd` adds the seconds of one
forward+backward pass at batch 1 and that length on this machine's CPU threads.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from model import CausalLM, build_model
from model.config import ModelConfig, load_model_config


def time_fwd_bwd(model: CausalLM, seq_len: int) -> dict[str, float]:
    """Seconds of one forward and of forward+backward at batch 1 on random tokens, and the loss:
    what a config costs on this machine before a run is planned around it."""
    ids = torch.randint(0, model.config.vocab_size, (1, seq_len + 1))
    start = time.perf_counter()
    loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
    forward_s = time.perf_counter() - start
    loss.backward()
    return {"forward_s": forward_s, "fwd_bwd_s": time.perf_counter() - start, "loss": loss.item()}


def summarize(config: ModelConfig, seq_len: int | None = None, fwd_bwd: bool = False) -> dict[str, Any]:
    """kind, parameters (all / without embedding / in a memory module) and training FLOPs per token
    at `seq_len`; with `fwd_bwd`, also the timing of `time_fwd_bwd`."""
    torch.manual_seed(0)
    model = build_model(config)
    context = seq_len or config.max_seq_len
    summary = {
        "kind": config.kind,
        "params": model.num_parameters(),
        "params_no_embed": model.num_parameters(exclude_embeddings=True),
        "params_memory": model.memory_parameters(),
        "seq_len": context,
        "flops_per_token": model.flops_per_token(context),
    }
    if fwd_bwd:
        summary |= time_fwd_bwd(model, context)
    return summary


def format_table(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """Markdown table of (name, summary) rows; the timing columns appear when the rows have them."""
    timed = all("fwd_bwd_s" in s for _, s in rows)
    header = "| config | kind | params | params w/o embedding | memory params | seq len | train FLOPs/token |"
    lines = [header + (" fwd+bwd s (fwd s) | loss |" if timed else ""), "|---|---|---:|---:|---:|---:|---:|"]
    if timed:
        lines[1] += "---:|---:|"
    for name, s in rows:
        line = (
            f"| {name} | {s['kind']} | {s['params']:,} | {s['params_no_embed']:,} | {s['params_memory']:,} "
            f"| {s['seq_len']} | {s['flops_per_token']:.4g} |"
        )
        if timed:
            line += f" {s['fwd_bwd_s']:.1f} ({s['forward_s']:.1f}) | {s['loss']:.3f} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m model.summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("configs", nargs="+", type=Path, help="YAML files with a model: section")
    parser.add_argument("--seq-len", type=int, default=None, help="context length for FLOPs (default: max_seq_len)")
    parser.add_argument("--fwd-bwd", action="store_true", help="time one forward+backward pass (batch 1, CPU)")
    args = parser.parse_args(argv)
    rows = [(path.stem, summarize(load_model_config(path), args.seq_len, args.fwd_bwd)) for path in args.configs]
    print(format_table(rows))
    if args.fwd_bwd:
        print(f"(timed on {torch.get_num_threads()} CPU threads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
