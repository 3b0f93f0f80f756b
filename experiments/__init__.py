"""The papers' experiments at CPU scale, run by `python launch/experiment.py run <name>`."""

from __future__ import annotations

from experiments import extrapolation, long_context, mqar, orders, phasor, retrieval
from experiments.runner import Experiment

EXPERIMENTS: dict[str, Experiment] = {
    e.name: e
    for e in (*retrieval.EXPERIMENTS, *phasor.EXPERIMENTS, *orders.EXPERIMENTS, *extrapolation.EXPERIMENTS,
              *mqar.EXPERIMENTS, *long_context.EXPERIMENTS)
}

__all__ = ["EXPERIMENTS", "Experiment"]
