"""What a Triton launch compiles to, read from its SASS: the instruction mix per program, by unit.

A launch (benchmarks.predict.capture.Launch) is compiled ahead of time for its target with the
runtime's specialisation (triton.compile on an ASTSource), the cubin disassembled by the nvdisasm that
ships with triton, and its instructions put in classes by the unit that runs them (`UNITS`). Loops are
the backward branches of the SASS; how often each runs comes from the loop bounds of the TTGIR, the
same loops in the same order, evaluated on the launch's scalar arguments and program ids
(`trip_counts`). So the mix is per program, with each loop body counted as many times as it runs:
`Program.per_warp[unit]` counts warp instructions (what one warp issues), `tensor_flops` the
tensor-core FLOPs (HMMA: per warp; HGMMA: per warpgroup, from the shape in its opcode).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import io
import json
import math
import os
import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from benchmarks.predict.capture import Launch, constants_of, signature_of
from benchmarks.predict.ttgir import LoopNest, parse_loops

# opcode (before its first dot) -> unit
UNITS = {
    "tensor": ("HMMA", "HGMMA", "IMMA", "QGMMA", "BMMA"),
    "fp32": ("FADD", "FMUL", "FFMA", "FMNMX", "FSEL", "FSETP", "FSET", "FCHK", "FADD32I", "FMUL32I", "FFMA32I",
             "HADD2", "HMUL2", "HFMA2", "HMNMX2", "HSETP2", "FSWZADD", "DADD", "DMUL", "DFMA"),
    "sfu": ("MUFU",),
    "cvt": ("F2F", "F2FP", "I2F", "F2I", "I2FP", "F2IP", "FRND"),
    "int": ("IMAD", "IADD3", "LOP3", "SHF", "ISETP", "SEL", "IMNMX", "LEA", "IABS", "POPC", "FLO", "BREV", "PRMT",
            "SGXT", "IMUL", "IADD", "LOP", "ISCADD", "VIADD", "VIMNMX", "MOV", "P2R", "R2P", "PLOP3", "CS2R", "S2R",
            "IDP", "VABSDIFF", "BMSK", "IADD32I", "LOP32I", "IMAD32I"),
    "global": ("LDG", "STG", "LDGSTS", "RED", "ATOM", "ATOMG", "UTMALDG", "UTMASTG", "UBLKCP", "LD", "ST", "REDG"),
    "shared": ("LDS", "STS", "LDSM", "STSM", "ATOMS", "SHFL", "MATCH"),
    "local": ("LDL", "STL"),  # spilled registers, through L1
    "sync": ("BAR", "DEPBAR", "LDGDEPBAR", "WARPSYNC", "SYNCS", "MEMBAR", "ARRIVES", "WARPGROUP", "BSSY", "BSYNC",
             "FENCE", "ERRBAR", "CCTL"),
}
_UNIT_OF = {op: unit for unit, ops in UNITS.items() for op in ops}
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(\.[\w.]+)?\s*([^;]*);")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclasses.dataclass(frozen=True)
class Instruction:
    address: int
    opcode: str
    modifiers: str
    operands: str

    @property
    def unit(self) -> str:
        if self.opcode.startswith("U") and self.opcode not in _UNIT_OF:
            return "uniform"  # the uniform datapath: one issue slot, no vector lanes
        return _UNIT_OF.get(self.opcode, "other")


@dataclasses.dataclass
class Binary:
    """A compiled launch: registers per thread, shared bytes per program, the SASS, the loops."""

    name: str
    registers: int
    shared: int
    spills: int
    warps: int
    instructions: list[Instruction]
    loops: list[tuple[int, int]]  # (first address, branch address) of each loop, in address order
    nest: LoopNest
    used_args: frozenset[str]  # the pointer arguments the kernel touches (loads or stores)


def parse_sass(text: str) -> tuple[list[Instruction], list[tuple[int, int]]]:
    """The instructions of one kernel's SASS and its loops, from the backward branches."""
    out, labels, branches = [], {}, []
    pending: list[str] = []
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            pending.append(label.group(1))
            continue
        m = _LINE.search(line)
        if not m:
            continue
        ins = Instruction(int(m.group(1), 16), m.group(3), (m.group(4) or "")[1:], m.group(5).strip())
        for name in pending:
            labels[name] = ins.address
        pending = []
        out.append(ins)
        if ins.opcode == "BRA":
            target = _TARGET.search(ins.operands)
            if target:
                branches.append((ins.address, target.group(1)))
    loops = sorted((labels[t], a) for a, t in branches if t in labels and labels[t] < a)
    # a loop may close with several backward branches to the same head: keep the outermost branch
    merged: dict[int, int] = {}
    for head, end in loops:
        merged[head] = max(end, merged.get(head, end))
    return out, sorted(merged.items())


