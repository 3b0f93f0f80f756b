"""VORT's learned order distribution on text: is it bimodal, entities high and function words low?

Two VORT runs on the demo books, without and with the weak-label entity loss
(model/entity_labels.py). After training, the model reads held-out text (the demo's validation
novel) and each byte's order alpha, averaged over heads, is grouped by a byte class: letters of
weakly labelled entities, letters of common English function words, everything else.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from experiments.runner import DemoTextExperiment, Family, Run, figure, held_out_bits, save_figure
from model import CausalLM
from model.entity_labels import capitalised_word_mask

FUNCTION_WORDS = frozenset({
    "a", "an", "the", "and", "or", "but", "of", "to", "in", "on", "at", "by", "for", "with", "from", "as",
    "is", "was", "be", "been", "are", "were", "it", "its", "he", "she", "his", "her", "they", "them",
    "their", "i", "you", "we", "that", "this", "which", "who", "not", "no", "so", "if", "then", "than",
})
BINS = np.linspace(0.0, 1.0, 41)


def function_word_mask(text: bytes) -> np.ndarray:
    """1 on the letters of lower-case function words (FUNCTION_WORDS), per byte of `text`."""
    mask = np.zeros(len(text), dtype=bool)
    for match in re.finditer(rb"[A-Za-z]+", text):
        if match.group().decode() in FUNCTION_WORDS:
            mask[match.start() : match.end()] = True
    return mask


def bimodality_coefficient(x: np.ndarray) -> float:
    """Sarle's coefficient (skewness^2 + 1) / kurtosis; above 5/9 (the uniform's) suggests two modes."""
    x = np.asarray(x, dtype=np.float64)
    centred = x - x.mean()
    var = (centred**2).mean()
    if var == 0:
        return 0.0
    skew = (centred**3).mean() / var**1.5
    kurt = (centred**4).mean() / var**2
    return float((skew**2 + 1) / kurt)


@torch.inference_mode()
def routed_orders(model: CausalLM, ids: np.ndarray, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Per byte: alpha per head [layers, heads, N] and the entity-probe score [layers, N]."""
    model.eval()
    alphas, entities = [], []
    usable = ids[: ids.size // seq_len * seq_len].reshape(-1, seq_len)
    for start in range(0, usable.shape[0], 16):
        model(torch.from_numpy(usable[start : start + 16]).long())
        routing = [block.mixer.memory.last_routing for block in model.blocks]
        alphas.append(torch.stack([a.reshape(-1, a.shape[-1]).T for a, _ in routing]))
        entities.append(torch.stack([e.reshape(-1) for _, e in routing]))
    return torch.cat(alphas, -1).numpy(), torch.cat(entities, -1).numpy()


class OrderDistribution(DemoTextExperiment):
    held_out_bytes: int = 65536

    def evaluate(self, model: CausalLM, run: Run, quick: bool) -> dict[str, Any]:
        text = self.held_out.read_bytes()[: 4096 if quick else self.held_out_bytes]
        seq_len = run.config.data.seq_len
        n = len(text) // seq_len * seq_len
        ids = np.frombuffer(text, dtype=np.uint8).astype(np.int64)
        per_head, entity_score = routed_orders(model, ids, seq_len)
        alpha = per_head.mean(1)
        entity = capitalised_word_mask(torch.from_numpy(ids[:n]).reshape(-1, seq_len)).reshape(-1).numpy() > 0
        function = function_word_mask(text[:n])
        other = ~entity & ~function
        metrics: dict[str, Any] = {}
        for layer in range(alpha.shape[0]):
            a = alpha[layer]
            tag = f"layer{layer}"
            metrics[f"{tag}/alpha_entity"] = float(a[entity].mean())
            metrics[f"{tag}/alpha_function"] = float(a[function].mean())
            metrics[f"{tag}/alpha_other"] = float(a[other].mean())
            metrics[f"{tag}/bimodality"] = bimodality_coefficient(a)
            gaps = per_head[layer][:, entity].mean(-1) - per_head[layer][:, function].mean(-1)
            metrics[f"{tag}/largest_head_gap"] = float(gaps[np.abs(gaps).argmax()])
            scores = entity_score[layer]
            metrics[f"{tag}/entity_probe_gap"] = float(scores[entity].mean() - scores[~entity].mean())
            hists = {
                name: np.histogram(a[mask], bins=BINS)[0]
                for name, mask in (("entity", entity), ("function", function), ("other", other))
            }
            for name, counts in hists.items():
                metrics[f"{tag}/alpha_peak_{name}"] = float((BINS[:-1] + BINS[1:])[counts.argmax()] / 2)
            metrics[f"{tag}/hist"] = {name: counts.tolist() for name, counts in hists.items()}
        metrics.update(held_out_bits(model, self.held_out_windows(seq_len, len(text)), far=seq_len // 2))
        metrics["entity_bytes"] = float(entity.sum())
        metrics["function_bytes"] = float(function.sum())
        return metrics

    def plot(self, results: dict[str, Any], path: Path) -> None:
        runs = [r for r in results["runs"] if r["seed"] == 0]
        layers = sorted({k.split("/")[0] for r in runs for k in r["metrics"] if k.endswith("/hist")})
        fig, axes = figure(len(runs), len(layers), (5 * len(layers), 3.2 * len(runs)))
        mids = (BINS[:-1] + BINS[1:]) / 2
        for row, record in zip(axes, runs):
            for ax, layer in zip(row, layers):
                for name, counts in record["metrics"][f"{layer}/hist"].items():
                    counts = np.asarray(counts, dtype=np.float64)
                    ax.plot(mids, counts / max(counts.sum(), 1), label=name)
                ax.set_title(f"{record['family']}, {layer}", fontsize=9)
                ax.set_xlabel("alpha (mean over heads)")
                ax.set_ylabel("share of bytes")
                ax.grid(True, alpha=0.3)
                ax.legend(fontsize=8)
        save_figure(fig, results, path)


EXPERIMENTS = [
    OrderDistribution(
        name="orders",
        title="VORT order distribution on held-out text, by byte class",
        config="orders.yaml",
        families=(Family("vort"), Family("vort-entity-aux", ("model.vort.entity_aux_weight=1.0",))),
        seeds=1,
        seed_overrides=("run.seed={seed}",),
        quick_overrides=("train.steps=2",),
        paper={"alpha": {"entities": 0.80, "function words": 0.35}},
    ),
]
