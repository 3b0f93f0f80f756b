"""Compile gate: every Triton kernel, compiled ahead of time for an A100 (sm_80) and an H100 (sm_90).

    python -m benchmarks.kernel_compile [--json compile.json]

Needs no GPU: triton's own compiler makes the PTX and the ptxas that ships with triton assembles it
and reports registers and spills. For every shipped model config (configs/model/*.yaml) it takes the
scan shapes (heads, features, head width, SOE terms, chunk; PMNet levels, memory width, slots), builds
the launches the autograd Functions make (kernels.soe.triton.soe_launches,
kernels.phasor.triton.phasor_launches) for fp32 and bf16 inputs and for both targets, compiles each
distinct one once, and prints one row per kernel, target and dtype: shared memory per block,
registers per thread, spilled bytes, and the programs launched at batch 1 and 65,536 tokens. A row
fails on shared memory above the target's per-block limit or on any spill in bf16 (fp32 is the
debugging dtype: its spills are reported, not fatal); a compile error fails the run. Exit status 1
if any row fails. tests/test_kernels_compile.py runs the same checks.
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
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from kernels._common import Launch
from kernels.span import MIN_PROGRAMS
from model import family
from model.config import ModelConfig, load_model_config

TARGETS = (80, 90)
SHARED_LIMIT = {80: 166_912, 90: 232_448}  # bytes per block (opt-in maximum) on A100 and H100
DTYPES = (torch.float32, torch.bfloat16)
SEQ_LEN = 65_536  # tokens per rank of the long-context runs: the grids are counted at this length
CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs" / "model"


@dataclasses.dataclass
class Row:
    """One compiled kernel on one target, with the configs whose shapes it serves."""

    kernel: str
    target: int
    dtype: str
    configs: list[str]
    constexprs: str
    warps: int
    stages: int
    shared: int = 0
    registers: int = 0
    spills: int = 0
    programs: int = 0  # the fewest over its configs, at batch 1 and SEQ_LEN tokens
    error: str = ""

    @property
    def failures(self) -> list[str]:
        """Why this row fails the gate (empty if it passes)."""
        if self.error:
            return [f"compile error: {self.error}"]
        out = []
        if self.shared > SHARED_LIMIT[self.target]:
            out.append(f"shared {self.shared} B > {SHARED_LIMIT[self.target]} B")
        if self.dtype != "fp32" and self.spills:
            out.append(f"{self.spills} B spilled in {self.dtype}")
        return out


def _shapes(name: str, cfg: ModelConfig, dtype: torch.dtype, target: int) -> dict[str, Launch]:
    """The launches of one training step's scans for a config, with the sequence-parallel entering-state
    read for the SOE scan (none for configs without a scan)."""
    from kernels.phasor.triton import phasor_launches
    from kernels.soe.triton import entering_launches, soe_launches

    scan = family(cfg.kind).scan_shape(cfg)
    if scan is None:
        return {}
    if scan.kernel == "soe":
        *sizes, chunk_size = scan.sizes
        shape = (1, SEQ_LEN, *sizes)
        _span, launches = soe_launches(*shape, chunk_size, dtype, target)
        found = {f"soe_{k}": x for k, x in launches.items()}
        # the entering-state read of sequence parallelism
        return found | {f"soe_entering_{k}": x for k, x in entering_launches(*shape, dtype, target).items()}
    _span, launches = phasor_launches(1, SEQ_LEN, *scan.sizes, dtype, target)
    return {f"phasor_{k}": x for k, x in launches.items()}


def shipped_configs(config_dir: Path = CONFIG_DIR) -> dict[str, ModelConfig]:
    """Every model config shipped in configs/model, by file stem."""
    return {p.stem: load_model_config(p) for p in sorted(config_dir.glob("*.yaml"))}


def enumerate_launches(configs: dict[str, ModelConfig]) -> Iterator[tuple[str, str, int, torch.dtype, Launch]]:
    """(config, kernel, target, dtype, launch) for every config, scan kernel, target and dtype."""
    for name, cfg in configs.items():
        for target in TARGETS:
            for dtype in DTYPES:
                for kernel, launch in _shapes(name, cfg, dtype, target).items():
                    yield name, kernel, target, dtype, launch


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
    part = log[log.index(f"Function properties for {name}") :]
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", part)
    registers = re.search(r"Used (\d+) registers", part)
    if spills is None or registers is None:
        raise ValueError(f"no register report for {name} in the ptxas log:\n{log}")
    return int(registers.group(1)), int(spills.group(1)) + int(spills.group(2))


def compile_launch(launch: Launch, target: int) -> tuple[int, int, int]:
    """Compile ``launch`` for compute capability ``target``: (shared bytes per block, registers, spills).

    Pointer arguments get the 16-byte alignment hint the JIT gives torch tensors. The ptxas log comes
    from triton's own ptxas run when it compiles, and from a second ptxas run on a cache hit.
    """
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = launch.signature()
    names = list(signature)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in launch.pointers}
    source = ASTSource(launch.kernel, signature, launch.constexprs, attrs)
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages}
    captured = io.StringIO()
    previous = triton.knobs.nvidia.dump_ptxas_log
    triton.knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(captured):
            compiled = triton.compile(source, target=GPUTarget("cuda", target, 32), options=options)
    finally:
        triton.knobs.nvidia.dump_ptxas_log = previous
    name = launch.kernel.__name__
    log = captured.getvalue()
    if f"Function properties for {name}" not in log:
        log = _ptxas_log(compiled.asm["ptx"], target)
    registers, spills = _parse_ptxas(log, name)
    return compiled.metadata.shared, registers, spills


def gate(configs: dict[str, ModelConfig] | None = None) -> list[Row]:
    """Compile every distinct launch of ``configs`` (default: the shipped ones) on both targets."""
    configs = shipped_configs() if configs is None else configs
    rows: dict[tuple, Row] = {}
    for name, kernel, target, dtype, launch in enumerate_launches(configs):
        dtype_name = str(dtype).removeprefix("torch.").replace("bfloat16", "bf16").replace("float32", "fp32")
        key = (
            kernel,
            target,
            dtype_name,
            tuple(sorted(launch.signature().items())),
            tuple(sorted(launch.constexprs.items())),
            launch.num_warps,
            launch.num_stages,
        )
        if key in rows:
            rows[key].configs.append(name)
            rows[key].programs = min(rows[key].programs, launch.programs)
            continue
        const = ",".join(f"{k}={v}" for k, v in launch.constexprs.items())
        row = Row(
            kernel, target, dtype_name, [name], const, launch.num_warps, launch.num_stages, programs=launch.programs
        )
        try:
            row.shared, row.registers, row.spills = compile_launch(launch, target)
        except Exception as err:
            row.error = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        rows[key] = row
    return list(rows.values())


def format_table(rows: Sequence[Row]) -> str:
    """One line per row: kernel, target, dtype, blocks, shared bytes, registers, spills, programs."""
    head = (
        "kernel",
        "sm",
        "dtype",
        "constexprs",
        "warps",
        "stages",
        "shared B",
        "regs",
        "spill B",
        f"programs@{SEQ_LEN}",
        "configs",
        "result",
    )
    lines = [head]
    for r in rows:
        configs = ",".join(r.configs) if len(r.configs) <= 3 else f"{r.configs[0]} +{len(r.configs) - 1}"
        result = "; ".join(r.failures) or "ok"
        lines.append(
            (
                r.kernel,
                str(r.target),
                r.dtype,
                r.constexprs,
                str(r.warps),
                str(r.stages),
                f"{r.shared:,}",
                str(r.registers),
                str(r.spills),
                str(r.programs),
                configs,
                result,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in lines)


def format_launch_counts(configs: dict[str, ModelConfig]) -> str:
    """Programs each kernel launches at batch 1 and SEQ_LEN tokens, per config and target (bf16)."""
    counts: dict[tuple[str, str], dict[int, int]] = {}
    for name, kernel, target, dtype, launch in enumerate_launches(configs):
        if dtype == torch.bfloat16:
            counts.setdefault((name, kernel), {})[target] = launch.programs
    lines = [
        f"programs at batch 1, {SEQ_LEN} tokens (bf16; >= {MIN_PROGRAMS} fills an H100)",
        "config  kernel  sm_80  sm_90",
    ]
    lines += [f"{c}  {k}  {t[80]}  {t[90]}" for (c, k), t in counts.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the rows to this JSON file")
    args = parser.parse_args(argv)
    configs = shipped_configs()
    rows = gate(configs)
    print(format_table(rows))
    print()
    print(format_launch_counts(configs))
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(r) | {"failures": r.failures} for r in rows], indent=1))
    failed = [r for r in rows if r.failures]
    print(f"{len(rows)} compilations, {len(failed)} failing")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
