"""Every aten op a function runs, with its shapes, FLOPs and bytes: what the step model prices.

`capture_ops(fn)` runs ``fn`` (on meta tensors: nothing is computed) under a TorchDispatchMode, which
sees the ops after autograd and after composite ops are decomposed, so the backward's ops, an
activation checkpoint's recompute and an optimizer's foreach ops are all recorded, in the order a GPU
would run them. Each `Op` is one of four kinds:
- "gemm": mm, addmm, bmm, baddbmm, _scaled_mm and tensor-core convolutions, with their GEMM dims;
- "attention": the fused scaled-dot-product attention ops (flash, memory-efficient, cuDNN), with the
  FLOPs of their matmuls (forward 2 Lq Lk (D + Dv) per head, backward 2.5x that, halved when causal);
- "view": ops that move no data (views, aliasing reshapes, allocations, detach): zero bytes;
- "memory": everything else (elementwise, reductions, norms, copies, loss, foreach and fused optimizer
  ops, fills), and convolutions too narrow for tensor-core tiles (depthwise: one input channel per
  output), which GPUs run as direct, bandwidth-bound kernels.
Bytes are the memory each tensor spans (dimensions of stride 0, an expand's, count once, and no tensor
more than its storage): each distinct input is read once (none by the ops that take only a shape from
their inputs: new_zeros, zeros_like...), each output and each mutated argument written once; an
in-place op reads and writes its target, except the ops that overwrite it whole (copy_, fill_, zero_);
a scatter (index_put_, scatter_, index_add_...) writes as many elements as its source holds. Tensor
lists (foreach ops, stack, cat) count every tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from kernels.library import FUSED_OPS, SCAN_OPS

KINDS = ("gemm", "attention", "memory", "view")

_GEMM = {"mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "convolution", "convolution_backward"}
_VIEW = {
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "detach", "detach_", "alias",
    "lift_fresh", "_unsafe_view", "_reshape_alias", "as_strided", "as_strided_", "t", "t_", "transpose",
    "transpose_", "expand", "view", "permute", "squeeze", "squeeze_", "unsqueeze", "unsqueeze_", "slice",
    "select", "split", "split_with_sizes", "chunk", "unbind", "unfold", "diagonal", "narrow", "resize_",
}
_SHAPE_ONLY = {"new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like", "rand_like",
               "randn_like", "randint_like"}  # their tensor arguments give a shape, dtype and device: nothing is read
_OVERWRITE = {"copy_", "fill_", "zero_", "_foreach_copy_", "_foreach_zero_"}
_SCATTER = {"index_put_", "index_put", "_index_put_impl_", "scatter_", "scatter", "scatter_add_",
            "scatter_add", "index_add_", "index_add", "index_copy_", "index_copy", "masked_scatter_"}
_ATTENTION_FORWARD = {
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_flash_attention_forward", "_efficient_attention_forward",
    "_scaled_dot_product_flash_attention_for_cpu",
}
BACKWARD_ATTENTION_RATIO = 2.5
"""FLOPs of an attention backward over its forward: five matmuls (the recomputed scores, dV, dP, dQ,
dK) against two."""

_DTYPE = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float64: "fp64"}


@dataclasses.dataclass(frozen=True)
class GemmDims:
    """``batch`` GEMMs C [m, n] = A [m, k] B [k, n] with operands of ``dtype``."""

    batch: int
    m: int
    n: int
    k: int
    dtype: str

    @property
    def flops(self) -> float:
        return 2.0 * self.batch * self.m * self.n * self.k


@dataclasses.dataclass(frozen=True)
class Op:
    """One aten op as it ran: name (e.g. "aten.mm.default"), kind (one of KINDS), FLOPs (GEMMs and
    attention; 0 otherwise), bytes read and written, the (shape, dtype) of its tensor inputs and
    outputs, for a GEMM its dims, and the package of this project whose code made the call (the innermost
    frame's, `origin_of`: "kernels" for the ops inside the scans, "kernels/features", "model"...; "" outside)."""

    name: str
    kind: str
    flops: float
    bytes_read: int
    bytes_written: int
    inputs: tuple[tuple[tuple[int, ...], str], ...]
    outputs: tuple[tuple[tuple[int, ...], str], ...]
    gemm: GemmDims | None = None
    origin: str = ""
    reads: tuple[tuple[int, int], ...] = ()  # (storage id, bytes) of each tensor argument
    writes: tuple[tuple[int, int], ...] = ()  # (storage id, bytes) of each output (in-place ops: their target)

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


def dtype_name(dtype: torch.dtype) -> str:
    """Short name of a torch dtype ("bf16", "fp32", "fp8" for the float8 types, else torch's)."""
    if dtype in _DTYPE:
        return _DTYPE[dtype]
    return "fp8" if "float8" in str(dtype) else str(dtype).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of memory ``t`` spans: its elements, counting dimensions of stride 0 once, at most its
    storage's size."""
    if t.numel() == 0:
        return 0
    elements = math.prod(s for s, st in zip(t.shape, t.stride()) if st != 0)
    return min(elements * t.element_size(), t.untyped_storage().nbytes())


def _key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage()._cdata, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _tensors(value: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(value)[0] if isinstance(x, torch.Tensor)]


def _unique_bytes(tensors: list[torch.Tensor]) -> int:
    seen, total = set(), 0
    for t in tensors:
        if _key(t) not in seen:
            seen.add(_key(t))
            total += tensor_bytes(t)
    return total


def _named_args(func: Any, args: tuple, kwargs: dict) -> dict[str, Any]:
    names = [a.name for a in func._schema.arguments]
    return {**dict(zip(names, args)), **kwargs}


def _conv_dims(named: dict[str, Any], out: torch.Tensor, weight: torch.Tensor) -> GemmDims:
    groups = int(named.get("groups", 1))
    spatial = out.shape[2:] if not named.get("transposed", False) else named["input"].shape[2:]
    per_group_in = weight.shape[0] // groups if named.get("transposed", False) else weight.shape[1]
    c_out = out.shape[1]
    k = per_group_in * math.prod(weight.shape[2:])
    return GemmDims(groups, out.shape[0] * math.prod(spatial), c_out // groups, k, dtype_name(weight.dtype))


def _gemm_dims(base: str, named: dict[str, Any], outs: list[torch.Tensor]) -> GemmDims | None:
    """GEMM dims of a GEMM op; None for a convolution too narrow for tensor-core tiles."""
    if base in ("mm", "addmm", "_scaled_mm"):
        a, b = (named["self"], named["mat2"]) if base != "addmm" else (named["mat1"], named["mat2"])
        return GemmDims(1, a.shape[0], b.shape[1], a.shape[1], dtype_name(a.dtype))
    if base in ("bmm", "baddbmm"):
        a, b = (named["self"], named["mat2"]) if base == "bmm" else (named["batch1"], named["batch2"])
        return GemmDims(a.shape[0], a.shape[1], b.shape[2], a.shape[2], dtype_name(a.dtype))
    weight = named["weight"]
    if base == "convolution":
        dims = _conv_dims(named, outs[0], weight)
    else:  # convolution_backward: the forward's GEMM once per gradient it computes
        out = named["grad_output"]
        dims = _conv_dims(named, out, weight)
        mask = named.get("output_mask", [True, True, True])
        dims = dataclasses.replace(dims, batch=dims.batch * max(1, sum(bool(x) for x in mask[:2])))
    return dims if min(dims.n, dims.k) >= 16 else None


def _attention_flops(base: str, named: dict[str, Any]) -> float:
    q, k, v = named["query"], named["key"], named["value"]
    lead = math.prod(q.shape[:-2])
    flops = 2.0 * lead * q.shape[-2] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    if named.get("is_causal", False):
        flops /= 2
    return flops * (BACKWARD_ATTENTION_RATIO if base.endswith("_backward") else 1.0)


def _is_attention(base: str) -> bool:
    return base in _ATTENTION_FORWARD or base.removesuffix("_backward") in _ATTENTION_FORWARD


def _base_name(func: Any) -> str:
    """An aten op's name without namespace or overload ("add_" for aten.add_.Tensor)."""
    return func._schema.name.split("::")[-1]


def make_op(func: Any, args: tuple, kwargs: dict, out: Any) -> Op:
    """The `Op` of one call of aten op ``func`` on ``args``/``kwargs`` that returned ``out``."""
    base = _base_name(func)
    named = _named_args(func, args, kwargs)
    outs = _tensors(out)
    schema_args = {a.name: a for a in func._schema.arguments}
    mutated = [t for n, v in named.items() if n in schema_args and schema_args[n].alias_info is not None
               and schema_args[n].alias_info.is_write for t in _tensors(v)]
    out_args = {n for n, a in schema_args.items() if a.is_out}
    ins = [t for n, v in named.items() if n not in out_args for t in _tensors(v)]
    shapes = (tuple((tuple(t.shape), dtype_name(t.dtype)) for t in ins),
              tuple((tuple(t.shape), dtype_name(t.dtype)) for t in outs))
    if func.is_view or base in _VIEW:
        return Op(str(func), "view", 0.0, 0, 0, *shapes)
    gemm = _gemm_dims(base, named, outs) if base in _GEMM else None
    if gemm is not None:
        kind, flops = "gemm", gemm.flops
    elif _is_attention(base):
        kind, flops = "attention", _attention_flops(base, named)
    else:
        kind, flops = "memory", 0.0
    if base.startswith("_fused_adam") and named.get("grad_scale") is None:
        mutated = [t for n in ("self", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs") for t in _tensors(named.get(n))]
    if base in _OVERWRITE:
        target = {_key(t) for t in mutated}
        ins = [t for t in ins if _key(t) not in target]
    if base in _SCATTER:
        target = {_key(t) for t in mutated} | {_key(t) for t in outs}
        read = _unique_bytes([t for t in ins if _key(t) not in target])
        source = next((named[n] for n in ("values", "src", "source") if isinstance(named.get(n), torch.Tensor)), None)
        written = 0 if source is None else source.numel() * (outs or mutated)[0].element_size()
        accumulates = "add" in base or bool(named.get("accumulate", False))  # reads the elements it adds to
        return Op(str(func), kind, flops, read + (written if accumulates else 0), written, *shapes)
    written = _unique_bytes(outs + mutated)
    read = 0 if base in _SHAPE_ONLY else _unique_bytes(ins)
    return Op(str(func), kind, flops, read, written, *shapes, gemm=gemm)


_ROOT = Path(__file__).resolve().parents[2]
_PACKAGES = {str(_ROOT / p) + "/": p  # longest first
             for p in ("kernels/features", "kernels/norm", "kernels/swiglu", "kernels/order", "kernels", "model",
                       "pretrain")}


def origin_of(filename: str) -> str:
    """The package of this project that the source file ``filename`` is in: "kernels/features" (the fused
    feature map), "kernels/norm" (the fused RMS norm), "kernels/swiglu" (the fused gate), "kernels/order"
    (the fused order coefficients), "kernels" (the scans), "model", "pretrain"; "" for none."""
    return next((package for prefix, package in _PACKAGES.items() if filename.startswith(prefix)), "")


def kernel_origin(kernel: Any) -> str:
    """`origin_of` the source of a Triton kernel (a JITFunction, or the interpreter's wrapper of one)."""
    return origin_of(kernel.fn.__code__.co_filename)


def _origin() -> str:
    """The package of this project whose code is innermost on the call stack ("" if none)."""
    frame = sys._getframe(2)
    while frame is not None:
        package = origin_of(frame.f_code.co_filename)
        if package:
            return package
        frame = frame.f_back
    return ""


class OpRecorder(TorchDispatchMode):
    """A dispatch mode that appends the `Op` of every aten call made under it to ``ops``, with the
    storages each reads and writes (numbered in order of first sight; every storage seen is kept alive
    until the recorder goes, so no number is reused)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[Op] = []
        self._storages: dict[int, tuple[int, Any]] = {}

    def storage_id(self, t: torch.Tensor) -> int:
        storage = t.untyped_storage()
        entry = self._storages.setdefault(storage._cdata, (len(self._storages), storage))
        return entry[0]

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        inside = SCAN_OPS.get(func) or FUSED_OPS.get(func)
        if inside is not None:  # a scan or fused op of kernels/: record the aten ops and launches inside it instead
            with self:
                return inside(*args, **kwargs)
        out = func(*args, **kwargs)
        read = () if _base_name(func) in _SHAPE_ONLY else (args, kwargs)
        reads = tuple((self.storage_id(t), tensor_bytes(t)) for t in _tensors(read))
        writes = tuple((self.storage_id(t), tensor_bytes(t)) for t in _tensors(out))
        self.ops.append(dataclasses.replace(make_op(func, args, kwargs, out), origin=_origin(), reads=reads,
                                            writes=writes))
        return out


_ACTIVE: list[OpRecorder] = []


def active_recorder() -> OpRecorder | None:
    """The innermost recorder running, if any: launches note where they fall among its ops."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def recording() -> Iterator[list[Op]]:
    """The ops run inside the block, appended to the yielded list as they run."""
    recorder = OpRecorder()
    _ACTIVE.append(recorder)
    try:
        with recorder:
            yield recorder.ops
    finally:
        _ACTIVE.pop()


def capture_ops(fn: Callable[[], Any]) -> list[Op]:
    """Every aten op ``fn()`` runs, in order (run ``fn`` on meta tensors to compute nothing)."""
    with recording() as ops:
        fn()
    return ops


def summarize(ops: list[Op], expected_gemm_flops: float | None = None) -> dict[str, Any]:
    """Per kind: op count, FLOPs, bytes read and written; with ``expected_gemm_flops`` (e.g. 6 x matmul
    parameters x tokens, plus the recompute of checkpointed blocks), the GEMM FLOPs over it."""
    out: dict[str, Any] = {}
    for kind in KINDS:
        chosen = [op for op in ops if op.kind == kind]
        out[kind] = {"ops": len(chosen), "flops": sum(op.flops for op in chosen),
                     "bytes_read": sum(op.bytes_read for op in chosen),
                     "bytes_written": sum(op.bytes_written for op in chosen)}
    if expected_gemm_flops:
        out["gemm_flops_over_expected"] = out["gemm"]["flops"] / expected_gemm_flops
        out["expected_gemm_flops"] = expected_gemm_flops
    return out
