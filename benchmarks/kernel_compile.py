"""Compile gate: the Triton launches the shipped models make, compiled ahead of time for an A100 (sm_80)
and an H100 (sm_90), and checked.

    python -m benchmarks.kernel_compile [--json compile.json]

Needs no GPU: triton's own compiler makes the PTX and the ptxas that ships with triton assembles it
and reports registers and spills. The launches are captured from the models themselves
(benchmarks/launch_capture.py): every config in configs/model/*.yaml with a scan, in bf16 as the
engines' bf16 precision runs it, forward and backward on the meta device, at batch 1 x 65,536 tokens,
batch 1 x 1M tokens and batch 8 x 512k tokens per rank, plus the sequence-parallel entering-state
read of the SOE scan. Each distinct launch is compiled once per target with the arguments' runtime
JIT specialisation (integers equal to 1 as constants, the divisibility-by-16 and pointer-alignment
hints). One row per kernel, target, operand dtype and compile-time blocks; a row fails on:

- a compile error;
- any register spill (the dtype compiled is the one the model passes, so every spill runs);
- a kernel with a ``tl.dot`` whose PTX has no tensor-core instruction (``mma.sync``; on sm_90 also
  ``wgmma.mma_async``);
- any atomic (``atom.``/``red.``) instruction: scan kernels write partials summed in a fixed order;
- shared memory over the target's per-block limit;
- fewer than 132 programs (one per H100 SM) at batch 1 and 65,536 tokens;
- a grid axis 1 or 2 over 65,535 (CUDA's limit) at any of the shapes, 1M tokens per rank included;
- a tensor argument with more elements than int32 offsets reach, at batch 8 x 512k tokens, that the
  launch does not declare 64-bit indexed (kernels._common.check_offsets, which also guards every
  launch at run time).

Exit status 1 if any row fails. tests/test_kernels_compile.py runs the same checks.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.launch_capture import SHAPES, Captured, capture_config
from kernels._common import check_offsets
from kernels.span import MIN_PROGRAMS
from model.config import ModelConfig, load_model_config

TARGETS = (80, 90)
SHARED_LIMIT = {80: 166_912, 90: 232_448}  # bytes per block (opt-in maximum) on A100 and H100
GRID_AXIS_LIMIT = 65_535  # CUDA's limit on grid axes 1 and 2
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "model"
_TENSOR_CORE = {80: r"mma\.sync", 90: r"(?:wgmma\.mma_async|mma\.sync)"}
_PREDICATE = r"^\s*(?:@!?%p\d+\s+)?"


@dataclasses.dataclass(frozen=True)
class Compiled:
    """What one compilation shows: shared bytes per block, registers per thread, spilled bytes, whether
    the kernel has a tl.dot, and its tensor-core and atomic instructions in the PTX."""

    shared: int
    registers: int
    spills: int
    dots: bool
    mma: int
    atomics: int


@dataclasses.dataclass
class Row:
    """One kernel on one target with one operand dtype and one set of compile-time blocks, over every
    config, shape and specialisation it was captured with (the worst of each)."""

    scan: str
    kernel: str
    target: int
    dtype: str
    constexprs: str
    warps: int
    stages: int
    configs: list[str] = dataclasses.field(default_factory=list)
    shared: int = 0
    registers: int = 0
    spills: int = 0
    dots: bool = False
    mma: int = -1  # the fewest over the row's compilations; -1 before any
    atomics: int = 0
    programs: int = -1  # the fewest at batch 1, 65,536 tokens; -1 if never captured there
    grid_axis: int = 0  # the widest grid axis 1 or 2 at any shape
    overflow: str = ""  # the first int32-offset refusal at the largest run
    error: str = ""

    @property
    def failures(self) -> list[str]:
        """Why this row fails the gate (empty if it passes)."""
        if self.error:
            return [f"compile error: {self.error}"]
        out = []
        if self.spills:
            out.append(f"{self.spills} B spilled")
        if self.dots and self.mma <= 0:
            out.append("tl.dot without tensor-core instructions")
        if self.atomics:
            out.append(f"{self.atomics} atomic instructions")
        if self.shared > SHARED_LIMIT[self.target]:
            out.append(f"shared {self.shared} B > {SHARED_LIMIT[self.target]} B")
        if 0 <= self.programs < MIN_PROGRAMS:
            out.append(f"{self.programs} programs < {MIN_PROGRAMS}")
        if self.grid_axis > GRID_AXIS_LIMIT:
            out.append(f"grid axis {self.grid_axis} > {GRID_AXIS_LIMIT}")
        if self.overflow:
            out.append(f"int32 offsets: {self.overflow}")
        return out


def _ptxas_log(ptx: str, target: int) -> str:
    """ptxas -v on ``ptx`` with the options triton's NVIDIA backend uses."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [get_ptxas(target).path, "-v", "--regAllocOptLevel=2", f"--gpu-name={sm_arch_from_capability(target)}"]
        done = subprocess.run([*cmd, str(src), "-o", str(src.with_suffix(".o"))], capture_output=True, text=True)
    return done.stderr


