"""What every experiment shares: train its runs with the ordinary trainer, evaluate, aggregate.

An experiment names one run config under configs/experiments/, the families it compares (each a
list of dotted overrides on that config) and the seeds. A run lives in
`<out>/runs/<config>/<family>/seed<k>` (so two experiments that train the same family on the same
config share the run) and is trained only if its final checkpoint is missing; the experiment's
evaluation of a run is stored beside it as `eval-<experiment>.json` and also computed once. The
experiment then writes `<out>/<experiment>/results.json`, `results.csv` and `plot.png`.
"""

from __future__ import annotations

import csv
import ctypes
import datetime
import hashlib
import itertools
import json
import math
import multiprocessing
import os
import signal
import statistics
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from data_pipeline import synthetic
from model import CausalLM
from pretrain.checkpoint.consolidate import consolidate, resolve_checkpoint
from pretrain.config import ConfigError, RunConfig, config_from_dict, config_to_dict, load_config, read_saved_config
from pretrain.sweeps.run import core_slots

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs" / "experiments"
EVAL_SEED = 1_000_003
"""Task seed of the evaluation examples; training examples are drawn with the run's seed."""
PR_SET_PDEATHSIG = 1  # Linux prctl option: the signal this process gets when its parent dies


class ExperimentError(RuntimeError):
    """A run that failed or an experiment that cannot proceed; the message says which."""


@dataclass(frozen=True)
class Family:
    """One model (or training variant) compared by an experiment."""

    name: str
    overrides: tuple[str, ...] = ()


@dataclass
class Run:
    """A trained run and where it lives."""

    family: Family
    seed: int
    dir: Path
    config: RunConfig


