"""Scaling-law sweeps: a sweep file and the grid of training runs it stands for.

A sweep file (YAML, `configs/sweeps/*.yaml`) names one base run config, the model families, the
model shapes, the FLOP budgets (isoFLOP) and/or tokens-per-parameter ratios, the seeds and a
learning-rate rule. `plan_sweep` turns it into cells: each cell is an ordinary run of
`launch/pretrain.py --config <base> <dotted overrides>`, sized so that the model's own
`flops_per_token` times the tokens it trains on meets the cell's budget to within 1%.

What the cells leave behind is read by pretrain/sweep_results.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import shlex
import weakref
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from torch import nn

from model import build_model
from model.config import ModelConfig
from model.config_loader import read_tree, to_overrides
from pretrain.config import ConfigError, RunConfig, load_config

BUDGET_TOLERANCE = 0.01  # a cell's FLOPs may miss its budget by at most 1%
ENTRY_POINT = "launch/pretrain.py"
SWEEP_KEYS = {
    "name", "base", "out", "families", "shapes", "budgets", "tokens_per_param", "tokens_per_param_range",
    "seeds", "lr", "warmup_fraction", "min_steps", "overrides", "launcher", "slurm",
}


class SweepError(ValueError):
    """A sweep file, plan or results set that cannot be used; the message names what and where."""


@dataclasses.dataclass(frozen=True)
class Shape:
    d_model: int
    n_layers: int
    n_heads: int

    @property
    def tag(self) -> str:
        return f"d{self.d_model}-l{self.n_layers}"


@dataclasses.dataclass(frozen=True)
class ParamTarget:
    """A shape given as a parameter count: resolved per family to the depth, with
    d_model = aspect_ratio x depth (rounded to a multiple of head_dim), nearest the target."""

    params: float
    aspect_ratio: float
    head_dim: int

    def shape(self, depth: int) -> Shape:
        width = max(1, round(self.aspect_ratio * depth / self.head_dim)) * self.head_dim
        return Shape(width, depth, width // self.head_dim)


@dataclasses.dataclass
class Cell:
    """One training run of the sweep and the numbers that size it."""

    family: str
    shape: Shape
    seed: int
    budget: float | None  # the nominal FLOP budget (None for a tokens-per-parameter cell)
    ratio: float | None  # the nominal tokens per parameter (None for an isoFLOP cell)
    params: int
    params_no_embed: int
    flops_per_token: float
    seq_len: int
    tokenizer: str  # "bytes" makes the held-out loss bits per byte
    tokens_per_step: int
    steps: int
    lr: float
    run_dir: str
    checkpoint_root: str  # a path or fsspec URL: <run dir>/checkpoints unless the base config names a root
    overrides: list[str]

    @property
    def name(self) -> str:
        size = f"C{self.budget:.2e}" if self.budget is not None else f"r{self.ratio:g}"
        return f"{self.family}/{self.shape.tag}-{size}-s{self.seed}"

    @property
    def tokens(self) -> int:
        return self.steps * self.tokens_per_step

    @property
    def flops(self) -> float:
        return self.flops_per_token * self.tokens

    def row(self) -> dict[str, Any]:
        """The plan's JSON row."""
        return {
            "name": self.name, "family": self.family, "d_model": self.shape.d_model,
            "n_layers": self.shape.n_layers, "n_heads": self.shape.n_heads, "seed": self.seed,
            "budget": self.budget, "ratio": self.ratio, "params": self.params,
            "params_no_embed": self.params_no_embed, "tokens": self.tokens, "flops": self.flops,
            "steps": self.steps, "lr": self.lr, "run_dir": self.run_dir, "overrides": self.overrides,
        }


@dataclasses.dataclass
class Sweep:
    """A parsed sweep file; `plan_sweep` turns it into cells."""

    path: Path
    name: str
    base: Path
    out: Path
    families: dict[str, list[str]]  # family -> dotted overrides (its model file, then its own)
    shapes: list[Shape | ParamTarget]
    budgets: list[float]
    ratios: list[float]
    ratio_range: tuple[float, float] | None
    seeds: list[int]
    lr: dict[str, float]
    warmup_fraction: float | None
    min_steps: int
    overrides: list[str]
    launcher: str  # words before the entry point; $VARIABLES expand where the cell runs
    slurm: dict[str, Any]


