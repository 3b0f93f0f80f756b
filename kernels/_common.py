"""Helpers shared by the scans: backend selection, compute dtype, angle wrapping and decay factors."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
from collections.abc import Iterator
from typing import Any

import torch

TWO_PI = 2.0 * math.pi
BACKENDS = ("auto", "reference", "torch", "triton")


def resolve_backend(backend: str, x: torch.Tensor, backends: tuple[str, ...] = BACKENDS) -> str:
    """Map ``backend`` (one of ``backends``) to a concrete one: "auto" is Triton for CUDA tensors and
    "torch" otherwise."""
    if backend not in backends:
        raise ValueError(f"backend must be one of {backends}, got {backend!r}")
    if backend == "auto":
        return "triton" if x.is_cuda else "torch"
    return backend


_AS_OPS = threading.local()


@contextlib.contextmanager
def scans_as_ops() -> Iterator[None]:
    """Inside the block (on this thread) the scans call their custom ops (kernels/library.py) instead of
    their autograd Functions, so that a dispatch mode sees each scan as one op: selective activation
    checkpointing (model/blocks.py) keeps a scan's outputs from the forward rather than scanning again
    in the recompute. The numbers are the same either way: the ops run the same Functions."""
    depth = getattr(_AS_OPS, "depth", 0)
    _AS_OPS.depth = depth + 1
    try:
        yield
    finally:
        _AS_OPS.depth = depth


def use_ops() -> bool:
    """Whether the scans call their custom ops: when torch.compile traces the caller (the compiler keeps
    the ops in its graph; it cannot trace the Functions) or inside `scans_as_ops`."""
    return torch.compiler.is_compiling() or getattr(_AS_OPS, "depth", 0) > 0


def wrap_angle(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """Map angles to [0, 2*pi); the gradient passes through unchanged (d wrap(x)/dx = 1)."""
    return x.remainder_(TWO_PI) if inplace else torch.remainder(x, TWO_PI)


def work_dtype(dtype: torch.dtype) -> torch.dtype:
    """The one compute-dtype policy of the scans and of the model code around them: float64 inputs
    stay float64 (tight reference checks); fp32, bf16 and fp16 compute and accumulate in fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_triton_inputs(x: torch.Tensor, kernel: object) -> None:
    """Triton kernels need CUDA tensors, unless they were built by the interpreter (TRITON_INTERPRET=1 set
    before kernels' Triton modules were first imported), which runs them on CPU tensors, or the launches
    are being captured (:func:`capture_launches`, meta tensors)."""
    if x.dtype == torch.float64:
        raise ValueError("the triton backend takes fp32, bf16 or fp16 inputs, not float64")
    if _CAPTURE.target is not None and x.is_meta:
        return
    if not x.is_cuda and type(kernel).__name__ != "InterpretedFunction":
        raise RuntimeError(
            "the triton backend needs CUDA tensors; for CPU tensors set TRITON_INTERPRET=1 before the first "
            "use of the triton backend"
        )


def decay(log_power: torch.Tensor) -> torch.Tensor:
    """exp(log_power) for log_power <= 0, with factors below ~1e-17 (fp32) / ~1e-130 (fp64) set to 0.

    Such factors are far below the working precision, and left in they make subnormal numbers in the
    products, which run tens of times slower on x86 CPUs.
    """
    return torch.exp(log_power).masked_fill(log_power < decay_cutoff(log_power.dtype), 0.0)


def decay_cutoff(dtype: torch.dtype) -> float:
    """The log power below which :func:`decay` returns exactly 0 in ``dtype``."""
    return -300.0 if dtype == torch.float64 else -40.0


INT32_ELEMENTS = 2**31 - 1
"""The most elements a tensor may hold for int32 offsets into it to be safe (the largest int32)."""


