"""Export a training checkpoint as a self-contained model directory for downstream evaluation.

    python -m pretrain.export --checkpoint <step dir | checkpoints dir | run dir> --out <dir>

The checkpoint's manifest is verified first. Whatever engine wrote it (single process, DeepSpeed
ZeRO 0-3, FSDP2 through torch.distributed.checkpoint), the weights are consolidated into one fp32
state dict under the CausalLM's own parameter names, loaded into a freshly built model (so that a
missing or unexpected key fails here, not in a user's notebook) and written as:

  model.safetensors       fp32 weights; tied head/embedding stored once, as safetensors' save_model does
  config.json             transformers-style: model_type, architectures, auto_map, our model config
                          nested under "lm_config", vocabulary and special ids, provenance
  recurrent_tokenizer.json  kind, vocab size, special ids, sha256 (a name HF tokenizers will not misread);
                          plus tokenizer.model (a copy of the sentencepiece model) for tokenized runs
  README.md               a short model card
  configuration_recurrent.py, modeling_recurrent.py, rlm_*.py
                          the code transformers runs under trust_remote_code (see `write_code`)

Loading never unpickles code: safetensors, JSON, YAML through safe_load, and torch.load with
weights_only=True (DeepSpeed's files need a few of its classes allow-listed; see
`_deepspeed_state`).
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import shutil
import sys
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import fsspec
import torch
import yaml
from safetensors.torch import load_file, load_model, save_model

from model import CausalLM, build_model
from pretrain import checkpoint as ckpt
from pretrain.config import ConfigError, RunConfig, config_from_dict, config_to_dict

REPO = Path(__file__).resolve().parents[1]
HF_TEMPLATES = Path(__file__).resolve().parent / "hf_export"
WEIGHTS = "model.safetensors"
TOKENIZER_JSON = "recurrent_tokenizer.json"  # not "tokenizer.json": that name is the HF tokenizers format
SENTENCEPIECE_FILE = "tokenizer.model"
CODE_PREFIX = "rlm_"
PROJECT_PACKAGES = ("model", "kernels")
EXPORT_FORMAT = 1
ENGINE_PREFIX = "model."  # engines wrap the CausalLM in TrainModule as `.model`


class ExportError(RuntimeError):
    """A checkpoint or export directory that cannot be used; the message names the path."""


# ----------------------------------------------------------------------------- finding the checkpoint


def resolve_checkpoint(path: str | Path) -> Path:
    """The step directory meant by `path`: a step directory itself, or a checkpoints directory or
    run directory, in which case its `latest` pointer (or else the newest step) is taken."""
    path = Path(path)
    if not path.exists():
        raise ExportError(f"{path}: no such checkpoint or run directory")
    if (path / "config.yaml").is_file() and (path / "engine").is_dir():
        return path
    for root in (path, path / "checkpoints"):
        latest = root / ckpt.LATEST
        if latest.is_file():
            step = root / latest.read_text().strip()
            if step.is_dir():
                return step
        steps = ckpt.committed_steps(str(root)) if root.is_dir() else []
        if steps:
            return root / steps[0]
    raise ExportError(f"{path}: not a checkpoint (no engine/ and config.yaml) and holds no step_* checkpoints")


def read_run_config(step_dir: Path) -> RunConfig:
    """The resolved RunConfig saved beside the weights."""
    path = step_dir / "config.yaml"
    try:
        return config_from_dict(yaml.safe_load(path.read_text()) or {})
    except (OSError, yaml.YAMLError, ConfigError) as err:
        raise ExportError(f"{path}: cannot read the run config: {err}") from err


# ----------------------------------------------------------------------------- consolidation


def _strip_engine_prefix(state: dict[str, torch.Tensor], source: Path) -> dict[str, torch.Tensor]:
    if not all(k.startswith(ENGINE_PREFIX) for k in state):
        odd = next(k for k in state if not k.startswith(ENGINE_PREFIX))
        raise ExportError(f"{source}: parameter {odd!r} is not under the engine's {ENGINE_PREFIX!r} prefix")
    return {k[len(ENGINE_PREFIX) :]: v for k, v in state.items()}


def _single_state(engine_dir: Path) -> dict[str, torch.Tensor]:
    path = engine_dir / "model.safetensors"
    if not path.is_file():
        raise ExportError(f"{path}: missing (engine.kind=single writes the weights there)")
    return load_file(str(path))


class _WeightsOnlyTorch:
    """Stands in for the `torch` module inside deepspeed.utils.zero_to_fp32 so that each of its
    torch.load calls (which ask for weights_only=False) runs with weights_only=True."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        kwargs["weights_only"] = True
        return torch.load(f, *args, **kwargs)