# ----------------------------------------------------------------------------- reading a sweep file


def _overrides(value: Any, where: str) -> list[str]:
    """Overrides given as a mapping of dotted keys (or nested sections) or as `key=value` strings."""
    if value is None:
        return []
    if isinstance(value, dict):
        return to_overrides(value, "")
    if isinstance(value, list) and all(isinstance(v, str) and "=" in v for v in value):
        return list(value)
    raise SweepError(f"{where}: expected a mapping of dotted keys to values or a list of key=value, got {value!r}")


def _model_overrides(path: Path, where: str) -> list[str]:
    """A model file's `model:` section (following its `extends`) as dotted overrides."""
    if not path.is_file():
        raise SweepError(f"{where}: model file {path} not found")
    try:
        tree, _ = read_tree(path)
    except ConfigError as err:
        raise SweepError(f"{where}: {err}") from err
    return to_overrides(tree.get("model") or {}, "model")


def _number_list(value: Any, where: str, kind: type = float) -> list:
    values = value if isinstance(value, list) else [value]
    out = []
    for v in values:
        try:
            number = kind(float(v)) if kind is int else float(v)
        except (TypeError, ValueError):
            raise SweepError(f"{where}: expected {'integers' if kind is int else 'numbers'}, got {v!r}") from None
        if kind is float and not number > 0:
            raise SweepError(f"{where}: expected positive numbers, got {v!r}")
        out.append(number)
    return out


def _parse_target(item: dict[str, Any], here: str) -> ParamTarget:
    if set(item) != {"params", "aspect_ratio", "head_dim"}:
        raise SweepError(f"{here}: a parameter target takes exactly params, aspect_ratio (d_model / n_layers) "
                         f"and head_dim, got {sorted(item)}")
    target = ParamTarget(*_number_list([item["params"], item["aspect_ratio"]], here), int(item["head_dim"]))
    if target.head_dim < 2 or target.head_dim % 2:
        raise SweepError(f"{here}: head_dim: expected an even number >= 2, got {item['head_dim']!r}")
    return target


def _parse_shapes(value: Any, where: str) -> list[Shape | ParamTarget]:
    if not isinstance(value, list) or not value:
        raise SweepError(f"{where}: expected a non-empty list of {{d_model, n_layers, n_heads or head_dim}} "
                         f"or {{params, aspect_ratio, head_dim}}")
    shapes: list[Shape | ParamTarget] = []
    for i, item in enumerate(value):
        here = f"{where}[{i}]"
        if isinstance(item, dict) and "params" in item:
            shapes.append(_parse_target(item, here))
            continue
        if not isinstance(item, dict) or not {"d_model", "n_layers"} <= set(item):
            raise SweepError(f"{here}: expected a mapping with d_model, n_layers and n_heads or head_dim, got {item!r}")
        unknown = set(item) - {"d_model", "n_layers", "n_heads", "head_dim"}
        if unknown:
            raise SweepError(f"{here}: unknown keys {sorted(unknown)}; shapes take d_model, n_layers, n_heads/head_dim")
        d_model, n_layers = int(item["d_model"]), int(item["n_layers"])
        if "n_heads" in item:
            n_heads = int(item["n_heads"])
        elif "head_dim" in item and d_model % int(item["head_dim"]) == 0:
            n_heads = d_model // int(item["head_dim"])
        else:
            raise SweepError(f"{here}: give n_heads, or a head_dim that divides d_model={d_model}")
        shapes.append(Shape(d_model, n_layers, n_heads))
    return shapes


