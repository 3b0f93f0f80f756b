"""Activation checkpointing keeps the scans' outputs (model/blocks.py, SCAN_OUTPUTS_KEPT): the backward
recomputes each block's forward but its scans, and the gradients stay those of the plain step."""

from __future__ import annotations

import pytest
import torch

from kernels.phasor.compiled import PhasorScanCompiled
from kernels.soe.chunk import SoeScanChunked
from model import build_model
from tests.test_short_conv import FAMILIES

SCANS = {"vort": SoeScanChunked, "pmnet": PhasorScanCompiled}  # the CPU paths' Functions


@pytest.mark.parametrize("kind", ["vort", "pmnet"])
def test_checkpointed_step_scans_once_per_block_and_keeps_the_gradients(kind: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    function = SCANS[kind]
    scanned = []
    forward = function.forward

    def counted(*args: object) -> object:
        scanned.append(1)
        return forward(*args)

    monkeypatch.setattr(function, "forward", staticmethod(counted))
    torch.manual_seed(0)
    cfg = FAMILIES[kind]
    model = build_model(cfg).train()
    ids = torch.randint(0, 258, (2, 33), generator=torch.Generator().manual_seed(3))
    grads, runs = [], []
    for checkpointing in (False, True):
        model.zero_grad()
        model.activation_checkpointing = checkpointing
        scanned.clear()
        loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
        loss.backward()
        runs.append(len(scanned))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    layers_with_scans = runs[0]
    assert 0 < layers_with_scans <= cfg.n_layers
    assert runs[1] == layers_with_scans  # the recompute took the outputs the forward kept
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)
