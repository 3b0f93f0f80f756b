"""pretrain.export: trained checkpoints -> export -> the project's loader and transformers give the
training model's logits; single-process here, DeepSpeed ZeRO-2/3 and FSDP2 (2 ranks) marked slow."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, load_model, save_file

from model import build_model
from pretrain import export as ex
from pretrain.checkpoint.consolidate import read_run_config
from pretrain.checkpoint.deepspeed_format import deepspeed_safe_globals
from pretrain.config import config_from_dict
from tests.launchers import run_training

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _offline_transformers(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> None:
    """No network; remote code is copied into a temporary module cache (when transformers is first
    imported by these tests)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path_factory.getbasetemp() / "hf_modules"))


def _config(root: Path, family: str) -> Path:
    path = root / f"{family}.yaml"
    path.write_text(
        f"extends: [{REPO / 'configs' / 'tiny.yaml'}, {REPO / 'configs' / 'model' / f'{family}-tiny.yaml'}]\n"
    )
    return path


def _train(root: Path, shards: dict[str, str], family: str, launcher: str, ranks: int, *extra: str) -> Path:
    run_dir = root / "run"
    run_training(launcher, ranks, [
        "--config", str(_config(root, family)), f"data.train=[{{path: {shards['train']}}}]", "data.valid=[]",
        f"run.dir={run_dir}", "train.steps=2", "checkpoint.every=0", *extra,
    ])  # fmt: skip
    return run_dir


def _hf_model(export_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(export_dir), trust_remote_code=True).eval()


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


STANDALONE = """
import sys
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
with torch.no_grad():
    logits = model(load_file(sys.argv[2])["ids"]).logits
assert AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=True).encode("é!") == [0xC3, 0xA9, 0x21]
assert not {"model", "kernels", "pretrain", "data_pipeline"} & set(sys.modules), "the project's packages were imported"
save_file({"logits": logits.contiguous()}, sys.argv[3])
"""


def _logits_without_project(export_dir: Path, ids: torch.Tensor, work: Path) -> torch.Tensor:
    """Logits from a fresh interpreter, outside the repository and with nothing of it on the path:
    the export must need only torch and transformers."""
    save_file({"ids": ids}, str(work / "ids.safetensors"))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", HF_MODULES_CACHE=str(work / "hf_modules"), OMP_NUM_THREADS="1")
    args = [str(export_dir), str(work / "ids.safetensors"), str(work / "out.safetensors")]
    subprocess.run([sys.executable, "-c", STANDALONE, *args], cwd=work, env=env, check=True, timeout=300)
    return load_file(str(work / "out.safetensors"))["logits"]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory: pytest.TempPathFactory, demo_shards: dict[str, str]) -> Path:
    """Two steps of VORT, one process, with a held-out evaluation logged at step 2 (for the card)."""
    root = tmp_path_factory.mktemp("single")
    return _train(root, demo_shards, "vort", "python", 1, f"data.valid=[{demo_shards['valid']}]", "eval.every=2")