def load_sweep(path: str | Path) -> Sweep:
    """Read and check a sweep file; every problem names the file and the key."""
    path = Path(path)
    try:
        data, _ = read_tree(path)
    except ConfigError as err:
        raise SweepError(str(err)) from err
    unknown = set(data) - SWEEP_KEYS
    if unknown:
        raise SweepError(f"{path}: unknown keys {sorted(unknown)}; a sweep file accepts {sorted(SWEEP_KEYS)}")
    for key in ("name", "base", "out", "families", "shapes"):
        if key not in data:
            raise SweepError(f"{path}: {key}: required")
    here = path.parent
    base = Path(os.path.normpath(here / data["base"]))
    if not base.is_file():
        raise SweepError(f"{path}: base: run config {base} not found")
    families_raw = data["families"]
    if not isinstance(families_raw, dict) or not families_raw:
        raise SweepError(f"{path}: families: expected a mapping of family name -> model file or {{model, overrides}}")
    families = {}
    for family, spec in families_raw.items():
        where = f"{path}: families.{family}"
        spec = {"model": spec} if isinstance(spec, str) else spec
        if not isinstance(spec, dict) or not set(spec) <= {"model", "overrides"}:
            raise SweepError(f"{where}: expected a model file name or a mapping with keys model, overrides")
        model = _model_overrides(here / spec["model"], where + ".model") if "model" in spec else []
        families[str(family)] = model + _overrides(spec.get("overrides"), where + ".overrides")
    budgets = _number_list(data.get("budgets", []), f"{path}: budgets")
    ratios = _number_list(data.get("tokens_per_param", []), f"{path}: tokens_per_param")
    if not budgets and not ratios:
        raise SweepError(f"{path}: give budgets (FLOPs per cell) and/or tokens_per_param")
    ratio_range = data.get("tokens_per_param_range")
    if ratio_range is not None:
        ratio_range = tuple(_number_list(ratio_range, f"{path}: tokens_per_param_range"))
        if len(ratio_range) != 2 or ratio_range[0] >= ratio_range[1]:
            raise SweepError(f"{path}: tokens_per_param_range: expected [low, high] with low < high")
    lr = data.get("lr", {})
    if not isinstance(lr, dict) or "base" not in lr or not set(lr) <= {"base", "d_model", "exponent"}:
        raise SweepError(f"{path}: lr: expected {{base, d_model, exponent}} (lr = base * (d_model / width)^exponent)")
    lr = {"base": float(lr["base"]), "d_model": float(lr.get("d_model", 1)), "exponent": float(lr.get("exponent", 0))}
    warmup = data.get("warmup_fraction")
    if warmup is not None and not 0 <= float(warmup) < 1:
        raise SweepError(f"{path}: warmup_fraction: expected a number in [0, 1), got {warmup!r}")
    launcher = str(data.get("launcher", "python"))
    slurm = data.get("slurm", {}) or {}
    if not isinstance(slurm, dict):
        raise SweepError(f"{path}: slurm: expected a mapping of sbatch settings")
    return Sweep(
        path=path, name=str(data["name"]), base=base, out=Path(data["out"]), families=families,
        shapes=_parse_shapes(data["shapes"], f"{path}: shapes"), budgets=budgets, ratios=ratios,
        ratio_range=ratio_range, seeds=_number_list(data.get("seeds", [0]), f"{path}: seeds", int), lr=lr,
        warmup_fraction=None if warmup is None else float(warmup), min_steps=int(data.get("min_steps", 1)),
        overrides=_overrides(data.get("overrides"), f"{path}: overrides"), launcher=launcher, slurm=slurm,
    )