def tensor_flops(ins: Instruction, warps: int) -> float:
    """Tensor-core FLOPs one execution of ``ins`` by every warp of a program does."""
    mods = ins.modifiers
    if ins.opcode == "HGMMA":  # warpgroup-wide m x n x k: executed by the group's 4 warps together
        m, n, k = (int(x) for x in re.match(r"(\d+)x(\d+)x(\d+)", mods).groups())
        return 2.0 * m * n * k * warps / 4
    if ins.opcode in ("HMMA", "IMMA"):
        m, n, k = (int(x) for x in re.match(r"(16|8)(8)(\d+)", mods).groups())
        return 2.0 * m * n * k * warps
    return 0.0


def is_tf32(ins: Instruction) -> bool:
    return ins.unit == "tensor" and "TF32" in ins.modifiers


def _tool(name: str) -> str:
    from triton.backends.nvidia.compiler import get_ptxas

    return str(Path(get_ptxas(90).path).with_name(name))


def _ptxas_counts(cubin: bytes, name: str) -> tuple[int, int]:
    """(registers per thread, spilled bytes) from cuobjdump's resource usage of the cubin: the spills are
    the stack frame (where ptxas puts them; a Triton kernel makes no calls) and any local arrays."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        res = subprocess.run([_tool("cuobjdump"), "--dump-resource-usage", str(path)], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([_tool("nvdisasm"), "-c", str(path)], capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", res)
    if m is None:
        raise ValueError(f"{name}: no resource usage in cuobjdump's output:\n{res}")
    return (int(m.group(1)), int(m.group(2)) + int(m.group(3))), sass


def _key(launch: Launch, target: int) -> tuple:
    sig, attrs = signature_of(launch)
    consts = constants_of(launch, sig)
    constants = tuple(sorted((str(k), repr(v)) for k, v in consts.items()))
    attributes = tuple(sorted((k, str(v)) for k, v in attrs.items()))
    return (launch.kernel.cache_key, target, tuple(sig.items()), constants, attributes, launch.num_warps,
            launch.num_stages, launch.options)


RECORD_VERSION = 2  # what a cached record holds; 2: spills include the stack frame
CACHE_DIR = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "recurrent-pretrain" / "predict"
_MEMORY: dict[str, Binary] = {}


def compile_launch(launch: Launch, target: int) -> Binary:
    """Compile ``launch`` for ``target`` as the runtime would and read its SASS. What the model needs of
    it is cached in this process and as JSON under CACHE_DIR (keyed by the kernel's source, the
    specialisation, the options, the target and triton's version), so a second run compiles nothing."""
    import triton

    digest = hashlib.sha256(repr((_key(launch, target), triton.__version__, RECORD_VERSION)).encode()).hexdigest()[:32]
    if digest not in _MEMORY:
        path = CACHE_DIR / f"{digest}.json"
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            record = _compile_record(launch, target)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(record))
            os.replace(tmp, path)
        _MEMORY[digest] = _binary(record)
    return _MEMORY[digest]


