"""The phasor scan: the compiled CPU (numba) and segmented PyTorch backends against the float64 reference."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import phasor_scan, soe_scan
from kernels._common import resolve_backend
from kernels.phasor import PHASOR_BACKENDS
from kernels.testing import angle_err, phasor_inputs, phasor_run, rel_err, resets

FWD_TOL, GRAD_TOL = 1e-4, 1e-3
CPU_BACKENDS = ["torch", "segmented"]  # "torch" on CPU tensors is the compiled (numba) loop


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


@pytest.mark.parametrize("backend", CPU_BACKENDS)
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
def test_matches_reference(backend, batch, seq_len, levels, width, branching, with_state, seed):
    inputs, n_slots = phasor_inputs(batch, seq_len, levels, width, branching, with_state, seed)
    assert_matches_reference(inputs, n_slots, backend)


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_reads_are_exclusive_prefix_sums(backend):
    """Slot 0 written by every token: read_t = wrap(sum_{j<t} delta_j), final = wrap(sum of all)."""
    delta = torch.full((1, 5, 1, 1), 2.0, dtype=torch.float64)
    read, final = phasor_scan(delta, torch.zeros(1, 5, 1, dtype=torch.long), 3, None, True, backend=backend)
    want = torch.remainder(torch.tensor([0.0, 2.0, 4.0, 6.0, 8.0], dtype=torch.float64), 2 * math.pi)
    assert torch.allclose(read.flatten().double(), want, atol=1e-6)
    assert abs(final[0, 0, 0].item() - math.remainder(10.0, 2 * math.pi) % (2 * math.pi)) < 1e-6
    assert final[0, 1:].abs().max() == 0


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_unwritten_slots_keep_initial_phase_wrapped(backend):
    init = torch.tensor([[[7.0], [-1.0]]])
    slots = torch.zeros(1, 3, 1, dtype=torch.long)
    _, final = phasor_scan(torch.ones(1, 3, 1, 1), slots, 2, init, True, backend=backend)
    assert abs(final[0, 1, 0].item() - (2 * math.pi - 1.0)) < 1e-6
    assert abs(final[0, 0, 0].item() - (10.0 - 2 * math.pi)) < 1e-5


@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_precision_holds_over_long_sequences(backend):
    """200k increments of 0.1 rad on one slot: the read stays exact to ~1e-5 rad in the fp32 result."""
    seq_len = 200_000
    delta = torch.full((1, seq_len, 1, 1), 0.1)
    slots = torch.zeros(1, seq_len, 1, dtype=torch.long)
    read, final = phasor_scan(delta, slots, 1, output_final_state=True, backend=backend)
    step = delta[0, 0, 0, 0].item()  # the fp32 value of 0.1, exactly
    exact = torch.remainder(torch.arange(seq_len, dtype=torch.float64) * step, 2 * math.pi)
    assert angle_err(read.flatten(), exact) < 1e-5
    assert angle_err(final.flatten(), torch.tensor([seq_len * step], dtype=torch.float64)) < 1e-5


@pytest.mark.parametrize("backend", [*CPU_BACKENDS, "reference"])
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
@pytest.mark.parametrize("backend", CPU_BACKENDS)
def test_matches_reference_long(backend):
    inputs, n_slots = phasor_inputs(2, 5000, 3, 16, 4, True, seed=7)
    assert_matches_reference(inputs, n_slots, backend)


def test_backend_selection():
    cpu = torch.empty(1)
    assert resolve_backend("auto", cpu, PHASOR_BACKENDS) == "torch"
    assert resolve_backend("segmented", cpu, PHASOR_BACKENDS) == "segmented"
    assert phasor_scan(torch.ones(1, 2, 1, 1), torch.zeros(1, 2, 1, dtype=torch.long), 1)[0].dtype == torch.float32
    with pytest.raises(ValueError, match="segmented"):
        phasor_scan(torch.ones(1, 2, 1, 1), torch.zeros(1, 2, 1, dtype=torch.long), 1, backend="cuda")


def test_compiled_kernels_leave_torch_threads_alone():
    """numba's OpenMP pool shares libgomp with torch and, once started, resets torch's intra-op thread
    count; the compiled kernels (phasor scan, SOE backward contractions) must not start it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        inputs, n_slots = phasor_inputs(2, 50, 3, 19, 3, True, seed=1)
        delta = inputs["delta"].float().requires_grad_()
        read, _ = phasor_scan(delta, inputs["slots"], n_slots, inputs["init"].float(), True, backend="torch")
        read.sum().backward()
        q = torch.rand(1, 40, 2, 4, requires_grad=True)
        o, z, _ = soe_scan(q, q.detach(), torch.randn(1, 40, 2, 4), torch.randn(1, 40, 2, 3), -torch.rand(2, 3))
        (o.sum() + z.sum()).backward()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("loss_on", ["read", "final"])
