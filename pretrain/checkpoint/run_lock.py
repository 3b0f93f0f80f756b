"""One trainer per run: rank 0 holds the run directory (and a remote checkpoint root) while it trains.

A job started twice on the same run would interleave `metrics.jsonl`, overwrite the other's
`config.yaml` and race its checkpoint commits. So before anything is written:

- the run directory (a local or shared file system) gets an advisory `flock` on `<run dir>/.lock`.
  The kernel drops it when the process dies, so a crashed trainer never blocks its successor; the
  file also records who holds it, for the refusal message and for the takeover warning.
- a checkpoint root on an object store (an fsspec URL, where no lock exists) gets a lease file
  `<root>/.lease.json` naming host, pid, job and a heartbeat that a background thread renews. A lease
  whose heartbeat is older than LEASE_TTL_S is stale and is taken over with a warning.

A restart of the same job (SLURM requeue: same `SLURM_JOB_ID`; a torchrun elastic restart: same
`TORCHELASTIC_RUN_ID`) is the same owner and takes the lease over at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any

from fsspec.core import url_to_fs

from data_pipeline.storage import retrying
from pretrain.checkpoint.manifest import is_local
from pretrain.telemetry.log import get_logger

LOCK_FILE = ".lock"
LEASE_FILE = ".lease.json"
LEASE_TTL_S = 120.0
HEARTBEAT_S = 30.0
SETTLE_S = 1.0  # after writing a lease, wait this long and read it back: a racing writer shows here


class RunLockedError(RuntimeError):
    """Another live trainer holds this run."""


def job_identity() -> str | None:
    """The scheduler's name for this job, stable across its restarts (None outside a scheduler)."""
    for key in ("SLURM_JOB_ID", "TORCHELASTIC_RUN_ID"):
        if os.environ.get(key):
            return f"{key}={os.environ[key]}"
    return None


def _holder() -> dict[str, Any]:
    return {"host": socket.gethostname(), "pid": os.getpid(), "job": job_identity(), "token": uuid.uuid4().hex,
            "heartbeat": time.time()}


def _describe(holder: dict[str, Any]) -> str:
    job = f", {holder['job']}" if holder.get("job") else ""
    return f"host {holder.get('host')!r} pid {holder.get('pid')}{job}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


class RunLock:
    """Held by rank 0 from before its first write until the run ends (`release`, or process exit)."""

    def __init__(self, run_dir: Path, checkpoint_root: str) -> None:
        self.run_dir = Path(run_dir)
        self.remote_root = None if is_local(checkpoint_root) else checkpoint_root.rstrip("/")
        self.me = _holder()
        self._file: IO[str] | None = None
        self._stop = threading.Event()
        self._heartbeat: threading.Thread | None = None

    # -- the run directory

    def _lock_directory(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        path = self.run_dir / LOCK_FILE
        handle = open(path, "a+")  # noqa: SIM115 - held open for the life of the run
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = _read_json(handle.read())
            handle.close()
            raise RunLockedError(
                f"{path}: run directory is in use by another trainer ({_describe(holder)}); "
                "stop it, or give this run another run.dir"
            ) from None
        handle.seek(0)
        previous = _read_json(handle.read())
        if previous:  # the kernel released it: its holder is gone
            get_logger().warning("%s: taking over the lock of a trainer that is gone (%s)", path, _describe(previous))
        handle.seek(0)
        handle.truncate()
        handle.write(json.dumps(self.me))
        handle.flush()
        os.fsync(handle.fileno())
        self._file = handle

    # -- a lease on an object store

    def _lease_url(self) -> str:
        return f"{self.remote_root}/{LEASE_FILE}"

    def _read_lease(self) -> dict[str, Any]:
        """The lease's holder ({} when there is none), read under the storage retry policy."""
        fs, path = url_to_fs(self._lease_url())
        try:
            return _read_json(retrying(self._lease_url(), lambda: fs.cat_file(path), what="read lease").decode())
        except FileNotFoundError:
            return {}

    def _write_lease(self) -> None:
        fs, path = url_to_fs(self._lease_url())
        fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        payload = json.dumps({**self.me, "heartbeat": time.time()}).encode()
        retrying(self._lease_url(), lambda: fs.pipe_file(path, payload), what="write lease")

    def _stale_reason(self, holder: dict[str, Any]) -> str | None:
        """Why `holder` no longer owns the lease, or None while it does."""
        if holder.get("job") and holder.get("job") == self.me["job"]:
            return "an earlier start of this job"
        if holder.get("host") == self.me["host"] and not _pid_alive(int(holder.get("pid", -1))):
            return "its process is gone"
        age = time.time() - float(holder.get("heartbeat", 0))
        if age > LEASE_TTL_S:
            return f"no heartbeat for {age:.0f} s (lease {LEASE_TTL_S:.0f} s)"
        return None

    def _take_lease(self) -> None:
        holder = self._read_lease()
        if holder:
            reason = self._stale_reason(holder)
            if reason is None:
                wait = LEASE_TTL_S - (time.time() - float(holder.get("heartbeat", 0)))
                raise RunLockedError(
                    f"{self._lease_url()}: checkpoint root is leased by another trainer ({_describe(holder)}); "
                    f"it expires {max(wait, 0):.0f} s after that trainer's last heartbeat"
                )
            get_logger().warning("%s: taking over the lease of %s: %s", self._lease_url(), _describe(holder), reason)
        self._write_lease()
        time.sleep(SETTLE_S)
        if self._read_lease().get("token") != self.me["token"]:
            raise RunLockedError(f"{self._lease_url()}: another trainer took the lease while this one started "
                                 f"({_describe(self._read_lease())})")
        self._heartbeat = threading.Thread(target=self._renew, daemon=True, name="run-lease")
        self._heartbeat.start()

    def _renew(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self._write_lease()
            except Exception as err:  # a failed renewal is retried at the next beat
                get_logger().warning("%s: lease renewal failed: %s", self._lease_url(), err)

    # -- the interface

    def acquire(self) -> None:
        """Take the run directory and, for a remote checkpoint root, its lease; raises RunLockedError."""
        self._lock_directory()
        if self.remote_root is not None:
            try:
                self._take_lease()
            except BaseException:
                self.release()
                raise

    def release(self) -> None:
        """Give both back (idempotent)."""
        self._stop.set()
        if self._heartbeat is not None:
            self._heartbeat.join()
            self._heartbeat = None
            fs, path = url_to_fs(self._lease_url())
            if self._read_lease().get("token") == self.me["token"]:
                retrying(self._lease_url(), lambda: fs.rm(path), what="delete lease")
        if self._file is not None:  # emptied: the next start sees a clean hand-over, not a takeover
            self._file.seek(0)
            self._file.truncate()
            self._file.flush()
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def _read_json(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError:
        return {"host": "?", "pid": "?"}
    return value if isinstance(value, dict) else {}