# ----------------------------------------------------------------------------- sizing cells


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Build modules with every parameter moved to the meta device as it is registered.

    Counting the parameters and FLOPs of a 1.3B model then costs no memory for its weights; tied
    weights stay tied (the same parameter maps to the same meta tensor). Buffers stay on the CPU,
    which model code that computes on them at construction needs.
    """
    original = nn.Module.register_parameter
    moved: dict[int, tuple[weakref.ref, nn.Parameter]] = {}

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is not None and param.device.type != "meta":
            seen = moved.get(id(param))
            if seen is None or seen[0]() is not param:
                seen = (weakref.ref(param), nn.Parameter(param.to("meta"), requires_grad=param.requires_grad))
                moved[id(param)] = seen
            param = seen[1]
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def measure_model(config: ModelConfig, seq_len: int) -> tuple[int, int, float]:
    """(parameters, parameters without the embedding, training FLOPs per token at seq_len)."""
    with parameters_on_meta():
        model = build_model(config)
    return model.num_parameters(), model.num_parameters(exclude_embeddings=True), model.flops_per_token(seq_len)


def _resolve(sweep: Sweep, overrides: list[str], where: str) -> RunConfig:
    try:
        return load_config(sweep.base, overrides)
    except ConfigError as err:
        raise SweepError(f"{where}: {err}") from err


def _shape_overrides(shape: Shape) -> list[str]:
    return [f"model.d_model={shape.d_model}", f"model.n_layers={shape.n_layers}", f"model.n_heads={shape.n_heads}"]


def _resolve_target(sweep: Sweep, family: str, overrides: list[str], target: ParamTarget) -> Shape:
    """The depth (and so the shape) whose parameter count is nearest the target on a log scale;
    counts grow with depth, so a doubling search then bisection needs a dozen model builds at most."""
    counts: dict[int, int] = {}

    def count(depth: int) -> int:
        if depth not in counts:
            shape = target.shape(depth)
            cfg = _resolve(sweep, [*overrides, *_shape_overrides(shape)], f"{sweep.path}: family {family} {shape.tag}")
            counts[depth] = measure_model(cfg.model, cfg.data.seq_len)[0]
        return counts[depth]

    low, high = 1, 1
    while count(high) < target.params and high < 1024:
        low, high = high, high * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if count(middle) < target.params else (low, middle)
    best = min((low, high), key=lambda d: abs(math.log(count(d) / target.params)))
    return target.shape(best)


def plan_sweep(sweep: Sweep) -> tuple[list[Cell], list[str]]:
    """Every cell of the sweep, and one line per (shape, budget) left out with the reason.

    Steps are chosen so that steps x tokens_per_step x flops_per_token is within 1% of the
    budget; a shape that cannot meet a budget that way (or with at least `min_steps` steps, or
    inside `tokens_per_param_range`) is left out, and a budget no shape meets is an error.
    """
    cells: list[Cell] = []
    skipped: list[str] = []
    for family, family_overrides in sweep.families.items():
        seen: set[Shape] = set()
        for entry in sweep.shapes:
            shape = entry if isinstance(entry, Shape) else _resolve_target(
                sweep, family, [*family_overrides, *sweep.overrides], entry)
            if shape in seen:
                skipped.append(f"{family} {shape.tag}: listed twice (a parameter target resolved to it)")
                continue
            seen.add(shape)
            shape_overrides = [*family_overrides, *sweep.overrides, *_shape_overrides(shape)]
            cfg = _resolve(sweep, shape_overrides, f"{sweep.path}: family {family} shape {shape.tag}")
            if not cfg.data.valid:
                raise SweepError(f"{sweep.base}: data.valid: a sweep needs held-out data for each cell's final loss")
            seq_len = cfg.data.seq_len
            params, params_no_embed, fpt = measure_model(cfg.model, seq_len)
            tokens_per_step = cfg.train.global_batch * seq_len
            targets = [(b, None, b / fpt) for b in sweep.budgets] + [(None, r, r * params) for r in sweep.ratios]
            for budget, ratio, tokens in targets:
                label = f"budget {budget:.3g}" if budget is not None else f"{ratio:g} tokens/param"
                steps = max(round(tokens / tokens_per_step), 0)
                reason = _infeasible(sweep, steps, tokens_per_step, fpt, params, budget)
                if reason:
                    skipped.append(f"{family} {shape.tag} ({params:,} params) at {label}: {reason}")
                    continue
                for seed in sweep.seeds:
                    cells.append(_make_cell(sweep, cfg, family, shape, seed, budget, ratio, steps,
                                            (params, params_no_embed, fpt), shape_overrides))
    for budget in sweep.budgets:
        for family in sweep.families:
            if not any(c.budget == budget and c.family == family for c in cells):
                reasons = "\n  ".join(s for s in skipped if s.startswith(f"{family} ") and f"budget {budget:.3g}" in s)
                raise SweepError(
                    f"{sweep.path}: budgets: no shape of family {family} can meet {budget:.3g} FLOPs:\n  {reasons}"
                )
    # smallest budgets first, all families side by side: a sweep cut short still has whole isoFLOP curves
    order = list(sweep.families)
    cells.sort(key=lambda c: (c.budget is None, c.budget or c.ratio, order.index(c.family), c.params, c.seed))
    return cells, skipped


def _infeasible(sweep: Sweep, steps: int, tokens_per_step: int, fpt: float, params: int, budget: float | None) -> str:
    if steps < max(sweep.min_steps, 1):
        return f"{steps} steps of {tokens_per_step:,} tokens, fewer than min_steps={sweep.min_steps}"
    if budget is not None:
        error = abs(steps * tokens_per_step * fpt - budget) / budget
        if error > BUDGET_TOLERANCE:
            return f"{steps} steps miss the budget by {error:.1%} (> 1%); smaller batches would meet it"
    if sweep.ratio_range is not None:
        ratio = steps * tokens_per_step / params
        low, high = sweep.ratio_range
        if not low <= ratio <= high:
            return f"{ratio:.3g} tokens/param, outside tokens_per_param_range [{low:g}, {high:g}]"
    return ""


def _make_cell(sweep: Sweep, cfg: RunConfig, family: str, shape: Shape, seed: int, budget: float | None,
               ratio: float | None, steps: int, measured: tuple[int, int, float], shape_overrides: list[str]) -> Cell:
    params, params_no_embed, fpt = measured
    lr = sweep.lr["base"] * (sweep.lr["d_model"] / shape.d_model) ** sweep.lr["exponent"]
    cell = Cell(family, shape, seed, budget, ratio, params, params_no_embed, fpt, cfg.data.seq_len,
                cfg.data.tokenizer, cfg.train.global_batch * cfg.data.seq_len, steps, lr, "", "", [])
    run_dir = sweep.out / cell.name
    cell.run_dir = str(run_dir)
    # a checkpoint root in the base config (e.g. s3://bucket/ckpt) gets one directory per cell under it
    cell.checkpoint_root = (f"{cfg.checkpoint.dir.rstrip('/')}/{sweep.name}/{cell.name}" if cfg.checkpoint.dir
                            else str(run_dir / "checkpoints"))
    cell.overrides = [
        *shape_overrides,
        f"run.name={sweep.name}-{cell.name.replace('/', '-')}",
        f"run.dir={run_dir}",
        f"checkpoint.dir={cell.checkpoint_root}",
        f"run.seed={seed}",
        f"train.steps={steps}",
        f"train.lr={lr:.6g}",
        # the held-out loss of the final step, at the training context, is the cell's result
        f"eval.every={steps}",
        f"eval.contexts=[{cfg.data.seq_len}]",
        "checkpoint.resume=auto",
    ]
    if sweep.warmup_fraction is not None:
        cell.overrides.append(f"train.warmup_steps={int(sweep.warmup_fraction * steps)}")
    _resolve(sweep, cell.overrides, f"{sweep.path}: cell {cell.name}")  # every cell's config validates
    return cell


def cell_arguments(sweep: Sweep, cell: Cell) -> list[str]:
    """What follows the launcher in a cell's command: the entry point, the base config, the overrides."""
    return [ENTRY_POINT, "--config", str(sweep.base), *cell.overrides]


def cell_shell_command(sweep: Sweep, cell: Cell) -> str:
    """One cell's command as a shell line (the launcher's $VARIABLES left for the shell to expand)."""
    return f"{sweep.launcher} {shlex.join(cell_arguments(sweep, cell))}"


def format_plan(cells: list[Cell]) -> str:
    """The plan as a Markdown table, one row per cell."""
    lines = [
        "| cell | family | params | non-embedding | tokens | tokens/param | FLOPs | budget error | steps | lr "
        "| run dir |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for c in cells:
        error = f"{(c.flops - c.budget) / c.budget:+.2%}" if c.budget is not None else "-"
        lines.append(
            f"| {c.name} | {c.family} | {c.params:,} | {c.params_no_embed:,} | {c.tokens:,} "
            f"| {c.tokens / c.params:.1f} | {c.flops:.3e} | {error} | {c.steps} | {c.lr:.3g} | {c.run_dir} |"
        )
    return "\n".join(lines)
