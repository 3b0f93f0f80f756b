"""Sequential reference for the sum-of-exponentials (SOE) scan.

One step per token, exactly the recurrence of VORT section 4. It is slow and differentiable through
plain autograd; every fast path is tested against it (run it in float64 for a tight reference).
"""

from __future__ import annotations

import torch

from kernels._common import work_dtype


def soe_scan_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    coef: torch.Tensor,
    log_lam: torch.Tensor,
    initial_state: tuple[torch.Tensor, torch.Tensor] | None = None,
    output_final_state: bool = False,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
    """Token-by-token SOE scan; computes in float64 if the inputs are float64, else in float32.

    G_{t,s} = lam_s G_{t-1,s} + coef[t,s] k_t v_t^T,  b_{t,s} = lam_s b_{t-1,s} + coef[t,s] k_t,
    o_t = sum_s q_t^T G_{t,s},  z_t = sum_s q_t . b_{t,s}.
    With ``reset`` (bool [B, T]), G_{t-1} and b_{t-1} are taken as zero where reset[:, t] is True: the
    token starts a document, and it and the tokens after it see nothing written before it.
    """
    batch, seq_len, heads, feat = q.shape
    dim_v = v.shape[-1]
    n_terms = log_lam.shape[-1]
    dtype = work_dtype(q.dtype)
    q, k, v, coef = (x.to(dtype) for x in (q, k, v, coef))
    lam = log_lam.to(dtype).exp()[None, :, :, None]  # [1, H, S, 1]
    if initial_state is None:
        g = q.new_zeros(batch, heads, n_terms, feat, dim_v)
        b = q.new_zeros(batch, heads, n_terms, feat)
    else:
        g, b = (x.to(dtype) for x in initial_state)
    outs, norms = [], []
    for t in range(seq_len):
        if reset is not None:
            keep = (~reset[:, t]).to(dtype)[:, None, None, None]  # [B, 1, 1, 1]
            g, b = g * keep[..., None], b * keep
        c_t = coef[:, t, :, :, None]  # [B, H, S, 1]
        k_t = k[:, t, :, None, :]  # [B, H, 1, F]
        g = lam[..., None] * g + (c_t * k_t)[..., None] * v[:, t, :, None, None, :]
        b = lam * b + c_t * k_t
        outs.append(torch.einsum("bhf,bhsfd->bhd", q[:, t], g))
        norms.append(torch.einsum("bhf,bhsf->bh", q[:, t], b))
    o = torch.stack(outs, dim=1).to(q.dtype)
    z = torch.stack(norms, dim=1).to(q.dtype)
    return o, z, ((g, b) if output_final_state else None)
