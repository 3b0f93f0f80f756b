"""The training loop: data -> engine step -> metrics, evaluation and checkpoints.

Read top to bottom: `train()` sets a run up (`_start`) and steps it (`_loop`); each step's data is
pretrain/data.py's, the engine behind pretrain/protocols.py's interface, the start-up rules
pretrain/preflight.py's, the periodic evaluation pretrain/validate.py's and everything on disk
pretrain/checkpoint/'s. Three guards of pretrain/resilience/ watch the loop through small hooks: the
hang watchdog (`watchdog`, told each phase), the straggler report (`straggler`, at log steps) and the
loss-spike rollback (`spike` and `_roll_back`, at log and checkpoint steps).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from model import CausalLM, build_model
from pretrain import carry
from pretrain.checkpoint.checkpointer import Checkpointer
from pretrain.checkpoint.layout import step_dir_name
from pretrain.checkpoint.run_lock import RunLock, RunLockedError
from pretrain.config import RunConfig, TrainSection, config_text, config_to_dict, dump_config
from pretrain.data import StepBatches, configure_storage, make_loader
from pretrain.distributed.compiling import compile_mode
from pretrain.distributed.parallel_dims import ParallelDims
from pretrain.distributed.process_group import all_reduce_mean, all_reduce_sum, barrier, device_for_rank
from pretrain.engines import build_engine, engine_class, join_process_group
from pretrain.optim import lr_at
from pretrain.preflight import DataError, check_data, check_start
from pretrain.protocols import Engine
from pretrain.resilience import requeue, straggler, watchdog
from pretrain.resilience.spike import Spike, SpikeDetector
from pretrain.run.directory import RunComplete, claim_run
from pretrain.run.init_from import load_initial_weights
from pretrain.telemetry.log import get_logger
from pretrain.telemetry.metrics import MetricsLogger, measure_peak_flops, memory_stats
from pretrain.telemetry.progress import Pace
from pretrain.validate import periodic_evaluation

__all__ = ["EXIT_DIVERGED", "EXIT_PREEMPTED", "DataError", "RunLockedError", "train"]

EXIT_PREEMPTED = requeue.EXIT_REQUEUE  # saved and stopped on SIGTERM/SIGUSR1/SIGINT or the wall-clock limit
EXIT_DIVERGED = requeue.EXIT_DIVERGED
SPIKED_DIR = "spiked"  # under the run directory: the weights of a spike past the rollback budget


@dataclass
class TrainerState:
    """What the loop itself must remember across a restart (saved as JSON in checkpoints)."""

    step: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def model_statistics(model: CausalLM) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Split the model's own statistics into scalars and histograms (1-D tensors)."""
    scalars, hists = {}, {}
    for key, value in model.stats().items():
        if isinstance(value, torch.Tensor) and value.numel() > 1:
            hists[f"model/{key}"] = value.detach().cpu()
        else:
            scalars[f"model/{key}"] = float(value)
    return scalars, hists


def account_skips(state: TrainerState, pending: list[tuple[int, torch.Tensor]], train: TrainSection) -> int | None:
    """Count the skipped updates among `pending` ((step, applied flag) pairs, emptied), reading all
    their flags in one transfer; returns the first step at which the run diverged (a skip under
    nan_policy "stop", or more than max_skipped_steps skips in a row), or None."""
    if not pending:
        return None
    flags = torch.stack([applied for _, applied in pending]).tolist()
    steps = [step for step, _ in pending]
    pending.clear()
    diverged = None
    for step, applied in zip(steps, flags, strict=True):
        if applied:
            state.consecutive_skips = 0
            continue
        state.skipped_steps += 1
        state.consecutive_skips += 1
        get_logger().warning("step %d: non-finite loss or gradient; update skipped", step)
        too_many = train.nan_policy == "stop" or state.consecutive_skips > train.max_skipped_steps
        if too_many and diverged is None:
            diverged = step
    return diverged


