"""Checkpoints on a real S3 endpoint (moto's server on loopback): saved, listed by manifest, pruned,
resumed, and killed before each request of a commit (pretrain/checkpoint/object_store.py).

The kill test forks a child that runs one checkpoint operation and exits (as a SIGKILL would) just
before its Nth request that changes the bucket (PutObject, CopyObject, DeleteObject(s), multipart
calls), for every N; the next start must restore the newest committed step with its own payload."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import fsspec
import pytest
from aiobotocore.client import AioBaseClient

from pretrain.checkpoint.checkpointer import Checkpointer
from pretrain.checkpoint.layout import CheckpointError
from pretrain.checkpoint.manifest import committed_steps, verify
from tests.test_crash_points import payload_of, restored, save

KILLED = 9
MUTATING = {"PutObject", "CopyObject", "DeleteObject", "DeleteObjects", "CreateMultipartUpload", "UploadPart",
            "UploadPartCopy", "CompleteMultipartUpload"}


def ckpt(root: str, staging: Path, keep_last: int = 10) -> Checkpointer:
    return Checkpointer(root, staging, keep_last, 0, False)


def test_save_list_prune_and_resume_on_s3(s3, tmp_path: Path) -> None:
    root = s3.url("run/checkpoints")
    for step in (1, 2, 3):
        save(ckpt(root, tmp_path / "stage", keep_last=2), step)
    fs, _ = fsspec.core.url_to_fs(root)
    assert committed_steps(root) == ["step_00000003", "step_00000002"]
    assert fs.cat_file(f"{root}/latest") == b"step_00000003"
    assert not fs.exists(f"{root}/step_00000001/manifest.json") and not fs.find(f"{root}/step_00000001")
    assert restored(root, tmp_path / "stage") == (3, payload_of(3))

    # an upload killed before its manifest leaves step 4 uncommitted: it is neither listed nor restored
    fs.pipe_file(f"{root}/step_00000004/trainer_state.json", b"{}")
    # an object the manifest does not list is never downloaded, so it cannot be loaded unchecked
    fs.pipe_file(f"{root}/step_00000003/engine/extra.json", b"{}")
    assert committed_steps(root) == ["step_00000003", "step_00000002"]
    assert restored(root, tmp_path / "stage") == (3, payload_of(3))
    verify(f"{root}/step_00000003")

    # a corrupt object in the newest step: it fails verification and the one before is restored
    fs.pipe_file(f"{root}/step_00000003/engine/payload.json", json.dumps({"value": 666}).encode())
    with pytest.raises(CheckpointError, match="sha256 does not match"):
        verify(f"{root}/step_00000003")
    assert restored(root, tmp_path / "stage") == (2, payload_of(2))


def _count_and_kill(kill_at: int, counter: list[int]) -> None:
    """From now on (in this process), exit before the `kill_at`th mutating S3 request (0: count only)."""
    real = AioBaseClient._make_api_call

    async def call(self: Any, operation: str, params: Any) -> Any:
        if operation in MUTATING:
            counter[0] += 1
            if counter[0] == kill_at:
                os._exit(KILLED)
        return await real(self, operation, params)

    AioBaseClient._make_api_call = call


def in_child(action: Any, kill_at: int) -> tuple[int, int]:
    """Fork; the child runs `action` counting (and killed at) mutating requests: (exit code, requests)."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read_end)
            counter = [0]
            _count_and_kill(kill_at, counter)
            try:
                action()
            finally:
                os.write(write_end, str(counter[0]).encode())
        except BaseException:
            code = 1
        os._exit(code)
    os.close(write_end)
    _, status = os.waitpid(pid, 0)
    with os.fdopen(read_end) as pipe:
        reported = pipe.read()
    return os.waitstatus_to_exitcode(status), int(reported or 0)


SCENARIOS: dict[str, dict[str, Any]] = {
    "first-save": dict(before=[], action=lambda r, s: save(ckpt(r, s), 1), old=None, new=(1, payload_of(1))),
    "save-and-prune": dict(before=[1], keep_last=1, action=lambda r, s: save(ckpt(r, s, keep_last=1), 2),
                           old=(1, payload_of(1)), new=(2, payload_of(2))),
    "overwrite-same-step": dict(before=[1, 2], action=lambda r, s: save(ckpt(r, s), 2, version=1),
                                old=(2, payload_of(2)), new=(2, payload_of(2, 1))),
}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.slow if n == "overwrite-same-step" else ()) for n in sorted(SCENARIOS)]
)  # the re-save makes ~3x the requests of a first save: 17-56 s on 2 shared cores, so in test-long
def test_a_kill_before_any_request_of_a_commit_keeps_the_newest_committed_step(s3, tmp_path: Path, name: str) -> None:
    spec = SCENARIOS[name]
    fs, _ = fsspec.core.url_to_fs(s3.url())
    template = s3.url("template")
    for step in spec["before"]:
        save(ckpt(template, tmp_path / "stage", keep_last=spec.get("keep_last", 10)), step)

    def fresh(n: int) -> str:
        root = s3.url(f"work-{n}")
        if fs.exists(template):
            fs.copy(template + "/", root + "/", recursive=True)
        return root

    root = fresh(0)
    code, total = in_child(lambda: spec["action"](root, tmp_path / "stage"), kill_at=0)
    assert code == 0 and total > 0, f"the uninterrupted {name} failed (exit {code}, {total} requests)"
    assert restored(root, tmp_path / "stage") == spec["new"]
    for kill_at in range(1, total + 1):
        root = fresh(kill_at)
        code, _ = in_child(lambda root=root: spec["action"](root, tmp_path / "stage"), kill_at)
        assert code == KILLED, f"{name}: the child was not killed at request {kill_at}"
        state = restored(root, tmp_path / "stage")
        assert state in (spec["old"], spec["new"]), f"{name}, killed at request {kill_at}/{total}: restored {state}"
        save(ckpt(root, tmp_path / "stage"), 7)  # and the next start saves again
        assert restored(root, tmp_path / "stage") == (7, payload_of(7))