def test_single_export_gives_training_logits(single_run: Path, tmp_path: Path) -> None:
    step_dir = single_run / "checkpoints" / "step_00000002"
    cfg = read_run_config(step_dir)
    trained = build_model(cfg.model)
    load_model(trained, str(step_dir / "engine" / "model.safetensors"))  # the weights exactly as the trainer saved them
    trained.eval()

    out = tmp_path / "export"
    assert ex.main(["--checkpoint", str(single_run), "--out", str(out)]) == 0  # a run dir resolves to its latest step
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    expected = _logits(trained, ids)
    assert torch.equal(_logits(ex.load_exported(out), ids), expected)

    hf = _hf_model(out)
    assert type(hf).__module__.startswith("transformers_modules.")  # the code that travelled, not ours
    assert torch.equal(_logits(hf, ids), expected)
    with torch.no_grad():  # the recurrent state also travels through the transformers interface
        first = hf(ids[:, :20], state=hf.init_state(2))
        second = hf(ids[:, 20:], state=first.state)
    torch.testing.assert_close(torch.cat([first.logits, second.logits], 1), expected, rtol=1e-4, atol=1e-5)

    assert torch.equal(_logits_without_project(out, ids, tmp_path), expected)

    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "recurrent_lm" and config["architectures"] == ["RecurrentLMForCausalLM"]
    assert config["lm_config"]["kind"] == "vort" and config["vocab_size"] == 258
    assert config["recurrent_export"]["step"] == 2 and config["recurrent_export"]["checkpoint"] == str(
        step_dir.resolve()
    )
    tokenizer = json.loads((out / ex.TOKENIZER_JSON).read_text())
    assert (tokenizer["kind"], tokenizer["vocab_size"], tokenizer["eos_id"]) == ("bytes", 258, 256)
    card = (out / "README.md").read_text()
    assert "vort" in card and "2 steps" in card and config["recurrent_export"]["data_fingerprint"] in card
    assert "| eval/bits_per_token@64 |" in card