@contextlib.contextmanager
def _deepspeed_weights_only() -> Iterator[None]:
    from deepspeed.utils import zero_to_fp32

    saved = zero_to_fp32.torch
    zero_to_fp32.torch = _WeightsOnlyTorch()
    try:
        with torch.serialization.safe_globals(ckpt.deepspeed_safe_globals()):
            yield
    finally:
        zero_to_fp32.torch = saved


def _deepspeed_state(engine_dir: Path, zero_stage: int) -> dict[str, torch.Tensor]:
    """ZeRO 1-3: the fp32 master weights from the optimizer partitions, merged by DeepSpeed's own
    zero_to_fp32. Stage 0 has no partitions: the module weights in mp_rank_00_model_states.pt."""
    tag_dir = engine_dir / "ds"
    if not tag_dir.is_dir():
        raise ExportError(f"{tag_dir}: missing (engine.kind=deepspeed saves with tag 'ds')")
    try:
        if zero_stage == 0:
            model_file = tag_dir / "mp_rank_00_model_states.pt"
            with torch.serialization.safe_globals(ckpt.deepspeed_safe_globals()):
                saved = torch.load(model_file, map_location="cpu", weights_only=True)
            state = dict(saved["module"])
        else:
            from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

            with _deepspeed_weights_only(), contextlib.redirect_stdout(sys.stderr):
                state = get_fp32_state_dict_from_zero_checkpoint(str(engine_dir), tag="ds")
    except ExportError:
        raise
    except Exception as err:  # DeepSpeed and torch.load raise many types; all mean "unusable checkpoint"
        raise ExportError(f"{tag_dir}: cannot consolidate the DeepSpeed ZeRO-{zero_stage} checkpoint: {err}") from err
    return _strip_engine_prefix(state, tag_dir)


def _fsdp_state(engine_dir: Path) -> dict[str, torch.Tensor]:
    """torch.distributed.checkpoint: read the "model" entries without a process group."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        metadata = dcp.FileSystemReader(str(engine_dir)).read_metadata()
    except Exception as err:  # a missing or unreadable .metadata file
        raise ExportError(f"{engine_dir}: not a torch.distributed.checkpoint directory: {err}") from err
    wanted = {}
    for key, meta in metadata.state_dict_metadata.items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            wanted[key[len("model.") :]] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not wanted:
        raise ExportError(f"{engine_dir}: the checkpoint holds no 'model' tensors")
    try:
        with warnings.catch_warnings():  # torch warns that no process group is initialised: that is the point
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load({"model": wanted}, checkpoint_id=str(engine_dir), no_dist=True)
    except Exception as err:
        raise ExportError(f"{engine_dir}: cannot read the model tensors: {err}") from err
    return _strip_engine_prefix(wanted, engine_dir)


def consolidate(step_dir: Path, cfg: RunConfig) -> CausalLM:
    """The trained model of a verified step directory, on CPU in fp32, whatever engine saved it."""
    engine_dir = step_dir / "engine"
    kind = cfg.engine.kind
    if kind == "single":
        state = _single_state(engine_dir)
    elif kind == "deepspeed":
        state = _deepspeed_state(engine_dir, cfg.engine.zero_stage)
    else:
        state = _fsdp_state(engine_dir)
    model = build_model(cfg.model)
    names = model.state_dict(keep_vars=True)  # persistent entries only, tied aliases included
    aliases = _tied_aliases(model)
    state = {k: v for k, v in state.items() if k not in aliases}
    missing = sorted(set(names) - set(state) - set(aliases))
    unexpected = sorted(set(state) - set(names))
    if missing or unexpected:
        raise ExportError(
            f"{engine_dir}: weights do not match model.kind={cfg.model.kind!r} from config.yaml "
            f"(missing: {missing[:5]}, unexpected: {unexpected[:5]})"
        )
    for key, value in state.items():
        if tuple(value.shape) != tuple(names[key].shape):
            expected = tuple(names[key].shape)
            raise ExportError(f"{engine_dir}: {key} has shape {tuple(value.shape)}, the model expects {expected}")
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
    return model.eval()


def _tied_aliases(model: torch.nn.Module) -> set[str]:
    """Names under which an already-named parameter appears again (the tied LM head)."""
    seen, aliases = set(), set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            aliases.add(name)
        seen.add(id(param))
    return aliases


# ----------------------------------------------------------------------------- the code that travels


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
    pretrain/hf_export/, and every project module reachable from `model` (model/ and kernels/),
    flattened to top-level files `rlm_<dotted name>.py` with relative imports.

    transformers copies a remote-code model's files into its module cache by following
    `from .x import y` lines only, one directory level deep. Modules bound as objects
    (`from . import rlm_kernels as kernels`) are invisible to it, so the generated rlm_sources.py,
    which modeling_recurrent.py imports, names each of them in that form. Returns the modules.
    """
    todo, done, bound = ["model"], {}, set()
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
    for template in ("configuration_recurrent.py", "modeling_recurrent.py"):
        shutil.copyfile(HF_TEMPLATES / template, out / template)
    return sorted(done)


