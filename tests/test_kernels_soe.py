"""The SOE scan: the chunked PyTorch backend against the sequential float64 reference."""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import soe_scan
from kernels._common import resolve_backend
from kernels.testing import rel_err, resets, soe_inputs, soe_run

FWD_TOL, GRAD_TOL = 1e-4, 1e-3


def assert_matches_reference(inputs, backend, chunk_size, **kw):
    outs, grads = soe_run(inputs, backend, chunk_size=chunk_size, **kw)
    ref_outs, ref_grads = soe_run(inputs, "reference", dtype=torch.float64)
    for name, got, want in zip(("o", "z", "G", "b"), outs, ref_outs):
        assert got.shape == want.shape, name
        assert rel_err(got, want) <= FWD_TOL, (name, rel_err(got, want))
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) <= GRAD_TOL, (name, rel_err(grads[name], ref_grads[name]))


@settings(max_examples=12, deadline=None)
@given(
    batch=st.integers(1, 2),
    seq_len=st.integers(1, 70),
    heads=st.integers(1, 2),
    feat=st.integers(1, 6),
    dim_v=st.integers(1, 5),
    n_terms=st.integers(1, 5),
    chunk_size=st.sampled_from([1, 4, 16, 64]),
    with_state=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_torch_matches_reference(batch, seq_len, heads, feat, dim_v, n_terms, chunk_size, with_state, seed):
    inputs = soe_inputs(batch, seq_len, heads, feat, dim_v, n_terms, with_state, seed)
    assert_matches_reference(inputs, "torch", chunk_size)


@pytest.mark.parametrize(
    ("seq_len", "n_terms", "chunk_size", "with_state"),
    [(1, 1, 64, True), (1, 3, 64, False), (130, 1, 64, True), (200, 8, 64, True), (97, 4, 32, False)],
)
def test_torch_edge_shapes(seq_len, n_terms, chunk_size, with_state):
    inputs = soe_inputs(2, seq_len, 2, 8, 8, n_terms, with_state, seed=seq_len)
    assert_matches_reference(inputs, "torch", chunk_size)


def test_no_decay_is_plain_linear_attention():
    """lam = 1 and coef = 1: o_t = sum_{j<=t} (q_t . k_j) v_j exactly."""
    inputs = soe_inputs(1, 50, 1, 4, 3, 1, False, seed=3)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    o, z, _ = soe_scan(q, k, v, torch.ones(1, 50, 1, 1, dtype=q.dtype), torch.zeros(1, 1, dtype=q.dtype), chunk_size=8)
    scores = torch.einsum("bthf,bjhf->bhtj", q, k).tril()
    assert torch.allclose(o, torch.einsum("bhtj,bjhd->bthd", scores, v), rtol=1e-10, atol=1e-10)
    assert torch.allclose(z, scores.sum(-1).transpose(1, 2), rtol=1e-10, atol=1e-10)


def test_float64_inputs_stay_float64_in_reference():
    inputs = soe_inputs(1, 5, 1, 2, 2, 2, False, seed=0)
    o, z, (g, b) = soe_scan(*inputs.values(), output_final_state=True, backend="reference")
    assert o.dtype == z.dtype == g.dtype == b.dtype == torch.float64


def _run_in_pieces(inputs, backend, cuts, chunk_size):
    leaves = {n: x.float().requires_grad_() for n, x in inputs.items()}
    state = (leaves["g0"], leaves["b0"]) if "g0" in leaves else None
    outs = []
    bounds = [0, *cuts, inputs["q"].shape[1]]
    for lo, hi in itertools.pairwise(bounds):
        piece = [leaves[n][:, lo:hi] for n in ("q", "k", "v", "coef")]
        o, z, state = soe_scan(*piece, leaves["log_lam"], state, True, chunk_size=chunk_size, backend=backend)
        outs.append((o, z))
    result = [torch.cat([o for o, _ in outs], 1), torch.cat([z for _, z in outs], 1), *state]
    gen = torch.Generator().manual_seed(5)
    loss = sum((r.double() * torch.randn(r.shape, generator=gen, dtype=torch.float64)).sum() for r in result)
    loss.backward()
    return [r.detach() for r in result], {n: x.grad for n, x in leaves.items()}


@pytest.mark.parametrize("backend", ["torch", "reference"])
@pytest.mark.parametrize("with_state", [False, True])
def test_carried_state_equals_one_pass(backend, with_state):
    inputs = soe_inputs(2, 90, 2, 4, 5, 3, with_state, seed=11)
    whole, whole_grads = _run_in_pieces(inputs, backend, [], chunk_size=16)
    split, split_grads = _run_in_pieces(inputs, backend, [1, 37, 64], chunk_size=16)
    for a, b in zip(split, whole):
        assert rel_err(a, b) <= FWD_TOL
    for name in whole_grads:
        assert rel_err(split_grads[name], whole_grads[name]) <= GRAD_TOL, name


def test_final_state_only_gradients():
    """A loss on the final state alone reaches every input, and matches the reference."""
    inputs = soe_inputs(1, 40, 2, 3, 3, 2, True, seed=4)
    got, want = {}, {}
    for backend, store in (("torch", got), ("reference", want)):
        leaves = {n: x.clone().requires_grad_() for n, x in inputs.items()}
        _, _, (g, b) = soe_scan(
            *(leaves[n] for n in ("q", "k", "v", "coef", "log_lam")),
            (leaves["g0"], leaves["b0"]),
            True,
            chunk_size=16,
            backend=backend,
        )
        (g.sum() + 2 * b.sum()).backward()
        store.update({n: x.grad for n, x in leaves.items()})
    assert got["q"].abs().max() == 0  # queries do not touch the state
    for name in ("k", "v", "coef", "log_lam", "g0", "b0"):
        assert rel_err(got[name], want[name]) <= 1e-8, name


def test_backend_selection():
    cpu = torch.zeros(1)
    assert resolve_backend("auto", cpu) == "torch"
    assert resolve_backend("reference", cpu) == "reference"
    assert resolve_backend("auto", torch.empty(1, device="meta")) == "torch"
    assert resolve_backend("auto", SimpleNamespace(is_cuda=True)) == "triton"
    assert resolve_backend("torch", SimpleNamespace(is_cuda=True)) == "torch"
    with pytest.raises(ValueError, match="backend"):
        resolve_backend("cuda", cpu)


def test_auto_on_cpu_is_the_chunked_path(monkeypatch):
    import kernels.soe as soe_module

    calls = []
    real = soe_module.SoeScanChunked.apply
    monkeypatch.setattr(soe_module.SoeScanChunked, "apply", lambda *a: calls.append(1) or real(*a))
    inputs = soe_inputs(1, 3, 1, 2, 2, 2, False, seed=0)
    soe_scan(*(x.float() for x in inputs.values()))
    assert calls == [1]


def test_shape_errors():
    inputs = soe_inputs(1, 4, 2, 3, 3, 2, False, seed=0)
    q, k, v, coef, log_lam = inputs.values()
    with pytest.raises(ValueError, match="log_lam"):
        soe_scan(q, k, v, coef, log_lam[:1])
    with pytest.raises(ValueError, match="coef"):
        soe_scan(q, k, v, coef[..., :1], log_lam)
    with pytest.raises(ValueError, match="initial_state"):
        soe_scan(q, k, v, coef, log_lam, (torch.zeros(1), torch.zeros(1)))


@pytest.mark.slow
def test_torch_matches_reference_long():
    inputs = soe_inputs(1, 2000, 2, 16, 16, 32, True, seed=9)
    assert_matches_reference(inputs, "torch", 64)


def test_bf16_inputs_accumulate_in_fp32():
    """The CPU path takes bf16 (the models' compute dtype): outputs come back in bf16, the state in fp32,
    and both match the reference run on the same (bf16-rounded) inputs to bf16 precision."""
    inputs = soe_inputs(1, 70, 2, 8, 8, 4, False, seed=6)
    low = {n: x.to(torch.bfloat16) for n, x in inputs.items()}
    o, z, (g, b) = soe_scan(*low.values(), output_final_state=True)
    ref_o, ref_z, (ref_g, _) = soe_scan(
        *(x.double() for x in low.values()), output_final_state=True, backend="reference"
    )
    assert o.dtype == z.dtype == torch.bfloat16 and g.dtype == b.dtype == torch.float32
    assert rel_err(o, ref_o) < 1e-2 and rel_err(z, ref_z) < 1e-2
    assert rel_err(g, ref_g) < 1e-5


def test_gradients_only_where_asked_and_no_grad_mode():
    inputs = soe_inputs(1, 20, 1, 3, 3, 2, False, seed=8)
    q, k, v, coef, log_lam = (x.float() for x in inputs.values())
    v.requires_grad_()
    o, z, _ = soe_scan(q, k, v, coef, log_lam, chunk_size=8)
    (o.sum() + z.sum()).backward()
    assert v.grad is not None and q.grad is None and log_lam.grad is None
    with torch.no_grad():
        o2, _, _ = soe_scan(q, k, v, coef, log_lam, chunk_size=8)
    assert not o2.requires_grad and torch.allclose(o2, o.detach())


def test_non_contiguous_inputs():
    inputs = soe_inputs(2, 30, 2, 4, 4, 3, True, seed=2)
    names = ("q", "k", "v", "coef", "log_lam")
    base = soe_scan(*(inputs[n].float() for n in names), chunk_size=8)
    wide = {
        n: torch.cat([x.float(), x.float()], dim=-1)[..., : x.shape[-1]] for n, x in inputs.items() if n != "log_lam"
    }
    strided = soe_scan(wide["q"], wide["k"], wide["v"], wide["coef"], inputs["log_lam"].float(), chunk_size=8)
    assert not wide["q"].is_contiguous()
    assert torch.equal(strided[0], base[0]) and torch.equal(strided[1], base[1])


def test_backward_saves_only_inputs():
    """The chunked backward recomputes states: what autograd keeps is O(inputs), not O(T * S * F * D)."""
    batch, seq_len, heads, feat, dim_v, n_terms = 1, 256, 2, 8, 8, 8
    inputs = {
        n: x.float().requires_grad_()
        for n, x in soe_inputs(batch, seq_len, heads, feat, dim_v, n_terms, True, 0).items()
    }
    saved = []

    def pack(t):
        saved.append(t.numel())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o = soe_scan(*(inputs[n] for n in ("q", "k", "v", "coef", "log_lam")), (inputs["g0"], inputs["b0"]))[0]
    assert o.requires_grad
    input_size = sum(x.numel() for x in inputs.values()) + seq_len * heads  # + the ones column of v
    assert sum(saved) <= 1.5 * input_size
    assert sum(saved) < seq_len * heads * n_terms * feat * dim_v / 4


@pytest.mark.parametrize("fixed", [("log_lam",), ("q",), ("q", "log_lam")])
def test_gradients_when_q_or_log_lam_are_fixed(fixed):
    """The backward skips the work for inputs that need no gradient; the other gradients do not change."""
    inputs = soe_inputs(1, 45, 2, 3, 4, 3, True, seed=21)
    names = ("q", "k", "v", "coef", "log_lam")
    grads = []
    for skip in ((), fixed):
        leaves = {n: x.float().requires_grad_(n not in skip) for n, x in inputs.items()}
        o, z, (g, b) = soe_scan(*(leaves[n] for n in names), (leaves["g0"], leaves["b0"]), True, chunk_size=16)
        gen = torch.Generator().manual_seed(1)
        loss = sum((t * torch.randn(t.shape, generator=gen)).sum() for t in (o, z, g, b))
        loss.backward()
        grads.append({n: x.grad for n, x in leaves.items()})
    full, partial = grads
    for name in inputs:
        if name in fixed:
            assert partial[name] is None
        else:
            assert torch.allclose(partial[name], full[name], rtol=1e-6, atol=1e-7), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_compiled_contractions_match_einsum(dtype):
    """The backward's one-pass contractions (numba on CPU) against einsum, at odd sizes."""
    from kernels.soe.contract import contract_terms

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 7, 9, generator=gen, dtype=dtype)
    scale, other = torch.randn(3, 9, 5, generator=gen, dtype=dtype), torch.randn(3, 9, 7, generator=gen, dtype=dtype)
    by_term, by_feature = contract_terms(x, scale, other)
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    assert rel_err(by_term, torch.einsum("bsfj,bjs->bjf", x, scale)) < tol
    assert rel_err(by_feature, torch.einsum("bsfj,bjf->bsj", x, other)) < tol


