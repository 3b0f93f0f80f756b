"""The Triton launches a model makes, captured from a run of the model itself on the meta device.

The compile gate (benchmarks/kernel_compile.py) compiles what these captures hold. A model is built
from its config with the Triton scan backend, cast to bf16 (what the engines' bf16 precision hands
the layers: FSDP's param_dtype, DeepSpeed's bf16), moved to the meta device, and run forward and
backward under kernels._common.capture_launches: every Launch.run records its launch record and its
actual arguments instead of launching. So the dtypes, grids and integer arguments the gate sees are
the ones the model's own code passes. The sequence-parallel entering-state read needs a process
group to be reached through the model; it is captured by running its autograd Function on meta
inputs of the sizes the family declares (`scan_shape`) and the dtype the model handed its scan.

Each captured argument also gets the specialisation the runtime JIT gives it (triton's own
``native_specialize_impl`` for integers: 1 becomes a constant, multiples of 16 get the divisibility
hint, values past int32 become i64; tensors get the 16-byte alignment hint when their offset from the
allocation is a multiple of 16 bytes, the caching allocator aligning every allocation to 512 bytes).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

import torch

from kernels._common import Launch, capture_launches, triton_type
from model import build_model, family
from model.config import ModelConfig

SHAPES = {"fill": (1, 65_536), "long": (1, 1 << 20), "largest": (8, 1 << 19)}
"""(batch, tokens per rank) of the captured runs: "fill" counts programs (>= one per H100 SM), "long"
checks grid axes at 1M tokens per rank, "largest" checks int32 offsets at the largest supported run."""


@dataclasses.dataclass(frozen=True)
class Captured:
    """One launch of one config's training step at one shape, on one target, with its arguments."""

    config: str
    scan: str  # the family's scan kernel: "soe" or "phasor"
    shape: str  # a key of SHAPES
    target: int
    launch: Launch
    args: tuple

    @property
    def name(self) -> str:
        """The kernel's function name."""
        return self.launch.kernel.__name__

    def specialization(self) -> dict[str, tuple[str, str | int | None]]:
        """Per non-constexpr argument, (type, attribute) as the runtime JIT computes them: the type is
        "constexpr" for an integer equal to 1 (then the attribute is its value), the attribute "D" when
        the argument is divisible by 16 (integers) or 16-byte aligned (pointers)."""
        from triton._C.libtriton import native_specialize_impl
        from triton.backends.nvidia.compiler import CUDABackend

        params = {p.name: p for p in self.launch.kernel.params}
        out = {}
        for name, arg in zip(self.launch.argument_names(), self.args):
            p = params[name]
            if isinstance(arg, torch.Tensor):
                aligned = arg.storage_offset() * arg.element_size() % 16 == 0 and not p.do_not_specialize_on_alignment
                out[name] = ("*" + triton_type(arg.dtype), "D" if aligned else "")
            else:
                spec = native_specialize_impl(
                    CUDABackend, arg, False, not p.do_not_specialize, not p.do_not_specialize_on_alignment
                )
                out[name] = (spec[0], spec[1])
        return out

    def run_dtype(self) -> str:
        """The narrowest floating type among the tensor arguments ("bf16" if any is bf16)."""
        types = {triton_type(a.dtype) for a in self.args if isinstance(a, torch.Tensor) and a.is_floating_point()}
        return next((t for t in ("bf16", "fp16") if t in types), "fp32")


@contextlib.contextmanager
def _meta_autocast() -> Iterator[None]:
    """torch.autocast has no meta device; the models only switch it off (enabled=False) around their
    fp32 regions, which a run without autocast already is, so on meta that is a no-op here."""
    real = torch.autocast

    def autocast(device_type: str, *args: Any, **kwargs: Any) -> Any:
        if device_type != "meta":
            return real(device_type, *args, **kwargs)
        if kwargs.get("enabled", True):
            raise RuntimeError("a capture on the meta device cannot enable autocast")
        return contextlib.nullcontext()

    torch.autocast = autocast
    try:
        yield
    finally:
        torch.autocast = real


