"""PNG plots of a scaling fit: isoFLOP curves, loss against compute, compute-optimal sizes, residuals."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np

from pretrain.sweeps.scaling import FamilyData, budget_groups, optimal_allocation, predict_loss


def _panels(count: int) -> tuple[plt.Figure, list[plt.Axes]]:
    fig, axes = plt.subplots(1, count, figsize=(4.5 * count, 3.8), squeeze=False)
    return fig, list(axes[0])


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_isoflops(data: dict[str, FamilyData], fits: dict[str, dict[str, Any]], path: Path) -> Path:
    """Per family: loss against N for each budget, the parabola through it and its minimum."""
    fig, axes = _panels(len(data))
    for ax, (family, fd) in zip(axes, data.items()):
        groups = budget_groups(fd)
        colours = plt.cm.viridis(np.linspace(0, 0.9, max(len(groups), 1)))
        for colour, (budget, idx) in zip(colours, sorted(groups.items())):
            x = np.log(fd.params[idx])
            ax.scatter(fd.params[idx], fd.loss[idx], color=colour, s=18, label=f"{budget:.2g} FLOPs")
            if len(np.unique(x)) >= 3:
                c2, c1, c0 = np.polyfit(x, fd.loss[idx], 2)
                grid = np.linspace(x.min(), x.max(), 50)
                ax.plot(np.exp(grid), c0 + c1 * grid + c2 * grid**2, color=colour, lw=1)
        for m in fits[family]["isoflop"].get("minima", []):
            ax.scatter(m["N_opt"], m["loss_opt"], marker="*", s=90, color="red", zorder=3)
        ax.set(xscale="log", xlabel="parameters N", ylabel=f"held-out {fd.loss_unit}",
               title=f"{family}: isoFLOP curves")
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_frontier(data: dict[str, FamilyData], fits: dict[str, dict[str, Any]], path: Path) -> Path:
    """Loss against training FLOPs: every run, each family's lower envelope, and the loss of the
    parametric fit at its compute-optimal allocation."""
    fig, axes = _panels(1)
    ax = axes[0]
    estimated = any(fd.flops is None for fd in data.values())
    for i, (family, fd) in enumerate(data.items()):
        colour = f"C{i}"
        flops = fd.flops if fd.flops is not None else 6.0 * fd.params * fd.tokens
        ax.scatter(flops, fd.loss, s=12, alpha=0.5, color=colour)
        order = np.argsort(flops)
        envelope = np.minimum.accumulate(fd.loss[order])
        ax.plot(flops[order], envelope, color=colour, lw=1, label=f"{family}: best run so far")
        fit = fits[family]
        per = fit.get("flops_per_param_token", 6.0)
        c = np.geomspace(flops.min(), flops.max(), 60)
        n_opt, d_opt = optimal_allocation(fit, c, per)
        ax.plot(c, predict_loss(fit, n_opt, d_opt), color=colour, ls="--", lw=1, label=f"{family}: fit at N*(C)")
    xlabel = "training FLOPs C" + (" (6ND where the results give none)" if estimated else "")
    units = sorted({fd.loss_unit for fd in data.values()})
    ax.set(xscale="log", xlabel=xlabel, ylabel=f"held-out {' / '.join(units)}", title="loss against compute")
    ax.legend(fontsize=7)
    return _save(fig, path)


def plot_optimal_sizes(data: dict[str, FamilyData], fits: dict[str, dict[str, Any]], path: Path) -> Path:
    """The isoFLOP minima N*(C), D*(C) with their power-law fits."""
    fig, axes = _panels(2)
    for i, family in enumerate(data):
        iso = fits[family]["isoflop"]
        if "skipped" in iso:
            continue
        c = np.array([m["flops"] for m in iso["minima"]])
        grid = np.geomspace(c.min(), c.max(), 20)
        for ax, key in zip(axes, ("N", "D")):
            values = np.array([m[f"{key}_opt"] for m in iso["minima"]])
            ax.scatter(c, values, color=f"C{i}", s=20)
            ax.plot(grid, iso[f"{key}_prefactor"] * grid ** iso[f"{key}_exponent"], color=f"C{i}", lw=1,
                    label=f"{family}: {key}* ~ C^{iso[f'{key}_exponent']:.2f}")
    for ax, key, name in zip(axes, ("N", "D"), ("parameters", "tokens")):
        ax.set(xscale="log", yscale="log", xlabel="training FLOPs C", ylabel=f"compute-optimal {name} {key}*")
        ax.legend(fontsize=7)
    return _save(fig, path)


def plot_residuals(data: dict[str, FamilyData], fits: dict[str, dict[str, Any]], path: Path) -> Path:
    """log(measured) - log(fitted loss) per run, against N, coloured by tokens per parameter."""
    fig, axes = _panels(len(data))
    for ax, (family, fd) in zip(axes, data.items()):
        residual = np.log(fd.loss) - np.log(predict_loss(fits[family], fd.params, fd.tokens))
        points = ax.scatter(fd.params, residual, c=np.log10(fd.tokens / fd.params), cmap="plasma", s=18)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set(xscale="log", xlabel="parameters N", ylabel="log L - log L_fit", title=f"{family}: residuals")
        fig.colorbar(points, ax=ax, label="log10 tokens/param")
    return _save(fig, path)


def plot_all(data: dict[str, FamilyData], fits: dict[str, dict[str, Any]], directory: Path) -> list[Path]:
    """Every plot into `directory` (created)."""
    directory.mkdir(parents=True, exist_ok=True)
    return [
        plot_isoflops(data, fits, directory / "isoflop.png"),
        plot_frontier(data, fits, directory / "frontier.png"),
        plot_optimal_sizes(data, fits, directory / "optimal_sizes.png"),
        plot_residuals(data, fits, directory / "residuals.png"),
    ]