@dataclass
class Experiment:
    """Base of the experiments: subclasses implement `evaluate`, `summarise` and `plot`."""

    name: str
    title: str
    config: str
    families: tuple[Family, ...]
    seeds: int = 3
    seed_overrides: tuple[str, ...] = ("run.seed={seed}", "data.task.seed={seed}")
    quick_overrides: tuple[str, ...] = ()
    paper: dict[str, Any] = field(default_factory=dict)

    # ------------------------------------------------------------------ to implement

    def evaluate(self, model: CausalLM, run: Run, quick: bool) -> dict[str, Any]:
        """Metrics of one trained run (JSON-able; scalars are averaged over seeds by `aggregate`)."""
        raise NotImplementedError

    def plot(self, results: dict[str, Any], path: Path) -> None:
        """A PNG of the results."""
        raise NotImplementedError

    def families_for(self, quick: bool) -> tuple[Family, ...]:
        """The families a run trains (all of them; an experiment with a grid may trim --quick's)."""
        return self.families

    def comparable_groups(self) -> list[tuple[Family, ...]]:
        """Families that must share size, budget and optimizer (all of them, unless a grid varies
        size or length on purpose)."""
        return [self.families]

    # ------------------------------------------------------------------ shared

    def run_config(self, family: Family, seed: int, out: Path, quick: bool) -> tuple[Path, RunConfig]:
        stem = Path(self.config).stem + ("-quick" if quick else "")
        run_dir = out / "runs" / stem / family.name / f"seed{seed}"
        overrides = [
            *(o.format(seed=seed) for o in self.seed_overrides),
            *family.overrides,
            *(self.quick_overrides if quick else ()),
            f"run.name={stem}-{family.name}-{seed}",
            f"run.dir={run_dir}",
        ]
        return run_dir, load_config(CONFIGS / self.config, overrides)

    def prepare(self, out: Path, quick: bool) -> None:
        """Anything the runs need before training (e.g. shards); nothing by default."""

    def train(self, family: Family, seed: int, out: Path, quick: bool) -> Run:
        """Train (or resume) one run unless its final checkpoint is already there."""
        from pretrain.trainer import train

        run_dir, cfg = self.run_config(family, seed, out, quick)
        wanted = config_to_dict(cfg)
        step = finished_step(run_dir)
        saved = [run_dir / "config.yaml"] + ([resolve_checkpoint(run_dir) / "config.yaml"] if step is not None else [])
        if any(p.is_file() and _saved_config(p) != wanted for p in saved) or (step or 0) > cfg.train.steps:
            raise ExperimentError(
                f"{run_dir} holds a run of another configuration (configs/experiments/{self.config} or the "
                "family changed since); delete it or choose another --out"
            )
        if step != cfg.train.steps:
            code = train(cfg)
            if code != 0:
                raise ExperimentError(f"{run_dir}: training exited with code {code}")
        return Run(family, seed, run_dir, cfg)

    def train_all(self, pairs: Sequence[tuple[Family, int]], out: Path, quick: bool, parallel: int) -> list[Run]:
        """`train` every (family, seed); with parallel > 1 in that many worker processes, each pinned
        to its own share of the cores (runs are independent, and each is deterministic alone)."""
        if parallel == 1:
            return [self.train(family, seed, out, quick) for family, seed in pairs]
        context = multiprocessing.get_context("spawn")
        slots = context.Queue()
        groups = core_slots(parallel)
        for cores in groups:
            slots.put(cores)
        # a worker's OpenMP pool is sized when it starts, from the environment: left at the machine's
        # core count, numba's first call resets torch's threads to it and they spin on one core
        previous = os.environ.get("OMP_NUM_THREADS")
        os.environ["OMP_NUM_THREADS"] = str(min(len(cores) for cores in groups))
        try:
            with ProcessPoolExecutor(parallel, mp_context=context, initializer=_claim_cores,
                                     initargs=(slots,)) as pool:
                futures = [pool.submit(self.train, family, seed, out, quick) for family, seed in pairs]
                return [future.result() for future in futures]
        finally:
            if previous is None:
                del os.environ["OMP_NUM_THREADS"]
            else:
                os.environ["OMP_NUM_THREADS"] = previous

    def results_dir(self, out: Path, subset: Sequence[str] = ()) -> Path:
        """Where `run` writes its files: out/<name>, or for a subset of the families (the names of
        those run, in the experiment's order) out/<name>/<subset_name>."""
        return out / self.name / subset_name(subset) if subset else out / self.name

    def run(self, out: Path, seeds: int | None = None, quick: bool = False, log: Any = print,
            parallel: int = 1, only: Sequence[str] = (), overrides: Sequence[str] = (),
            first_seed: int = 0) -> dict[str, Any]:
        """Train (`parallel` runs at a time) and evaluate every (family, seed), seeds `first_seed` to
        `first_seed + seeds - 1` (so more seeds can be added to a sweep without retraining), then write
        results.json, results.csv, plot.png under out/<name>; with `only` (family names), just those
        families, written under out/<name>/<subset_name> so that the whole experiment's files stay.
        `overrides` (dotted KEY=VALUE) go after every family's own: a variant of the whole
        experiment, whose runs a run without them in the same `out` refuses to reuse."""
        if parallel < 1:
            raise ExperimentError(f"--parallel: expected a number >= 1, got {parallel}")
        seeds = 1 if quick and seeds is None else (seeds or self.seeds)
        families = self.families_for(quick)
        unknown = sorted(set(only) - {f.name for f in families})
        if unknown:
            raise ExperimentError(f"--families: {', '.join(unknown)} not in {self.name}; its families: "
                                  f"{', '.join(f.name for f in families)}")
        families = tuple(Family(f.name, (*f.overrides, *overrides)) for f in families if not only or f.name in only)
        self.prepare(out, quick)
        started = time.time()
        pairs = [(family, seed) for family in families for seed in range(first_seed, first_seed + seeds)]
        runs = self.train_all(pairs, out, quick, parallel)
        log(f"[{self.name}] {len(runs)} runs trained in {time.time() - started:.0f}s")
        records = []
        for run in runs:
            family, seed = run.family, run.seed
            started = time.time()
            cached = run.dir / f"eval-{self.name}{'-quick' if quick else ''}.json"
            if cached.is_file():
                record = json.loads(cached.read_text())
            else:
                model = consolidate(resolve_checkpoint(run.dir), run.config)
                record = {
                    "family": family.name,
                    "seed": seed,
                    "parameters": model.num_parameters(),
                    "train_tokens": tokens_trained(run.config),
                    "metrics": self.evaluate(model, run, quick),
                }
                cached.write_text(json.dumps(record, indent=1) + "\n")
            record["metrics"]["train_loss_end"] = final_train_loss(run.dir)
            records.append(record)
            shown = {k: v for k, v in record["metrics"].items() if isinstance(v, float) and "_n_" not in k}
            log(f"[{self.name}] {family.name} seed {seed} (evaluated in {time.time() - started:.0f}s): "
                + ", ".join(f"{k}={v:.3f}" for k, v in shown.items()))
        results = {
            "experiment": self.name,
            "title": self.title,
            "command": f"python launch/experiment.py run {self.name}" + (" --quick" if quick else "")
            + ("" if seeds == self.seeds or quick else f" --seeds {seeds}")
            + (f" --first-seed {first_seed}" if first_seed else "")
            + (f" --families {','.join(f.name for f in families)}" if only else "")
            + "".join(f" --set {o}" for o in overrides),
            "date": datetime.date.today().isoformat(),
            "quick": quick,
            "config": f"configs/experiments/{self.config}",
            "families": {f.name: list(f.overrides) for f in families},
            "paper": self.paper,
            "summary": aggregate(records),
            "runs": records,
        }
        target = self.results_dir(out, [f.name for f in families] if only else ())
        target.mkdir(parents=True, exist_ok=True)
        (target / "results.json").write_text(json.dumps(results, indent=1) + "\n")
        write_csv(results["summary"], target / "results.csv")
        self.plot(results, target / "plot.png")
        return results


