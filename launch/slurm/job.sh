# The body of the SLURM templates (launch/slurm/*.sbatch source it; it is not submitted itself).
# One task per GPU, started by srun: SLURM delivers signals to every rank and reports each
# rank's own exit status, with no launcher in between (docs/cluster.md says why not torchrun).
# Expects ENGINE_ARGS (an array of overrides) from the template and the config as $1.
set -uo pipefail
CONFIG=${1:?usage: sbatch [--nodes=N --gpus-per-node=G --ntasks-per-node=G] launch/slurm/<engine>.sbatch CONFIG [key=value ...]}
shift
PYTHON=${PYTHON:-.venv/bin/python}

GPUS=${SLURM_GPUS_PER_NODE:-}
GPUS=${GPUS##*:}  # "h100:8" -> "8"
if [ -n "$GPUS" ] && [ "${SLURM_NTASKS_PER_NODE:-}" != "$GPUS" ]; then
  echo "error: --ntasks-per-node=${SLURM_NTASKS_PER_NODE:-unset} but --gpus-per-node=$GPUS: one task per GPU is" \
       "expected; pass both with the same value (sbatch --nodes=N --gpus-per-node=G --ntasks-per-node=G ...)" >&2
  exit 2
fi

MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_ADDR
export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
MARKER=${PREEMPTED_MARKER:-runs/slurm-$SLURM_JOB_ID.preempted}
mkdir -p "$(dirname "$MARKER")"
rm -f "$MARKER"
echo "job $SLURM_JOB_ID (restart ${SLURM_RESTART_COUNT:-0}): $SLURM_NNODES node(s) x $SLURM_NTASKS_PER_NODE rank(s)," \
     "rendezvous $MASTER_ADDR:$MASTER_PORT"

# SLURM signals every rank itself (SIGTERM on preemption, SIGUSR1 from --signal=USR1@T before the
# time limit). This shell only has to outlive srun to reach the requeue below; the trap (rather
# than the default action, which would end the script) runs once srun has returned.
trap 'echo "batch shell: signal received; the ranks save and stop"' TERM USR1
# The requeue state in the run directory (pretrain/resilience/requeue.py): the newest committed step now,
# to tell at the end whether this job moved the run forward.
"$PYTHON" -m pretrain.resilience.requeue begin --config "$CONFIG" "${ENGINE_ARGS[@]}" "$@"
srun --kill-on-bad-exit=1 "$PYTHON" launch/pretrain.py --config "$CONFIG" --resume auto \
  --preempted-marker "$MARKER" "${ENGINE_ARGS[@]}" "$@"
STATUS=$?

# Requeue on the trainer's note, not on srun's exit status (whatever status the ranks or srun ended
# with). Rank 0 writes it once a preemption checkpoint has committed; a rank's hang watchdog writes it
# (reason "hang") when that rank stayed in one phase past its deadline, and srun --kill-on-bad-exit
# then ends the other ranks. Either way the requeued job resumes from the newest verified checkpoint,
# unless the requeue could not help: train.max_no_progress_requeues requeues in a row without a newer
# checkpoint stop the job here, with the no-progress line and exit 5 (a preemption never counts).
if [ -f "$MARKER" ]; then
  echo "job $SLURM_JOB_ID left the requeue marker: $(cat "$MARKER")"
  "$PYTHON" -m pretrain.resilience.requeue decide --config "$CONFIG" --marker "$MARKER" "${ENGINE_ARGS[@]}" "$@"
  VERDICT=$?
  if [ "$VERDICT" -ne 0 ]; then
    exit "$VERDICT"
  fi
  echo "requeueing job $SLURM_JOB_ID"
  scontrol requeue "$SLURM_JOB_ID"
  exit 0
fi
exit "$STATUS"