@pytest.mark.parametrize("reset", [None, [[4, 5, 20], [0]], [[29], []]])
def test_compiled_gradient_of_one_output(loss_on, reset):
    """A loss on only the reads or only the final state (the other gradient arrives as None), with and
    without document resets (on the last token, at the first, back to back, a row without one)."""
    inputs, n_slots = phasor_inputs(2, 30, 3, 5, 3, True, seed=4)
    starts = None if reset is None else resets(30, reset)
    grads = {}
    for backend in ("torch", "reference"):
        delta = inputs["delta"].double().requires_grad_()
        init = inputs["init"].double().requires_grad_()
        read, final = phasor_scan(delta, inputs["slots"], n_slots, init, True, backend=backend, reset=starts)
        out = read if loss_on == "read" else final
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
        grads[backend] = torch.autograd.grad((out.double() * weights).sum(), (delta, init))
    for got, want in zip(grads["torch"], grads["reference"]):
        assert rel_err(got, want) <= 1e-6  # the final state is returned in fp32


def test_compiled_low_precision_inputs():
    """bf16 increments: the scan runs in fp32 and returns bf16 reads and fp32 final phases."""
    inputs, n_slots = phasor_inputs(1, 40, 3, 8, 3, True, seed=5)
    delta = inputs["delta"].bfloat16().requires_grad_()
    read, final = phasor_scan(delta, inputs["slots"], n_slots, inputs["init"].float(), True, backend="torch")
    assert read.dtype == torch.bfloat16 and final.dtype == torch.float32
    ref_read, ref_final = phasor_scan(
        delta.detach().double(), inputs["slots"], n_slots, inputs["init"].double(), True, backend="reference"
    )
    assert angle_err(read.double(), ref_read) <= 2e-2 and angle_err(final.double(), ref_final) <= 1e-5
    read.float().sum().backward()
    assert delta.grad.dtype == torch.bfloat16 and torch.isfinite(delta.grad.float()).all()


def test_torch_in_many_pieces_matches_reference(monkeypatch):
    """Long inputs run in pieces with the state carried between them; force tiny pieces to check that path."""
    import kernels.phasor.segment as segment

    monkeypatch.setattr(segment, "PIECE_VALUES", 40)
    inputs, n_slots = phasor_inputs(2, 45, 3, 4, 3, True, seed=12)
    assert len(segment._pieces(inputs["delta"])) > 5
    assert_matches_reference(inputs, n_slots, "segmented")


# ----------------------------------------------------------------------------- document resets

# starts per row of 24 tokens: inside chunks of the Triton kernels (16 tokens), on the chunk edge (16), at
# the first and last token, back to back, and a row without one
RESET_CASES = [[[3, 16, 17, 23]], [[0, 1, 9], []], [[12], [0, 16]]]


@pytest.mark.parametrize("backend", CPU_BACKENDS)
@pytest.mark.parametrize("starts", RESET_CASES)
@pytest.mark.parametrize("with_state", [False, True])
def test_reset_matches_reference(backend, starts, with_state):
    inputs, n_slots = phasor_inputs(len(starts), 24, 3, 4, 3, with_state, seed=len(starts[0]))
    inputs["reset"] = resets(24, starts)
    assert_matches_reference(inputs, n_slots, backend)


def test_reset_equals_each_document_alone():
    """The reference with resets: the first document reads what it reads scanned alone from the initial
    state, every later one what it reads alone from zero, and the final phases are the last document's."""
    inputs, n_slots = phasor_inputs(1, 24, 3, 4, 3, True, seed=7)
    starts = [5, 6, 19]
    read, final = phasor_scan(
        inputs["delta"], inputs["slots"], n_slots, inputs["init"], True, "reference", reset=resets(24, [starts])
    )
    for lo, hi in itertools.pairwise([0, *starts, 24]):
        want, want_final = phasor_scan(
            inputs["delta"][:, lo:hi], inputs["slots"][:, lo:hi], n_slots, inputs["init"] if lo == 0 else None,
            True, "reference"
        )
        assert angle_err(read[:, lo:hi], want) < 1e-12, (lo, hi)
    assert angle_err(final, want_final) < 1e-12


def test_reset_segmented_in_many_pieces(monkeypatch):
    """The segmented scan's pieces carry a state zeroed by a reset like any other."""
    import kernels.phasor.segment as segment

    monkeypatch.setattr(segment, "PIECE_VALUES", 40)
    inputs, n_slots = phasor_inputs(2, 45, 3, 4, 3, True, seed=12)
    inputs["reset"] = resets(45, [[3, 10, 11, 30], [22]])
    assert len(segment._pieces(inputs["delta"])) > 5
    assert_matches_reference(inputs, n_slots, "segmented")


def test_reset_input_errors():
    inputs, n_slots = phasor_inputs(1, 8, 2, 3, 2, False, seed=0)
    with pytest.raises(ValueError, match="reset must be bool"):
        phasor_scan(inputs["delta"], inputs["slots"], n_slots, reset=torch.zeros(1, 7, dtype=torch.bool))
