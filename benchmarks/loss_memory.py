"""Peak memory of the LM loss, forward + backward: full logits (before) against the chunked
cross-entropy of model/interface.py (after).

    python -m benchmarks.loss_memory [--tokens 32768] [--vocab 32768] [--d-model 768] [--dtype bf16] [--json out.json]

Each variant runs in a fresh process and its peak is the kernel's resident high-water mark over the
step (pretrain.plan's probe), inputs and weights excluded: what the loss itself adds. "before" is the
loss as it was: logits = hidden @ W^T in the weights' dtype, an fp32 copy, F.cross_entropy.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import torch
import torch.nn.functional as F

from model.interface import IGNORE_INDEX, chunked_cross_entropy, loss_chunk_tokens
from pretrain.plan.memory import GIB, peak_growth

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _loss_step(variant: str, tokens: int, vocab: int, d_model: int, dtype: str) -> Callable[[], None]:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, d_model, generator=gen).to(DTYPES[dtype]).requires_grad_()
    weight = (torch.randn(vocab, d_model, generator=gen) * d_model**-0.5).to(DTYPES[dtype]).requires_grad_()
    labels = torch.randint(0, vocab, (tokens,), generator=gen)

    def plain() -> None:
        logits = hidden @ weight.t()
        F.cross_entropy(logits.float(), labels, ignore_index=IGNORE_INDEX, reduction="sum").backward()

    def chunked() -> None:
        chunked_cross_entropy(hidden, weight, labels).backward()

    return plain if variant == "before" else chunked


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.loss_memory", description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--d-model", type=int, default=768)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="hidden states and weights")
    parser.add_argument("--json", default=None, help="also write the rows here")
    args = parser.parse_args(argv)
    rows = []
    print(f"loss forward+backward, {args.tokens} tokens x {args.vocab} vocabulary, d_model {args.d_model}, "
          f"{args.dtype} weights; chunks of {loss_chunk_tokens(args.vocab)} tokens")
    print(f"{'variant':<10}{'peak GiB':>10}{'bytes per token x vocab':>26}")
    for variant in ("before", "after"):
        peak = peak_growth(_loss_step, variant, args.tokens, args.vocab, args.d_model, args.dtype,
                           what=f"the {variant} loss probe")
        rows.append({"variant": variant, "tokens": args.tokens, "vocab": args.vocab, "d_model": args.d_model,
                     "dtype": args.dtype, "peak_bytes": peak})
        print(f"{variant:<10}{peak / GIB:>10.3f}{peak / (args.tokens * args.vocab):>26.2f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(rows, out, indent=1)


if __name__ == "__main__":
    main()