def _stop_vote(run: Run, flag: bool) -> bool:
    """Collective, every step: whether any rank wants to stop (`flag`); when rank 0's commit in the
    background has failed, every rank raises its error instead (Checkpointer.raise_if_failed), so that
    none goes on into the next step's collectives while rank 0 stops."""
    stop, failed = all_reduce_sum([1.0 if flag else 0.0, 1.0 if run.checkpointer.failed() else 0.0])
    run.checkpointer.raise_if_failed(failed > 0)
    return stop > 0


@dataclass
class Run:
    """A started run: everything the loop reads and updates."""

    cfg: RunConfig
    rank: int
    world: int
    dims: ParallelDims
    device: torch.device
    model: CausalLM
    engine: Engine
    batches: StepBatches | carry.StateCarrier
    checkpointer: Checkpointer
    lock: RunLock | None
    metrics: MetricsLogger
    state: TrainerState
    flops_per_token: float
    peak_flops: float
    spikes: SpikeDetector
    pace: Pace | None = None  # the loop's elapsed time and time left, from its first step

    @property
    def carrier(self) -> carry.StateCarrier | None:
        """The state carrier when the batches are train.carry_state's."""
        return self.batches if isinstance(self.batches, carry.StateCarrier) else None


def _build(
    cfg: RunConfig, rank: int, world: int, dims: ParallelDims, gas: int, device: torch.device
) -> tuple[CausalLM, Engine, Any]:
    """The model (initial weights identical on every rank, or init.from's), its engine, and the
    step batches: the state carrier under train.carry_state (each batch row continues its text and
    the model's state with it), else the loader of this rank's data-parallel place."""
    seed_everything(cfg.run.seed)
    model = build_model(cfg.model).to(device)
    if cfg.init.from_ is not None:  # weights only; a resumed checkpoint replaces them
        load_initial_weights(model, cfg.init.from_)
    seed_everything(cfg.run.seed + 1000 * rank)  # per-rank streams from here on
    sequence_parallel = dims.build(rank, cfg.data.seq_len)
    carrier = carry.make_carrier(cfg, model, rank, world, device) if cfg.train.carry_state else None
    # a sequence group reads the same samples: the loader runs at the data-parallel rank and size
    batches = carrier or StepBatches(make_loader(cfg, dims.dp_rank(rank), dims.data_parallel), gas,
                                     sequence_parallel, device)
    return model, build_engine(cfg, model, gas, sequence_parallel), batches


def _lock_run(rank: int, run_dir: Path, checkpoint_root: str) -> RunLock | None:
    """Rank 0 takes the run (pretrain/checkpoint/run_lock.py) before anything is written; every
    rank learns whether it could, so that a refused start stops all of them alike."""
    lock, refusal = None, None
    if rank == 0:
        lock = RunLock(run_dir, checkpoint_root)
        try:
            lock.acquire()
        except RunLockedError as err:
            lock, refusal = None, err
    if all_reduce_sum([1.0 if refusal else 0.0])[0] > 0:
        raise refusal or RunLockedError(f"{run_dir}: rank 0 could not take the run's lock (its log says who holds it)")
    return lock


