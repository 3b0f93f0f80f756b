"""How a scan becomes a pair of ``torch.library`` custom ops, so that ``torch.compile`` keeps it inside one graph.

Dynamo cannot trace the scans' autograd Functions: they call numba-compiled loops on the CPU and Triton
launches on CUDA. :func:`scan_op` makes each scan an opaque op pair to the compiler, ``recurrent::<name>``
(the forward) and ``recurrent::<name>_backward``, with fake implementations that give the output shapes
and an autograd registration that calls the backward op. Both ops run the autograd Function the eager
path runs (its ``forward``, ``prepare_backward`` and ``backward`` called with a stand-in ctx), chosen
by the resolved backend: "torch" is the CPU path, "triton" the CUDA kernels (also CPU tensors under
TRITON_INTERPRET=1). So compiled and eager training compute the same numbers.

An op's outputs are tensors of shapes known in advance, so the backward op cannot get the Function's ctx.
It gets the forward's inputs, from which every Function's ``prepare_backward(ctx, *inputs, *kept)``
rebuilds its saved tensors without scanning, and ``kept``: the tensors only a scan makes that its
backward reads (the Triton SOE scan's states at span borders), which the Function names with
``kept(ctx)`` and the forward op returns after the scan's outputs (not differentiable). The ops
themselves are registered beside their scans (kernels/soe/op.py, kernels/phasor/op.py,
kernels/parallel.py); this module knows none of them. The scans call their ops under torch.compile and
inside ``kernels._common.scans_as_ops`` (selective activation checkpointing); on meta tensors an op runs
its Function as a device does, so that the benchmarks can capture the launches a step makes.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor

OpResult = tuple[Tensor, ...]

NAMESPACE = "recurrent" if __name__ == "kernels.library" else \
    "recurrent_" + hashlib.sha1(__name__.encode()).hexdigest()[:12]
"""The ops' namespace. A copy of this module under another name (an export's flattened code, loaded by
transformers into a process that also imports the project) registers its own ops: with one namespace,
the copy's registration would replace the project's kernels, and the project's scans would run the
copy's code."""

SCAN_OPS: dict[Any, Callable[..., OpResult]] = {}
"""Every scan op, forward and backward (OpOverloads), and the Python function it runs: selective
activation checkpointing keeps these ops' outputs (model/blocks.py; only forwards run in a forward), and
a dispatch mode that must see the aten ops inside a scan runs the function itself
(benchmarks/predict/ops.py)."""


FUSED_OPS: dict[Any, Callable[..., Any]] = {}
"""kernels/'s other custom ops (the fused feature map, norm, gate and order coefficients: `fused_op`), forward and
backward, and the Python function each runs: activation checkpointing recomputes them as it does elementwise
work, and a dispatch mode that must see the aten ops and launches inside one runs the function itself, as for
SCAN_OPS."""


def fused_op(name: str, forward: Callable[..., Any], schema: str, fake: Callable[..., Any],
             backward: Callable[..., Any], backward_schema: str, backward_fake: Callable[..., Any],
             setup_context: Callable[..., None], gradients: Callable[..., Any]) -> Any:
    """Register the fused op ``recurrent::<name>`` running ``forward`` and its backward op
    ``recurrent::<name>_backward`` running ``backward``, each with its fake implementation and a meta kernel
    that runs the function itself (meta tensors launch as a device does, for the benchmarks to capture), the
    autograd of ``setup_context`` and ``gradients(ctx, backward_op, *grads)``, both in FUSED_OPS; return the
    forward op."""
    op = torch.library.custom_op(f"{NAMESPACE}::{name}", forward, mutates_args=(), schema=schema)
    op.register_fake(fake)
    op.register_kernel("meta", forward)
    backward_op = torch.library.custom_op(f"{NAMESPACE}::{name}_backward", backward, mutates_args=(),
                                          schema=backward_schema)
    backward_op.register_fake(backward_fake)
    backward_op.register_kernel("meta", backward)
    op.register_autograd(lambda ctx, *grads: gradients(ctx, backward_op, *grads), setup_context=setup_context)
    ops = getattr(torch.ops, NAMESPACE)
    FUSED_OPS[getattr(ops, name).default] = forward
    FUSED_OPS[getattr(ops, f"{name}_backward").default] = backward
    return op


