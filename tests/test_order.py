"""The fused order coefficients (kernels/order): the Triton kernels, run by the interpreter on CPU tensors,
against the composite form in float64, orders inside and outside the banks' range; opcheck and a compiled
graph; the paths that stay composite; VORT's memory through it."""

from __future__ import annotations

import pytest
import torch

from kernels.order import order_coefficients, order_coefficients_op, order_coefficients_torch
from model import build_model
from pretrain.config import load_config

pytest.importorskip("triton")

BANKS = (0.2, 0.35, 0.5, 0.8, 0.9)  # orders below 0.2 and above 0.9 are clamped (delta 0.1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / b.abs().max())


def inputs(lead: tuple[int, ...], classes: int, heads: int, terms: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """float64 logits, a gate in (0, 1), per-head parameters spread so that the orders reach both clamps, the
    banks and a table of coefficients, and the upstream gradient of the coefficients."""
    gen = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    return {"logits": 2.0 * rand(*lead, classes), "gate": torch.sigmoid(rand(*lead)),
            "bias": torch.linspace(-3.0, 3.0, heads, dtype=torch.float64), "entropy_gain": 1.0 + rand(heads),
            "gate_gain": 1.0 + rand(heads), "banks": torch.tensor(BANKS, dtype=torch.float64),
            "table": rand(len(BANKS), terms), "d_coef": rand(*lead, heads, terms)}


NAMES = ("logits", "gate", "bias", "entropy_gain", "gate_gain")


def run(fn, x: dict[str, torch.Tensor], dtype: torch.dtype) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(coef, alpha, entropy) of ``fn`` on the inputs in ``dtype`` (logits) / fp32 or float64 (the rest), and
    the gradients of sum(coef * d_coef) with respect to NAMES."""
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    leaves = {n: x[n].to(dtype if n == "logits" else wide).requires_grad_() for n in NAMES}
    coef, alpha, entropy = fn(*(leaves[n] for n in NAMES), x["banks"].to(wide), x["table"].to(wide), 0.1)
    grads = torch.autograd.grad((coef * x["d_coef"].to(coef.dtype)).sum(), [leaves[n] for n in NAMES])
    return [coef, alpha, entropy], list(grads)


@pytest.mark.parametrize(("lead", "classes", "heads", "terms"), [((37,), 50, 3, 7), ((2, 21), 64, 12, 18)])
def test_triton_equals_the_float64_reference(lead: tuple[int, ...], classes: int, heads: int, terms: int) -> None:
    x = inputs(lead, classes, heads, terms)
    want, want_grads = run(order_coefficients_torch, x, torch.float64)
    got, got_grads = run(lambda *a: order_coefficients(*a, backend="triton"), x, torch.float32)
    alpha = want[1]
    assert bool((alpha < BANKS[0]).any()) and bool((alpha > BANKS[-1]).any())  # both clamps exercised
    for g, w in zip(got, want, strict=True):
        assert g.dtype == torch.float32 and g.shape == w.shape
        assert rel_err(g, w) < 1e-5
    for name, g, w in zip(NAMES, got_grads, want_grads, strict=True):
        assert rel_err(g, w) < 1e-5, name


def test_bf16_logits_give_gradients_in_bf16() -> None:
    x = inputs((3, 16), 40, 4, 5, seed=1)
    got, got_grads = run(lambda *a: order_coefficients(*a, backend="triton"), x, torch.bfloat16)
    rounded = x | {"logits": x["logits"].bfloat16().double()}
    want, want_grads = run(order_coefficients_torch, rounded, torch.float64)
    assert got[0].dtype == torch.float32 and got_grads[0].dtype == torch.bfloat16
    assert rel_err(got[0], want[0]) < 1e-5
    assert rel_err(got_grads[0], want_grads[0]) < 2**-7  # the logits' gradient rounded once to bf16
    for g, w in zip(got_grads[1:], want_grads[1:], strict=True):
        assert rel_err(g, w) < 1e-5


def test_op_passes_opcheck_and_compiles_to_one_graph() -> None:
    x = inputs((2, 10), 32, 3, 6, seed=2)
    args = [x[n].float().requires_grad_() for n in NAMES] + [x["banks"].float(), x["table"].float(), 0.1]
    results = torch.library.opcheck(order_coefficients_op, args)
    assert set(results.values()) == {"SUCCESS"}, results
    eager = run(lambda *a: order_coefficients(*a, backend="triton"), x, torch.float32)
    compiled_fn = torch.compile(lambda *a: order_coefficients(*a, backend="triton"), backend="aot_eager",
                                fullgraph=True)
    compiled = run(compiled_fn, x, torch.float32)
    for got, want in zip([*compiled[0], *compiled[1]], [*eager[0], *eager[1]], strict=True):
        assert torch.equal(got, want)


def test_a_table_that_learns_or_a_single_bank_stays_composite() -> None:
    """Only the composite form differentiates the banks' table; one bank has no pair to interpolate."""
    x = inputs((9,), 20, 2, 3, seed=3)
    table = x["table"].float().requires_grad_()
    coef, _alpha, _entropy = order_coefficients(*(x[n].float() for n in NAMES), x["banks"].float(), table, 0.1,
                                                backend="triton")
    (coef * x["d_coef"].float()).sum().backward()
    assert table.grad is not None and table.grad.abs().sum() > 0
    one = order_coefficients(*(x[n].float() for n in NAMES), torch.tensor([0.5]), x["table"][:1].float(), 0.1,
                             backend="triton")[0]
    assert torch.equal(one, x["table"][0].float().expand_as(one))


def test_mismatched_shapes_are_refused() -> None:
    x = inputs((4,), 8, 2, 3)
    with pytest.raises(ValueError, match=r"gate \(5,\)"):
        order_coefficients(x["logits"], torch.rand(5), x["bias"], x["entropy_gain"], x["gate_gain"], x["banks"],
                           x["table"], 0.1)
    with pytest.raises(ValueError, match=r"banks \(5,\) and table \(4, 3\)"):
        order_coefficients(x["logits"], x["gate"], x["bias"], x["entropy_gain"], x["gate_gain"], x["banks"],
                           x["table"][:4], 0.1)


def test_vort_memory_takes_the_op_on_the_triton_backend() -> None:
    """VORT's memory: the coefficients and every router parameter's gradient equal on both paths."""
    cfg = load_config("configs/tiny-vort.yaml").model
    torch.manual_seed(0)
    memory = build_model(cfg).blocks[0].mixer.memory
    x = torch.randn(2, 33, cfg.d_model)
    results = []
    for backend in ("torch", "triton"):
        memory.backend = backend
        memory.zero_grad(set_to_none=True)
        coef, _log_lam = memory(x)
        (coef * torch.linspace(-1.0, 1.0, coef.numel()).view(coef.shape)).sum().backward()
        results.append([coef.detach(), memory.last_routing[0]]
                       + [p.grad for p in memory.router.parameters()])
    for got, want in zip(results[1], results[0], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
