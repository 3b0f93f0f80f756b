"""PMNet's memory capacity against tree depth: leaves, addresses, FLOPs and state for a config.

    python -m experiments.pmnet_capacity configs/model/pmnet-119m.yaml --depths 3 4 5
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import torch

from model import build_model
from model.config import ModelConfig, load_model_config


def capacity_row(config: ModelConfig, depth: int, seq_len: int) -> str:
    """One markdown row: the config at `depth`, its leaves per memory block, addresses over all blocks,
    slots, parameters, training FLOPs per token at `seq_len`, and the memory state of one sequence."""
    config = dataclasses.replace(config, pmnet=dataclasses.replace(config.pmnet, depth=depth))
    torch.manual_seed(0)
    model = build_model(config)
    leaves = config.pmnet.branching**depth
    state, _ = model.state_bytes(1, 1)
    return (f"| {depth} | {leaves} | {leaves * len(model.memories())} | {config.pmnet.n_slots} | "
            f"{model.num_parameters():,} | {model.flops_per_token(seq_len):.4g} | {state / 2**20:.2f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("config", type=Path, help="a YAML file with a model: section of kind pmnet")
    parser.add_argument("--depths", type=int, nargs="+", default=[3, 4, 5])
    parser.add_argument("--seq-len", type=int, default=4096)
    args = parser.parse_args(argv)
    config = load_model_config(args.config)
    print("| depth | leaves per block | addresses (leaves x memory blocks) | slots | params | "
          f"train FLOPs/token (T={args.seq_len}) | memory state per sequence (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for depth in args.depths:
        print(capacity_row(config, depth, args.seq_len))


if __name__ == "__main__":
    main()