class _Ctx:
    """What the scans' autograd Functions use of their ctx, for calling forward and backward outside
    autograd: saved tensors, the input-gradient flags, whether None gradients are materialised, and any
    attribute they set."""

    def __init__(self, needs_input_grad: Sequence[bool] = ()) -> None:
        self.needs_input_grad = tuple(needs_input_grad)
        self.saved_tensors: tuple[Tensor | None, ...] = ()
        self.materialize_grads = True

    def save_for_backward(self, *tensors: Tensor | None) -> None:
        self.saved_tensors = tensors

    def set_materialize_grads(self, value: bool) -> None:
        self.materialize_grads = value


def _shares_storage(a: Tensor, b: Tensor) -> bool:
    """Whether a and b are views of one storage, or of two storages over the same memory (meta and empty
    storages have no memory: all their data pointers are 0)."""
    first, second = a.untyped_storage(), b.untyped_storage()
    if first._cdata == second._cdata:
        return True
    return a.device.type != "meta" and first.data_ptr() != 0 and first.data_ptr() == second.data_ptr()


def _aliases(x: Tensor, others: Sequence[Tensor | None]) -> bool:
    """Whether x shares storage with one of ``others`` (an op's output may not alias its inputs)."""
    return any(o is not None and _shares_storage(x, o) for o in others)


def _fresh(outputs: Sequence[Tensor], inputs: Sequence[Any]) -> OpResult:
    """``outputs`` as the fake implementations describe them: contiguous, and none a view of an input or
    of an earlier output (those are copied)."""
    tensors = [x for x in inputs if isinstance(x, Tensor)]
    out: list[Tensor] = []
    for x in outputs:
        x = x.contiguous()
        out.append(x.clone() if _aliases(x, [*tensors, *out]) else x)
    return tuple(out)


def _filled(grads: Sequence[Tensor | None], likes: Sequence[Tensor], inputs: Sequence[Any]) -> OpResult:
    """Gradients as op outputs: zeros where the Function returned None, each in its input's dtype and
    a fresh tensor (no view of an input or of another gradient)."""
    out = [torch.zeros_like(like, memory_format=torch.contiguous_format) if grad is None else grad.to(like.dtype)
           for grad, like in zip(grads, likes)]  # fmt: skip
    return _fresh(out, inputs)


