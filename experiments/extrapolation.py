"""Bits per byte against context on a held-out book (experiment 3) and the extrapolation fix (8).

Every family is trained on the demo plays and poems with the demo model's size and budget
(configs/experiments/books.yaml: 150 steps of 16 x 256 bytes) and scored on the held-out Austen
novel at contexts from 256 to 65,536 bytes, on the same first 65,536 bytes of the book at every
context (so a longer context sees the same text with more of it in memory), streamed in chunks
with the carried state as pretrain.evaluate does. The softmax Transformer carries no memory
between chunks, so it is scored with one chunk per window, up to 4,096 bytes. The recurrent
families are also scored on the first 524,288 bytes of a second held-out novel, once as 512 windows
of 1,024 bytes and once as a single 524,288-byte window: the same bytes, read with 1k or 512k of
context.

Experiment 8 trains the VORT variants that the memory probe (pretrain/memory_probe.py) points
to: rotary positions off, the state carried across windows (train.carry_state), both, and rotary
off with the kernel tempered at 1,024 tokens (what configs/demo.yaml now uses); for every
VORT-family run it also records what the probe measures at the longest context.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_pipeline.build import build_shards
from data_pipeline.tokenizer import byte_tokenizer
from experiments.runner import REPO, Experiment, Family, Run
from model import CausalLM
from pretrain.config import RunConfig
from pretrain.evaluate import compare as compare
from pretrain.evaluate.memory_probe import probe
from pretrain.evaluate.text import Text, evaluate_context, read_text

DEMO = REPO / "data" / "demo"
HELD_OUT = DEMO / "valid" / "northangerabbey.txt"
CONTEXTS = (256, 1024, 4096, 16384, 65536)
QUICK_CONTEXTS = (64, 256)
LONG_HELD_OUT = DEMO / "long" / "prideprejudice.txt"
LONG_CONTEXTS = (1024, 524288)
QUICK_LONG_CONTEXTS = (64, 1024)
TRANSFORMER_MAX = 4096  # whole-window attention; beyond it the window no longer fits one chunk
CHUNK = 1024
DEMO_SEED = 1234  # run.seed of configs/experiments/books.yaml (the demo's)
TRAIN_LEN = 256  # data.seq_len of configs/experiments/books.yaml (through demo.yaml)

PMNET = ("model.kind=pmnet", "model.short_conv=3")  # as configs/model/pmnet-tiny.yaml ships it (results.md 12c)
BOOKS_FAMILIES = (
    Family("vort"),
    Family("pl", ("model.kind=pl",)),
    Family("exp", ("model.kind=exp",)),
    Family("m5", ("model.kind=m5",)),
    Family("pmnet", (*PMNET, "model.mlp_ratio=3.0")),  # 3.0: same parameters within 2%
    Family("pmnet-swa", (*PMNET, "model.pmnet.memory_every=0")),
    Family("pmnet-carry", (*PMNET, "model.mlp_ratio=3.0", "train.carry_state=true")),
    Family("pmnet-horizon", (*PMNET, "model.mlp_ratio=3.0", "model.pmnet.memory_horizon=256")),
    Family("pmnet-horizon-carry", (*PMNET, "model.mlp_ratio=3.0", "model.pmnet.memory_horizon=1024",
                                   "train.carry_state=true")),
    Family("transformer", ("model.kind=transformer",)),
)
FIX_FAMILIES = (
    Family("vort"),
    Family("vort-norotary", ("model.vort.rotary=false",)),
    Family("vort-carry", ("train.carry_state=true",)),
    Family("vort-norotary-carry", ("model.vort.rotary=false", "train.carry_state=true")),
    Family("vort-norotary-temper", ("model.vort.rotary=false", "model.vort.temper=1024")),  # the demo's fix
)
QUICK = ("train.steps=2", "train.global_batch=4", "train.micro_batch=2", "data.seq_len=32",
         "model.d_model=32", "model.n_layers=1", "model.vort.soe_horizon=256")


@dataclass
class BooksExperiment(Experiment):
    """Train-short-test-long on books: bits per byte by context and by position in the context.

    `contexts` are scored on the same first max(contexts) bytes of the held-out novel, `long_contexts`
    on the second novel (none: skipped); `train_len` marks the training length in the plots.
    """

    contexts: tuple[int, ...] = CONTEXTS
    quick_contexts: tuple[int, ...] = QUICK_CONTEXTS
    long_contexts: tuple[int, ...] = LONG_CONTEXTS
    train_len: int = TRAIN_LEN

    def prepare(self, out: Path, quick: bool) -> None:
        shards = out / "shards" / "demo-train"
        if not (shards / "manifest.json").is_file():
            build_shards([str(DEMO / "train")], str(shards), tokenizer="bytes", shard_tokens=262144)

    def run_config(self, family: Family, seed: int, out: Path, quick: bool) -> tuple[Path, RunConfig]:
        """The runner's, on the shards of `prepare`, seeded from the demo's seed."""
        shards = out / "shards" / "demo-train"
        extended = Family(family.name, (f"run.seed={DEMO_SEED + seed}", f"data.train=[{{path: {shards}}}]",
                                        *family.overrides))
        return super().run_config(extended, seed, out, quick)

    def evaluate(self, model: CausalLM, run: Run, quick: bool) -> dict[str, Any]:
        model.eval()
        contexts = self.quick_contexts if quick else self.contexts
        text = read_text([str(HELD_OUT)], byte_tokenizer())
        scored = score_contexts(model, text, contexts)
        metrics: dict[str, Any] = {f"bpb@{c}": v["bits_per_token"] for c, v in scored.items()}
        metrics["contexts"] = scored  # pretrain.evaluate's report layout, for pretrain.compare
        if model.streams_exactly and self.long_contexts:
            long_text = read_text([str(LONG_HELD_OUT)], byte_tokenizer())
            long_scored = score_contexts(model, long_text, QUICK_LONG_CONTEXTS if quick else self.long_contexts)
            metrics.update({f"long_bpb@{c}": v["bits_per_token"] for c, v in long_scored.items()})
            metrics["long_contexts"] = long_scored
        max_tokens = max(contexts)
        if model.reports_memory:
            report = probe(model, text.ids, max_tokens, min(max_tokens, CHUNK), run.config.data.seq_len)
            first, last = report["chunks"][0]["layers"], report["chunks"][-1]["layers"]
            metrics["normaliser_growth"] = float(np.mean([b["normaliser_mass"] / a["normaliser_mass"]
                                                          for a, b in zip(first, last, strict=True)]))
            if "order_one_share" in last[0]:
                metrics["order_one_share"] = float(np.mean([layer["order_one_share"] for layer in last]))
            if "alpha_mean" in last[0]:
                metrics["alpha_mean"] = float(np.mean([layer["alpha_mean"] for layer in last]))
        return metrics

    def plot(self, results: dict[str, Any], path: Path) -> None:
        """Bits per byte against context, and against position in the longest context (seed 0);
        the same for the second novel's long window in plot-long.png."""
        runs = [r for r in results["runs"] if r["seed"] == 0]
        title = results["title"] + (" (quick)" if results["quick"] else "")
        train_len = None if results["quick"] else self.train_len
        compare.plot({r["family"]: {"contexts": r["metrics"]["contexts"]} for r in runs}, str(path), title, train_len)
        long = {r["family"]: {"contexts": r["metrics"]["long_contexts"]}
                for r in runs if "long_contexts" in r["metrics"]}
        if long:
            compare.plot(long, str(path.with_name("plot-long.png")),
                         f"{title}: {LONG_HELD_OUT.name}, the same bytes read with 1k or 512k of context", train_len)