def triton_config(cfg: ModelConfig) -> ModelConfig:
    """``cfg`` with its scan on the Triton backend."""
    subs = {k: dataclasses.replace(getattr(cfg, k), scan_backend="triton") for k in ("vort", "pmnet")}
    return dataclasses.replace(cfg, **{k: v for k, v in subs.items() if v is not None})


def meta_model(cfg: ModelConfig) -> torch.nn.Module:
    """The model of ``cfg`` with the Triton scan backend, in bf16, on the meta device; its modules that pick
    a backend by device ("auto": Triton for CUDA tensors, as RMSNorm's fused norm) set to Triton, as a GPU
    runs them."""
    model = build_model(triton_config(cfg)).to(torch.bfloat16).to("meta")
    for module in model.modules():
        if getattr(module, "backend", None) == "auto":
            module.backend = "triton"
    return model


def capture_step(model: torch.nn.Module, batch: int, seq_len: int, target: int,
                 documents: bool = False) -> list[tuple[Launch, tuple]]:  # fmt: skip
    """The launches of one forward and backward of ``model`` (on meta) over [batch, seq_len] tokens on
    a GPU of compute capability ``target``; with ``documents``, of packed documents whose starts reset the
    memory (data.doc_boundaries), which the scans' kernels read (other compilations than without)."""
    ids = torch.zeros(batch, seq_len, dtype=torch.long, device="meta")
    doc_start = torch.zeros(batch, seq_len, dtype=torch.bool, device="meta") if documents else None
    with capture_launches(target) as launches, _meta_autocast():
        hidden, _state = model.hidden_states(ids, doc_start=doc_start)
        hidden.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return list(launches)


def capture_entering(cfg: ModelConfig, batch: int, seq_len: int, dtype: torch.dtype, target: int) -> list:
    """The launches of the sequence-parallel entering-state read of an SOE config (forward and
    backward), at the family's declared scan sizes, for queries of ``dtype``."""
    from kernels.soe.triton import SoeEnteringTriton

    heads, n_terms, feat, width, _chunk = family(cfg.kind).scan_shape(cfg).sizes
    meta = {"device": "meta", "requires_grad": True}
    q = torch.zeros(batch, seq_len, heads, feat, dtype=dtype, **meta)
    log_lam = torch.zeros(heads, n_terms, device="meta")
    g_in = torch.zeros(batch, heads, n_terms, feat, width, **meta)
    b_in = torch.zeros(batch, heads, n_terms, feat, **meta)
    with capture_launches(target) as launches:
        o, z = SoeEnteringTriton.apply(q, log_lam, g_in, b_in)
        (o.float().sum() + z.float().sum()).backward()
    return list(launches)


def capture_config(name: str, cfg: ModelConfig, targets: tuple[int, ...]) -> list[Captured]:
    """Every launch of a training step of config ``name`` at every shape of SHAPES on every target, and
    at the "fill" shape with document starts (shape "documents") (empty for a config without a scan)."""
    scan = family(cfg.kind).scan_shape(cfg)
    if scan is None:
        return []
    model = meta_model(cfg)
    out = []
    for shape, (batch, seq_len) in SHAPES.items():
        for target in targets:
            launches = capture_step(model, batch, seq_len, target)
            found = [Captured(name, scan.kernel, shape, target, *x) for x in launches]
            if not found:
                raise RuntimeError(f"{name}: the model made no Triton launch at {shape} on sm_{target}")
            if scan.kernel == "soe":
                dtype = min((c.run_dtype() for c in found), key=("bf16", "fp16", "fp32").index)
                dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
                entering = capture_entering(cfg, batch, seq_len, dtype, target)
                found += [Captured(name, "soe", shape, target, *x) for x in entering]
            out += found
    for target in targets:  # the "fill" run again with document starts
        found = capture_step(model, *SHAPES["fill"], target, documents=True)
        out += [Captured(name, scan.kernel, "documents", target, *x) for x in found]
    return out
