"""Certified kernels: the smallest node set meeting eps, with the error measured over every lag in [0, T]."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from model.soe.fit import _NODE_HI, _NODE_LO, _fit_sample, bank_coefficients, design_nodes, fit_coefficients
from model.soe.weights import gl_weights, soe_weights

# Default alpha range certified by the command line and ``certify``.
DEFAULT_ALPHA_RANGE = (0.1, 0.95)
# Number of lags evaluated at once when measuring errors over every n in [0, T] (bounds memory).
_CHUNK = 1 << 16
# Orders used to choose the nodes inside an alpha range (the smallest order is the hardest).
_DESIGN_POINTS = 9
# Largest S ``certify`` tries by default.
_MAX_TERMS = 96


def max_relative_error(log_lambda: np.ndarray, coef: np.ndarray, alphas: Sequence[float] | np.ndarray,
                       T: int) -> np.ndarray:
    """Max over every integer n in [0, T] of |soe - w_n(alpha)| / w_n(alpha), one value per order.

    ``coef`` is [K, S] aligned with ``alphas``.  All T + 1 lags are evaluated (in chunks of
    ``_CHUNK``), so this is a measurement, not an estimate from a sample.

    Speed: the SOE side is one float64 matmul per chunk against a [S, chunk] table of powers that is
    computed once per call and shared by every order (the chunk offset is folded into the
    coefficients).  The reference side is the exact recurrence w_n = w_{n-1} (n - 1 + alpha) / n run
    as a cumulative product along n, carried from chunk to chunk from w_0 = 1, instead of three
    lgammas per (n, alpha).  Each step rounds three times (add, divide, multiply), so the reference
    is within 3 (T + 1) u of the true weight (u = 2^-53: 1.7e-10 relative at T = 524288), tighter
    than the lgamma difference used by ``gl_weights`` (~1e-9 there) and nowhere near any eps used.
    """
    alphas = np.asarray(alphas, dtype=np.float64).reshape(-1)
    coef = np.atleast_2d(np.asarray(coef, dtype=np.float64))
    log_lambda = np.asarray(log_lambda, dtype=np.float64)
    if coef.shape != (alphas.size, log_lambda.size):
        raise ValueError(f"coef must be [{alphas.size}, {log_lambda.size}], got {list(coef.shape)}")
    if np.any(alphas <= 0.0):
        raise ValueError("orders must be > 0 (relative error against w_n(0) = 0 for n > 0 is undefined)")
    worst = np.zeros(alphas.size)
    if alphas.size == 0:
        return worst
    width = min(_CHUNK, T + 1)
    # lambda**(start + j) = lambda**j * lambda**start, all factors <= 1 (no division, no overflow).
    table = np.exp(log_lambda[:, None] * np.arange(width, dtype=np.float64)[None, :])
    exact = np.empty((alphas.size, width))
    approx = np.empty((alphas.size, width))
    last = np.ones(alphas.size)  # w_{start - 1}, carried across chunks
    for start in range(0, T + 1, width):
        count = min(T + 1, start + width) - start
        n = np.arange(start, start + count, dtype=np.float64)
        ex, ap = exact[:, :count], approx[:, :count]
        # Ratios w_n / w_{n-1} = (n - 1 + alpha) / n, then a running product.
        np.add((n - 1.0)[None, :], alphas[:, None], out=ex)
        if start == 0:
            ex[:, 0] = 1.0  # w_0 = 1 exactly
            np.divide(ex[:, 1:], n[None, 1:], out=ex[:, 1:])
        else:
            np.divide(ex, n[None, :], out=ex)
            ex[:, 0] *= last
        np.cumprod(ex, axis=1, out=ex)
        last = ex[:, -1].copy()
        np.matmul(coef * np.exp(start * log_lambda), table[:, :count], out=ap)
        np.subtract(ap, ex, out=ap)
        np.abs(ap, out=ap)
        np.divide(ap, ex, out=ap)
        np.maximum(worst, ap.max(axis=1), out=worst)
    return worst


@dataclass(frozen=True)
class SOEKernel:
    """What the VORT layer consumes: shared log-decays, per-bank coefficients and the bank orders.

    log_lambda: [S] float64, ascending, <= 0, last entry 0.0 (the lambda = 1 node used by alpha = 1).
    coef: [K, S] float64, row k gives w_n(banks[k]) ~= sum_s coef[k, s] * exp(n * log_lambda[s]).
    banks: [K] float64, increasing orders in (0, 1].
    """

    log_lambda: np.ndarray
    coef: np.ndarray
    banks: np.ndarray

    @property
    def S(self) -> int:
        """Number of SOE terms (recurrent states per head)."""
        return int(self.log_lambda.size)

    def weights(self, n: np.ndarray | Sequence[float]) -> np.ndarray:
        """SOE kernel of every bank at lags ``n``: [K, len(n)]."""
        return soe_weights(self.log_lambda, self.coef, np.asarray(n, dtype=np.float64))

    def as_tensors(self, dtype: torch.dtype = torch.float32,
                   device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(log_lambda [S], coef [K, S], banks [K]) as torch tensors, e.g. for register_buffer."""
        return tuple(torch.as_tensor(x, dtype=dtype, device=device)
                     for x in (self.log_lambda, self.coef, self.banks))