def _compile_record(launch: Launch, target: int) -> dict[str, Any]:
    """Compile, disassemble and parse ``launch``: the plain data a Binary is made of."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = signature_of(launch)
    consts = constants_of(launch, sig)
    options = {"num_warps": launch.num_warps, "num_stages": launch.num_stages, **dict(launch.options)}
    with contextlib.redirect_stdout(io.StringIO()):
        compiled = triton.compile(ASTSource(launch.kernel, sig, consts, attrs), target=GPUTarget("cuda", target, 32),
                                  options=options)
    (registers, spills), sass = _ptxas_counts(compiled.asm["cubin"], launch.name)
    instructions, loops = parse_sass(sass)
    ttgir = compiled.asm["ttgir"]
    used = sorted(n for n, kind in sig.items() if kind.startswith("*") and re.search(rf"%{n}\b[^:]", _body(ttgir)))
    return {"name": launch.name, "registers": registers, "shared": compiled.metadata.shared, "spills": spills,
            "warps": launch.num_warps, "instructions": [[i.address, i.opcode, i.modifiers] for i in instructions],
            "loops": loops, "nest": parse_loops(ttgir).to_plain(), "used": used}


def _binary(record: dict[str, Any]) -> Binary:
    instructions = [Instruction(a, op, mods, "") for a, op, mods in record["instructions"]]
    return Binary(record["name"], record["registers"], record["shared"], record["spills"], record["warps"],
                  instructions, [tuple(x) for x in record["loops"]], LoopNest.from_plain(record["nest"]),
                  frozenset(record["used"]))


def _body(ttgir: str) -> str:
    """The TTGIR after the kernel's signature line."""
    start = ttgir.index("tt.func")
    return ttgir[ttgir.index("\n", start):]


@dataclasses.dataclass
class Program:
    """The work of one program (CTA) of a launch, loops counted as they run."""

    per_warp: Counter  # unit -> warp instructions one warp issues
    tensor_flops: float  # per program
    tf32_flops: float  # the part run as TF32 (half the bf16 rate)
    global_bytes: float  # bytes the program's loads and stores request (bulk copies aside)
    shared_bytes: float  # bytes through shared memory (LDS/STS/LDSM)
    loop_iterations: float  # iterations of the outermost loops (the sequential steps)
    body_instructions: float  # warp instructions per warp in one iteration of the outermost loops (0 if none)
    waiting_iterations: float  # iterations of outermost loops that wait on their own loads (_waits_on_loads)


BULK_COPIES = ("UTMALDG", "UTMASTG", "UBLKCP")
"""TMA and bulk copies: their bytes are not in the instruction's modifiers, so `Program.global_bytes` leaves
them out."""

_WIDTH = re.compile(r"(?:^|\.)(?:U?)(8|16|32|64|128)(?:\.|$)")


def _access_bytes(ins: Instruction) -> int:
    """Bytes one warp moves with a load or store instruction (32 lanes x the access width)."""
    if ins.opcode == "LDSM":  # ldmatrix: .M88.N = N 8x8 matrices of 16-bit
        n = re.search(r"M88\.(\d)", ins.modifiers)
        return 128 * int(n.group(1)) if n else 128
    m = _WIDTH.findall(ins.modifiers)
    width = int(m[-1]) if m else 32
    return 32 * width // 8


def program_work(binary: Binary, trips: list[float]) -> Program:
    """The instruction mix of one program given each SASS loop's total iterations per program."""
    weights = []  # an instruction runs as often as the innermost loop around it (trips are totals)
    for ins in binary.instructions:
        inside = [(end - head, count) for (head, end), count in zip(binary.loops, trips) if head <= ins.address <= end]
        weights.append(min(inside)[1] if inside else 1.0)
    per_warp, flops, tf32, gbytes, sbytes = Counter(), 0.0, 0.0, 0.0, 0.0
    for w, ins in zip(weights, binary.instructions):
        per_warp[ins.unit] += w
        if ins.unit == "tensor":
            f = tensor_flops(ins, binary.warps) * w
            flops += f
            tf32 += f if is_tf32(ins) else 0.0
        elif ins.unit == "global" and ins.opcode not in BULK_COPIES:
            gbytes += _access_bytes(ins) * binary.warps * w
        elif ins.unit == "shared" and ins.opcode in ("LDS", "STS", "LDSM", "STSM"):
            sbytes += _access_bytes(ins) * binary.warps * w
    outer = [i for i, (h, e) in enumerate(binary.loops) if not any(h2 < h and e <= e2 for h2, e2 in binary.loops)]
    iterations = sum(trips[i] for i in outer)
    body = sum(w for w, ins in zip(weights, binary.instructions)
               if any(binary.loops[i][0] <= ins.address <= binary.loops[i][1] for i in outer))
    waiting = sum(trips[i] for i in outer if _waits_on_loads(binary, *binary.loops[i]))
    return Program(per_warp, flops, tf32, gbytes, sbytes, iterations, body / iterations if iterations else 0.0,
                   waiting)