def _start(cfg: RunConfig, resume: str | None, start_over: bool = False) -> Run:
    """Check, join the process group, take the run and settle what it continues (pretrain/run/directory.py),
    build, and restore the chosen checkpoint; config.yaml and the metrics are written only then, so
    that a refused start leaves the run directory as it was."""
    configure_storage(cfg)
    check_data(cfg)
    rank, world = join_process_group(cfg)
    dims, gas = check_start(cfg, world)
    run_dir = Path(cfg.run.dir)
    checkpoint_root = cfg.checkpoint.dir or str(run_dir / "checkpoints")
    lock = _lock_run(rank, run_dir, checkpoint_root)
    try:
        checkpointer = Checkpointer(
            checkpoint_root, run_dir / ".checkpoint_staging",
            cfg.checkpoint.keep_last, cfg.checkpoint.milestone_every, cfg.checkpoint.async_save,
        )
        checkpoint = claim_run(cfg, checkpointer, resume if resume is not None else cfg.checkpoint.resume, start_over,
                               world)
        device = device_for_rank()
        model, engine, batches = _build(cfg, rank, world, dims, gas, device)
        n_params = model.num_parameters()  # before sharding engines partition the weights
        state = TrainerState()
        spikes = SpikeDetector(cfg.train.spike)
        if checkpoint is not None:
            restored = checkpointer.restore(checkpoint, engine)
            state = _restored_state(batches, spikes, restored)
            get_logger().info("resumed from %s at step %d", restored["path"], state.step)
        if rank == 0:
            dump_config(cfg, run_dir / "config.yaml")
    except BaseException:
        if lock is not None:  # given back as taken: a refused start leaves the lock file as it found it
            lock.release()
        raise
    metrics = MetricsLogger(run_dir, config_to_dict(cfg), rank == 0, cfg.log.wandb, cfg.log.wandb_project)
    peak = (cfg.log.peak_tflops * 1e12) if cfg.log.peak_tflops else all_reduce_mean([measure_peak_flops()])[0]
    flops = model.flops_per_token(cfg.data.seq_len)
    metrics.console(
        f"model {cfg.model.kind}: {n_params / 1e6:.2f}M parameters, {flops / 1e6:.1f} MFLOP/token; engine "
        f"{engine_class(cfg).describe(cfg)} on {world} rank(s) (data-parallel {dims.data_parallel} x "
        f"sequence-parallel {dims.sequence_parallel}), {gas} micro-batch(es) of {cfg.train.micro_batch} per "
        "data-parallel rank per step"
    )
    return Run(cfg, rank, world, dims, device, model, engine, batches, checkpointer, lock, metrics, state, flops,
               peak, spikes)


def _restored_state(batches: StepBatches | carry.StateCarrier, spikes: SpikeDetector, restored: dict[str, Any],
                    rollback: bool = False) -> TrainerState:
    """Put a restored checkpoint's data position (and carried states) and spike history in place; returns
    its trainer state. A rollback keeps its count of rollbacks (SpikeDetector.load_state_dict)."""
    batches.load_state_dict(restored["data"])
    if isinstance(batches, carry.StateCarrier):  # its lanes' states, saved beside the checkpoint
        batches.load(Path(restored["path"]))
    spikes.load_state_dict(restored.get("spike"), keep_rollbacks=rollback)
    return TrainerState(**restored["trainer"])


def _join_commit(run: Run) -> None:
    """Collective: rank 0 waits for its asynchronous commit in flight (a full hash, and the upload to a
    remote root) and the others for rank 0, timed apart from the save that follows; a failed commit
    raises on every rank (Checkpointer.settle)."""
    watchdog.phase("checkpoint_commit")
    run.checkpointer.settle()


def _save(run: Run, pending: list[tuple[int, torch.Tensor]], apart: Checkpointer | None = None) -> None:
    """Collective: checkpoint the current step (under `apart`'s root instead of the run's, when given)."""
    _join_commit(run)
    watchdog.phase("checkpoint_save")
    account_skips(run.state, pending, run.cfg.train)
    trainer_state = {"trainer": vars(run.state), "data": run.batches.state_dict(), "spike": run.spikes.state_dict()}
    (apart or run.checkpointer).save(run.state.step, run.engine, trainer_state, config_text(run.cfg),
                                     run.carrier.save if run.carrier else None)
    if apart is None:
        run.metrics.console(f"checkpoint of step {run.state.step} written (async={run.cfg.checkpoint.async_save})")
    if run.rank == 0:  # what this job measured, for the deadlines of the next one after a requeue
        watchdog.save_longest(Path(run.cfg.run.dir))


def _save_spiked(run: Run, pending: list[tuple[int, torch.Tensor]], said: str) -> int:
    """Collective: the spike budget is spent. The spiked weights are written apart, to `<run dir>/spiked/`
    (kept for a post-mortem; `--resume auto` reads only the checkpoints' root, so it never picks them);
    returns EXIT_DIVERGED."""
    cfg = run.cfg.train.spike
    run_dir = Path(run.cfg.run.dir)
    apart = Checkpointer(str(run_dir / SPIKED_DIR), run_dir / ".checkpoint_staging", keep_last=1 << 30,
                         milestone_every=0, async_save=False)
    _save(run, pending, apart)
    newest = run.checkpointer.last_committed or (run.checkpointer.list() or ["none"])[0]
    get_logger().warning(
        "%s; %d rollbacks in the last train.spike.rollback_window=%d steps (train.spike.max_rollbacks=%d): "
        "stopping. The spiked weights of step %d are written apart to %s, never resumed by --resume auto; the "
        "newest checkpoint is still %s", said, run.spikes.rollbacks_near(run.state.step), cfg.rollback_window,
        cfg.max_rollbacks, run.state.step, run_dir / SPIKED_DIR / step_dir_name(run.state.step), newest)
    return EXIT_DIVERGED


