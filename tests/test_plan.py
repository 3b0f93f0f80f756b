"""pretrain.plan: the trainer's start-up rules decide whether a config can start (every shipped config
at every world size its header names), the activation probe is reproducible and sees what
checkpointing saves, a probe that dies is reported instead of waited on, the command shards weights
and optimizer as the engine does, and its evaluation prediction matches a measured long-context
evaluation."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from data_pipeline.storage import DEFAULT_BLOCK_SIZE
from data_pipeline.tokenizer import smallest_dtype
from model import build_model
from pretrain.config import ConfigError, load_config
from pretrain.engines import SingleEngine, build_engine, deepspeed_bucket_elements
from pretrain.plan import memory as plan
from pretrain.preflight import check_start

REPO = Path(__file__).resolve().parents[1]
SP_VORT = str(REPO / "configs" / "sp-cpu-vort.yaml")
TINY = str(REPO / "configs" / "tiny.yaml")


def per_token(cfg, checkpointing: bool, tokens: int) -> float:
    return (plan.measure(cfg, checkpointing, 2 * tokens, 1) - plan.measure(cfg, checkpointing, tokens, 1)) / tokens


@pytest.mark.slow  # over a minute on two cores (several probe runs): make test-long
def test_probe_is_reproducible_and_sees_checkpointing() -> None:
    cfg = load_config(SP_VORT, [])
    plain = [per_token(cfg, False, 1024) for _ in range(2)]
    checkpointed = per_token(cfg, True, 1024)
    assert plain[0] > 0
    assert plain[1] == pytest.approx(plain[0], rel=0.1), plain
    assert checkpointed < 0.8 * min(plain), (checkpointed, plain)


def test_a_probe_that_dies_is_reported() -> None:
    cfg = load_config(SP_VORT, [])
    with pytest.raises(RuntimeError, match=r"probe of 1 x 0 tokens .* exited with code 1"):
        plan.measure(cfg, False, 0, 1)


@pytest.mark.slow  # over a minute on two cores (several probe runs): make test-long
def test_plan_command_shards_state_and_says_whether_it_fits(capsys: pytest.CaptureFixture[str]) -> None:
    overrides = ["engine.zero_stage=1", "data.seq_len=4096", "train.global_batch=2"]
    args = ["--config", SP_VORT, "--world", "4", "--probe-tokens", "256", *overrides]
    assert plan.main([*args, "--gpu-mem", "80GiB"]) == 0
    out, err = capsys.readouterr()
    assert re.search(r"^\[0/(\d) elapsed 0:\d\d, left ~\?\] memory probe: train, 1 x 256 tokens", err, re.M), err
    assert re.search(r"^\[1/(\d) elapsed \d+:\d\d, left ~\d+:\d\d\] memory probe", err, re.M), err
    assert re.search(r"^\[(\d)/\1 elapsed \d+:\d\d, left ~0:00\] probes done$", err, re.M), err
    assert "2048 tokens per rank" in out and "world 4" in out
    torch.manual_seed(0)
    n_params = sum(p.numel() for p in build_model(load_config(SP_VORT, overrides).model).parameters())
    rows = {line.split()[0]: [float(v) for v in line.split()[1:]] for line in out.splitlines()
            if line.split() and line.split()[0] in ("params", "optimizer", "activations", "reduce_bucket")}
    # ZeRO-1 over 4 ranks, fp32: every rank holds the weights, a quarter of AdamW's two moments and
    # DeepSpeed's whole gradient-reduction bucket
    assert rows["params"][0] == pytest.approx(n_params * 4 / 2**30, abs=0.006)
    assert rows["optimizer"][0] == pytest.approx(n_params * 8 / 4 / 2**30, abs=0.006)
    assert rows["activations"][0] > 0
    # two of the model-sized buckets in flight under overlap_comm, not DeepSpeed's 5e8-element default
    assert rows["reduce_bucket"][0] == pytest.approx(2 * deepspeed_bucket_elements(n_params) * 4 / 2**30, abs=0.006)
    assert out.splitlines()[-1].split()[-2:] == ["fits", "fits"]
    assert plan.main([*args, "--gpu-mem", "1MiB"]) == 0
    assert capsys.readouterr().out.splitlines()[-1].count("does NOT fit") == 2


@pytest.mark.parametrize(("extra", "message"), [
    (["--gpu-mem", "eighty"], "--gpu-mem: expected a size like 80GiB"),
    (["--world", "3"], "engine.sequence_parallel=2 does not divide the world size 3"),
    (["--world", "0"], "--world: must be >= 1 ranks, got 0"),
    (["--world", "-4"], "--world: must be >= 1 ranks, got -4"),
])
def test_plan_command_refuses_bad_arguments(extra: list[str], message: str, capsys) -> None:
    assert plan.main(["--config", SP_VORT, *extra]) == 2
    assert message in capsys.readouterr().err


def _configs() -> list[Path]:
    """Every shipped run config (the fragments they extend, base and model sizes, excluded)."""
    found = sorted((REPO / "configs").glob("*.yaml")) + sorted((REPO / "configs" / "experiments").glob("*.yaml"))
    return [path for path in found if path.name != "base.yaml"]


def header_world_sizes(path: Path) -> list[int]:
    """The world sizes a config's header comment names ("World sizes: 8, 16, 32, 64")."""
    header = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line)
    match = re.search(r"World sizes: (\d+(?:, \d+)*)", " ".join(header))
    assert match, f"{path}: the header names no world sizes (a line 'World sizes: 1, 2, ...')"
    return [int(w) for w in match.group(1).split(",")]


