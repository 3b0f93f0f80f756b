"""Triton launches of any code, recorded without a GPU: ours through kernels._common.Launch, anyone
else's (fla's) by intercepting triton's runtime.

`capture(fn, target)` runs ``fn`` (on meta tensors) with triton's runtime patched so that a kernel
launch is recorded instead of compiled and run, and returns the recorded launches. An autotuned
kernel records every configuration the autotuner would benchmark (after its pruning), as alternatives
of one group: the model prices each and takes the fastest (`Launch.group`). `pretend_gpu(target)`
makes code that asks the driver or torch.cuda what GPU it runs on (fla reads that at import to pick
block sizes) see an H100 (sm_90) or an A100 (sm_80); the foreign package must be imported inside it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any
from unittest import mock

import torch

from benchmarks.predict.ops import Op, active_recorder, kernel_origin, recording
from kernels._common import Launch as OurLaunch
from kernels._common import capture_launches, triton_type

_PROPERTIES = {  # what the CUDA driver reports, per compute capability (datasheets)
    90: {"multiprocessor_count": 132, "max_shared_mem": 232_448, "max_num_regs": 65_536, "warpSize": 32,
         "name": "NVIDIA H100 80GB HBM3", "total_memory": 80 * 2**30},
    80: {"multiprocessor_count": 108, "max_shared_mem": 166_912, "max_num_regs": 65_536, "warpSize": 32,
         "name": "NVIDIA A100-SXM4-80GB", "total_memory": 80 * 2**30},
}


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch as the model prices it: the JIT function, every argument by name (constexprs
    included, tensors as meta tensors), the grid, warps and stages. Launches with the same ``group``
    are the configurations of one autotuned call: one of them runs."""

    kernel: Any  # triton.runtime.jit.JITFunction
    args: dict[str, Any]
    grid: tuple[int, int, int]
    num_warps: int
    num_stages: int
    group: int
    options: tuple[tuple[str, Any], ...] = ()
    position: int = -1  # ops recorded before it (benchmarks.predict.ops.recording), -1 outside one
    touches: tuple[int, ...] = ()  # storage ids of its tensor arguments, as the op recorder numbers them

    @property
    def name(self) -> str:
        return self.kernel.__name__

    @property
    def origin(self) -> str:
        """The package of this project the kernel's source is in (benchmarks.predict.ops.origin_of)."""
        return kernel_origin(self.kernel)

    @property
    def programs(self) -> int:
        return math.prod(self.grid)

    def constexprs(self) -> dict[str, Any]:
        """The compile-time arguments."""
        return {p.name: self.args[p.name] for p in self.kernel.params if p.is_constexpr}

    def config(self) -> str:
        """The compile-time choices that tell alternatives of a group apart."""
        blocks = ",".join(f"{k}={v}" for k, v in self.constexprs().items() if isinstance(v, int) and k.isupper())
        return f"{blocks} warps={self.num_warps} stages={self.num_stages}"