def _roll_back(run: Run, pending: list[tuple[int, torch.Tensor]], spike: Spike) -> int | None:
    """Collective: answer a loss spike. Restore the newest checkpoint from before it in these processes,
    skip the global samples read from that checkpoint through the spike's batch (kept in the data state,
    so every later resume skips them too) and go on; returns None. With train.spike.max_rollbacks
    rollbacks made in the train.spike.rollback_window steps before it, write the spiked weights apart and
    return EXIT_DIVERGED instead (`_save_spiked`)."""
    cfg = run.cfg.train.spike
    said = (f"loss spike at step {spike.step}: {spike.loss:.4f} > train.spike.factor={cfg.factor} x the median "
            f"{spike.median:.4f} of the {cfg.window} steps before")
    if run.spikes.exhausted(spike.step):
        return _save_spiked(run, pending, said)
    watchdog.phase("checkpoint_load")
    restored = run.checkpointer.restore_before(spike.step, run.engine)
    if restored is None:
        get_logger().warning("%s; no checkpoint from before it to roll back to: going on", said)
        return None
    pending.clear()
    since = run.state.step
    run.state = _restored_state(run.batches, run.spikes, restored, rollback=True)
    run.spikes.rollback_steps.append(spike.step)
    run.checkpointer.restored_step = None  # the state now skips the spike's samples: a save of this step is new
    if run.pace is not None:
        run.pace.rewind(since, run.state.step)
    first = run.batches.position()
    run.batches.skip(first, spike.end_sample)
    skipped = [first, spike.end_sample]
    run.metrics.event(
        {"event": "rollback", "step": spike.step, "to_step": run.state.step, "skipped_samples": skipped},
        f"{said}; rolled back to step {run.state.step}, skipping global samples [{first}, {spike.end_sample}) "
        f"(rollback {run.spikes.rollbacks_near(spike.step)} of train.spike.max_rollbacks={cfg.max_rollbacks} in "
        f"train.spike.rollback_window={cfg.rollback_window} steps)",
    )
    return None


def _log_step(run: Run, info: Any, lr: float, window: tuple[float, int], times: straggler.StepTimes) -> None:
    """Report step `run.state.step`: the global mean loss (a collective, only on steps that report
    it), throughput and MFU over the window (start time, tokens) since the last report, memory, the
    data's and the model's own statistics, and with several ranks the straggler report."""
    cfg, state = run.cfg, run.state
    loss_value = all_reduce_mean([float(info.loss)])[0]
    tokens_per_s = window[1] / max(time.time() - window[0], 1e-9)
    scalars = {
        "train/loss": loss_value,
        "train/bits_per_token": loss_value / math.log(2),
        "train/lr": lr,
        "train/grad_norm": float(info.grad_norm),
        "train/tokens_seen": state.tokens_seen,
        "train/skipped_steps": state.skipped_steps,
        "perf/tokens_per_s": tokens_per_s,
        "perf/mfu": run.flops_per_token * tokens_per_s / (run.peak_flops * run.world),
        **memory_stats(),
        **{f"data/{k}": v for k, v in run.batches.stats().items()},
        "ckpt/retries": run.checkpointer.retries,
        **_times(run.pace, state.step),
    }
    model_scalars, model_hists = model_statistics(run.model)
    named = None
    if run.world > 1:
        rank_scalars, per_rank, named = straggler.report(times, run.rank, run.world, cfg.train.straggler_factor)
        scalars.update(rank_scalars)
        model_hists.update(per_rank)
    run.metrics.log(state.step, {**scalars, **model_scalars}, model_hists)
    run.metrics.console(
        f"step {state.step}/{cfg.train.steps} loss {loss_value:.4f} lr {lr:.2e} "
        f"grad {scalars['train/grad_norm']:.3f} {tokens_per_s:,.0f} tok/s mfu {scalars['perf/mfu']:.1%}"
        + (f" | {run.pace.report(state.step)}" if run.pace else "")
    )
    if named:
        run.metrics.console(named)


