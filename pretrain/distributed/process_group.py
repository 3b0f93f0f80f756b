"""Process-group helpers shared by the trainer, the checkpointer and the metrics: who am I, how
many are we, wait for everyone, sum over everyone. Each works unchanged in a single process.

Also the bridge from SLURM's task variables to the ones torch.distributed reads, so that
`srun python launch/pretrain.py` (one task per GPU) needs no launcher in between.
"""

from __future__ import annotations

import datetime
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist


def rank() -> int:
    """This process's global rank: from the process group once it exists, from the launcher's
    environment before that (logging is set up first), 0 when not distributed."""
    if dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")))


def world_size() -> int:
    """Number of ranks in the default group (1 when not distributed)."""
    return dist.get_world_size() if dist.is_initialized() else 1


def barrier() -> None:
    """Wait for every rank (no-op in one process)."""
    if dist.is_initialized():
        dist.barrier()


_host_group: dist.ProcessGroup | None = None
_timeout: datetime.timedelta | None = None  # the default group's, given to every group made after it

FLIGHT_RECORDER = {"TORCH_FR_BUFFER_SIZE": "2000"}
"""torch's flight recorder, on every backend: each rank keeps its last 2,000 collectives, which the hang
watchdog writes out when it fires (`flight_record`)."""
NCCL_FLIGHT_RECORDER = {"TORCH_NCCL_TRACE_BUFFER_SIZE": "2000", "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
                        "TORCH_NCCL_ENABLE_TIMING": "1"}
"""The same on GPUs for NCCL, which also dumps the record by itself when a collective times out (to
TORCH_NCCL_DEBUG_INFO_TEMP_FILE, `<run dir>/nccl_trace_rank_<r>` as `enable_flight_recorder` sets it) and
times each collective on the device (the straggler report reads those durations)."""
NCCL_TRACE_FILE = "nccl_trace_rank_"  # torch appends the rank


def enable_flight_recorder(run_dir: Path, cuda: bool) -> dict[str, str]:
    """Turn torch's flight recorder on for the process group about to be made: FLIGHT_RECORDER, and on
    GPUs NCCL_FLIGHT_RECORDER with NCCL's own dumps in `run_dir`. A variable the user has set is left as
    it is; returns the ones set here."""
    wanted = dict(FLIGHT_RECORDER)
    if cuda:
        wanted.update(NCCL_FLIGHT_RECORDER, TORCH_NCCL_DEBUG_INFO_TEMP_FILE=str(run_dir / NCCL_TRACE_FILE))
    chosen = {name: value for name, value in wanted.items() if name not in os.environ}
    os.environ.update(chosen)
    return chosen


def flight_record() -> bytes | None:
    """This rank's flight record as JSON bytes (its last collectives, the ones in flight marked so), or
    None where torch has none (a build without it, no process group)."""
    dump = getattr(torch._C._distributed_c10d, "_dump_fr_trace_json", None)
    if dump is None or not dist.is_initialized():
        return None
    return dump(True, False)


def new_group(ranks: list[int] | None = None, backend: str | None = None) -> dist.ProcessGroup:
    """A process group over `ranks` (all when None) with the default group's timeout (engine.dist_timeout_s):
    torch gives a group made without one its own default (30 minutes), whatever the default group has."""
    return dist.new_group(ranks, timeout=_timeout, backend=backend)


def host_group() -> dist.ProcessGroup:
    """A gloo group over every rank, for host scalars: the default group when it is gloo, else one
    made on first use (every rank gets here together, as every caller is a collective). Reducing a
    host value over NCCL would copy it to the GPU and back, and so wait for all the GPU work queued."""
    global _host_group
    if dist.get_backend() == "gloo":
        return dist.group.WORLD
    if _host_group is None:
        _host_group = new_group(backend="gloo")
    return _host_group


def all_reduce_sum(values: list[float]) -> list[float]:
    """Sum of each value over ranks (identity in one process), in float64, on the host."""
    if not dist.is_initialized():
        return list(values)
    tensor = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(tensor, group=host_group())
    return tensor.tolist()