class DemoTextExperiment(Experiment):
    """An experiment whose runs train on the demo books (byte shards built under <out>/shards) and
    are scored on the demo's held-out novel."""

    held_out = REPO / "data" / "demo" / "valid" / "northangerabbey.txt"

    def prepare(self, out: Path, quick: bool) -> None:
        from data_pipeline.build import build_shards

        shards = out / "shards" / "demo-train"
        if not (shards / "manifest.json").is_file():
            build_shards([str(REPO / "data" / "demo" / "train")], str(shards), tokenizer="bytes", shard_tokens=262144)

    def run_config(self, family: Family, seed: int, out: Path, quick: bool) -> tuple[Path, RunConfig]:
        shards = out / "shards" / "demo-train"
        extended = Family(family.name, (f"data.train=[{{path: {shards}}}]", *family.overrides))
        return super().run_config(extended, seed, out, quick)

    def held_out_windows(self, seq_len: int, n_bytes: int) -> np.ndarray:
        """The first `n_bytes` of the held-out novel as [windows, seq_len + 1] byte ids (inputs and
        the next byte), consecutive windows."""
        data = np.frombuffer(self.held_out.read_bytes()[: n_bytes + 1], dtype=np.uint8).astype(np.int64)
        n = (data.size - 1) // seq_len
        return np.stack([data[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])


def subset_name(families: Sequence[str]) -> str:
    """The folder of a run of some of an experiment's families: their names joined by +, or past 100
    characters the first name, how many more, and a digest of all of them."""
    joined = "+".join(families)
    if len(joined) <= 100:
        return joined
    return f"{families[0]}+{len(families) - 1}-more-{hashlib.sha1(joined.encode()).hexdigest()[:8]}"


def _saved_config(path: Path) -> dict[str, Any] | None:
    """A run's saved config with today's defaults filled in (an option added since, at its default,
    is the same run; one whose default changed keeps the value the run was trained with), or None if
    it no longer loads."""
    try:
        return config_to_dict(config_from_dict(read_saved_config(path)))
    except ConfigError:
        return None


def _claim_cores(slots: Any) -> None:
    """Pool worker start-up: take one group of cores from `slots` and use exactly those, and get
    SIGTERM when the launcher dies (however it dies), which the trainer answers by saving a
    checkpoint and stopping, so a killed `--parallel` run leaves no worker training on."""
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if os.getppid() != parent:  # the launcher died before the request took effect
        os.kill(os.getpid(), signal.SIGTERM)
    cores = slots.get()
    os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores))


def tokens_trained(cfg: RunConfig) -> int:
    return cfg.train.steps * cfg.train.global_batch * cfg.data.seq_len


def final_train_loss(run_dir: Path) -> float:
    """Mean training loss (nats per scored token) over the last tenth of the logged steps: beside a
    task's chance level it says whether the run learned anything at all."""
    losses = [row["train/loss"] for row in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
              if "train/loss" in row]
    return statistics.fmean(losses[-max(1, len(losses) // 10) :])


def finished_step(run_dir: Path) -> int | None:
    """The step of the run's newest verified checkpoint, or None."""
    try:
        step_dir = resolve_checkpoint(run_dir)
    except Exception:
        return None
    return int(step_dir.name.rsplit("_", 1)[-1])


def aggregate(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, dict[str, float]]]:
    """Per family and scalar metric: mean, sample standard deviation (0 for one seed) and n."""
    by_family: dict[str, dict[str, list[float]]] = {}
    for record in records:
        metrics = by_family.setdefault(record["family"], {})
        for key, value in [("parameters", record["parameters"]), *record["metrics"].items()]:
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                metrics.setdefault(key, []).append(float(value))
    return {
        family: {
            key: {"mean": statistics.fmean(v), "std": statistics.stdev(v) if len(v) > 1 else 0.0, "n": len(v)}
            for key, v in metrics.items()
        }
        for family, metrics in by_family.items()
    }


def write_csv(summary: dict[str, dict[str, dict[str, float]]], path: Path) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["family", "metric", "mean", "std", "n"])
        for family, metrics in summary.items():
            for key, s in metrics.items():
                writer.writerow([family, key, f"{s['mean']:.6g}", f"{s['std']:.6g}", s["n"]])


# ----------------------------------------------------------------------------- shared evaluation


def eval_task(run: Run, quick: bool) -> synthetic.Task:
    """The training task of `run` with held-out examples (another seed than any training run)."""
    task = run.config.data.task
    if task is None:
        raise ExperimentError(f"{run.dir}: the run config has no data.task")
    params = dict(task.params)
    vocab = int(params.pop("vocab_size", min(run.config.model.vocab_size, 256)))
    return synthetic.make_task(task.name, run.config.data.seq_len, vocab_size=vocab, seed=EVAL_SEED, **params)


@torch.inference_mode()
def predictions(model: CausalLM, examples: Sequence[synthetic.Example], batch_size: int = 16) -> list[np.ndarray]:
    """The model's argmax next-token guesses per example (whole sequences in one forward pass, so
    every family sees the full context)."""
    model.eval()
    out = []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start : start + batch_size]
        batch = synthetic.collate(chunk, pad_id=0)
        guesses = model(batch["input_ids"]).logits.argmax(-1).numpy()
        out += [g[: e.input_ids.size] for e, g in zip(chunk, guesses)]
    return out