def _times(pace: Pace | None, step: int) -> dict[str, float]:
    """Seconds since the process started and the estimate of the seconds left, for metrics.jsonl."""
    if pace is None:
        return {}
    left = pace.left(step)
    return {"time/elapsed_s": pace.elapsed(), **({"time/left_s": left} if left is not None else {})}


def _evaluate(run: Run) -> None:
    """Collective: the periodic evaluation, rank 0's tasks and its logging included, all under the
    evaluation's deadline: the other ranks wait for rank 0 at a barrier inside it, not in the next
    step's collective under the step's deadline."""
    watchdog.phase("evaluation")
    results = periodic_evaluation(run.cfg, run.engine, run.rank, run.world, run.device)
    run.metrics.log(run.state.step, results)
    run.metrics.console("eval " + " ".join(f"{k.removeprefix('eval/')}={v:.4f}" for k, v in results.items()))
    barrier()


def _check(run: Run, pending: list[tuple[int, torch.Tensor]]) -> int | None:
    """Collective, before every save: the verdict on the steps since the last check. An exit code when
    the run diverged or a spike found the rollback budget spent; else None, after rolling back a spike
    found (run.state is then the restored checkpoint's)."""
    train_cfg = run.cfg.train
    diverged_at = account_skips(run.state, pending, train_cfg)
    if diverged_at is not None:
        get_logger().warning("diverged at step %d (train.nan_policy=%s, train.max_skipped_steps=%d)",
                             diverged_at, train_cfg.nan_policy, train_cfg.max_skipped_steps)
        _save(run, pending)
        return EXIT_DIVERGED
    spike = run.spikes.check()
    return _roll_back(run, pending, spike) if spike is not None else None


def _loop(run: Run, started: float, stop: requeue.StopFlag, times: straggler.StepTimes) -> int:
    """Step until train.steps, a divergence or a stop; returns the exit code. The host waits for the
    device only at log and checkpoint steps (every step under nan_policy "stop"); every rank reads
    the same flags, so every rank agrees to stop."""
    cfg = run.cfg
    tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
    pending: list[tuple[int, torch.Tensor]] = []  # (step, applied) flags the host has not read yet
    window_start, window_tokens = time.time(), 0
    run.pace = Pace(cfg.train.steps, run.state.step, started)
    first_step = True  # this process's first: it compiles under train.compile
    while run.state.step < cfg.train.steps:
        state = run.state  # a rollback replaces it
        lr = lr_at(state.step, cfg.train)
        watchdog.phase("data", state.step + 1)
        times.step_begins()
        committing = not run.checkpointer.join(0.0)  # this rank's commit in flight: the step is not compared
        micro_batches = run.batches.next_step()
        times.data_ready()
        watchdog.phase("forward_backward")
        step_deadline, step_start = watchdog.deadline("step"), time.monotonic()
        info = run.engine.train_step(micro_batches, lr)
        watchdog.phase("step_end")
        if first_step and compile_mode(cfg) is not None:
            _log_compile(cfg, time.monotonic() - step_start, step_deadline)
        first_step = False
        times.step_ends(counted=not committing and run.checkpointer.join(0.0))
        if run.carrier is not None:
            run.carrier.update(info.states)
        state.step += 1
        state.tokens_seen += tokens_per_step
        window_tokens += tokens_per_step
        pending.append((state.step, info.applied))
        run.spikes.record(state.step, info.loss, run.batches.position())
        log_step = state.step % cfg.train.log_every == 0 or state.step == cfg.train.steps
        checkpoint_step = cfg.checkpoint.every and state.step % cfg.checkpoint.every == 0
        if log_step or checkpoint_step or cfg.train.nan_policy == "stop":
            exit_code = _check(run, pending)
            if exit_code is not None:
                return exit_code
            if run.state is not state:  # rolled back: the next step is the checkpoint's
                window_start, window_tokens = time.time(), 0
                times.take()
                continue
        if log_step:
            _log_step(run, info, lr, (window_start, window_tokens), times)
            window_start, window_tokens = time.time(), 0
        if cfg.eval.every and state.step % cfg.eval.every == 0:
            _evaluate(run)
            watchdog.phase("step_end")
            times.skip_next()
        out_of_time = cfg.train.max_runtime is not None and _projected_past(started, state.step, cfg)
        if _stop_vote(run, stop.signal is not None or out_of_time):
            exit_code = _check(run, pending)  # a stop between two checks: the steps since are judged first
            if exit_code is not None:
                return exit_code
            _save(run, pending)
            run.metrics.console(f"stopping at step {run.state.step}: {'signal' if stop.signal else 'max_runtime'}")
            return EXIT_PREEMPTED
        if checkpoint_step and state.step < cfg.train.steps:
            _save(run, pending)
            times.skip_next()
    _save(run, pending)
    return 0


