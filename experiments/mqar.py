"""Multi-query associative recall (Zoology's MQAR): accuracy against the size of the recurrent state.

Every family (with the short convolution of configs/experiments/mqar.yaml) is trained at each
(length, pairs, width) setting of a grid; the plot puts each run's recall accuracy against the
floats its state carries from one call to the next, as Zoology's figure does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib.ticker import NullFormatter

from data_pipeline import synthetic
from experiments.recall_routes import model_hit_rates
from experiments.runner import Experiment, Family, Run, eval_task, figure, predictions, save_figure
from model import CausalLM

Kinds = tuple[tuple[str, tuple[str, ...]], ...]
"""(name, config overrides) of each family."""
Settings = tuple[tuple[int, int, int], ...]

KINDS: Kinds = (
    ("transformer", ("model.kind=transformer",)),
    ("vort", ("model.kind=vort",)),
    ("pl", ("model.kind=pl",)),
    ("exp", ("model.kind=exp",)),
    ("m5", ("model.kind=m5",)),
    ("pmnet", ("model.kind=pmnet",)),
    ("swa", ("model.kind=pmnet", "model.pmnet.memory_every=0")),
    ("transformer-noconv", ("model.kind=transformer", "model.short_conv=0")),
)
SETTINGS: Settings = ((64, 8, 32), (64, 8, 64), (128, 16, 32), (128, 16, 64))
"""(sequence length, key/value pairs, d_model), the shortest first so that an interrupted grid has
its cheapest settings complete."""


def family(kind: str, overrides: tuple[str, ...], seq_len: int, pairs: int, width: int) -> Family:
    """`kind` at one grid setting, named `<kind>-T<seq_len>-d<width>`."""
    setting = (f"data.seq_len={seq_len}", f"model.max_seq_len={seq_len}", f"model.vort.soe_horizon={seq_len}",
               f"data.task.params.num_pairs={pairs}", f"model.d_model={width}")
    return Family(f"{kind}-T{seq_len}-d{width}", (*overrides, *setting))


def grid(settings: Settings, kinds: Kinds) -> tuple[Family, ...]:
    """Every kind at every setting, setting by setting."""
    return tuple(family(kind, overrides, *s) for s in settings for kind, overrides in kinds)




@dataclass
class MQAR(Experiment):
    """Accuracy over the queries of held-out examples, the run's state size, and for PMNet the
    routing hit rates (experiments/recall_routes.py)."""

    settings: Settings = SETTINGS
    kinds: Kinds = KINDS
    examples: int = 256

    def families_for(self, quick: bool) -> tuple[Family, ...]:
        """The grid; --quick only its first setting."""
        return grid(self.settings[:1], self.kinds) if quick else self.families

    def comparable_groups(self) -> list[tuple[Family, ...]]:
        """Per setting, the families of equal size. Left out: PMNet, whose memory adds 60% to the
        parameters at width 32 (the SwiGLU's hidden width is already at its minimum of 64, so the
        others cannot be matched to it; as in Zoology, families meet at equal width and results.json
        lists each run's parameters), and the Transformer without the convolution, which is the
        Transformer less the convolution's weights (VORT's router puts it 5.3% apart at width 32)."""
        n = len(self.kinds)
        groups = [self.families[i : i + n] for i in range(0, len(self.families), n)]
        left_out = ("pmnet-", "transformer-noconv-")
        return [tuple(f for f in group if not f.name.startswith(left_out)) for group in groups]

    def evaluate(self, model: CausalLM, run: Run, quick: bool) -> dict[str, Any]:
        task = eval_task(run, quick)
        examples = [task.example(i) for i in range(16 if quick else self.examples)]
        scores = synthetic.accuracy(examples, predictions(model, examples))
        return {
            "accuracy": scores["token"],
            "all_queries_right": scores["exact"],
            "chance": 1.0 / task.keys,
            "state_floats": float(model.cache_floats(run.config.data.seq_len)),
            **model_hit_rates(model, examples),
        }

    def plot(self, results: dict[str, Any], path: Path) -> None:
        summary = results["summary"]
        lengths = sorted({int(name.rsplit("-", 2)[1][1:]) for name in summary})
        fig, axes = figure(1, len(lengths), (max(7.0, 5.5 * len(lengths)), 4.2))
        for ax, length in zip(axes[0], lengths):
            for kind, _ in self.kinds:
                names = [n for n in summary if n.rsplit("-", 2)[0] == kind and n.rsplit("-", 2)[1] == f"T{length}"]
                points = sorted((summary[n]["state_floats"]["mean"], summary[n]["accuracy"]["mean"],
                                 summary[n]["accuracy"]["std"]) for n in names)
                if points:
                    xs, ys, errs = np.asarray(points).T
                    ax.errorbar(xs, ys, yerr=errs, marker="o", capsize=3, label=kind)
            ax.set_xscale("log")
            ax.xaxis.set_minor_formatter(NullFormatter())  # labels on the decades only: the others collide
            ax.set_ylim(-0.02, 1.02)
            ax.set_xlabel("state size (floats carried between calls)")
            ax.set_ylabel("MQAR accuracy (mean, spread over seeds)")
            ax.set_title(f"{length} tokens")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
        save_figure(fig, results, path)


CHECK_SETTINGS: Settings = ((128, 16, 64),)
CHECK_KINDS = (KINDS[0], KINDS[-1])
EXPERIMENTS = [
    MQAR(
        name="mqar",
        title="MQAR (Zoology layout): recall accuracy against recurrent state size",
        config="mqar.yaml",
        families=grid(SETTINGS, KINDS),
        quick_overrides=("train.steps=2",),
    ),
    MQAR(  # its runs are the grid's runs of the same names, so the grid reuses them
        name="mqar-check",
        title="MQAR: the Transformer with and without the short convolution (128 tokens, 16 pairs)",
        config="mqar.yaml",
        families=grid(CHECK_SETTINGS, CHECK_KINDS),
        settings=CHECK_SETTINGS,
        kinds=CHECK_KINDS,
        seeds=1,
        quick_overrides=("train.steps=2",),
    ),
]