def exact_hits(model: CausalLM, examples: Sequence[synthetic.Example]) -> np.ndarray:
    """1.0 where the model's argmax reproduces the whole answer of an example, else 0.0."""
    return np.asarray([synthetic.accuracy([e], [p])["exact"] for e, p in zip(examples, predictions(model, examples))])


@torch.inference_mode()
def held_out_bits(model: CausalLM, windows: np.ndarray, far: int) -> dict[str, float]:
    """Bits per byte over the windows [n, T + 1], overall and at positions >= `far` only."""
    model.eval()
    nll = []
    for start in range(0, len(windows), 16):
        batch = torch.from_numpy(windows[start : start + 16])
        logits = model(batch[:, :-1]).logits
        nll.append(torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none"))
    bits = torch.cat(nll).double() / math.log(2)
    return {"bits_per_byte": float(bits.mean()), f"bits_per_byte_from_{far}": float(bits[:, far:].mean())}


def bucket_accuracy(hits: np.ndarray, values: np.ndarray, edges: Sequence[float], prefix: str) -> dict[str, float]:
    """Mean of `hits` for `values` in each half-open bucket (edges[i], edges[i+1]]; NaN-free: empty
    buckets are left out, and `<prefix>_n_<bucket>` records how many examples each holds."""
    out: dict[str, float] = {}
    for lo, hi in itertools.pairwise(edges):
        inside = (values > lo) & (values <= hi)
        label = f"{int(lo)}-{int(hi)}" if math.isfinite(hi) else f">{int(lo)}"
        out[f"{prefix}_n_{label}"] = float(inside.sum())
        if inside.any():
            out[f"{prefix}_{label}"] = float(hits[inside].mean())
    return out


def figure(rows: int, cols: int, size: tuple[float, float]) -> tuple[Any, np.ndarray]:
    """A matplotlib figure (headless backend) and its axes as a [rows, cols] array."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(rows, cols, figsize=size, squeeze=False)


def save_figure(fig: Any, results: dict[str, Any], path: Path) -> None:
    """Title the figure after the experiment (marking quick runs), write the PNG, free it."""
    import matplotlib.pyplot as plt

    fig.suptitle(results["title"] + (" (quick)" if results["quick"] else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def bar_plot(
    results: dict[str, Any],
    keys: Sequence[str],
    labels: Sequence[str],
    path: Path,
    ylabel: str,
    levels: Sequence[tuple[str, float]] = (),
) -> None:
    """Grouped bars (one group per key, one bar per family), error bars = spread over seeds; a
    dashed line at each reference level (label, value), e.g. chance."""
    summary = results["summary"]
    families = list(summary)
    width = 0.8 / max(1, len(families))
    fig, axes = figure(1, 1, (max(6, 1.6 * len(keys) + 2), 4))
    ax = axes[0, 0]
    for i, family in enumerate(families):
        means = [summary[family].get(k, {}).get("mean", np.nan) for k in keys]
        stds = [summary[family].get(k, {}).get("std", 0.0) for k in keys]
        xs = np.arange(len(keys)) + (i - (len(families) - 1) / 2) * width
        ax.bar(xs, means, width, yerr=stds, capsize=3, label=family)
    for (label, value), style in zip(levels, ("--", ":", "-.")):
        ax.axhline(value, color="black", linestyle=style, linewidth=0.8, label=label)
    ax.set_xticks(np.arange(len(keys)), labels)
    ax.set_ylabel(ylabel)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, results, path)
