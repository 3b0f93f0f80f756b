"""One-pass contractions of a per-term gradient block, compiled by numba (CPU tensors).

The backward of the chunked SOE scan forms, per chunk, the gradient of a per-term scaled operand,
X [BH, S, F, r] (X[s, f, j] = dL/d(scale[j, s] * y[j, f])), and needs two contractions of it:

    by_term[j, f]  = sum_s scale[s, j] X[s, f, j]      (the gradient of y)
    by_feature[s, j] = sum_f X[s, f, j] other[j, f]    (the gradient of the scale, up to a factor)

In PyTorch each is a broadcast product and a sum, four passes over X (2 MB at the benchmark shape,
larger than L2); this reads X once. Single-threaded: numba's OpenMP pool would reset torch's
intra-op thread count (they share libgomp).
"""

from __future__ import annotations

import numba
import torch


@numba.njit(cache=True, nogil=True)
def _contract(x, scale, other_t, by_term_t, by_feature):  # pragma: no cover - compiled
    bh, n_terms, feat, r = x.shape
    for i in range(bh):
        by_term_t[i] = 0.0
        for s in range(n_terms):
            row = by_feature[i, s]
            row[:] = 0.0
            weight = scale[i, s]
            for f in range(feat):
                xs = x[i, s, f]
                acc = by_term_t[i, f]
                oth = other_t[i, f]
                for j in range(r):
                    acc[j] += weight[j] * xs[j]
                    row[j] += xs[j] * oth[j]


def contract_terms(x: torch.Tensor, scale: torch.Tensor, other: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [BH, S, F, r], scale [BH, r, S], other [BH, r, F] -> (sum_s scale * x as [BH, r, F],
    sum_f x * other as [BH, S, r]), in x's dtype. Compiled on the CPU; PyTorch products elsewhere."""
    if x.device.type != "cpu":
        by_term = (x * scale.transpose(1, 2)[:, :, None, :]).sum(1).transpose(1, 2)
        return by_term, (x * other.transpose(1, 2)[:, None]).sum(2)
    bh, n_terms, feat, r = x.shape
    by_term_t = x.new_empty(bh, feat, r)
    by_feature = x.new_empty(bh, n_terms, r)
    _contract(
        x.contiguous().numpy(),
        scale.transpose(1, 2).contiguous().numpy(),
        other.transpose(1, 2).contiguous().numpy(),
        by_term_t.numpy(),
        by_feature.numpy(),
    )
    return by_term_t.transpose(1, 2), by_feature
