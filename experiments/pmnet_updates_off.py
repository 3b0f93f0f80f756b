"""A trained PMNet's held-out bits per byte by context, with its memory updates on and off at inference.

    python -m experiments.pmnet_updates_off --run runs/experiments/runs/books/pmnet/seed0 --contexts 1024,16384

Scores the first max(contexts) bytes of the held-out demo novel at each context, streamed as the books
experiment does (experiments/extrapolation.py), once as trained and once with `update_memory_eval`
off (the slots keep their initial phases; routing and reads still run); prints the write gains too.
If the model is flat with updates off and not with them, what hurts at long context is the written
state, not the rest of the model.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from data_pipeline.tokenizer import byte_tokenizer
from experiments.extrapolation import HELD_OUT, score_contexts
from model.pmnet import PMNet
from pretrain.checkpoint.consolidate import consolidate, read_run_config, resolve_checkpoint
from pretrain.evaluate.text import read_text


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--run", type=Path, required=True, help="a PMNet run directory: its final checkpoint")
    parser.add_argument("--contexts", default="1024,16384")
    args = parser.parse_args(argv)
    step = resolve_checkpoint(args.run)
    model = consolidate(step, read_run_config(step)).eval()
    if not isinstance(model, PMNet) or not model.memories():
        raise SystemExit("not a PMNet with memory")
    gains = [memory.write_gain.detach().abs() for memory in model.memories()]
    print("write gain |g| per memory block (mean / max):",
          ", ".join(f"{float(g.mean()):.4f} / {float(g.max()):.4f}" for g in gains))
    text = read_text([str(HELD_OUT)], byte_tokenizer())
    contexts = tuple(int(c) for c in args.contexts.split(","))
    report = {}
    for updates in (True, False):
        for memory in model.memories():
            memory.update_eval = updates
        scored = score_contexts(model, text, contexts)
        report["updates on" if updates else "updates off"] = {c: v["bits_per_token"] for c, v in scored.items()}
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