def all_reduce_mean(values: list[float]) -> list[float]:
    """Mean of each value over ranks (identity in one process)."""
    return [v / world_size() for v in all_reduce_sum(values)]


def init_process_group(backend: str, timeout: datetime.timedelta) -> None:
    """Join the default process group from the launcher's environment (env://).

    Under torchrun the group's keys are prefixed with the restart attempt: after `--max-restarts`
    restarts the workers, the store still holds the dead workers' addresses, and a new rank
    reading one before its peer has replaced it would connect to nothing (gloo's connectFullMesh
    then fails, and with it the restart).
    """
    global _timeout
    _timeout = timeout
    store, rank_, world = next(dist.rendezvous("env://", timeout=timeout))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"attempt_{attempt}", store)
    dist.init_process_group(backend, store=store, rank=rank_, world_size=world, timeout=timeout)


def _tasks_on_first_node(tasks_per_node: str) -> int:
    """SLURM writes tasks per node as e.g. "8(x2),4"; every node of our templates runs the same
    number, so the first entry is this node's."""
    match = re.match(r"\d+", tasks_per_node)
    if match is None:
        raise ValueError(f"SLURM_TASKS_PER_NODE={tasks_per_node!r}: expected a count such as '8(x2)'")
    return int(match.group())


def adopt_slurm_environment() -> bool:
    """Under `srun` (one task per GPU, no torchrun or deepspeed launcher), set RANK, WORLD_SIZE,
    LOCAL_RANK and LOCAL_WORLD_SIZE from SLURM's task variables; MASTER_ADDR and MASTER_PORT come
    from the batch script. Does nothing when a launcher has set RANK already or outside a SLURM
    job step. Returns True when the variables were taken from SLURM."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or "SLURM_STEP_ID" not in os.environ:
        return False
    missing = [name for name in ("MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
    if missing and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        raise RuntimeError(
            f"running as SLURM task {os.environ['SLURM_PROCID']} of {os.environ['SLURM_NTASKS']} but "
            f"{' and '.join(missing)} is not set: export both in the batch script (launch/slurm/job.sh does)"
        )
    os.environ["RANK"] = os.environ["SLURM_PROCID"]
    os.environ["WORLD_SIZE"] = os.environ.get("SLURM_NTASKS", "1")
    os.environ["LOCAL_RANK"] = os.environ.get("SLURM_LOCALID", "0")
    per_node = os.environ.get("SLURM_STEP_TASKS_PER_NODE", os.environ.get("SLURM_TASKS_PER_NODE", "1"))
    os.environ["LOCAL_WORLD_SIZE"] = str(_tasks_on_first_node(per_node))
    return True


def init_distributed(
    timeout_s: float, group_of_one: bool, joined: Callable[[str, datetime.timedelta], None], run_dir: Path
) -> tuple[int, int]:
    """Join the process group the launcher set up (gloo on CPU, NCCL on CUDA) and return (rank, world).
    Without a launcher, a plain `python` run stays a single process, unless the engine needs a process
    group even then (`group_of_one`: a group of one is made). `joined(backend, timeout)` runs once the
    group exists: the engine's own set-up on top of it. The flight recorder is enabled first
    (`enable_flight_recorder`, NCCL's dumps in `run_dir`)."""
    launched = "MASTER_ADDR" in os.environ and "RANK" in os.environ  # deepspeed / torchrun / SLURM wrapper
    if dist.is_initialized() or not (launched or group_of_one):
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    if not launched:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29500"),
                          RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    timeout = datetime.timedelta(seconds=timeout_s)
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    enable_flight_recorder(run_dir, torch.cuda.is_available())
    init_process_group(backend, timeout)
    joined(backend, timeout)
    return dist.get_rank(), dist.get_world_size()


def device_for_rank() -> torch.device:
    """This rank's device. On CPU, the cores are split between the ranks of this node: with
    more compute threads than cores, OpenMP's spinning threads slow every rank many times over."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    if "OMP_NUM_THREADS" not in os.environ or local_ranks > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_ranks))
    return torch.device("cpu")