def score_contexts(model: CausalLM, text: Text, contexts: tuple[int, ...]) -> dict[str, dict[str, Any]]:
    """Bits per byte at each context over the same first max(contexts) tokens of `text`, streamed in
    chunks of at most CHUNK with the carried state (a Transformer: one chunk per window, and no
    context beyond TRANSFORMER_MAX)."""
    scored: dict[str, dict[str, Any]] = {}
    for context in contexts:
        if not model.streams_exactly:  # a Transformer: one chunk per window, up to TRANSFORMER_MAX
            if context > TRANSFORMER_MAX:
                continue
            chunk = context
        else:
            chunk = min(context, CHUNK)
        windows = max(1, max(contexts) // context)
        result = evaluate_context(model, text, context, chunk, windows, torch.device("cpu"))
        scored[str(context)] = {"bits_per_token": result["bits_per_token"], "buckets": result["buckets"]}
    return scored


BOOKS = BooksExperiment(
    name="books",
    title="Bits per byte against context on a held-out novel, trained at 256 bytes",
    config="books.yaml",
    families=BOOKS_FAMILIES,
    seeds=1,
    seed_overrides=(),
    quick_overrides=QUICK,
    paper={"vort_table_row_3": "VORT.md section 6, row 3", "pmnet_extrapolation": "PMNET.md section 5"},
)
FIX = BooksExperiment(
    name="extrapolation-fix",
    title="VORT with positions off and the state carried across windows, trained at 256 bytes",
    config="books.yaml",
    families=FIX_FAMILIES,
    seeds=1,
    seed_overrides=(),
    quick_overrides=QUICK,
)
EXPERIMENTS = (BOOKS, FIX)