def scan_op(
    name: str,
    schema: str,
    function: Callable[[str], Any],
    fake: Callable[..., OpResult],
    outputs: int,
    differentiable: Sequence[int],
    *,
    kept: int = 0,
    arguments: Callable[[tuple, str], tuple] | None = None,
    shape_only: Sequence[int] = (),
    check: Callable[..., None] | None = None,
) -> Any:
    """Register the scan ``recurrent::<name>`` and its backward and return the forward op.

    ``schema`` lists the op's arguments before its final ``str backend`` ("Tensor q, ..., Tensor? reset");
    ``function(backend)`` is the autograd Function that runs it, returning ``outputs`` tensors;
    ``fake(*inputs, backend)`` gives them, then ``kept`` more (the Function's ``kept(ctx)``, empty
    tensors for a backend that keeps none), as empty tensors; ``differentiable`` are the positions of
    the inputs that get gradients. ``arguments(inputs, backend)`` maps the op's inputs to the Function's
    (by default the same); the inputs at ``shape_only`` are saved as a broadcast zero (the backward reads
    only their shape, dtype and device); ``check(*inputs)``, if given, validates the forward's inputs.
    """
    n_inputs = len(schema.split(","))
    to_function = arguments or (lambda inputs, backend: inputs)
    tensors = lambda count: ", ".join(["Tensor"] * count)  # noqa: E731

    def forward(*args: Any) -> OpResult:
        inputs, backend = args[:-1], args[-1]
        if check is not None:
            check(*inputs)
        scan, ctx = function(backend), _Ctx()
        results = scan.forward(ctx, *to_function(inputs, backend))
        saved = tuple(scan.kept(ctx)) if hasattr(scan, "kept") else ()
        saved += tuple(inputs[0].new_empty(0) for _ in range(kept - len(saved)))
        return _fresh((*results, *saved), inputs)

    def backward(*args: Any) -> OpResult:
        inputs, backend = args[:n_inputs], args[n_inputs]
        saved, grads, needs = args[n_inputs + 1 : n_inputs + 1 + kept], args[n_inputs + 1 + kept : -1], args[-1]
        scan, ctx = function(backend), _Ctx(needs)
        function_inputs = to_function(inputs, backend)
        scan.prepare_backward(ctx, *function_inputs, *(saved if hasattr(scan, "kept") else ()))
        if ctx.materialize_grads:  # as autograd does for a Function that did not turn it off
            likes = fake(*inputs, backend)
            grads = tuple(torch.zeros_like(like) if g is None else g for g, like in zip(grads, likes))
        results = scan.backward(ctx, *grads)
        return _filled([results[i] for i in differentiable], [inputs[i] for i in differentiable], inputs)

    op = torch.library.custom_op(f"{NAMESPACE}::{name}", forward, mutates_args=(),
                                 schema=f"({schema}, str backend) -> ({tensors(outputs + kept)})")
    op.register_fake(fake)
    op.register_kernel("meta", forward)  # meta tensors run the Function as a device does (fake tensors: ``fake``)
    SCAN_OPS[getattr(getattr(torch.ops, NAMESPACE), name).default] = forward
    after = ", ".join([*(f"Tensor kept{i}" for i in range(kept)), *(f"Tensor? grad{i}" for i in range(outputs))])
    backward_op = torch.library.custom_op(
        f"{NAMESPACE}::{name}_backward", backward, mutates_args=(),
        schema=f"({schema}, str backend, {after}, bool[] needs) -> ({tensors(len(differentiable))})",
    )
    backward_op.register_fake(lambda *args: tuple(torch.empty_like(args[i], memory_format=torch.contiguous_format)
                                                  for i in differentiable))
    backward_op.register_kernel("meta", backward)
    SCAN_OPS[getattr(getattr(torch.ops, NAMESPACE), f"{name}_backward").default] = backward

    def setup_context(ctx: Any, inputs: tuple, output: tuple) -> None:
        *inputs, ctx.backend = inputs
        ctx.is_tensor = [isinstance(x, Tensor) for x in inputs]
        ctx.others = [None if is_tensor else x for x, is_tensor in zip(inputs, ctx.is_tensor)]
        stored = [x.new_zeros(()).expand(x.shape) if i in shape_only else x
                  for i, x in enumerate(inputs) if ctx.is_tensor[i]]  # fmt: skip
        ctx.mark_non_differentiable(*output[outputs:])
        # no zero gradients for the kept outputs, which nothing differentiates (the forward's per-chunk states
        # can be hundreds of MB a layer); the backward fills its outputs' missing gradients itself
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(*stored, *output[outputs:])

    def gradients(ctx: Any, *grads: Tensor | None) -> tuple:
        saved = iter(ctx.saved_tensors)
        inputs = [next(saved) if is_tensor else x for x, is_tensor in zip(ctx.others, ctx.is_tensor)]
        needs = [bool(n) for n in ctx.needs_input_grad[:n_inputs]]
        results = backward_op(*inputs, ctx.backend, *saved, *grads[:outputs], needs)
        out: list[Tensor | None] = [None] * (n_inputs + 1)
        for i, result in zip(differentiable, results):
            out[i] = result if needs[i] else None
        return tuple(out)

    op.register_autograd(gradients, setup_context=setup_context)
    return op