@pytest.mark.parametrize("family", ["pmnet", "transformer", "vort-long", "pmnet-conv", "pmnet-route-memory"])
def test_transformers_matches_own_loader(family: str, tmp_path: Path) -> None:
    """The other families through transformers, from an in-memory model (PMNet has a constant that
    is not in the weights file, which transformers' loading empties and the wrapper restores);
    vort-long: VORT with learned temperatures and the gated read, its weights moved off their init;
    pmnet-conv: the shipped PMNet with a short convolution of 3, its memory awake (weights moved off
    the init that makes it a no-op), so the routes from the input before the convolution reach the
    logits; pmnet-route-memory: the same routed from the memory's input (`route_input: memory`)."""
    base = family.removesuffix("-long").removesuffix("-conv").removesuffix("-route-memory")
    tree = yaml.safe_load((REPO / "configs" / "model" / f"{base}-tiny.yaml").read_text())
    if family == "vort-long":
        tree["model"]["vort"].update(learn_temperature=True, readout="norm_gate")
    if family in ("pmnet-conv", "pmnet-route-memory"):
        tree["model"]["short_conv"] = 3
        tree["model"]["pmnet"]["route_input"] = "memory" if family == "pmnet-route-memory" else "pre_conv"
    cfg = config_from_dict(tree)
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    if family in ("vort-long", "pmnet-conv", "pmnet-route-memory"):
        with torch.no_grad():
            for param in model.parameters():
                param.add_(0.05 * torch.randn_like(param))
    out = ex.write_export(model, cfg, tmp_path / family)
    ids = torch.randint(0, 256, (2, 40), generator=torch.Generator().manual_seed(1))
    expected = _logits(model, ids)
    assert torch.equal(_logits(ex.load_exported(out), ids), expected)
    hf = _hf_model(out)
    assert torch.equal(_logits(hf, ids), expected)
    if family == "pmnet-route-memory":  # an export written before route_input existed loads as it was trained
        config = json.loads((out / "config.json").read_text())
        del config["lm_config"]["pmnet"]["route_input"]
        (out / "config.json").write_text(json.dumps(config))
        assert torch.equal(_logits(ex.load_exported(out), ids), expected)
    with torch.no_grad():  # transformers' loss convention: labels are the inputs, shifted inside
        loss = hf(ids, labels=ids, attention_mask=torch.ones_like(ids)).loss
    torch.testing.assert_close(
        loss, torch.nn.functional.cross_entropy(expected[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    )
    with pytest.raises(ValueError, match="padding"):
        hf(ids, attention_mask=torch.zeros_like(ids))


def test_bad_checkpoints_are_named(single_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nowhere"
    assert ex.main(["--checkpoint", str(missing), "--out", str(tmp_path / "o1")]) == 2
    assert str(missing) in capsys.readouterr().err

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ex.ExportError, match="holds no step_"):
        ex.export(empty, tmp_path / "o2")

    corrupt = tmp_path / "step_00000002"
    shutil.copytree(single_run / "checkpoints" / "step_00000002", corrupt)
    weights = corrupt / "engine" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert ex.main(["--checkpoint", str(corrupt), "--out", str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err
    assert "failed verification" in err and str(weights) in err
    assert not (tmp_path / "o3").exists()

    with pytest.raises(ex.ExportError, match=r"config\.json"):
        ex.load_exported(tmp_path)


def _deepspeed_module_weights(step_dir: Path) -> dict[str, torch.Tensor]:
    """ZeRO-2 keeps whole fp32 module weights beside the partitions: an independent reference."""
    with torch.serialization.safe_globals(deepspeed_safe_globals()):
        saved = torch.load(step_dir / "engine" / "ds" / "mp_rank_00_model_states.pt", weights_only=True)
    return {k.removeprefix("model."): v for k, v in saved["module"].items()}


@pytest.mark.slow
def test_sharded_exports_give_training_logits(
    tmp_path_factory: pytest.TempPathFactory, demo_shards: dict[str, str]
) -> None:
    """2-rank DeepSpeed ZeRO-2, ZeRO-3 and FSDP2 PMNet runs: the export of each gives, through both
    loaders, the logits of the training model (ZeRO-2: its module weights; ZeRO-3 and FSDP2, which
    hold no whole copy, train identically, so they must match ZeRO-2's to fp32 reduction noise)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    engines = {
        "zero2": ("deepspeed", "engine.kind=deepspeed", "engine.zero_stage=2"),
        "zero3": ("deepspeed", "engine.kind=deepspeed", "engine.zero_stage=3"),
        "fsdp": ("torchrun", "engine.kind=fsdp"),
    }
    ids = torch.randint(0, 256, (2, 48), generator=torch.Generator().manual_seed(0))
    logits = {}
    for name, (launcher, *overrides) in engines.items():
        root = tmp_path_factory.mktemp(name)
        run_dir = _train(root, demo_shards, "pmnet", launcher, 2, *overrides)
        out = ex.export(run_dir / "checkpoints", root / "export")
        own = _logits(ex.load_exported(out), ids)
        assert torch.equal(_logits(_hf_model(out), ids), own)
        logits[name] = own
        if name == "zero2":
            step_dir = run_dir / "checkpoints" / "step_00000002"
            trained = build_model(read_run_config(step_dir).model)
            trained.load_state_dict(_deepspeed_module_weights(step_dir), strict=True)
            assert torch.equal(own, _logits(trained.eval(), ids))
    torch.testing.assert_close(logits["zero3"], logits["zero2"], rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logits["fsdp"], logits["zero2"], rtol=1e-4, atol=1e-4)


def test_an_export_loaded_beside_the_project_leaves_the_projects_scans_alone(tmp_path: Path) -> None:
    """transformers loads an export's copy of the kernels into a process that also runs the project (an
    evaluation harness beside training, or this test suite): the copy registers its scan ops under its
    own namespace, so the project's ops still run the project's code (here: the meta-device capture of
    the GPU step model, which the copy's kernels would have launched on meta tensors)."""
    from benchmarks.predict.step import capture_step_ops
    from kernels import library

    cfg = config_from_dict(yaml.safe_load((REPO / "configs" / "model" / "vort-tiny.yaml").read_text()))
    torch.manual_seed(0)
    model = build_model(cfg.model).eval()
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(1))
    hf = _hf_model(ex.write_export(model, cfg, tmp_path / "vort"))
    assert torch.equal(_logits(hf, ids), _logits(model, ids))
    copies = [m for name, m in sys.modules.items() if name.endswith("rlm_kernels_library")]
    assert copies and all(copy.NAMESPACE not in ("recurrent", library.NAMESPACE) for copy in copies)
    assert library.NAMESPACE == "recurrent"
    capture = capture_step_ops(cfg.model, 1, 64, activation_checkpointing=True)
    assert capture.launches