# ----------------------------------------------------------------------------- tokenizer, config, card


def _sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write_tokenizer(out: Path, spec: str) -> dict[str, Any]:
    """recurrent_tokenizer.json describing the run's tokenizer (and a copy of a sentencepiece model)."""
    from data_pipeline.tokenizer import load_tokenizer

    try:
        tok = load_tokenizer(spec)
    except (OSError, ValueError) as err:
        raise ExportError(f"data.tokenizer={spec!r}: {err}") from err
    info: dict[str, Any] = {
        "format": "recurrent-pretrain tokenizer v1",
        "kind": tok.kind,
        "vocab_size": tok.vocab_size,
        "eos_id": tok.eos_id,
        "pad_id": tok.pad_id,
        "sha256": tok.sha256,
    }
    if tok.kind == "bytes":
        info["description"] = "ids 0..255 are the byte values; eos_id ends a document; pad_id is reserved"
    else:
        with fsspec.open(spec, "rb") as f:
            proto = f.read()
        (out / SENTENCEPIECE_FILE).write_bytes(proto)
        info["file"] = SENTENCEPIECE_FILE
        info["description"] = "sentencepiece model in tokenizer.model (sha256 above is of that file)"
    (out / TOKENIZER_JSON).write_text(json.dumps(info, indent=1) + "\n")
    return info


def _data_fingerprint(cfg: RunConfig) -> str:
    """sha256 over the training sources' manifests (path, weight, manifest bytes), or a note."""
    digest = hashlib.sha256()
    for source in cfg.data.train:
        try:
            with fsspec.open(source.path.rstrip("/") + "/manifest.json", "rb") as f:
                manifest = f.read()
        except OSError:
            return f"unavailable ({source.path}/manifest.json not readable at export time)"
        digest.update(f"{source.path}\0{source.weight}\0".encode())
        digest.update(manifest)
    return digest.hexdigest()


def _eval_metrics(step_dir: Path, cfg: RunConfig, step: int) -> dict[str, float]:
    """The run's last logged eval/* numbers at or before `step`, from metrics.jsonl in the run
    directory (the checkpoint's grandparent by default, else the configured run.dir)."""
    found: dict[str, float] = {}
    candidates = [step_dir.parent.parent / "metrics.jsonl", Path(cfg.run.dir) / "metrics.jsonl"]
    metrics = next((path for path in candidates if path.is_file()), None)
    if metrics is None:
        return found
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step", 0) <= step:
            found.update({k: v for k, v in record.items() if k.startswith("eval/")})
    return found


def hf_config(cfg: RunConfig, tokenizer: dict[str, Any], provenance: dict[str, Any]) -> dict[str, Any]:
    """config.json: what transformers needs to find the remote code, plus our model config."""
    m = cfg.model
    return {
        "model_type": "recurrent_lm",
        "architectures": ["RecurrentLMForCausalLM"],
        "auto_map": {
            "AutoConfig": "configuration_recurrent.RecurrentLMConfig",
            "AutoModelForCausalLM": "modeling_recurrent.RecurrentLMForCausalLM",
        },
        "lm_config": config_to_dict(m),
        "family": m.kind,
        "vocab_size": m.vocab_size,
        "hidden_size": m.d_model,
        "num_hidden_layers": m.n_layers,
        "num_attention_heads": m.n_heads,
        "max_position_embeddings": m.max_seq_len,
        "tie_word_embeddings": m.tie_embeddings,
        "eos_token_id": tokenizer["eos_id"],
        "pad_token_id": tokenizer["pad_id"] if tokenizer["pad_id"] >= 0 else None,
        "dtype": "float32",
        "recurrent_export": provenance,
    }


