"""Stand-ins for `sbatch`, `srun` and `scontrol` that run a SLURM job on this machine, so that the
templates in launch/slurm/ are tested end to end: `python -m tests.slurm_standins install DIR`
writes the three commands into DIR, to be put first on PATH.

What they do of SLURM's job:
  sbatch    reads the #SBATCH lines (command-line options win), sets the job's variables
            (SLURM_JOB_ID from $STANDIN_JOB_ID, SLURM_RESTART_COUNT from $STANDIN_RESTART_COUNT,
            node list, task and GPU counts) and runs the script in the foreground.
  srun      starts one task per rank with SLURM_PROCID, SLURM_LOCALID, SLURM_NTASKS, ...; passes
            SIGTERM, SIGINT, SIGUSR1 and SIGUSR2 on to every task; with --kill-on-bad-exit=1 it
            kills the others once one task exits non-zero; exits with the first non-zero status.
  scontrol  `show hostnames` prints 127.0.0.1 once per node; `requeue ID` appends ID to the file
            named by $STANDIN_REQUEUE_LOG.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2)


def _options(args: list[str]) -> tuple[dict[str, str], list[str]]:
    """Leading `--key=value` options (`--flag` alone reads as ""), and the rest of the command line."""
    options: dict[str, str] = {}
    i = 0
    while i < len(args) and args[i].startswith("--"):
        key, _, value = args[i][2:].partition("=")
        options[key] = value
        i += 1
    return options, args[i:]


def sbatch(args: list[str]) -> int:
    options, rest = _options(args)
    script, script_args = rest[0], rest[1:]
    directives: dict[str, str] = {}
    for line in Path(script).read_text().splitlines():
        if line.startswith("#SBATCH "):
            directive, _ = _options(line.split()[1:2])
            directives.update(directive)
    directives.update(options)
    nodes = int(directives.get("nodes", "1"))
    per_node = int(directives.get("ntasks-per-node", "1"))
    env = dict(
        os.environ,
        SLURM_JOB_ID=os.environ.get("STANDIN_JOB_ID", "4242"),
        SLURM_RESTART_COUNT=os.environ.get("STANDIN_RESTART_COUNT", "0"),
        SLURM_JOB_NODELIST=f"standin[1-{nodes}]",
        SLURM_NNODES=str(nodes),
        SLURM_NTASKS=str(nodes * per_node),
        SLURM_NTASKS_PER_NODE=str(per_node),
        SLURM_TASKS_PER_NODE=f"{per_node}(x{nodes})",
        SLURM_SUBMIT_DIR=os.getcwd(),
    )
    if "gpus-per-node" in directives:
        env["SLURM_GPUS_PER_NODE"] = directives["gpus-per-node"]
    for sig in FORWARDED:  # the submitter is not part of the job: signals to the job pass it by
        signal.signal(sig, lambda *_: None)
    return subprocess.call(["bash", script, *script_args], env=env)


def srun(args: list[str]) -> int:
    options, command = _options(args)
    ntasks = int(os.environ["SLURM_NTASKS"])
    per_node = int(os.environ["SLURM_NTASKS_PER_NODE"])
    tasks = []
    for rank in range(ntasks):
        env = dict(
            os.environ, SLURM_PROCID=str(rank), SLURM_LOCALID=str(rank % per_node), SLURM_NODEID=str(rank // per_node),
            SLURM_STEP_ID="0", SLURM_STEP_TASKS_PER_NODE=os.environ["SLURM_TASKS_PER_NODE"],
        )
        tasks.append(subprocess.Popen(command, env=env))

    def forward(signum: int, _frame: object) -> None:
        for task in tasks:
            if task.poll() is None:
                task.send_signal(signum)

    for sig in FORWARDED:
        signal.signal(sig, forward)
    status = 0
    while any(task.poll() is None for task in tasks):
        failed = [task.returncode for task in tasks if task.returncode not in (None, 0)]
        if failed and not status:
            status = failed[0]
            if options.get("kill-on-bad-exit") == "1":
                for task in tasks:
                    if task.poll() is None:
                        task.kill()
        time.sleep(0.05)
    return status or next((task.returncode for task in tasks if task.returncode), 0)


def scontrol(args: list[str]) -> int:
    if args[:2] == ["show", "hostnames"]:
        nodes = re.fullmatch(r"standin\[1-(\d+)\]", args[2])
        print("\n".join(["127.0.0.1"] * int(nodes.group(1) if nodes else 1)))
        return 0
    if args[0] == "requeue":
        with open(os.environ["STANDIN_REQUEUE_LOG"], "a") as log:
            log.write(args[1] + "\n")
        return 0
    print(f"scontrol stand-in: unsupported command {args}", file=sys.stderr)
    return 1


def install(directory: Path) -> None:
    """Write executable `sbatch`, `srun` and `scontrol` into `directory`."""
    directory.mkdir(parents=True, exist_ok=True)
    root = Path(__file__).resolve().parents[1]
    for name in ("sbatch", "srun", "scontrol"):
        path = directory / name
        path.write_text(f'#!/bin/sh\nPYTHONPATH="{root}" exec "{sys.executable}" -m tests.slurm_standins {name} "$@"\n')
        path.chmod(0o755)


if __name__ == "__main__":
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "install":
        install(Path(rest[0]))
        sys.exit(0)
    sys.exit({"sbatch": sbatch, "srun": srun, "scontrol": scontrol}[command](rest))