def _parse_ptxas(log: str, name: str) -> tuple[int, int]:
    """(registers per thread, spilled bytes stored + loaded) of kernel ``name`` in a ptxas -v log."""
    part = log[log.index(f"Function properties for {name}") :] if f"Function properties for {name}" in log else ""
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", part)
    registers = re.search(r"Used (\d+) registers", part)
    if spills is None or registers is None:
        raise ValueError(f"no register report for {name} in the ptxas log:\n{log}")
    return int(registers.group(1)), int(spills.group(1)) + int(spills.group(2))


def count_instructions(ptx: str, target: int) -> tuple[int, int]:
    """(tensor-core instructions, atomic instructions) in ``ptx`` for compute capability ``target``."""
    mma = re.findall(_PREDICATE + _TENSOR_CORE[target], ptx, re.MULTILINE)
    atomics = re.findall(_PREDICATE + r"(?:atom|red)\.", ptx, re.MULTILINE)
    return len(mma), len(atomics)


def compile_kernel(
    kernel: Any, specialization: dict[str, tuple], constexprs: dict[str, Any], options: dict[str, int], target: int
) -> Compiled:
    """Compile ``kernel`` for compute capability ``target`` as the runtime JIT would for arguments of
    ``specialization`` (Captured.specialization), ``constexprs`` and ``options`` (Launch.options: warps,
    stages, a register cap). The ptxas log comes from triton's
    own ptxas run when it compiles, and from a second ptxas run on a cache hit."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constants, attrs = {}, dict(constexprs), {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
            continue
        kind, attr = specialization[name]
        signature[name] = kind
        if kind == "constexpr":
            constants[name] = attr
        elif attr == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    captured = io.StringIO()
    previous = triton.knobs.nvidia.dump_ptxas_log
    triton.knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(captured):
            compiled = triton.compile(
                ASTSource(kernel, signature, constants, attrs),
                target=GPUTarget("cuda", target, 32),
                options=options,
            )
    finally:
        triton.knobs.nvidia.dump_ptxas_log = previous
    log = captured.getvalue()
    if f"Function properties for {kernel.__name__}" not in log:
        log = _ptxas_log(compiled.asm["ptx"], target)
    registers, spills = _parse_ptxas(log, kernel.__name__)
    mma, atomics = count_instructions(compiled.asm["ptx"], target)
    dots = "tt.dot" in compiled.asm["ttir"]
    return Compiled(compiled.metadata.shared, registers, spills, dots, mma, atomics)


def _merge(row: Row, found: Compiled) -> None:
    """Fold one compilation of the row's kernel into it, keeping the worst of each."""
    row.shared, row.registers = max(row.shared, found.shared), max(row.registers, found.registers)
    row.spills, row.atomics = max(row.spills, found.spills), max(row.atomics, found.atomics)
    row.dots = row.dots or found.dots
    row.mma = found.mma if row.mma < 0 else min(row.mma, found.mma)