@pytest.mark.parametrize("path", _configs(), ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_every_config_starts_at_the_world_sizes_its_header_names(path: Path) -> None:
    cfg = load_config(path)
    for world in header_world_sizes(path):
        dims, gas = check_start(cfg, world)
        assert dims.data_parallel * gas * cfg.train.micro_batch == cfg.train.global_batch


def test_cluster_recipes_lay_each_rank_samples_together() -> None:
    """The recipes extending configs/base/pretrain.yaml set data.interleave as docs/data.md's "Choosing
    C" says: at the largest world size their header names, the data-parallel ranks divide C (each
    reads whole shuffle windows of its own, no other rank reads there), and a rank's stretch of a span
    is at least two read blocks long (storage.block_size's default), so that the blocks or shards cut
    by its two ends are a small part of what it reads."""
    recipes = [path for path in _configs() if "base/pretrain.yaml" in path.read_text()]
    assert len(recipes) >= 10
    for path in recipes:
        cfg = load_config(path)
        ranks = check_start(cfg, max(header_world_sizes(path)))[0].data_parallel
        interleave = cfg.data.interleave
        assert interleave > 1 and interleave % ranks == 0, (path.name, interleave, ranks)
        # bytes of a window in the shards: byte-level shards store uint8 (EOS is implied by the lengths)
        item = 1 if cfg.data.tokenizer == "bytes" else smallest_dtype(cfg.model.vocab_size).itemsize
        window = cfg.data.shuffle_buffer * (cfg.data.seq_len + 1) * item
        assert interleave // ranks * window >= 2 * DEFAULT_BLOCK_SIZE, (path.name, interleave, window)


def test_long_context_configs_start_at_64_gpus() -> None:
    """The scale docs/sequence_parallel.md plans for: 8 nodes of 8, one sequence per node."""
    for name in ("vort-125m-128k", "vort-125m-256k", "vort-350m-256k", "pmnet-119m-256k", "pmnet-119m-512k"):
        path = REPO / "configs" / f"{name}.yaml"
        assert 64 in header_world_sizes(path), name
        cfg = load_config(path)
        assert check_start(cfg, 64)[0].data_parallel == 8
        assert f"{cfg.train.global_batch * cfg.data.seq_len:,} tokens per" in path.read_text(), name


def test_plan_refuses_what_the_trainer_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    """4 sequences cannot be split over the 8 data-parallel groups of 64 ranks: the trainer's message."""
    config = str(REPO / "configs" / "vort-125m-256k.yaml")
    with pytest.raises(ConfigError) as trainer_error:
        check_start(load_config(config, ["train.global_batch=4"]), 64)
    assert plan.main(["--config", config, "--world", "64", "train.global_batch=4"]) == 2
    err = capsys.readouterr().err
    assert str(trainer_error.value) in err and "cannot be split over 8 data-parallel ranks" in err


@pytest.mark.slow
def test_evaluation_prediction_matches_a_long_context_evaluation() -> None:
    """The periodic evaluation of a 16k-token context, streamed in 2048-token pieces: the plan's
    prediction (probes at 512 and 1024 tokens) within 25% of its measured peak, and that peak far
    below evaluating the context in one call (what the trainer did before)."""
    cfg = load_config(SP_VORT, ["data.seq_len=4096", "eval.every=10", "eval.contexts=[16384]"])
    model = build_model(cfg.model)
    plain, _ = plan.plan(cfg, 2, model, probe=512)
    streamed = plan.measure(cfg, False, 2048, 1, "eval", context=16384)
    whole = plan.measure(cfg, False, 16384, 1, "eval", context=16384)
    assert plain.eval_activations == pytest.approx(streamed, rel=0.25), (plain.eval_activations, streamed)
    assert streamed < whole / 3, (streamed, whole)


def _bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_plan_counts_what_the_single_engine_holds(precision: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights, gradients and AdamW state as the single engine holds them at the end of the second
    micro-batch's backward (the model's fresh gradients beside the master's summed ones, under bf16)."""
    torch.manual_seed(0)
    cfg = load_config(TINY, [f"engine.precision={precision}"])
    model = build_model(cfg.model)
    engine = build_engine(cfg, model, gas=2)
    held: dict[str, int] = {}
    original = SingleEngine._backward_done

    def counted(self: SingleEngine) -> None:
        masters = list(self.master.parameters()) if self.master is not None else []
        grads = _bytes(p.grad for p in [*self.model.parameters(), *masters])
        held["weights"] = _bytes([*self.model.parameters(), *masters])
        held["grads"] = max(held.get("grads", 0), grads)
        original(self)

    monkeypatch.setattr(SingleEngine, "_backward_done", counted)
    ids = torch.randint(0, 258, (4, 33), generator=torch.Generator().manual_seed(0))
    engine.train_step([(ids[:2, :-1], ids[:2, 1:]), (ids[2:, :-1], ids[2:, 1:])], 3e-3)
    held["optimizer"] = _bytes(t for state in engine.optimizer.state.values() for t in state.values() if t.ndim)
    weights, grads, optimizer = plan.parameter_plan(cfg, 1, model)
    assert (weights, grads, optimizer) == (held["weights"], held["grads"], held["optimizer"])


def test_most_tokens_is_the_longest_rank_length_that_fits() -> None:
    """--most-tokens: the plan at the tokens per rank it finds fits, one step (1024 tokens per row) more
    does not; the scan's buffers count (with them taken away the same capacity holds more), and a
    capacity below the fixed parts holds nothing. Synthetic probes (no CPU measurement): 2 kB per token
    of activations, 1 kB with checkpointing."""
    cfg = load_config(SP_VORT, ["train.micro_batch=2", "train.global_batch=2"])
    model = build_model(cfg.model)
    parts = plan.Measured(1e6, 1e6, 2e6, 1e5, 1e5, 1e6, 512, {False: (4e6, 5e6), True: (2e6, 2.5e6)}, None)
    capacity = 2**30
    most = plan.most_tokens(cfg, model, parts, capacity)
    assert most[1] > most[0] > 0 and most[0] % 2048 == 0
    for which, tokens in enumerate(most):
        rows = tokens // 2
        assert plan.plan_at(cfg, model, parts, rows)[which].total <= capacity
        assert plan.plan_at(cfg, model, parts, rows + 1024)[which].total > capacity
    model.scan_buffer_bytes = lambda batch, tokens: 0.0  # type: ignore[method-assign]
    assert plan.most_tokens(cfg, model, parts, capacity)[0] > most[0]
    assert plan.most_tokens(cfg, model, parts, 4e6) == (0, 0)


def test_saved_probes_are_read_back_for_the_same_key_only(tmp_path: Path) -> None:
    """--probes: the first plan measures and writes the parts, the next with the same key reads them
    back equal without measuring, and one with another key is refused."""
    parts = plan.Measured(1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 512, {False: (7.0, 8.0), True: (9.0, 10.0)}, (11.0, 12.0))
    key = {"config": "c.yaml", "overrides": [], "world": 8, "probe": 512}
    path = tmp_path / "probes.json"
    assert plan.cached_parts(path, key, lambda: parts) == parts

    def measure_again() -> plan.Measured:
        raise AssertionError("measured again")

    assert plan.cached_parts(path, key, measure_again) == parts
    with pytest.raises(ValueError, match="measured for"):
        plan.cached_parts(path, key | {"world": 16}, measure_again)
