"""VORT for long contexts (issue 25): the read's normalisation, the q.k temperature, tempering.

"vort-readout" trains byte-level VORT at 256-byte windows with the num/den read or the per-head
RMS norm and sigmoid output gate (`model.vort.readout`), each with the fixed temperature 2 and the
learned per-head temperature (`learn_temperature`) started at 2, and for num/den also the fixed
temperature 8 (the cap) and the learned one started at 8. "vort-temper" trains at 2,048-byte
windows with and without `temper` (4x the training length, the demo's ratio), for the defaults
(num/den, temperature 2) and for num/den at temperature 8, which vort-readout found to hold up
best far beyond the training length. Both score held-out bits per byte at the training length
and far beyond it, streamed with the carried state, as the books experiment does
(experiments/extrapolation.py), and record the learned temperatures.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from experiments.extrapolation import QUICK, BooksExperiment
from experiments.runner import Family, Run, figure, save_figure
from model import CausalLM

LEARNED = "model.vort.learn_temperature=true"
GATED = "model.vort.readout=norm_gate"
NUMDEN = Family("numden")
NUMDEN_LEARNED = Family("numden-learned-t", (LEARNED,))
T8 = "model.vort.temperature=8.0"
NUMDEN_T8 = Family("numden-t8", (T8,))
NUMDEN_LEARNED_T8 = Family("numden-learned-t8", (T8, LEARNED))
GATE = Family("gate", (GATED,))
GATE_LEARNED = Family("gate-learned-t", (GATED, LEARNED))
TEMPER = "model.vort.temper=8192"  # 4 x the 2,048-byte training windows, as configs/demo.yaml's 1024 for 256


def learned_temperatures(model: CausalLM) -> dict[str, Any]:
    """Per layer, the learned q.k temperature of every head (nothing for a fixed temperature)."""
    out: dict[str, Any] = {}
    for i, block in enumerate(model.blocks):
        temperature = block.mixer.temperature()
        if not isinstance(temperature, float):
            out[f"temperature/layer{i}"] = [round(float(t), 4) for t in temperature.detach()]
    if out:
        every = [t for heads in out.values() for t in heads]
        out["temperature_mean"] = sum(every) / len(every)
        out["temperature_max"] = max(every)
    return out


@dataclass
class LongContextExperiment(BooksExperiment):
    """The books protocol on VORT variants, plus each run's learned temperatures; families that
    change the read's parameters (the gate) are compared among themselves for size."""

    def evaluate(self, model: CausalLM, run: Run, quick: bool) -> dict[str, Any]:
        return {**super().evaluate(model, run, quick), **learned_temperatures(model)}

    def comparable_groups(self) -> list[tuple[Family, ...]]:
        """The gated read adds a d x d gate per layer (+6.6% parameters at width 64): the families
        of one readout share a size, and the report gives both sizes."""
        gated = tuple(f for f in self.families if GATED in f.overrides)
        return [g for g in (tuple(f for f in self.families if f not in gated), gated) if g]

    def plot(self, results: dict[str, Any], path: Path) -> None:
        """The books plots (seed 0), and in plot-seeds.png each family's bits per byte against
        context, mean and spread over seeds."""
        super().plot(results, path)
        contexts = self.quick_contexts if results["quick"] else self.contexts
        fig, axes = figure(1, 1, (7, 4.5))
        ax = axes[0, 0]
        for family, metrics in results["summary"].items():
            stats = [metrics.get(f"bpb@{c}") for c in contexts]
            xs = [c for c, s in zip(contexts, stats) if s]
            means = [s["mean"] for s in stats if s]
            ax.errorbar(xs, means, yerr=[s["std"] for s in stats if s], marker="o", capsize=3,
                        label=f"{family} (n={stats[0]['n'] if stats[0] else 0})")
        ax.set_xscale("log", base=2)
        if not results["quick"]:
            ax.axvline(self.train_len, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("context (bytes)")
        ax.set_ylabel("held-out bits per byte (mean ± sd over seeds)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
        save_figure(fig, results, path.with_name("plot-seeds.png"))


READOUT = LongContextExperiment(
    name="vort-readout",
    title="VORT's read: num/den or RMS norm + gate, fixed or learned q.k temperature (trained at 256 bytes)",
    config="vort-readout.yaml",
    families=(NUMDEN, NUMDEN_LEARNED, NUMDEN_T8, NUMDEN_LEARNED_T8, GATE, GATE_LEARNED),
    seeds=3,
    seed_overrides=(),
    quick_overrides=QUICK,
    contexts=(256, 1024, 4096, 16384, 65536),
    long_contexts=(),
    train_len=256,
)
TEMPERED = LongContextExperiment(
    name="vort-temper",
    title="VORT tempered (tau = 8192) or not, at q.k temperature 2 or 8, trained at 2,048 bytes",
    config="vort-temper.yaml",
    families=(NUMDEN, Family("numden-temper", (TEMPER,)), NUMDEN_T8, Family("numden-t8-temper", (T8, TEMPER))),
    seeds=2,
    seed_overrides=(),
    quick_overrides=QUICK,
    contexts=(2048, 8192, 65536),
    long_contexts=(2048, 524288),
    train_len=2048,
)
EXPERIMENTS = (READOUT, TEMPERED)