def _log_compile(cfg: RunConfig, seconds: float, deadline: float | None) -> None:
    """Log the first step's time, which includes torch.compile's tracing and code generation, beside the
    watchdog's deadline that step was held to (the first-step allowance, pretrain/resilience/watchdog.py)."""
    held = "no watchdog" if deadline is None else f"the watchdog's deadline for it was {deadline:.0f} s"
    get_logger().info("first step took %.1f s with train.compile=%s (%s mode, compiling included); %s",
                      seconds, cfg.train.compile, compile_mode(cfg), held)


def train(
    cfg: RunConfig, resume: str | None = None, preempted_marker: str | None = None, start_over: bool = False
) -> int:
    """Run (or continue) the configured training; returns the process exit code. After a
    preemption save has committed, rank 0 writes `preempted_marker` (when given): the file a
    batch script checks to requeue the job. `start_over` moves a previous run in the directory aside
    first (pretrain/run/directory.py)."""
    started = time.time()
    try:
        run = _start(cfg, resume, start_over)
    except RunComplete as done:
        get_logger().info("%s", done)
        return 0
    deadlines = watchdog.start_for(cfg, run.rank, Path(preempted_marker) if preempted_marker else None)
    watchdog.guard_commit(run.checkpointer.join)
    allowance = watchdog.FIRST_TIME_FACTOR * watchdog.HANG_FLOOR_S
    if cfg.train.hang_timeout_s is None and deadlines.first_time_s() < allowance:
        get_logger().warning(
            "the hang watchdog's first-step allowance of %.0f s is clamped to %.0f s, below engine.dist_timeout_s=%.0f "
            "(a collective fails by itself past it, with no requeue); raise engine.dist_timeout_s or set "
            "train.hang_timeout_s", allowance, deadlines.first_time_s(), cfg.engine.dist_timeout_s)
    times = straggler.StepTimes(straggler.clock_for(run.device, run.world))
    try:
        stop = requeue.StopFlag()
        exit_code = _loop(run, started, stop, times)
        # the last commit, rank 0's closing of the metrics (wandb) and the other ranks' wait for both
        watchdog.phase("finish")
        run.checkpointer.settle()
        if exit_code == EXIT_PREEMPTED and preempted_marker and run.rank == 0:
            requeue.write_preempted_marker(Path(preempted_marker), run.state.step, run.checkpointer.last_committed,
                                   stop.signal)
        run.metrics.close()
        # No rank leaves before rank 0 has committed: a launcher that kills the job when its first
        # rank exits (srun --kill-on-bad-exit) would otherwise interrupt the commit.
        barrier()
    finally:
        watchdog.stop()
        times.stop()
        if run.lock is not None:
            run.lock.release()
    return exit_code


def _projected_past(started: float, steps_done: int, cfg: RunConfig) -> bool:
    """True when one more step (at the mean pace so far) plus a save would pass max_runtime."""
    elapsed = time.time() - started
    per_step = elapsed / max(steps_done, 1)
    return elapsed + 2 * per_step > cfg.train.max_runtime