@dataclass(frozen=True)
class Certificate:
    """Result of ``certify``: the kernel plus the measured error that backs it.

    rel_err[k] is the max relative error of bank k over every n in [0, T]; design_err is the same
    measure at the orders used to choose the nodes (an even grid on alpha_range).
    """

    kernel: SOEKernel
    T: int
    eps: float
    alpha_range: tuple[float, float]
    rel_err: np.ndarray
    design_err: float

    @property
    def S(self) -> int:
        """Number of SOE terms, the lambda = 1 node included."""
        return self.kernel.S

    @property
    def max_rel_err(self) -> float:
        """Max relative error over the requested orders and every n in [0, T]."""
        return float(self.rel_err.max()) if self.rel_err.size else 0.0


def _design_alphas(alpha_range: tuple[float, float]) -> np.ndarray:
    """Evenly spaced orders below 1 on the range (empty when the range is just alpha = 1)."""
    lo, hi = alpha_range
    if lo >= 1.0:
        return np.empty(0)
    return np.unique(np.linspace(lo, min(hi, 1.0 - 1e-9), _DESIGN_POINTS))


def _sample_error(log_lambda: np.ndarray, alpha: float, T: int) -> float:
    """Max relative error of the fitted kernel on the fitting sample (cheap screen before certifying).

    Memoised per (nodes, alpha, T) like the fit: the bisection, the placement scan and certify's
    retry ask about the same node sets repeatedly.
    """
    return _sample_error_cached(np.asarray(log_lambda, dtype=np.float64).tobytes(), float(alpha), int(T))


@functools.lru_cache(maxsize=4096)
def _sample_error_cached(nodes_bytes: bytes, alpha: float, T: int) -> float:
    log_lambda = np.frombuffer(nodes_bytes, dtype=np.float64)
    n = _fit_sample(T)
    c = fit_coefficients(log_lambda, alpha, T)
    return float(np.max(np.abs(soe_weights(log_lambda, c, n) / gl_weights(n, alpha) - 1.0)))


