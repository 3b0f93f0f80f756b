"""Activation checkpointing keeps the scans' outputs, and in its "elementwise" mode the matmuls' too
(model/blocks.py, CHECKPOINT_POLICIES): the backward recomputes the rest of each block's forward, and the
gradients stay those of the plain step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.predict.ops import capture_ops
from kernels.phasor.compiled import PhasorScanCompiled
from kernels.soe.chunk import SoeScanChunked
from model import build_model
from tests.test_short_conv import FAMILIES

SCANS = {"vort": SoeScanChunked, "pmnet": PhasorScanCompiled}  # the CPU paths' Functions


@pytest.mark.parametrize("mode", [True, "elementwise"])
@pytest.mark.parametrize("kind", ["vort", "pmnet"])
def test_checkpointed_step_runs_what_its_mode_keeps_once_and_keeps_the_gradients(
    kind: str, mode: bool | str, monkeypatch: pytest.MonkeyPatch
) -> None:
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
    grads, runs, gemms = [], [], []
    for checkpointing in (False, mode):
        model.zero_grad()
        model.activation_checkpointing = checkpointing
        scanned.clear()

        def step() -> None:
            loss, _ = model.loss(ids[:, :-1], ids[:, 1:])
            loss.backward()

        # the blocks' GEMMs, forward and backward (the scans' own, origin "kernels", run as the scan path does)
        gemms.append(sum(op.kind == "gemm" and op.origin != "kernels" for op in capture_ops(step)))
        runs.append(len(scanned))
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    layers_with_scans = runs[0]
    assert 0 < layers_with_scans <= cfg.n_layers
    assert runs[1] == layers_with_scans  # the recompute took the outputs the forward kept
    if mode == "elementwise":
        assert gemms[1] == gemms[0]  # and the matmuls' outputs: no GEMM runs twice
    else:
        assert gemms[1] > gemms[0]  # the recompute ran the blocks' GEMMs again
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-5, atol=1e-7)


def test_unknown_checkpointing_mode_is_refused() -> None:
    model = build_model(FAMILIES["vort"]).train()
    model.activation_checkpointing = "sometimes"
    ids = torch.zeros(1, 9, dtype=torch.long)
    expected = "activation_checkpointing: expected false, true or 'elementwise', got 'sometimes'"
    with pytest.raises(ValueError, match=expected):
        model.loss(ids[:, :-1], ids[:, 1:])


def test_checkpointed_backward_fills_no_gradient_for_the_kept_states() -> None:
    """The scan op's kept outputs (the span and per-chunk states of the Triton backward, hundreds of MB a
    layer at long contexts) are not differentiated: autograd must not allocate and fill zero gradients for
    them. Captured on the meta device as the GPU runs the step (benchmarks.predict.step)."""
    from benchmarks.predict.step import capture_step_ops
    from model.config import load_model_config

    cfg = load_model_config(Path(__file__).resolve().parents[1] / "configs" / "model" / "vort-tiny.yaml")
    width = cfg.vort.n_features * (cfg.head_dim + 1)  # a packed state's row: F x D values and F normalisers
    ops = capture_step_ops(cfg, 1, 256, activation_checkpointing=True).ops
    fills = [op for op in ops if op.name.split(".")[1] in ("zeros", "zeros_like", "new_zeros", "fill_", "zero_")]
    kept = [op.outputs for op in fills if op.outputs and len(op.outputs[0][0]) == 3 and op.outputs[0][0][-1] == width]
    assert fills and not kept  # the scans' own fills only (a 2-d one for the final state's missing gradient)
