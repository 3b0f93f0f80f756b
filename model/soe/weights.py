"""The exact Grünwald–Letnikov weights w_n(alpha) and the evaluation of an SOE approximation of them."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def gl_weights(n: np.ndarray | Sequence[float] | float, alpha: np.ndarray | Sequence[float] | float) -> np.ndarray:
    """Exact Grünwald–Letnikov weights w_n(alpha) in float64, broadcasting ``n`` against ``alpha``.

    Computed as exp(lgamma(n+alpha) - lgamma(alpha) - lgamma(n+1)) so that no product of ratios
    accumulates rounding over long lags (the lgamma difference loses about log10(n log n) digits:
    relative accuracy ~1e-9 at n ~ 5e5, far below any eps used here).  alpha = 1 gives exactly 1
    for every n; alpha = 0 gives the limit (1, 0, 0, ...); n = 0 gives exactly 1 for every alpha.
    """
    n_arr = np.asarray(n, dtype=np.float64)
    a_arr = np.asarray(alpha, dtype=np.float64)
    if np.any(n_arr < 0) or np.any(a_arr < 0):
        raise ValueError("gl_weights needs n >= 0 and alpha >= 0")
    positive = a_arr > 0
    nt = torch.as_tensor(n_arr)
    at = torch.as_tensor(a_arr if positive.all() else np.where(positive, a_arr, 1.0))
    # lgamma of the broadcast sum only; the n-only and alpha-only terms are computed once each.
    # At n = 0 the exponent is exactly lgamma(a) - lgamma(a) - lgamma(1) = 0, so w_0 = 1 exactly.
    w = torch.exp(torch.lgamma(nt + at) - torch.lgamma(at) - torch.lgamma(nt + 1.0))
    if not positive.all():
        w = torch.where(torch.as_tensor(positive), w, (nt == 0).to(w.dtype))
    return w.numpy()


def soe_weights(log_lambda: np.ndarray, coef: np.ndarray, n: np.ndarray | Sequence[float]) -> np.ndarray:
    """Evaluate the SOE kernel sum_s coef[..., s] * lambda_s**n; returns shape coef.shape[:-1] + n.shape."""
    powers = np.exp(np.multiply.outer(np.asarray(n, dtype=np.float64), np.asarray(log_lambda, dtype=np.float64)))
    return np.tensordot(np.asarray(coef, dtype=np.float64), powers, axes=([-1], [-1]))
