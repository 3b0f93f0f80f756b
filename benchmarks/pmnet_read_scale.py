"""How loud PMNet's memory read is: its RMS against the residual stream entering each memory block,
and how far its write gain has grown.

    python -m benchmarks.pmnet_read_scale --config configs/experiments/text.yaml --init before
    python -m benchmarks.pmnet_read_scale --run runs/experiments/runs/text/pmnet/seed0

With --config the model is freshly initialised: `--init now` as PMNet builds it (read-out projection
and write gain at zero), `--init before` as the memory started before 2026-12-01 (the read-out with
the N(0, 0.02^2) init every other Linear gets, writes on: gain 1). With --run the trained run's final
checkpoint is loaded. Scored on
windows of the held-out demo novel (never trained on); prints one line per memory block.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

import torch

from model import build_model
from model.config import load_model_config
from model.pmnet import PMNet
from pretrain.checkpoint.consolidate import consolidate, resolve_checkpoint
from pretrain.config import load_config

HELD_OUT = Path(__file__).resolve().parents[1] / "data" / "demo" / "valid" / "northangerabbey.txt"


def read_scale(model: PMNet, ids: torch.Tensor) -> list[tuple[float, float]]:
    """(RMS of the memory's output, RMS of the residual stream entering its norm) per memory block."""
    found: list[tuple[float, float]] = []
    handles = []
    for block in model.blocks:
        if block.memory is None:
            continue
        entering: list[float] = []
        handles.append(block.memory_norm.register_forward_hook(
            lambda module, args, out, store=entering: store.append(float(args[0].pow(2).mean().sqrt()))))
        handles.append(block.memory.register_forward_hook(
            lambda module, args, out, store=entering: found.append((float(out[0].pow(2).mean().sqrt()), store[-1]))))
    with torch.no_grad():
        model.eval()(ids)
    for handle in handles:
        handle.remove()
    return found


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", type=Path, help="a config with a `model:` section (a fresh model)")
    source.add_argument("--run", type=Path, help="a run directory: its final checkpoint")
    parser.add_argument("--init", choices=("now", "before"), default="now", help="with --config")
    parser.add_argument("--windows", type=int, default=4)
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    if args.run is not None:
        model = consolidate(resolve_checkpoint(args.run), load_config(args.run / "config.yaml"))
    else:
        model = build_model(load_model_config(args.config))
        if args.init == "before":
            for memory in model.memories():
                torch.nn.init.normal_(memory.out.weight, std=0.02)
                torch.nn.init.ones_(memory.write_gain)
    if not isinstance(model, PMNet) or not model.memories():
        raise SystemExit("not a PMNet with memory")
    text = HELD_OUT.read_bytes()
    stride = len(text) // args.windows
    ids = torch.tensor([list(text[i * stride : i * stride + args.length]) for i in range(args.windows)])
    for layer, ((read, residual), memory) in enumerate(zip(read_scale(model, ids), model.memories())):
        gain = memory.write_gain.detach().abs()
        print(f"memory block {layer}: read RMS {read:.4f}, residual RMS {residual:.4f}, ratio {read / residual:.2f}; "
              f"write gain |g| mean {float(gain.mean()):.4f}, max {float(gain.max()):.4f}")


if __name__ == "__main__":
    main()
