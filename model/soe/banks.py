"""Bank orders: the error that quantising alpha to a bank layout costs (Theorem 4.1); the layer's
differentiable interpolation between neighbouring banks is kernels.order.interpolate_coefficients."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from model.soe.weights import gl_weights


@dataclass(frozen=True)
class BankError:
    """Quantisation error of a bank layout: worst relative and absolute kernel error and where."""

    max_rel: float
    max_abs: float
    worst_alpha: float
    worst_n: int


def _interp_weights(banks: np.ndarray, alpha: np.ndarray, n: np.ndarray) -> np.ndarray:
    """Exact bank kernels blended linearly between neighbouring banks: [len(alpha), len(n)]."""
    idx = np.clip(np.searchsorted(banks, alpha, side="right"), 1, banks.size - 1)
    theta = ((alpha - banks[idx - 1]) / (banks[idx] - banks[idx - 1]))[:, None]
    return (1.0 - theta) * gl_weights(n[None, :], banks[idx - 1][:, None]) + theta * gl_weights(
        n[None, :], banks[idx][:, None])


def _error_lags(T: int, dense: int = 4096) -> np.ndarray:
    """All n <= 2048 and a dense log-spaced sample beyond, always including T."""
    head = np.arange(1, min(T, 2048) + 1)
    tail = np.round(np.geomspace(min(T, 2048), T, dense)) if T > 2048 else np.array([])
    return np.unique(np.concatenate([head, tail, [T]])).astype(np.float64)


def bank_layout_error(banks: Sequence[float] | np.ndarray, T: int, per_interval: int = 16,
                      lags: np.ndarray | None = None) -> BankError:
    """Kernel error of quantising alpha to ``banks`` with linear interpolation (Theorem 4.1).

    Max over alpha in [banks[0], banks[-1]] (``per_interval`` evenly spaced orders inside each pair
    of neighbouring banks, end points excluded since the error vanishes there) and over lags n in
    [1, T] (default: every n <= 2048 plus 4096 log-spaced lags up to T; pass ``lags`` to use others)
    of |blend - w_n(alpha)| relative to w_n(alpha), and in absolute terms.  The exact GL weights are
    used for the banks, so this isolates the quantisation error from the SOE error.
    """
    banks = np.asarray(banks, dtype=np.float64)
    if banks.ndim != 1 or banks.size < 2 or np.any(np.diff(banks) <= 0) or banks[0] <= 0 or banks[-1] > 1:
        raise ValueError("banks must be increasing, at least two, inside (0, 1]")
    n = _error_lags(T) if lags is None else np.asarray(lags, dtype=np.float64)
    frac = np.arange(1, per_interval + 1) / (per_interval + 1)
    alphas = (banks[:-1, None] + np.diff(banks)[:, None] * frac[None, :]).ravel()
    blend = _interp_weights(banks, alphas, n)
    exact = gl_weights(n[None, :], alphas[:, None])
    abs_err = np.abs(blend - exact)
    rel_err = abs_err / exact
    i, j = np.unravel_index(np.argmax(rel_err), rel_err.shape)
    return BankError(float(rel_err[i, j]), float(abs_err.max()), float(alphas[i]), int(n[j]))


def uniform_banks(K: int, delta: float) -> np.ndarray:
    """K evenly spaced orders from delta to 1."""
    return np.linspace(delta, 1.0, K)


def equidistributed_banks(K: int, delta: float, T: int, grid: int = 2001) -> np.ndarray:
    """K orders on [delta, 1] spaced so every interval has about the same interpolation error.

    Linear interpolation of w_n(alpha) in alpha with spacing h has relative error ~ h^2/8 * M(alpha),
    M(alpha) = max_n |d^2 w_n/d alpha^2| / w_n = max_n |g'^2 + g''| with g = log w_n,
    g' = psi(n+alpha) - psi(alpha), g'' = psi'(n+alpha) - psi'(alpha).  Equal error per interval
    means spacing ~ 1/sqrt(M), i.e. banks at equal quantiles of the density sqrt(M(alpha)).
    """
    if K < 2 or not 0.0 < delta < 1.0:
        raise ValueError("need K >= 2 and 0 < delta < 1")
    alpha = torch.linspace(delta, 1.0, grid, dtype=torch.float64)[:, None]
    n = torch.from_numpy(_error_lags(T))[None, :]
    g1 = torch.digamma(n + alpha) - torch.digamma(alpha)
    g2 = torch.polygamma(1, n + alpha) - torch.polygamma(1, alpha)
    density = torch.sqrt((g1 * g1 + g2).abs().amax(dim=1)).numpy()
    a = alpha[:, 0].numpy()
    cum = np.concatenate([[0.0], np.cumsum(0.5 * (density[1:] + density[:-1]) * np.diff(a))])
    banks = np.interp(np.linspace(0.0, cum[-1], K), cum, a)
    banks[0], banks[-1] = delta, 1.0
    return banks
