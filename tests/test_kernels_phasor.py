"""The phasor scan: the segmented PyTorch backend against the sequential float64 reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import phasor_scan
from kernels.testing import angle_err, phasor_inputs, phasor_run, rel_err

FWD_TOL, GRAD_TOL = 1e-4, 1e-3


def assert_matches_reference(inputs, n_slots, backend, **kw):
    (read, final), grads = phasor_run(inputs, n_slots, backend, **kw)
    (ref_read, ref_final), ref_grads = phasor_run(inputs, n_slots, "reference", dtype=torch.float64)
    assert read.shape == ref_read.shape and final.shape == ref_final.shape
    # Angles are compared on the circle: wrap may land a value just below 2*pi on one side and near 0 on the other.
    assert angle_err(read, ref_read) <= FWD_TOL * 2 * math.pi
    assert angle_err(final, ref_final) <= FWD_TOL * 2 * math.pi
    assert read.min() >= 0 and read.max() < 2 * math.pi + 1e-6
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) <= GRAD_TOL, name


@settings(max_examples=15, deadline=None)
@given(
    batch=st.integers(1, 3),
    seq_len=st.integers(1, 80),
    levels=st.integers(1, 3),
    width=st.integers(1, 6),
    branching=st.integers(1, 4),
    with_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_torch_matches_reference(batch, seq_len, levels, width, branching, with_state, seed):
    inputs, n_slots = phasor_inputs(batch, seq_len, levels, width, branching, with_state, seed)
    assert_matches_reference(inputs, n_slots, "torch")


def test_reads_are_exclusive_prefix_sums():
    """Slot 0 written by every token: read_t = wrap(sum_{j<t} delta_j), final = wrap(sum of all)."""
    delta = torch.full((1, 5, 1, 1), 2.0, dtype=torch.float64)
    read, final = phasor_scan(delta, torch.zeros(1, 5, 1, dtype=torch.long), 3, output_final_state=True)
    want = torch.remainder(torch.tensor([0.0, 2.0, 4.0, 6.0, 8.0], dtype=torch.float64), 2 * math.pi)
    assert torch.allclose(read.flatten().double(), want, atol=1e-6)
    assert abs(final[0, 0, 0].item() - math.remainder(10.0, 2 * math.pi) % (2 * math.pi)) < 1e-6
    assert final[0, 1:].abs().max() == 0


def test_unwritten_slots_keep_initial_phase_wrapped():
    init = torch.tensor([[[7.0], [-1.0]]])
    _, final = phasor_scan(torch.ones(1, 3, 1, 1), torch.zeros(1, 3, 1, dtype=torch.long), 2, init, True)
    assert abs(final[0, 1, 0].item() - (2 * math.pi - 1.0)) < 1e-6
    assert abs(final[0, 0, 0].item() - (10.0 - 2 * math.pi)) < 1e-5


def test_precision_holds_over_long_sequences():
    """200k increments of 0.1 rad on one slot: the read stays exact to ~1e-4 rad in the fp32 result."""
    seq_len = 200_000
    delta = torch.full((1, seq_len, 1, 1), 0.1)
    read, final = phasor_scan(delta, torch.zeros(1, seq_len, 1, dtype=torch.long), 1, output_final_state=True)
    step = delta[0, 0, 0, 0].item()  # the fp32 value of 0.1, exactly
    exact = torch.remainder(torch.arange(seq_len, dtype=torch.float64) * step, 2 * math.pi)
    assert angle_err(read.flatten(), exact) < 1e-5
    assert angle_err(final.flatten(), torch.tensor([seq_len * step], dtype=torch.float64)) < 1e-5


@pytest.mark.parametrize("backend", ["torch", "reference"])
def test_carried_state_equals_one_pass(backend):
    inputs, n_slots = phasor_inputs(2, 70, 3, 4, 3, True, seed=2)
    results = []
    for cuts in ([], [1, 33, 50]):
        delta = inputs["delta"].float().requires_grad_()
        init = inputs["init"].float().requires_grad_()
        state, reads = init, []
        bounds = [0, *cuts, 70]
        for lo, hi in itertools.pairwise(bounds):
            read, state = phasor_scan(delta[:, lo:hi], inputs["slots"][:, lo:hi], n_slots, state, True, backend=backend)
            reads.append(read)
        read = torch.cat(reads, 1)
        gen = torch.Generator().manual_seed(0)
        loss = (read * torch.randn(read.shape, generator=gen)).sum() + (
            state * torch.randn(state.shape, generator=gen)
        ).sum()
        loss.backward()
        results.append((read.detach(), state.detach(), delta.grad, init.grad))
    (r1, f1, gd1, gi1), (r2, f2, gd2, gi2) = results
    assert angle_err(r1, r2) <= 1e-5 and angle_err(f1, f2) <= 1e-5
    assert rel_err(gd2, gd1) <= GRAD_TOL and rel_err(gi2, gi1) <= GRAD_TOL


def test_input_errors():
    delta = torch.zeros(1, 4, 2, 3)
    slots = torch.zeros(1, 4, 2, dtype=torch.long)
    with pytest.raises(ValueError, match="slots"):
        phasor_scan(delta, slots[..., :1], 4)
    with pytest.raises(ValueError, match="integer"):
        phasor_scan(delta, slots.float(), 4)
    with pytest.raises(ValueError, match="initial_state"):
        phasor_scan(delta, slots, 4, torch.zeros(1, 5, 3))
    with pytest.raises(ValueError, match="share a slot"):
        phasor_scan(delta, slots, 4)  # both levels write slot 0
    with pytest.raises(ValueError, match=r"\[0, 4\)"):
        phasor_scan(delta, torch.stack([slots[..., 0], slots[..., 1] + 4], -1), 4)


@pytest.mark.slow
def test_torch_matches_reference_long():
    inputs, n_slots = phasor_inputs(2, 5000, 3, 16, 4, True, seed=7)
    assert_matches_reference(inputs, n_slots, "torch")


def test_torch_in_many_pieces_matches_reference(monkeypatch):
    """Long inputs run in pieces with the state carried between them; force tiny pieces to check that path."""
    import kernels.phasor.segment as segment

    monkeypatch.setattr(segment, "PIECE_VALUES", 40)
    inputs, n_slots = phasor_inputs(2, 45, 3, 4, 3, True, seed=12)
    assert len(segment._pieces(inputs["delta"])) > 5
    assert_matches_reference(inputs, n_slots, "torch")
