"""The fused RMS norm (kernels/norm): the Triton kernels, run by the interpreter on CPU tensors, against the
composite norm in float64; the weight gradient repeatable bit for bit; the op under torch.compile and
opcheck; the model's RMSNorm through it."""

from __future__ import annotations

import pytest
import torch

from kernels.norm import rms_norm, rms_norm_op, rms_norm_torch
from model.blocks import RMSNorm

pytest.importorskip("triton")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def inputs(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x of ``shape`` with one row of zeros (the eps floor) and one scaled far up, a weight around 1, and an
    upstream gradient: all float64."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=gen, dtype=torch.float64)
    x.view(-1, shape[-1])[3] = 0.0
    x.view(-1, shape[-1])[7] *= 1e4
    weight = 1.0 + 0.3 * torch.randn(shape[-1], generator=gen, dtype=torch.float64)
    return x, weight, torch.randn(*shape, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("shape", [(37, 48), (2, 21, 64), (1, 40, 100)])
def test_triton_norm_and_gradients_equal_the_float64_reference(shape: tuple[int, ...]) -> None:
    """Rows not a multiple of a program's, widths that are and are not powers of two."""
    x, weight, dy = inputs(shape)
    want_x, want_w = x.clone().requires_grad_(), weight.clone().requires_grad_()
    want = rms_norm_torch(want_x, want_w, 1e-5)
    want.backward(dy)
    got_x, got_w = x.float().requires_grad_(), weight.float().requires_grad_()
    got = rms_norm(got_x, got_w, 1e-5, "triton")
    got.backward(dy.float())
    assert got.dtype == torch.float32 and got_x.grad.dtype == torch.float32 and got_w.grad.dtype == torch.float32
    assert rel_err(got, want) < 1e-6
    assert rel_err(got_x.grad, want_x.grad) < 1e-5
    assert rel_err(got_w.grad, want_w.grad) < 1e-5


def test_bf16_input_is_normalised_in_fp32_and_returned_in_bf16() -> None:
    """bf16 x and weight: the kernels compute in fp32 and round once, as the composite norm does."""
    x, weight, dy = inputs((3, 30, 64), seed=1)
    xb, wb = x.bfloat16().requires_grad_(), weight.bfloat16().requires_grad_()
    got = rms_norm(xb, wb, 1e-5, "triton")
    got.backward(dy.bfloat16())
    rx, rw = xb.detach().double().requires_grad_(), wb.detach().double().requires_grad_()
    want = rms_norm_torch(rx, rw, 1e-5)
    want.backward(dy.bfloat16().double())
    assert got.dtype == xb.grad.dtype == wb.grad.dtype == torch.bfloat16
    # each element rounded once from fp32: within one bf16 step (2^-7 of its binade) of the float64 norm of
    # the same inputs (the interpreter's fp32 -> bf16 conversion truncates, a GPU's rounds to the nearest)
    for got_t, want_t in ((got, want), (xb.grad, rx.grad), (wb.grad, rw.grad)):
        assert rel_err(got_t, want_t) < 2**-7


def test_weight_gradient_is_repeatable_bit_for_bit() -> None:
    x, weight, dy = (t.float() for t in inputs((70, 48), seed=2))
    grads = []
    for _ in range(2):
        w = weight.clone().requires_grad_()
        rms_norm(x, w, 1e-5, "triton").backward(dy)
        grads.append(w.grad)
    assert torch.equal(grads[0], grads[1])


def test_op_passes_opcheck_and_compiles_to_one_graph() -> None:
    x, weight, dy = (t.float() for t in inputs((2, 20, 32), seed=3))
    x = x.requires_grad_()
    results = torch.library.opcheck(rms_norm_op, (x, weight, 1e-5))
    assert set(results.values()) == {"SUCCESS"}, results
    results = torch.library.opcheck(torch.ops.recurrent.rms_norm_backward, (x.detach(), weight, dy, 1e-5))
    assert set(results.values()) == {"SUCCESS"}, results

    def run(fn):
        out = fn(x, weight)
        return [out, *torch.autograd.grad((out * dy).sum(), x)]

    eager = run(lambda a, w: rms_norm(a, w, 1e-5, "triton"))
    compiled = run(torch.compile(lambda a, w: rms_norm(a, w, 1e-5, "triton"), backend="aot_eager", fullgraph=True))
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)


def test_a_weight_of_the_wrong_width_is_refused() -> None:
    with pytest.raises(ValueError, match=r"weight of shape \(5,\) for x \(2, 4\): expected \[4\]"):
        rms_norm(torch.ones(2, 4), torch.ones(5), 1e-5)


def test_model_norm_takes_the_op_on_the_triton_backend() -> None:
    """RMSNorm's output and gradients through the fused op equal its composite path's."""
    norm = RMSNorm(48, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 48))
    x, _weight, dy = (t.float() for t in inputs((2, 19, 48), seed=4))
    results = []
    for backend in ("torch", "triton"):
        norm.backend = backend
        xi = x.clone().requires_grad_()
        norm.weight.grad = None
        out = norm(xi)
        out.backward(dy)
        results.append((out.detach(), xi.grad, norm.weight.grad.clone()))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
