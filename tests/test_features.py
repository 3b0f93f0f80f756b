"""The fused feature map (kernels/features): the Triton kernels, run by the interpreter on CPU tensors, against
the composite map in float64, with and without the rotary rotation; the op under torch.compile and opcheck;
the paths a learned W or scale takes."""

from __future__ import annotations

import pytest
import torch

from kernels.features import features_torch, positive_features, positive_features_op
from model.blocks import rotary_tables

pytest.importorskip("triton")

FWD_TOL, GRAD_TOL = 1e-5, 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def inputs(heads: int, dim: int, n_features: int, dtype: torch.dtype = torch.float32, seed: int = 0):
    """x [2, 70, H, D] as the VORT layer passes q (a view of a [B, T, 3, H, D] projection), with a row of
    zeros (the norm's floor) and one scaled far down; W [H, F, D] with N(0, 1) entries."""
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(2, 70, 3, heads, dim, generator=gen, dtype=torch.float64)
    qkv[0, 5] = 0.0
    qkv[1, 9] *= 1e-7
    weight = torch.randn(heads, n_features, dim, generator=gen, dtype=torch.float64)
    return qkv.to(dtype)[:, :, 0], weight


def tables(seq_len: int, dim: int, rotary: str) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The rotary tables: none, shared by the rows ([T, D/2]) or per row ([2, T, D/2], the second row's
    positions restarting at a document start)."""
    if rotary == "none":
        return None, None
    positions = torch.arange(seq_len)
    if rotary == "rows":
        positions = torch.stack([positions, torch.where(positions < 30, positions + 100, positions - 30)])
    return rotary_tables(positions, dim, 10_000.0)


@pytest.mark.parametrize("rotary", ["none", "shared", "rows"])
@pytest.mark.parametrize(("heads", "dim", "n_features"), [(3, 16, 24), (2, 8, 8), (1, 64, 64)])
def test_triton_map_and_gradient_equal_the_float64_reference(heads: int, dim: int, n_features: int,
                                                             rotary: str) -> None:
    """Forward and dx against the composite map in float64, with padded blocks (D/2 or F under 16 or not a
    power of two), a strided input, rows at or near the norm's floor, and the rotation: none, one table
    for the rows, or a table per row."""
    x, weight = inputs(heads, dim, n_features)
    assert not x.is_contiguous()
    cos, sin = tables(x.shape[1], dim, rotary)
    got_x, want_x = x.clone().requires_grad_(), x.double().clone().requires_grad_()
    got = positive_features(got_x, weight.float(), 1.3, cos, sin, "triton")
    want = features_torch(want_x, weight, 1.3, *((None, None) if cos is None else (cos.double(), sin.double())))
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert rel_err(got, want) <= FWD_TOL
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (got.double() * g).sum().backward()
    (want * g).sum().backward()
    assert rel_err(got_x.grad, want_x.grad) <= GRAD_TOL


def test_bf16_input_gives_bf16_features_within_its_rounding() -> None:
    """A bf16 x (the run's dtype) gives phi and dx in bf16, within twice bf16's rounding of the float64 map of
    the same (rounded) x: phi's own rounding, and the tf32 projection's (about |W y| 2^-11 in the exponent)."""
    x, weight = inputs(3, 16, 24, torch.bfloat16)
    got_x, want_x = x.clone().requires_grad_(), x.double().clone().requires_grad_()
    cos, sin = tables(x.shape[1], 16, "rows")
    got = positive_features(got_x, weight.float(), 1.3, cos, sin, "triton")
    want = features_torch(want_x, weight, 1.3, cos.double(), sin.double())
    assert got.dtype == torch.bfloat16
    assert rel_err(got, want) <= 2 * 2**-8
    g = torch.randn(want.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    (got.double() * g.to(torch.bfloat16).double()).sum().backward()
    (want * g.to(torch.bfloat16).double()).sum().backward()
    assert got_x.grad.dtype == torch.bfloat16
    assert rel_err(got_x.grad, want_x.grad) <= 2**-6


def test_learned_weight_or_scale_takes_the_composite_map_on_every_backend() -> None:
    """The kernels differentiate x only: a W that needs a gradient or a per-head scale tensor (learned
    temperature) runs the composite map, which gives them theirs."""
    x, weight = inputs(3, 16, 24)
    learned = weight.float().requires_grad_()
    scale = torch.full((3, 1), 1.3, requires_grad=True)
    positive_features(x, learned, scale, backend="triton").sum().backward()
    assert learned.grad is not None and scale.grad is not None
    torch.testing.assert_close(positive_features(x, weight.float(), torch.full((3, 1), 1.3), backend="triton"),
                               features_torch(x, weight.float(), 1.3))


def test_rotary_tables_that_do_not_fit_are_refused() -> None:
    x, weight = inputs(3, 16, 24)
    cos, sin = tables(40, 16, "shared")  # 40 positions for 70 tokens
    with pytest.raises(ValueError, match=r"rotary tables of shape \(40, 8\) do not fit x \(2, 70, 3, 16\)"):
        positive_features(x, weight.float(), 1.3, cos, sin, "triton")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_op_passes_opcheck_and_compiles_to_one_graph(dtype: torch.dtype) -> None:
    x, weight = inputs(2, 16, 16, dtype)
    x = x.detach().requires_grad_()
    cos, sin = tables(x.shape[1], 16, "rows")
    results = torch.library.opcheck(positive_features_op, (x, weight.float(), 0.7, cos, sin))
    assert set(results.values()) == {"SUCCESS"}, results
    d_phi = torch.randn(*x.shape[:-1], 16).to(dtype)
    results = torch.library.opcheck(torch.ops.recurrent.positive_features_backward,
                                    (x.detach(), weight.float(), d_phi, 0.7, None, None))
    assert set(results.values()) == {"SUCCESS"}, results

    def run(fn):
        out = fn(x, weight.float())
        return [out, *torch.autograd.grad((out.float() * torch.linspace(0.5, 1.5, out.numel()).view(out.shape)).sum(),
                                          x)]

    eager = run(lambda a, w: positive_features(a, w, 0.7, cos, sin, "triton"))
    compiled = run(torch.compile(lambda a, w: positive_features(a, w, 0.7, cos, sin, "triton"), backend="aot_eager",
                                 fullgraph=True))
    for got, want in zip(compiled, eager):
        assert torch.equal(got, want)
