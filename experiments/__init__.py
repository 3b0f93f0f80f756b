"""The papers' experiments at CPU scale, run by `python launch/experiment.py run <name>`, and the
investigations that ask why a run behaves as it does (`python -m experiments.<name>`: sp_divergence,
pmnet_updates_off); what only measures speed, memory or precision lives in benchmarks/."""

from __future__ import annotations

from experiments import extrapolation, long_context, mqar, orders, phasor, recall_beyond, recall_family, retrieval
from experiments.runner import Experiment

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (*retrieval.EXPERIMENTS, *phasor.EXPERIMENTS, *orders.EXPERIMENTS, *extrapolation.EXPERIMENTS,
              *mqar.EXPERIMENTS, *long_context.EXPERIMENTS,
              *recall_beyond.EXPERIMENTS, *recall_family.EXPERIMENTS)
}

__all__ = ["EXPERIMENTS", "Experiment"]