def _waits_on_loads(binary: Binary, head: int, end: int) -> bool:
    """Whether a loop loads from global memory synchronously (LDG) with no asynchronous copy (LDGSTS,
    TMA) that the compiler's pipelining issues iterations ahead: such a loop waits on its loads."""
    ops = {i.opcode for i in binary.instructions if head <= i.address <= end}
    return "LDG" in ops and not ops & {"LDGSTS", "UTMALDG", "UBLKCP"}


def loop_trips(binary: Binary, launch: Launch, samples: int = 16) -> list[float]:
    """Mean iterations per program of each SASS loop (its total over the loops around it), from the
    TTGIR's loop bounds over a sample of program ids. The TTGIR loops map to the SASS loops in order,
    with three compiler rewrites undone:
    - loops that run at most once each time they are reached (an argument the JIT specialised to 1, as a
      span of one chunk) that the SASS has fewer of became straight code (these first);
    - loops of constant trip count that the SASS has fewer of were unrolled, and their bodies are
      counted as the unrolled code (innermost and shortest first);
    - a SASS loop right after a longer one at the same depth, when the SASS has more loops, is the
      remainder of an unrolled loop: the pair shares the TTGIR loop's iterations, the long body
      running trips / u times and the remainder (u - 1) / 2 on average (u: the ratio of their sizes,
      rounded to a power of two).
    """
    loops = binary.nest.order()
    means = binary.nest.mean_trips(launch.args, launch.grid, samples)
    parent = {id(child): i for i, loop in enumerate(loops) for child in loop.children}
    single = [i for i, loop in enumerate(loops)
              if means[i] <= (means[parent[id(loop)]] if id(loop) in parent else 1.0)]  # fmt: skip
    unrollable = sorted((i for i, loop in enumerate(loops) if binary.nest.constant_trips(loop) is not None
                         and not loop.children and i not in single),
                        key=lambda i: (binary.nest.constant_trips(loops[i]), -i))  # fmt: skip
    unrollable = single + unrollable
    keep = set(range(len(loops)))
    while len(keep) > len(binary.loops) and unrollable:
        keep.discard(unrollable.pop(0))
    remainders = _remainder_loops(binary.loops, len(binary.loops) - len(keep))
    if len(keep) + len(remainders) != len(binary.loops):
        raise ValueError(f"{launch.name}: {len(binary.loops)} loops in the SASS but {len(loops)} in the TTGIR")
    kept = iter(means[i] for i in sorted(keep))
    out: list[float] = []
    for i, (head, end) in enumerate(binary.loops):
        if i in remainders:
            main_head, main_end = binary.loops[i - 1]
            ratio = (main_end - main_head) / max(end - head, 1)  # LLVM unrolls by powers of two
            unroll = 2 ** max(0, round(math.log2(max(ratio, 1.0))))
            parents = [j for j, (h, e) in enumerate(binary.loops[:i]) if h < head and end <= e]
            entries = out[parents[-1]] if parents else 1.0
            out[i - 1] /= unroll
            out.append(entries * (unroll - 1) / 2)
        else:
            out.append(next(kept))
    return out


def _remainder_loops(loops: list[tuple[int, int]], extra: int) -> set[int]:
    """Indices of the ``extra`` SASS loops that follow a longer loop at the same depth (remainders)."""
    if extra <= 0:
        return set()
    depth = [sum(1 for h, e in loops if h < head and end <= e) for head, end in loops]
    found = [i for i in range(1, len(loops)) if depth[i] == depth[i - 1] and loops[i - 1][1] < loops[i][0]
             and (loops[i][1] - loops[i][0]) < (loops[i - 1][1] - loops[i - 1][0])]
    return set(found[:extra]) if len(found) >= extra else set(found) | {-1}