def choose_nodes(T: int, eps: float, alpha_range: tuple[float, float] = DEFAULT_ALPHA_RANGE,
                 max_terms: int = _MAX_TERMS) -> np.ndarray:
    """Smallest shared node set whose fitted kernels meet ``eps`` on the fitting sample for the range.

    Doubling then bisection on the number of decaying nodes, with the default grid placement and
    the smallest order of the range (the hardest one in practice); then, from one node fewer than
    that, every candidate placement is checked on an even grid of orders, adding nodes until one
    passes for every order.  Raises ValueError when ``max_terms`` are not enough.
    """
    lo_alpha, hi_alpha = alpha_range
    if not 0.0 < lo_alpha <= hi_alpha <= 1.0:
        raise ValueError(f"alpha range must satisfy 0 < lo <= hi <= 1, got {alpha_range}")
    fitted = _design_alphas(alpha_range)
    if fitted.size == 0:
        return np.array([0.0])
    target = 0.9 * eps

    def passes_hardest(m: int) -> bool:
        return _sample_error(design_nodes(T, m, _NODE_LO[0], _NODE_HI[0]), fitted[0], T) <= target

    left, right = 1, 4
    while not passes_hardest(right):
        if right >= max_terms - 1:
            raise ValueError(f"no SOE kernel with <= {max_terms} terms meets eps={eps} for T={T}")
        left, right = right + 1, min(2 * right, max_terms - 1)
    while left < right:
        mid = (left + right) // 2
        if passes_hardest(mid):
            right = mid
        else:
            left = mid + 1
    for m in range(max(1, left - 1), max_terms):
        for lo in _NODE_LO:
            for hi in _NODE_HI:
                nodes = design_nodes(T, m, lo, hi)
                if all(_sample_error(nodes, a, T) <= target for a in fitted):
                    return nodes
    raise ValueError(f"no SOE kernel with <= {max_terms} terms meets eps={eps} for T={T}")


def certify(T: int, eps: float, alphas: Sequence[float] | np.ndarray | None = None,
            alpha_range: tuple[float, float] = DEFAULT_ALPHA_RANGE, max_terms: int = _MAX_TERMS) -> Certificate:
    """Choose the smallest S meeting ``eps`` and measure the error over every n in [0, T].

    The nodes are designed for ``alpha_range`` widened to contain every requested order below 1,
    so one node set serves them all.  The design orders are certified over all lags too, and S is
    increased until both they and the requested orders (default: the design orders) meet eps.
    """
    if T < 1 or eps <= 0:
        raise ValueError("need T >= 1 and eps > 0")
    requested = None if alphas is None else np.asarray(alphas, dtype=np.float64)
    lo, hi = alpha_range
    if requested is not None and requested.size:
        if np.any(requested <= 0) or np.any(requested > 1):
            raise ValueError("orders must lie in (0, 1]")
        below_one = requested[requested < 1.0]
        if below_one.size:
            lo, hi = min(lo, float(below_one.min())), max(hi, float(below_one.max()))
    design = _design_alphas((lo, hi))
    nodes = choose_nodes(T, eps, (lo, hi), max_terms)
    while True:
        design_coef = bank_coefficients(design, nodes, T)
        if requested is None:
            banks, coef = design, design_coef
            rel = design_rel = max_relative_error(nodes, design_coef, design, T)
        else:
            # One pass over every lag for the design and the requested orders together: the table
            # of powers is built once and the per-chunk work is one matmul for all of them.
            banks, coef = requested, bank_coefficients(requested, nodes, T)
            both = max_relative_error(nodes, np.concatenate([design_coef, coef]),
                                      np.concatenate([design, banks]), T)
            design_rel, rel = both[: design.size], both[design.size:]
        design_err = float(design_rel.max(initial=0.0))
        if max(design_err, float(rel.max(initial=0.0))) <= eps:
            return Certificate(SOEKernel(nodes, coef, banks), T, eps, (lo, hi), rel, design_err)
        if nodes.size >= max_terms:
            raise ValueError(f"no SOE kernel with <= {max_terms} terms meets eps={eps} for T={T}")
        # The sample screen passed but a lag between samples did not: one more decaying node
        # (nodes.size counts the lambda = 1 node, so this is the current decaying count + 1).
        nodes = min((design_nodes(T, nodes.size, a, b) for a in _NODE_LO for b in _NODE_HI),
                    key=lambda nd: max(_sample_error(nd, a, T) for a in design))