@dataclasses.dataclass(frozen=True)
class Launch:
    """One Triton kernel launch, known without running it.

    The autograd Functions launch exactly these (``run``), and the compile gate
    (benchmarks/kernel_compile.py) compiles them ahead of time for a GPU target: one description, so
    the gate checks the block sizes, warps, stages and grid that run. ``pointers`` maps each pointer
    argument to its element type ("fp32", "bf16", "i32"); ``scalars`` each scalar argument to its type
    ("i32", "fp32"); ``constexprs`` holds the compile-time arguments. ``wide`` names the pointer
    arguments the kernel indexes with 64-bit offsets: only those may hold more than INT32_ELEMENTS
    elements (``run`` refuses the launch otherwise, :func:`check_offsets`).
    """

    kernel: Any
    pointers: dict[str, str]
    scalars: dict[str, str]
    constexprs: dict[str, Any]
    grid: tuple[int, ...]
    num_warps: int
    num_stages: int
    wide: frozenset[str] = frozenset()
    max_registers: int | None = None  # ptxas's cap on registers per thread (triton's maxnreg), if any

    @property
    def programs(self) -> int:
        """Programs launched: the product of the grid."""
        return math.prod(self.grid)

    def signature(self) -> dict[str, str]:
        """The argument types in the form triton's ASTSource takes."""
        types = {**{n: "*" + t for n, t in self.pointers.items()}, **self.scalars}
        types.update({n: "constexpr" for n in self.constexprs})
        missing = set(self.kernel.arg_names) - types.keys()
        if missing:
            raise ValueError(f"{self.kernel.__name__}: no type for {sorted(missing)}")
        return {n: types[n] for n in self.kernel.arg_names}

    def argument_names(self) -> list[str]:
        """The non-constexpr arguments, in the order ``run`` takes them."""
        return [n for n in self.kernel.arg_names if n not in self.constexprs]

    def arguments(self, args: tuple) -> dict[str, Any]:
        """Every argument by name: ``args`` (the non-constexpr ones, in ``run``'s order) and the constexprs."""
        return dict(zip(self.argument_names(), args)) | self.constexprs

    def run(self, *args: Any) -> None:
        """Launch the kernel on ``args`` (the non-constexpr arguments, in order), after
        :func:`check_offsets`; while :func:`capture_launches` is on, record the launch instead (the
        compile gate checks the offsets of what it records)."""
        if _CAPTURE.target is not None:
            _CAPTURE.launches.append((self, args))
            return
        check_offsets(self, args)
        self.kernel[self.grid](*args, **self.constexprs, **self.options())

    def options(self) -> dict[str, int]:
        """The compile options: warps, stages and any register cap."""
        capped = {} if self.max_registers is None else {"maxnreg": self.max_registers}
        return {"num_warps": self.num_warps, "num_stages": self.num_stages} | capped


def check_offsets(launch: Launch, args: tuple) -> None:
    """Raise ValueError if a tensor argument of ``launch`` holds more than INT32_ELEMENTS elements and
    is not one of ``launch.wide``: the kernel's int32 offsets into it could overflow and read or write
    out of bounds. Launch.run calls it before every launch."""
    names = launch.argument_names()
    if len(names) != len(args):
        raise ValueError(f"{launch.kernel.__name__} takes {len(names)} arguments ({names}), got {len(args)}")
    for name, arg in zip(names, args):
        if isinstance(arg, torch.Tensor) and arg.numel() > INT32_ELEMENTS and name not in launch.wide:
            raise ValueError(
                f"{launch.kernel.__name__}: argument {name!r} holds {arg.numel():,} elements "
                f"{tuple(arg.shape)}, over the {INT32_ELEMENTS:,} that int32 offsets reach; use a smaller "
                "batch or sequence per rank (or a kernel that indexes it with 64-bit offsets)"
            )


@dataclasses.dataclass
class _Capture:
    """What capture_launches records: the compute capability reported, and the launches made."""

    target: int | None = None
    launches: list[tuple[Launch, tuple]] = dataclasses.field(default_factory=list)


_CAPTURE = _Capture()


@contextlib.contextmanager
def capture_launches(target: int) -> Iterator[list[tuple[Launch, tuple]]]:
    """Record, without running them, the Triton launches made inside the block: (launch, its arguments)
    in order. The scans then take meta tensors and see a GPU of compute capability ``target``, so a
    model run on the meta device shows the launches it makes on that GPU (the compile gate,
    benchmarks/kernel_compile.py). Outputs the kernels would write stay unset."""
    if _CAPTURE.target is not None:
        raise RuntimeError("capture_launches does not nest")
    _CAPTURE.target, _CAPTURE.launches = target, []
    try:
        yield _CAPTURE.launches
    finally:
        _CAPTURE.target = None


def triton_type(dtype: torch.dtype) -> str:
    """Triton's name of a torch element type."""
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int32: "i32"}[dtype]


def device_capability(x: torch.Tensor) -> int:
    """Compute capability of x's GPU as 10 * major + minor (80 for an A100); 80 for CPU tensors, whose
    kernels the interpreter runs, so they run the A100 launch table; the captured target inside
    :func:`capture_launches`."""
    if _CAPTURE.target is not None:
        return _CAPTURE.target
    if not x.is_cuda:
        return 80
    major, minor = torch.cuda.get_device_capability(x.device)
    return 10 * major + minor


def document_numbers(
    reset: torch.Tensor | None, batch: int, seq_len: int, device: torch.device, dtype: torch.dtype = torch.int32
) -> torch.Tensor:
    """[B, T] in ``dtype``: how many resets (bool [B, T], document starts) are at or before each token, all
    zero without ``reset``. Two tokens are in the same document when their numbers are equal; the state
    before the first token has number 0. Every scan backend masks its resets with these."""
    if reset is None:
        return torch.zeros(batch, seq_len, dtype=dtype, device=device)
    return reset.cumsum(1, dtype=dtype)