# ----------------------------------------------------------------------------- document resets


# boundaries inside chunks of 8, on chunk edges (8, 16), at the first token, and back to back
RESET_CASES = [[[3, 8, 9, 21]], [[0, 16, 17]], [[5], []], [[0, 1, 2, 8, 15, 23], [12]]]


@pytest.mark.parametrize("starts", RESET_CASES)
@pytest.mark.parametrize("with_state", [False, True])
def test_reset_chunked_matches_reference(starts, with_state):
    inputs = soe_inputs(len(starts), 24, 2, 3, 4, 3, with_state, seed=len(starts[0]))
    inputs["reset"] = resets(24, starts)
    assert_matches_reference(inputs, "torch", chunk_size=8)


@pytest.mark.parametrize("chunk_size", [1, 4, 16, 64])
def test_reset_chunked_is_exact_in_float64(chunk_size):
    """Random resets, a partial last chunk and an entering state: the chunked scan in float64 agrees with
    the reference to rounding, outputs and every gradient (the decay's included)."""
    gen = torch.Generator().manual_seed(chunk_size)
    inputs = soe_inputs(2, 37, 2, 3, 4, 3, True, seed=chunk_size)
    inputs["reset"] = torch.rand(2, 37, generator=gen) < 0.15
    outs, grads = soe_run(inputs, "torch", dtype=torch.float64, chunk_size=chunk_size)
    ref_outs, ref_grads = soe_run(inputs, "reference", dtype=torch.float64)
    for got, want in zip(outs, ref_outs, strict=True):
        assert rel_err(got, want) < 1e-12
    for name, grad in grads.items():
        assert rel_err(grad, ref_grads[name]) < 1e-12, name