def _check_launch(row: Row, c: Captured) -> None:
    """The launch checks of one captured launch: programs, grid axes and int32 offsets."""
    if c.shape == "fill":
        row.programs = c.launch.programs if row.programs < 0 else min(row.programs, c.launch.programs)
    row.grid_axis = max(row.grid_axis, *c.launch.grid[1:3], 0)
    if c.shape == "largest" and not row.overflow:
        try:
            check_offsets(c.launch, c.args)
        except ValueError as err:
            row.overflow = f"{c.config}: {err}"


def gate(captures: Iterable[Captured]) -> list[Row]:
    """Check every captured launch and compile each distinct one once per target."""
    rows: dict[tuple, Row] = {}
    compiled: dict[tuple, Compiled | str] = {}
    for c in captures:
        launch, spec = c.launch, c.specialization()
        const = tuple(sorted(launch.constexprs.items()))
        options = launch.options()
        key = (c.scan, c.name, c.target, c.run_dtype(), const, tuple(options.items()))
        if key not in rows:
            text = ",".join(f"{k}={v}" for k, v in launch.constexprs.items())
            rows[key] = Row(c.scan, c.name, c.target, c.run_dtype(), text, launch.num_warps, launch.num_stages)
        row = rows[key]
        if c.config not in row.configs:
            row.configs.append(c.config)
        _check_launch(row, c)
        ckey = (id(launch.kernel), c.target, const, tuple(options.items()), tuple(sorted(spec.items())))
        if ckey not in compiled:
            try:
                compiled[ckey] = compile_kernel(
                    launch.kernel, spec, launch.constexprs, options, c.target
                )
            except Exception as err:  # a compile error is a finding of the gate, reported in its row
                compiled[ckey] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        found = compiled[ckey]
        if isinstance(found, str):
            row.error = row.error or found
        else:
            _merge(row, found)
    return list(rows.values())


def shipped_configs(config_dir: Path = CONFIG_DIR) -> dict[str, ModelConfig]:
    """Every model config shipped in configs/model, by file stem."""
    return {p.stem: load_model_config(p) for p in sorted(config_dir.glob("*.yaml"))}


def capture_shipped(configs: dict[str, ModelConfig]) -> list[Captured]:
    """The captured launches of every config on both targets."""
    return [c for name, cfg in configs.items() for c in capture_config(name, cfg, TARGETS)]


def format_table(rows: Sequence[Row]) -> str:
    """One line per row, with the checks' values and the result."""
    b, t = SHAPES["fill"]
    head = ("scan", "kernel", "sm", "dtype", "constexprs", "warps", "stages", "shared B", "regs", "spill B",
            "mma", "atom", f"programs@{b}x{t}", "grid y/z max", "int32", "configs", "result")
    lines = [head]
    for r in rows:
        configs = ",".join(r.configs) if len(r.configs) <= 3 else f"{r.configs[0]} +{len(r.configs) - 1}"
        mma = str(max(r.mma, 0)) if r.dots else "-"
        lines.append((r.scan, r.kernel, str(r.target), r.dtype, r.constexprs, str(r.warps), str(r.stages),
                      f"{r.shared:,}", str(r.registers), str(r.spills), mma, str(r.atomics), str(r.programs),
                      str(r.grid_axis), "overflow" if r.overflow else "ok", configs, "; ".join(r.failures) or "ok"))
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    rows = gate(capture_shipped(shipped_configs()))
    print(format_table(rows))
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) | {"failures": r.failures} for r in rows], indent=1))
    failed = [r for r in rows if r.failures]
    for scan in sorted({r.scan for r in rows}):
        mine = [r for r in rows if r.scan == scan]
        print(f"{scan}: {len(mine)} rows, {sum(1 for r in mine if r.failures)} failing")
    print(f"{len(rows)} rows, {len(failed)} failing")
    for r in failed:
        print(f"FAIL {r.scan} {r.kernel} sm_{r.target} {r.dtype} [{r.constexprs}]: {'; '.join(r.failures)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
