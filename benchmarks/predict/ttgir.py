"""How often each loop of a compiled kernel runs: the `scf.for` loops of its TTGIR, their bounds evaluated
on a launch's scalar arguments and program ids.

A bound is an SSA value computed by integer `arith` ops from the kernel's arguments, constants, the
program id and the loop variables around it; `LoopNest.mean_trips` evaluates those ops (a bound read
from memory cannot be known ahead and raises) for a sample of program ids spread over the grid and
returns, per loop in the order the loops appear, its mean total iterations per program.
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Any

_DEF = re.compile(r"^\s*(%[\w.\-#]+)\s*=\s*([\w.]+)\s*(.*)$")
_FOR = re.compile(r"scf\.for\s+(%[\w.\-#]+)\s*=\s*(%[\w.\-#]+)\s+to\s+(%[\w.\-#]+)\s+step\s+(%[\w.\-#]+)")
_ARG = re.compile(r"%([\w]+):\s*(?:!tt\.ptr<[^>]*>|i\d+|f\d+|bf16)")
_BINARY = {
    "arith.addi": lambda a, b: a + b, "arith.subi": lambda a, b: a - b, "arith.muli": lambda a, b: a * b,
    "arith.divsi": lambda a, b: int(a / b), "arith.divui": lambda a, b: a // b,
    "arith.ceildivsi": lambda a, b: -(-a // b), "arith.floordivsi": lambda a, b: a // b,
    "arith.remsi": lambda a, b: int(math.fmod(a, b)), "arith.remui": lambda a, b: a % b,
    "arith.maxsi": max, "arith.minsi": min, "arith.maxui": max, "arith.minui": min,
    "arith.andi": lambda a, b: a & b, "arith.ori": lambda a, b: a | b, "arith.xori": lambda a, b: a ^ b,
    "arith.shli": lambda a, b: a << b, "arith.shrsi": lambda a, b: a >> b, "arith.shrui": lambda a, b: a >> b,
}
_CMP = {"eq": lambda a, b: a == b, "ne": lambda a, b: a != b, "slt": lambda a, b: a < b, "sle": lambda a, b: a <= b,
        "sgt": lambda a, b: a > b, "sge": lambda a, b: a >= b, "ult": lambda a, b: a < b, "ule": lambda a, b: a <= b,
        "ugt": lambda a, b: a > b, "uge": lambda a, b: a >= b}
_CASTS = ("arith.extsi", "arith.extui", "arith.trunci", "arith.index_cast", "arith.index_castui")
_MAX_ENUMERATED = 256  # loop-variable values walked one by one; longer loops are sampled evenly


class UnknownBound(ValueError):
    """A loop bound that depends on something a launch does not know ahead (a load from memory)."""


@dataclasses.dataclass
class Loop:
    iv: str
    lower: str
    upper: str
    step: str
    children: list[Loop] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class LoopNest:
    """The loops of one kernel (a forest, in order) and the SSA definitions their bounds use."""

    roots: list[Loop]
    defs: dict[str, tuple[str, str]]  # SSA name -> (op, rest of the line)
    args: list[str]  # the kernel's argument names

    def to_plain(self) -> dict[str, Any]:
        """The nest as JSON-able data: the loops and the integer definitions (tensor ones dropped)."""

        def plain(loop: Loop) -> list:
            return [loop.iv, loop.lower, loop.upper, loop.step, [plain(c) for c in loop.children]]

        defs = {k: v for k, v in self.defs.items() if "tensor<" not in v[1]}
        return {"roots": [plain(r) for r in self.roots], "defs": defs, "args": self.args}

    @classmethod
    def from_plain(cls, data: dict[str, Any]) -> LoopNest:
        def loop(x: list) -> Loop:
            return Loop(x[0], x[1], x[2], x[3], [loop(c) for c in x[4]])

        return cls([loop(r) for r in data["roots"]], {k: tuple(v) for k, v in data["defs"].items()}, data["args"])

    def order(self) -> list[Loop]:
        """Every loop, in the order it appears (pre-order)."""
        out: list[Loop] = []

        def walk(loops: list[Loop]) -> None:
            for loop in loops:
                out.append(loop)
                walk(loop.children)

        walk(self.roots)
        return out

    def constant_trips(self, loop: Loop) -> int | None:
        """The loop's trip count if its bounds are compile-time constants (LLVM may unroll it)."""
        env = _Env(self.defs, {}, (0, 0, 0), (1, 1, 1))
        try:
            lo, hi, step = (env.value(x) for x in (loop.lower, loop.upper, loop.step))
        except (UnknownBound, KeyError):
            return None
        return max(0, -(-(hi - lo) // step))

    def mean_trips(self, args: dict[str, Any], grid: tuple[int, int, int], samples: int) -> list[float]:
        """Per loop (pre-order), its total iterations per program, averaged over up to ``samples``
        program ids spread evenly over the grid."""
        loops = self.order()
        total = [0.0] * len(loops)
        index = {id(loop): i for i, loop in enumerate(loops)}
        programs = math.prod(grid)
        picks = sorted({round(i * (programs - 1) / max(samples - 1, 1)) for i in range(min(samples, programs))})
        for linear in picks:
            pid = (linear % grid[0], linear // grid[0] % grid[1], linear // (grid[0] * grid[1]))
            env = _Env(self.defs, args, pid, grid)
            for root in self.roots:
                self._count(root, env, 1.0, total, index)
        return [t / len(picks) for t in total]

    def _count(self, loop: Loop, env: _Env, weight: float, total: list[float], index: dict[int, int]) -> None:
        lo, hi, step = (env.value(x) for x in (loop.lower, loop.upper, loop.step))
        trips = max(0, -(-(hi - lo) // step))
        total[index[id(loop)]] += weight * trips
        if not loop.children or not trips:
            return
        values = list(range(lo, hi, step))
        if len(values) > _MAX_ENUMERATED:
            values = [values[round(i * (len(values) - 1) / (_MAX_ENUMERATED - 1))] for i in range(_MAX_ENUMERATED)]
        scale = trips / len(values)
        for v in values:
            inner = env.with_value(loop.iv, v)
            for child in loop.children:
                self._count(child, inner, weight * scale, total, index)


class _Env:
    """Evaluates integer SSA values for one program id."""

    def __init__(self, defs: dict[str, tuple[str, str]], args: dict[str, Any], pid: tuple[int, ...],
                 grid: tuple[int, ...], fixed: dict[str, int] | None = None) -> None:
        self.defs, self.args, self.pid, self.grid = defs, args, pid, grid
        self.fixed = dict(fixed or {})
        self.memo: dict[str, int] = {}

    def with_value(self, name: str, value: int) -> _Env:
        return _Env(self.defs, self.args, self.pid, self.grid, {**self.fixed, name: value})

    def value(self, name: str) -> int:
        if name in self.fixed:
            return self.fixed[name]
        if name in self.memo:
            return self.memo[name]
        if name not in self.defs:
            arg = name[1:]
            if arg in self.args and isinstance(self.args[arg], (int, bool)):
                return int(self.args[arg])
            raise UnknownBound(f"loop bound {name} is neither an integer argument nor computed from one")
        op, rest = self.defs[name]
        out = self._eval(op, rest)
        self.memo[name] = out
        return out

    def _eval(self, op: str, rest: str) -> int:
        body = rest.split(" : ")[0]
        operands = [x.strip() for x in body.split(",")]
        if op == "arith.constant":
            text = body.strip()
            return {"true": 1, "false": 0}.get(text) if text in ("true", "false") else int(text)
        if op in _BINARY:
            return _BINARY[op](self.value(operands[0]), self.value(operands[1]))
        if op == "arith.cmpi":
            return int(_CMP[operands[0]](self.value(operands[1]), self.value(operands[2])))
        if op == "arith.select":
            return self.value(operands[1]) if self.value(operands[0]) else self.value(operands[2])
        if op in _CASTS:
            return self.value(body.split()[0])
        if op == "tt.get_program_id":
            return self.pid["xyz".index(body.strip())]
        if op == "tt.get_num_programs":
            return self.grid["xyz".index(body.strip())]
        raise UnknownBound(f"loop bound computed by {op}, which is not known ahead of a launch")


def _strip(line: str) -> str:
    return re.sub(r"\s+loc\(.*$", "", line.rstrip())


def parse_loops(ttgir: str) -> LoopNest:
    """The loop nest and integer definitions of the (single) kernel function in ``ttgir``."""
    start = ttgir.index("tt.func")
    header = ttgir[start:ttgir.index("\n", start)]
    args = [m.group(1) for m in _ARG.finditer(header)]
    defs: dict[str, tuple[str, str]] = {}
    roots: list[Loop] = []
    stack: list[Loop | None] = []  # open regions: a loop, or None for any other region
    for raw in ttgir[ttgir.index("\n", start) + 1:].splitlines():
        line = _strip(raw)
        text = line.strip()
        closes = len(re.match(r"^\}*", text).group(0)) if text.startswith("}") else 0
        for _ in range(closes):
            if stack:
                stack.pop()
        loop = _FOR.search(line)
        if loop:
            new = Loop(*loop.groups())
            parent = next((x for x in reversed(stack) if x is not None), None)
            (parent.children if parent else roots).append(new)
        else:
            d = _DEF.match(line)
            if d and ":" not in d.group(1):
                defs[d.group(1)] = (d.group(2), d.group(3))
        opens = text.count("{") - text.count("}") + closes
        if text.endswith("{") or opens > 0:
            for _ in range(max(opens, 1 if text.endswith("{") else 0)):
                stack.append(new if loop else None)
    return LoopNest(roots, defs, args)