@pytest.mark.parametrize("backend", ["reference", "torch"])
def test_reset_equals_each_document_alone(backend):
    """Every document of a packed row gives the outputs it gives scanned alone from zero (the first
    one continues the entering state), and the row's final state is its last document's."""
    inputs = soe_inputs(1, 24, 2, 3, 4, 3, True, seed=7)
    starts = [5, 8, 19]
    inputs["reset"] = resets(24, [starts])
    outs, _ = soe_run(inputs, backend, dtype=torch.float64, chunk_size=8)
    bounds = [0, *starts, 24]
    for i, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        alone = {name: inputs[name][:, lo:hi] for name in ("q", "k", "v", "coef")}
        alone["log_lam"] = inputs["log_lam"]
        if i == 0:
            alone["g0"], alone["b0"] = inputs["g0"], inputs["b0"]
        want, _ = soe_run(alone, "reference", dtype=torch.float64)
        assert torch.allclose(outs[0][:, lo:hi], want[0], atol=1e-12), (lo, hi)
        assert torch.allclose(outs[1][:, lo:hi], want[1], atol=1e-12), (lo, hi)
    assert torch.allclose(outs[2], want[2], atol=1e-12) and torch.allclose(outs[3], want[3], atol=1e-12)


def test_reset_refusals():
    inputs = soe_inputs(1, 8, 1, 2, 2, 2, False, seed=0)
    args = [inputs[n] for n in ("q", "k", "v", "coef", "log_lam")]
    with pytest.raises(ValueError, match="reset must be bool"):
        soe_scan(*args, reset=torch.zeros(1, 7, dtype=torch.bool))
