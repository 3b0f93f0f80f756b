"""The fused SwiGLU gate (kernels/swiglu): the Triton kernels, run by the interpreter on CPU tensors, against the
composite gate in float64; the op under torch.compile and opcheck; the model's SwiGLU through it."""

from __future__ import annotations

import pytest
import torch

from kernels.swiglu import swiglu, swiglu_op, swiglu_torch
from model.blocks import SwiGLU

pytest.importorskip("triton")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def inputs(shape: tuple[int, ...], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """A projection [..., 2H] with gates far into both tails of the sigmoid, and an upstream gradient [..., H]:
    float64."""
    gen = torch.Generator().manual_seed(seed)
    gate_up = 3.0 * torch.randn(*shape, generator=gen, dtype=torch.float64)
    gate_up.view(-1, shape[-1])[2, : shape[-1] // 2] = torch.linspace(-40.0, 40.0, shape[-1] // 2)
    return gate_up, torch.randn(*shape[:-1], shape[-1] // 2, generator=gen, dtype=torch.float64)


@pytest.mark.parametrize("shape", [(37, 96), (2, 21, 600), (1, 9, 32)])
def test_triton_gate_and_gradient_equal_the_float64_reference(shape: tuple[int, ...]) -> None:
    """Rows and columns not multiples of a program's block, one hidden width wider than a block."""
    gate_up, dh = inputs(shape)
    want_in = gate_up.clone().requires_grad_()
    want = swiglu_torch(want_in)
    want.backward(dh)
    got_in = gate_up.float().requires_grad_()
    got = swiglu(got_in, "triton")
    got.backward(dh.float())
    assert got.shape == want.shape and got.dtype == got_in.grad.dtype == torch.float32
    assert rel_err(got, want) < 1e-6
    assert rel_err(got_in.grad, want_in.grad) < 1e-6


def test_bf16_gate_is_made_in_fp32_and_rounded_once() -> None:
    gate_up, dh = inputs((3, 30, 128), seed=1)
    got_in = gate_up.bfloat16().requires_grad_()
    got = swiglu(got_in, "triton")
    got.backward(dh.bfloat16())
    want_in = got_in.detach().double().requires_grad_()
    want = swiglu_torch(want_in)
    want.backward(dh.bfloat16().double())
    assert got.dtype == got_in.grad.dtype == torch.bfloat16
    # within one bf16 step (the interpreter's fp32 -> bf16 conversion truncates, a GPU's rounds to the nearest)
    assert rel_err(got, want) < 2**-7
    assert rel_err(got_in.grad, want_in.grad) < 2**-7


def test_op_passes_opcheck_and_compiles_to_one_graph() -> None:
    gate_up, dh = (t.float() for t in inputs((2, 20, 64), seed=2))
    gate_up = gate_up.requires_grad_()
    results = torch.library.opcheck(swiglu_op, (gate_up,))
    assert set(results.values()) == {"SUCCESS"}, results
    results = torch.library.opcheck(torch.ops.recurrent.swiglu_backward, (gate_up.detach(), dh))
    assert set(results.values()) == {"SUCCESS"}, results

    def run(fn):
        out = fn(gate_up)
        return [out, *torch.autograd.grad((out * dh).sum(), gate_up)]

    eager = run(lambda a: swiglu(a, "triton"))
    compiled = run(torch.compile(lambda a: swiglu(a, "triton"), backend="aot_eager", fullgraph=True))
    for got, want in zip(compiled, eager, strict=True):
        assert torch.equal(got, want)


def test_an_odd_width_is_refused() -> None:
    with pytest.raises(ValueError, match=r"gate and up halves, got \(2, 5\)"):
        swiglu(torch.ones(2, 5))


def test_model_mlp_takes_the_op_on_the_triton_backend() -> None:
    """SwiGLU's output and gradients through the fused op equal its composite path's."""
    torch.manual_seed(0)
    mlp = SwiGLU(32, 4.0)
    x = torch.randn(2, 19, 32)
    results = []
    for backend in ("torch", "triton"):
        mlp.backend = backend
        mlp.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        out = mlp(xi)
        out.square().sum().backward()
        results.append((out.detach(), xi.grad, mlp.gate_up.weight.grad, mlp.down.weight.grad))
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
