"""Sequential reference for the phasor scan (PMNet sections 2 and 4).

Each token reads the slots on its path (their phase before the token writes), then adds its increments.
The running sums are kept unwrapped in float64 and wrapped only when read, which is as plain as the
definition gets; differentiable through ordinary autograd.
"""

from __future__ import annotations

import torch

from kernels._common import wrap_angle


def phasor_scan_reference(
    delta: torch.Tensor,
    slots: torch.Tensor,
    n_slots: int,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    reset: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Token-by-token phasor scan: read[b,t,l] = wrap(state[b, slots[b,t,l]]) before token t writes.
    Where ``reset[b, t]`` (bool [B, T]), every slot of row b goes back to zero before token t reads."""
    batch, seq_len, levels, width = delta.shape
    init = delta.new_zeros(batch, n_slots, width, dtype=torch.float64)
    if initial_state is not None:
        init = init + initial_state.to(torch.float64)
    state = init
    idx = slots.long()[..., None].expand(batch, seq_len, levels, width)
    reads = []
    for t in range(seq_len):
        if reset is not None:
            state = torch.where(reset[:, t, None, None], 0.0, state)
        reads.append(wrap_angle(state.gather(1, idx[:, t])))
        state = state.scatter_add(1, idx[:, t], delta[:, t].to(torch.float64))
    read = torch.stack(reads, dim=1).to(delta.dtype)
    final = wrap_angle(state).to(delta.dtype) if output_final_state else None
    return read, final
