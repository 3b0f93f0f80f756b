"""What the document reset (data.doc_boundaries) costs in training throughput, on this machine.

    python -m benchmarks.doc_boundaries --kinds transformer,vort,pmnet --T 2048 --doc-len 512

For each model family (a small model from model.config defaults with the given width and depth), times
forward and backward of a [batch, T] token batch with and without ``doc_start``, documents of
geometrically distributed length with mean ``--doc-len``, and prints one JSON line per family with
tokens/s of both and their ratio (the best of ``--repeats`` timed runs of each after one warm-up, the
two alternating).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Sequence

import torch

from model import build_model
from model.config import ModelConfig


def doc_starts(batch: int, seq_len: int, mean_len: float, generator: torch.Generator) -> torch.Tensor:
    """bool [batch, seq_len]: each token starts a document with probability 1/mean_len (the first always)."""
    starts = torch.rand(batch, seq_len, generator=generator) < 1.0 / mean_len
    starts[:, 0] = True
    return starts


def step_seconds(model: torch.nn.Module, ids: torch.Tensor, doc_start: torch.Tensor | None) -> float:
    """Wall time of one forward and backward of the loss."""
    start = time.perf_counter()
    loss, _ = model.loss(ids[:, :-1], ids[:, 1:], doc_start=None if doc_start is None else doc_start[:, :-1])
    loss.backward()
    return time.perf_counter() - start


def tokens_per_s(model: torch.nn.Module, ids: torch.Tensor, starts: torch.Tensor, repeats: int) -> tuple[float, float]:
    """Tokens/s without and with ``starts``: the best of `repeats` timed steps each after one warm-up of
    each, the two kinds of step alternating so that a change in the machine's load hits both alike."""
    best = [float("inf"), float("inf")]
    for attempt in range(repeats + 1):  # the first round is a warm-up
        for i, doc_start in enumerate((None, starts)):
            seconds = step_seconds(model, ids, doc_start)
            if attempt:
                best[i] = min(best[i], seconds)
    return ids[:, :-1].numel() / best[0], ids[:, :-1].numel() / best[1]


def main(argv: Sequence[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kinds", default="transformer,vort,pmnet")
    parser.add_argument("--T", type=int, default=2048, help="tokens per row")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--doc-len", type=float, default=512.0, help="mean document length in tokens")
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 258, (args.batch, args.T + 1), generator=generator)
    starts = doc_starts(args.batch, args.T + 1, args.doc_len, generator)
    results = []
    for kind in args.kinds.split(","):
        torch.manual_seed(0)
        config = ModelConfig(kind=kind, d_model=args.d_model, n_layers=args.layers, n_heads=4, max_seq_len=args.T)
        model = build_model(config)
        plain, reset = tokens_per_s(model, ids, starts, args.repeats)
        row = {"kind": kind, "T": args.T, "batch": args.batch, "mean_doc_len": args.doc_len,
               "documents": int(starts.sum()), "tokens_per_s": round(plain), "tokens_per_s_reset": round(reset),
               "ratio": round(reset / plain, 3)}
        print(json.dumps(row), flush=True)
        results.append(row)
    return results


if __name__ == "__main__":
    main()
