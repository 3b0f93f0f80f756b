"""Helpers for checking a scan backend against the reference: random inputs, a loss through every
output (including the final state), and error measures. Used by the tests and the GPU check script."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from kernels.phasor import phasor_scan
from kernels.soe import soe_scan


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error ||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a, b = a.double().cpu(), b.double().cpu()
    scale = b.norm().item()
    diff = (a - b).norm().item()
    return diff / scale if scale > 0 else diff


def angle_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest circular distance between two angle tensors (so 2*pi - eps and 0 agree)."""
    d = torch.remainder(a.double().cpu() - b.double().cpu() + math.pi, 2 * math.pi) - math.pi
    return d.abs().max().item() if d.numel() else 0.0


def soe_inputs(
    batch: int, seq_len: int, heads: int, feat: int, dim_v: int, n_terms: int, with_state: bool, seed: int
) -> dict[str, torch.Tensor]:
    """float64 inputs for soe_scan with decays spread over (0.1, 1] and a positive feature map like VORT's."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    inputs = {
        "q": rnd(batch, seq_len, heads, feat).exp() / feat,
        "k": rnd(batch, seq_len, heads, feat).exp() / feat,
        "v": rnd(batch, seq_len, heads, dim_v),
        "coef": rnd(batch, seq_len, heads, n_terms),
        "log_lam": -torch.rand(heads, n_terms, generator=gen, dtype=torch.float64) * 2.3,
    }
    if with_state:
        inputs["g0"] = rnd(batch, heads, n_terms, feat, dim_v)
        inputs["b0"] = rnd(batch, heads, n_terms, feat)
    return inputs


def phasor_inputs(
    batch: int, seq_len: int, levels: int, width: int, branching: int, with_state: bool, seed: int
) -> tuple[dict[str, torch.Tensor], int]:
    """float64 inputs for phasor_scan on a full tree (level l has branching**l slots); returns (inputs, n_slots)."""
    gen = torch.Generator().manual_seed(seed)
    sizes = [branching**level for level in range(levels)]
    offsets = [sum(sizes[:level]) for level in range(levels)]
    slots = torch.stack(
        [off + torch.randint(0, size, (batch, seq_len), generator=gen) for off, size in zip(offsets, sizes)], dim=-1
    )
    n_slots = sum(sizes)
    inputs = {"delta": torch.randn(batch, seq_len, levels, width, generator=gen, dtype=torch.float64), "slots": slots}
    if with_state:
        inputs["init"] = torch.rand(batch, n_slots, width, generator=gen, dtype=torch.float64) * 2 * math.pi
    return inputs, n_slots


def resets(seq_len: int, rows: Sequence[Sequence[int]]) -> torch.Tensor:
    """bool [len(rows), seq_len], True at the listed document starts of each row."""
    reset = torch.zeros(len(rows), seq_len, dtype=torch.bool)
    for row, positions in enumerate(rows):
        reset[row, positions] = True
    return reset


def _run_with_grads(
    call: Callable[[dict[str, torch.Tensor]], list[torch.Tensor]],
    inputs: dict[str, torch.Tensor],
    dtype: torch.dtype,
    device: str | torch.device,
    seed: int,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    leaves = {
        name: (
            x.detach().to(device=device, dtype=dtype, copy=True).requires_grad_()
            if x.is_floating_point()
            else x.to(device)
        )
        for name, x in inputs.items()
    }
    outs = call(leaves)
    gen = torch.Generator().manual_seed(seed)
    loss = sum((o.double() * torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.device)).sum() for o in outs)
    loss.backward()
    # an input no output depends on (a state dropped by a reset at the first token) has gradient zero
    grads = {
        name: torch.zeros_like(x) if x.grad is None else x.grad for name, x in leaves.items() if x.is_floating_point()
    }
    return [o.detach() for o in outs], grads


def soe_run(
    inputs: dict[str, torch.Tensor],
    backend: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    chunk_size: int = 64,
    seed: int = 0,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs [o, z, G_T, b_T] and the gradients of a fixed random linear loss on all four (with the
    document starts of ``inputs["reset"]`` when present)."""

    def call(x: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        state = (x["g0"], x["b0"]) if "g0" in x else None
        scan_inputs = (x[name] for name in ("q", "k", "v", "coef", "log_lam"))
        o, z, (g, b) = soe_scan(*scan_inputs, state, True, chunk_size, backend, reset=x.get("reset"))
        return [o, z, g, b]

    return _run_with_grads(call, inputs, dtype, device, seed)


def phasor_run(
    inputs: dict[str, torch.Tensor],
    n_slots: int,
    backend: str,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs [read, final] and the gradients of a fixed random linear loss on both (with the document
    starts of ``inputs["reset"]`` when present)."""

    def call(x: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        read, final = phasor_scan(
            x["delta"], x["slots"], n_slots, x.get("init"), True, backend=backend, reset=x.get("reset")
        )
        return [read, final]

    return _run_with_grads(call, inputs, dtype, device, seed)