def model_card(cfg: RunConfig, provenance: dict[str, Any], evals: dict[str, float]) -> str:
    m = cfg.model
    lines = [
        f"# {cfg.run.name}: {m.kind} language model",
        "",
        f"- family: `{m.kind}` (d_model {m.d_model}, {m.n_layers} layers, {m.n_heads} heads, "
        f"vocabulary {m.vocab_size})",
        f"- parameters: {provenance['parameters']:,} ({provenance['parameters'] / 1e6:.2f}M)",
        f"- training: {provenance['step']:,} steps, {provenance['tokens_seen']:,} tokens, engine "
        f"`{cfg.engine.kind}`, sequence length {cfg.data.seq_len}",
        f"- tokenizer: `{provenance['tokenizer']}`",
        f"- data manifest fingerprint (sha256): `{provenance['data_fingerprint']}`",
        f"- exported from: `{provenance['checkpoint'] or 'a model in memory (write_export)'}`",
        "",
        "## Evaluation logged during training",
        "",
    ]
    if evals:
        lines += ["| metric | value |", "|---|---|"] + [f"| {k} | {v:.4f} |" for k, v in sorted(evals.items())]
    else:
        lines.append("none logged (`eval.every` was 0 or no validation data).")
    lines += [
        "",
        "## Use",
        "",
        "```python",
        "from pretrain.export import load_exported          # with this project installed",
        "model = load_exported('<this dir>')",
        "# or, with only transformers and torch:",
        "from transformers import AutoModelForCausalLM",
        "model = AutoModelForCausalLM.from_pretrained('<this dir>', trust_remote_code=True)",
        "```",
        "",
        "`forward(input_ids, state=None)` returns logits and the recurrent state; pass the state back",
        "to continue a long text piece by piece (`python -m pretrain.evaluate` does this).",
        "",
    ]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- export and load


def write_export(
    model: CausalLM,
    cfg: RunConfig,
    out: str | Path,
    training: dict[str, Any] | None = None,
    evals: dict[str, float] | None = None,
) -> Path:
    """Write `model` (built from `cfg.model`) as an export directory. `training` adds provenance
    (checkpoint, step, tokens_seen) and `evals` the metrics shown in the model card."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = write_tokenizer(out, cfg.data.tokenizer)
    provenance = {
        "format": EXPORT_FORMAT,
        "checkpoint": None,
        "engine": cfg.engine.kind + (f" zero_stage={cfg.engine.zero_stage}" if cfg.engine.kind == "deepspeed" else ""),
        "step": 0,
        "tokens_seen": 0,
        **(training or {}),
        "parameters": model.num_parameters(),
        "tokenizer": tokenizer["kind"] if tokenizer["kind"] == "bytes" else cfg.data.tokenizer,
        "data_fingerprint": _data_fingerprint(cfg),
    }
    save_model(model, str(out / WEIGHTS), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config(cfg, tokenizer, provenance), indent=1) + "\n")
    write_code(out)
    (out / "README.md").write_text(model_card(cfg, provenance, evals or {}))
    return out


def export(checkpoint: str | Path, out: str | Path) -> Path:
    """Verify, consolidate and write the export directory; returns it."""
    step_dir = resolve_checkpoint(checkpoint)
    try:
        manifest = ckpt.verify(step_dir)
    except ckpt.CheckpointError as err:
        raise ExportError(f"{step_dir}: checkpoint failed verification: {err}") from err
    cfg = read_run_config(step_dir)
    model = consolidate(step_dir, cfg)
    try:
        trainer = json.loads((step_dir / "trainer_state.json").read_text()).get("trainer", {})
    except (OSError, json.JSONDecodeError) as err:
        raise ExportError(f"{step_dir / 'trainer_state.json'}: {err}") from err
    step = int(trainer.get("step", manifest.get("step", 0)))
    training = {"checkpoint": str(step_dir.resolve()), "step": step, "tokens_seen": int(trainer.get("tokens_seen", 0))}
    return write_export(model, cfg, out, training, _eval_metrics(step_dir, cfg, step))


def read_export_config(export_dir: str | Path) -> dict[str, Any]:
    """config.json of an export directory (raises ExportError naming the path)."""
    path = Path(export_dir) / "config.json"
    if not path.is_file():
        raise ExportError(f"{path}: missing; is {export_dir} an export directory (python -m pretrain.export)?")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ExportError(f"{path}: not valid JSON: {err}") from err
    if "lm_config" not in config:
        raise ExportError(f"{path}: no 'lm_config' entry; not written by pretrain.export")
    return config


def load_exported(export_dir: str | Path, device: str | torch.device = "cpu") -> CausalLM:
    """The exported CausalLM (eval mode, fp32), built by this project's code; no DeepSpeed needed."""
    export_dir = Path(export_dir)
    config = read_export_config(export_dir)
    try:
        model_cfg = config_from_dict({"model": config["lm_config"]}).model
    except ConfigError as err:
        raise ExportError(f"{export_dir / 'config.json'}: lm_config: {err}") from err
    weights = export_dir / WEIGHTS
    if not weights.is_file():
        raise ExportError(f"{weights}: missing")
    model = build_model(model_cfg)
    load_model(model, str(weights), strict=True)
    return model.to(device).eval()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pretrain.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="step directory, checkpoints directory or run directory")
    parser.add_argument("--out", required=True, help="export directory (created)")
    args = parser.parse_args(argv)
    try:
        out = export(args.checkpoint, args.out)
    except ExportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"exported {resolve_checkpoint(args.checkpoint)} -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
