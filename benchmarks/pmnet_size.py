"""A PMNet config's sizes and FLOPs per token, and optionally the time of one forward+backward pass.

    python -m benchmarks.pmnet_size --config configs/model/pmnet-119m.yaml [--seq-len 4096] [--fwd-bwd]

Prints parameters (all, without the embedding, in the phasor memories), the memory blocks and
training FLOPs per token at ``--seq-len``; ``--fwd-bwd`` times one pass at batch 1 on this machine.
"""

from __future__ import annotations

import argparse
import time

import torch

from model.config import load_model_config
from model.pmnet import PMNet


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.pmnet_size", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="YAML file with a `model:` section")
    parser.add_argument("--seq-len", type=int, default=4096, help="context length for FLOPs and timing")
    parser.add_argument("--fwd-bwd", action="store_true", help="time one forward+backward pass (batch 1, CPU)")
    args = parser.parse_args(argv)
    config = load_model_config(args.config)
    torch.manual_seed(0)
    model = PMNet(config)
    print(f"config            {args.config}")
    print(f"parameters        {model.num_parameters():,}")
    print(f"  non-embedding   {model.num_parameters(exclude_embeddings=True):,}")
    print(f"  memory          {sum(p.numel() for m in model.memories() for p in m.parameters()):,}")
    print(f"memory blocks     {len(model.memories())} of {config.n_layers}, {config.pmnet.n_slots} slots each")
    flops = model.flops_per_token(args.seq_len)
    print(f"FLOPs/token       {flops:.4g} (training, fwd+bwd, seq_len {args.seq_len})")
    if args.fwd_bwd:
        ids = torch.randint(0, config.vocab_size, (1, args.seq_len + 1))
        start = time.perf_counter()
        loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
        forward_s = time.perf_counter() - start
        loss.backward()
        total_s = time.perf_counter() - start
        print(
            f"fwd+bwd           {total_s:.1f} s (forward {forward_s:.1f} s), loss {loss.item():.3f}, "
            f"{torch.get_num_threads()} threads"
        )


if __name__ == "__main__":
    main()