@contextlib.contextmanager
def pretend_gpu(target: int) -> Iterator[None]:
    """Answer the driver's and torch.cuda's questions as a GPU of compute capability ``target`` would.
    Nothing runs on it: launches must be captured (`capture`)."""
    from triton.runtime import driver

    props = _PROPERTIES[target]
    cuda_props = mock.Mock(**{"name": props["name"], "multi_processor_count": props["multiprocessor_count"],
                              "shared_memory_per_block_optin": props["max_shared_mem"],
                              "shared_memory_per_block": 49_152, "total_memory": props["total_memory"],
                              "major": target // 10, "minor": target % 10})
    patches = [
        mock.patch.object(torch.cuda, "get_device_name", lambda *a: props["name"]),
        mock.patch.object(torch.cuda, "get_device_capability", lambda *a: (target // 10, target % 10)),
        mock.patch.object(torch.cuda, "get_device_properties", lambda *a: cuda_props),
        mock.patch.object(torch.cuda, "device_count", lambda: 1),
        mock.patch.object(torch.cuda, "current_device", lambda: 0),
        mock.patch.object(torch.cuda, "is_available", lambda: True),
    ]
    previous = driver._active
    driver.set_active(_PretendDriver(target))
    try:
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            yield
    finally:
        driver._active = previous


class _PretendDriver:
    """The part of a triton driver that code asks before launching: the target and the device."""

    def __init__(self, target: int) -> None:
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", target, 32)
        props = dict(_PROPERTIES[target])
        self.utils = mock.Mock(get_device_properties=lambda *a: dict(props))

    def get_current_target(self) -> Any:
        return self.target

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0

    def get_active_torch_device(self) -> torch.device:
        return torch.device("meta")

    def is_active(self) -> bool:
        return True


_OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


class _Recorder:
    """Patches of JITFunction.run and Autotuner.run that record launches."""

    def __init__(self) -> None:
        self.launches: list[Launch] = []
        self.group = 0
        self.in_autotune = False

    def jit_run(self, fn: Any, *args: Any, grid: Any, warmup: bool = False, **kwargs: Any) -> None:
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in _OPTIONS}
        for k in ("debug", "instrumentation_mode", "fpsan_homomorphic_casts"):
            kwargs.pop(k, None)
        bound = fn.signature.bind(*args, **kwargs)
        bound.apply_defaults()
        values = dict(bound.arguments)
        grid = grid(values) if callable(grid) else grid
        grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
        if not self.in_autotune:
            self.group += 1
        extra = tuple(sorted((k, v) for k, v in options.items() if k not in ("num_warps", "num_stages")))
        self.add(Launch(fn, values, grid, int(options.get("num_warps", 4)), int(options.get("num_stages", 3)),
                        self.group, extra))

    def add(self, launch: Launch) -> None:
        """Record ``launch`` with its place among the ops being recorded."""
        recorder = active_recorder()
        if recorder is not None:
            tensors = [v for v in launch.args.values() if isinstance(v, torch.Tensor)]
            launch = dataclasses.replace(launch, position=len(recorder.ops),
                                         touches=tuple(recorder.storage_id(t) for t in tensors))
        self.launches.append(launch)

    def our_run(self, launch: Any, *args: Any) -> None:
        """kernels._common.Launch.run while capturing: this project's launches record themselves here."""
        self.group += 1
        values = launch.arguments(args)
        grid = tuple(launch.grid) + (1,) * (3 - len(launch.grid))
        extra = tuple((k, v) for k, v in launch.options().items() if k not in ("num_warps", "num_stages"))
        self.add(Launch(launch.kernel, values, grid, launch.num_warps, launch.num_stages, self.group, extra))

    def autotune_run(self, tuner: Any, *args: Any, **kwargs: Any) -> None:
        tuner.nargs = dict(zip(tuner.arg_names, args))
        configs = tuner.prune_configs(kwargs) if len(tuner.configs) > 1 else tuner.configs
        self.group += 1
        self.in_autotune = True
        try:
            for config in configs:
                tuner.fn.run(*args, **kwargs, **config.all_kwargs())
        finally:
            self.in_autotune = False
            tuner.nargs = None


@contextlib.contextmanager
def capture_triton(target: int) -> Iterator[list[Launch]]:
    """Record every Triton launch made inside the block (ours and others'), for compute capability
    ``target``, instead of running it."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    rec = _Recorder()

    def jit_run(self: Any, *args: Any, grid: Any, warmup: bool = False, **kwargs: Any) -> None:
        rec.jit_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def autotune_run(self: Any, *args: Any, **kwargs: Any) -> None:
        rec.autotune_run(self, *args, **kwargs)

    def our_run(self: Any, *args: Any) -> None:
        rec.our_run(self, *args)

    with (pretend_gpu(target), mock.patch.object(JITFunction, "run", jit_run),
          mock.patch.object(Autotuner, "run", autotune_run), mock.patch.object(OurLaunch, "run", our_run),
          capture_launches(target)):
        yield rec.launches


@dataclasses.dataclass
class Captured:
    """What a piece of code runs on the GPU: Triton launches and the other (aten) ops, each in order."""

    launches: list[Launch]
    ops: list[Op]


def capture(fn: Callable[[], Any], target: int = 90) -> Captured:
    """The launches and aten ops ``fn`` makes on a GPU of compute capability ``target``."""
    with capture_triton(target) as launches, recording() as ops:
        fn()
    return Captured(list(launches), list(ops))


def signature_of(launch: Launch) -> tuple[dict[str, str], dict[tuple, list]]:
    """(signature, attributes) of ``launch`` as triton's runtime would specialise it: an integer equal
    to 1 becomes a constant, multiples of 16 get the divisibility hint, tensors are 16-byte aligned
    (the caching allocator aligns to 512 bytes) unless a view starts off that alignment."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    signature, attrs = {}, {}
    for i, p in enumerate(launch.kernel.params):
        arg = launch.args[p.name]
        if p.is_constexpr:
            signature[p.name] = "constexpr"
        elif isinstance(arg, torch.Tensor):
            signature[p.name] = "*" + triton_type(arg.dtype)
            if arg.storage_offset() * arg.element_size() % 16 == 0 and not p.do_not_specialize_on_alignment:
                attrs[(i,)] = [["tt.divisibility", 16]]
        elif arg is None:
            signature[p.name] = "constexpr"
        else:
            kind, attr = native_specialize_impl(CUDABackend, arg, False, not p.do_not_specialize,
                                                not p.do_not_specialize_on_alignment)[:2]
            signature[p.name] = kind
            if attr == "D":
                attrs[(i,)] = [["tt.divisibility", 16]]
    return signature, attrs


def constants_of(launch: Launch, signature: dict[str, str]) -> dict[str, Any]:
    """The compile-time values: constexprs, None pointers and integers specialised to 1."""
    return {n: launch.args[n] for n, kind in signature.items() if kind == "constexpr"}

