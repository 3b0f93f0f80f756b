"""The code that travels: project modules flattened into an export for transformers' trust_remote_code.

transformers copies a remote-code model's files into its module cache by following the
`from .x import y` lines of the file it loads, recursively, one directory level deep; it copies
nothing else and refuses absolute imports of packages that are not installed. So every project
module reachable from the roots (`model`, and the tokenizer of `data_pipeline`) is written as a
top-level `rlm_<dotted name>.py` with its project imports rewritten, through `ast`, to relative ones.
"""

from __future__ import annotations

import ast
import shutil
from collections.abc import Iterator
from pathlib import Path

from pretrain.export.layout import CODE_PREFIX, HF_TEMPLATES, ExportError

REPO = Path(__file__).resolve().parents[2]
PROJECT_PACKAGES = ("model", "kernels", "data_pipeline")
ROOTS = ("model", "data_pipeline.tokenizer")
"""The modules the wrappers import; everything they reach travels with them."""
TEMPLATES = ("configuration_recurrent.py", "modeling_recurrent.py", "tokenization_recurrent.py")


def _module_file(name: str) -> Path | None:
    """The source file of project module `name` (e.g. "kernels.soe"), or None if it is not one."""
    parts = name.split(".")
    if parts[0] not in PROJECT_PACKAGES:
        return None
    base = REPO.joinpath(*parts)
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return base.with_suffix(".py") if base.with_suffix(".py").is_file() else None


def flat_name(module: str) -> str:
    """Where project module `module` lives in an export: "kernels.soe.chunk" -> "rlm_kernels_soe_chunk"."""
    return CODE_PREFIX + module.replace(".", "_")


def _project_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            modules = [node.module]
        else:
            continue
        if any(m.split(".")[0] in PROJECT_PACKAGES for m in modules):
            yield node


def _rewrite_import(node: ast.Import | ast.ImportFrom, where: str) -> list[str]:
    """Statements (without indentation) that bind the same names from the flattened modules.

    `from .x import y` is the only relative form transformers' loader follows to copy files, so
    names are imported that way; a submodule bound as a name (`import kernels`, `from model import
    soe`) becomes `from . import rlm_... as name`, and the file is reached through rlm_sources.py.
    """
    lines = []
    if isinstance(node, ast.Import):
        for alias in node.names:
            if "." in alias.name and alias.asname is None:
                raise ExportError(f"{where}: `import {alias.name}` binds a package chain the export cannot flatten")
            lines.append(f"from . import {flat_name(alias.name)} as {alias.asname or alias.name}")
        return lines
    names = []
    for alias in node.names:
        if _module_file(f"{node.module}.{alias.name}") is not None:
            lines.append(f"from . import {flat_name(node.module + '.' + alias.name)} as {alias.asname or alias.name}")
        else:
            names.append(alias.name if alias.asname is None else f"{alias.name} as {alias.asname}")
    if names:
        lines.insert(0, f"from .{flat_name(node.module)} import {', '.join(names)}")
    return lines


def _flatten_source(path: Path) -> tuple[str, list[str], list[str]]:
    """Module source with its project imports made relative to the flat layout. Also returns the
    project modules it imports (at any depth in the file, so lazily imported backends come too)
    and, of those, the ones bound as module objects (`import kernels`, `from model import soe`)."""
    text = path.read_text()
    tree = ast.parse(text)
    lines = text.splitlines()
    deps, bound = [], []
    for node in sorted(_project_imports(tree), key=lambda n: n.lineno, reverse=True):
        where = f"{path}:{node.lineno}"
        indent = lines[node.lineno - 1][: node.col_offset]
        if indent.strip():
            raise ExportError(f"{where}: an import sharing its line with other code cannot be rewritten")
        lines[node.lineno - 1 : node.end_lineno] = [indent + line for line in _rewrite_import(node, where)]
        if isinstance(node, ast.Import):
            bound.extend(a.name for a in node.names)
        else:
            deps.append(node.module)
            bound.extend(f"{node.module}.{a.name}" for a in node.names if _module_file(f"{node.module}.{a.name}"))
    rel = path.relative_to(REPO).as_posix()
    lines += ["", f'PROJECT_SOURCE = "{rel}"  # added by pretrain.export: where this file came from']
    return "\n".join(lines) + "\n", deps + bound, bound


def write_code(out: Path) -> list[str]:
    """Copy the modeling code into `out`: the hand-written transformers wrappers from
    pretrain/export/hf_templates/, and every project module reachable from ROOTS, flattened to
    top-level files `rlm_<dotted name>.py` with relative imports.

    transformers copies a remote-code model's files into its module cache by following
    `from .x import y` lines only, one directory level deep. Modules bound as objects
    (`from . import rlm_kernels as kernels`) are invisible to it, so the generated rlm_sources.py,
    which modeling_recurrent.py imports, names each of them in that form. Returns the modules.
    """
    todo, done, bound = list(ROOTS), {}, set()
    while todo:
        module = todo.pop()
        if module in done:
            continue
        path = _module_file(module)
        if path is None:
            raise ExportError(f"project module {module!r} not found under {REPO}")
        done[module], deps, as_objects = _flatten_source(path)
        bound.update(as_objects)
        todo.extend(d for d in deps if d not in done)
    for module, text in done.items():
        (out / f"{flat_name(module)}.py").write_text(text)
    named = sorted(bound)
    sources = [
        '"""Project modules that the carried code binds as module objects (generated by pretrain.export).',
        "",
        "transformers' loader copies only files reached by `from .x import` lines; this file holds one",
        "such line for each module the code imports as `from . import x as y`, which it cannot see.",
        '"""',
        "",
        *(f"from .{flat_name(m)} import PROJECT_SOURCE as _source_{i}" for i, m in enumerate(named)),
        "",
        "CARRIED_SOURCES = (",
        *(f"    _source_{i}," for i in range(len(named))),
        ")",
        "",
    ]
    (out / f"{CODE_PREFIX}sources.py").write_text("\n".join(sources))
    for template in TEMPLATES:
        shutil.copyfile(HF_TEMPLATES / template, out / template)
    return sorted(done)
