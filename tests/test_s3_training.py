"""Training against a real S3 endpoint (moto's server on loopback): shards and checkpoints in the bucket,
export and init.from reading from it, no credential in anything a run writes, a run through a faulty
connection logging the clean run's losses bitwise, and a 2-rank DeepSpeed run killed with SIGKILL
resuming from the bucket bitwise (slow)."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import fsspec
import pytest
import torch

from pretrain.checkpoint.manifest import committed_steps
from pretrain.export import load_exported
from pretrain.run.init_from import read_initial_weights
from tests.fault_proxy import FaultProxy
from tests.launchers import REPO, free_port, run_training
from tests.s3_server import SECRETS
from tests.test_resume import STEPS, config_args, kill_at_step, step_losses

TINY = REPO / "configs" / "tiny.yaml"


def upload_shards(s3, demo_shards: dict[str, str]) -> str:
    fs, _ = fsspec.core.url_to_fs(s3.url())
    fs.put(demo_shards["train"] + "/", s3.url("shards/train") + "/", recursive=True)
    return s3.url("shards/train")


def tiny_args(shards: str, run_dir: Path, ckpt: str, steps: int = 6, *extra: str) -> list[str]:
    return ["--config", str(TINY), f"data.train=[{{path: {shards}}}]", "data.valid=[]", f"run.dir={run_dir}",
            f"checkpoint.dir={ckpt}", f"train.steps={steps}", "checkpoint.every=3", "checkpoint.keep_last=2",
            "train.log_every=1", *extra]


def leaked(paths: list[Path], texts: list[str]) -> list[str]:
    """Where any of the test credentials appears: files under `paths` and the `texts` (process output)."""
    found = []
    for root in paths:
        for path in [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file()):
            data = path.read_bytes()
            found += [f"{path}: {secret[:6]}..." for secret in SECRETS if secret.encode() in data]
    for i, text in enumerate(texts):
        found += [f"output {i}: {secret[:6]}..." for secret in SECRETS if secret in text]
    return found


def test_a_run_on_s3_exports_and_inits_from_the_bucket_and_writes_no_secret(s3, demo_shards, tmp_path: Path) -> None:
    shards, ckpt = upload_shards(s3, demo_shards), s3.url("runs/tiny/checkpoints")
    run_dir = tmp_path / "run"
    done = run_training("python", 1, tiny_args(shards, run_dir, ckpt, 6, "log.wandb=true"))
    assert committed_steps(ckpt) == ["step_00000006", "step_00000003"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, 7))
    assert all(r["ckpt/retries"] == 0 and r["data/read_retries"] == 0 for r in records if "train/loss" in r)

    export_url, export_dir = s3.url("exports/tiny"), tmp_path / "export"
    exported = subprocess.run(  # the endpoint from the flag alone, as the tools take a run's storage settings
        [sys.executable, "-m", "pretrain.export", "--checkpoint", s3.url("runs/tiny"), "--out", export_url,
         "--storage", f"endpoint_url={s3.endpoint}", "--storage", "retries=2"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
        env={k: v for k, v in s3.child_env().items() if k != "AWS_ENDPOINT_URL"},
    )
    assert exported.returncode == 0, exported.stderr[-3000:]
    fs, _ = fsspec.core.url_to_fs(export_url)
    fs.get(export_url + "/", str(export_dir) + "/", recursive=True)
    assert f"{ckpt}/step_00000006" in (export_dir / "config.json").read_text()  # provenance: the bucket's URL
    model = load_exported(export_dir)
    for source in (ckpt, export_url):  # init.from accepts the bucket's checkpoints and exports
        weights = read_initial_weights(source)
        assert weights.keys() == dict(model.named_parameters()).keys()
        assert all(torch.equal(weights[k], p) for k, p in model.named_parameters())

    refused = run_training("python", 1, tiny_args(s3.url("no/such/shards"), tmp_path / "bad", ckpt), check=False)
    assert refused.returncode == 2 and s3.url("no/such/shards") in refused.stdout + refused.stderr
    outputs = [done.stdout, done.stderr, exported.stdout, exported.stderr, refused.stdout, refused.stderr]
    fs.get(s3.url("runs") + "/", str(tmp_path / "bucket") + "/", recursive=True)  # the checkpoints and lease
    assert any((tmp_path / "bucket").rglob("config.yaml"))
    assert not leaked([run_dir, export_dir, tmp_path / "bad", tmp_path / "bucket"], outputs)
    assert any((run_dir / "wandb").rglob("*")), "the wandb files were not written, so not checked"


def test_a_run_through_faults_logs_the_clean_losses(s3, s3_server, demo_shards, tmp_path: Path) -> None:
    """Resets, cut answers, stalls past the read timeout and 503 SlowDown on every 5th request while
    training, reading byte ranges in 4 kB blocks: the losses and the data position are those of a clean
    run reading whole shards, the retries counted."""
    shards = upload_shards(s3, demo_shards)
    fast = ["storage.read_timeout_s=0.5", "storage.backoff_s=0.01", "storage.backoff_max_s=0.05",
            "checkpoint.async_save=false"]
    clean, faulty = tmp_path / "clean", tmp_path / "faulty"
    run_training("python", 1, tiny_args(shards, clean, s3.url("clean/ckpt"), 6, *fast))
    proxy = FaultProxy(("127.0.0.1", s3_server.port), every=5, stall_s=1.5)
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # the s3 fixture puts it back
    try:
        run_training("python", 1, tiny_args(shards, faulty, s3.url("faulty/ckpt"), 6, *fast, "data.read=range",
                                            "storage.block_size=4096"))
    finally:
        proxy.close()
    assert step_losses(faulty) == step_losses(clean) and len(step_losses(clean)) == 6
    last = json.loads((faulty / "metrics.jsonl").read_text().splitlines()[-1])
    fs, _ = fsspec.core.url_to_fs(s3.url())
    states = [json.loads(fs.cat_file(s3.url(f"{name}/ckpt/step_00000006/trainer_state.json")))
              for name in ("clean", "faulty")]
    assert states[0]["data"] == states[1]["data"]  # the same samples consumed: none lost or repeated
    records = [json.loads(line) for line in (faulty / "metrics.jsonl").read_text().splitlines()]
    assert max(r.get("data/sha256_verified", 0) for r in records) == 0  # read by ranges: no whole shard
    assert max(r.get("data/prefetched", 0) for r in records) > 0  # blocks asked for ahead of the samples
    retries = max(r.get("data/read_retries", 0) for r in records), max(r.get("ckpt/retries", 0) for r in records)
    assert proxy.done.total() >= 4 and retries[0] + retries[1] >= 1, (proxy.done, retries, last)


def test_a_commit_failing_on_rank_0_stops_both_ranks_with_exit_2(s3, s3_server, demo_shards, tmp_path: Path) -> None:
    """Two ranks (plain processes joined through env://, FSDP on gloo), checkpoints in the bucket, the
    manifest of step 3 never getting through: only rank 0 commits, so only rank 0 sees the upload fail,
    in the background; both ranks stop with exit 2 and rank 0's line naming the object, none hangs."""
    shards, ckpt = upload_shards(s3, demo_shards), s3.url("two/ckpt")
    proxy = FaultProxy(("127.0.0.1", s3_server.port))
    proxy.plan = lambda n, line: "reset" if line.startswith(b"PUT") and b"step_00000003/manifest.json" in line else None
    args = tiny_args(shards, tmp_path / "run", ckpt, 6, "storage.retries=2", "storage.backoff_s=0.01",
                     "storage.backoff_max_s=0.05", "engine.kind=fsdp", "engine.dist_timeout_s=120")
    port = free_port()
    env = {**s3.child_env(), "AWS_ENDPOINT_URL": proxy.endpoint, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
           "WORLD_SIZE": "2", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    ranks = [subprocess.Popen([sys.executable, str(REPO / "launch" / "pretrain.py"), *args], cwd=REPO, text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT) for r in range(2)]
    try:
        outputs = [rank.communicate(timeout=300)[0] for rank in ranks]
    finally:
        proxy.close()
        for rank in ranks:
            rank.kill()
    said = f"rank 0 could not commit the checkpoint of step 3: cannot upload '{ckpt}/step_00000003/manifest.json'"
    for r, (rank, output) in enumerate(zip(ranks, outputs)):
        assert rank.returncode == 2 and said in output, (r, rank.returncode, output[-3000:])
    assert committed_steps(ckpt) == []
    assert not leaked([tmp_path / "run"], outputs)


@pytest.mark.slow
def test_deepspeed_2_ranks_killed_resume_from_s3_bitwise(s3, demo_shards, tmp_path: Path) -> None:
    shards = {"train": upload_shards(s3, demo_shards)}
    extra = ["engine.kind=deepspeed", "engine.zero_stage=2"]
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_training("deepspeed", 2, [*config_args(shards, straight, extra), f"checkpoint.dir={s3.url('straight')}"])
    expected = {step: values[0] for step, values in step_losses(straight).items()}
    assert sorted(expected) == list(range(1, STEPS + 1))
    args = [*config_args(shards, killed, extra), f"checkpoint.dir={s3.url('killed')}"]
    reached = kill_at_step("deepspeed", 2, args, killed, random.Random("s3").randint(4, STEPS - 2))
    assert committed_steps(s3.url("killed")), "no checkpoint reached the bucket before the kill"
    run_training("deepspeed", 2, [*args, "--resume", "auto"])
    resumed = step_losses(killed)
    assert {step: values[-1] for step, values in resumed.items()} == expected, f"killed after step {reached}"
    assert any(len(values) > 1 for values in resumed.values()), "nothing was trained twice: no resume happened"


def test_a_checkpoint_that_cannot_be_committed_ends_the_run_with_exit_2_naming_it(s3, s3_server, demo_shards,
                                                                                  tmp_path: Path) -> None:
    """The manifest of step 3 never gets through (every PUT of it reset): the run stops with exit 2 and
    a line naming the object and the attempts, and the bucket holds no committed step 3."""
    shards, ckpt = upload_shards(s3, demo_shards), s3.url("doomed/ckpt")
    proxy = FaultProxy(("127.0.0.1", s3_server.port))
    proxy.plan = lambda n, line: "reset" if line.startswith(b"PUT") and b"step_00000003/manifest.json" in line else None
    os.environ["AWS_ENDPOINT_URL"] = proxy.endpoint  # the s3 fixture puts it back
    try:
        done = run_training("python", 1, tiny_args(shards, tmp_path / "run", ckpt, 6, "storage.retries=2",
                                                    "storage.backoff_s=0.01", "storage.backoff_max_s=0.05"),
                            check=False)
    finally:
        proxy.close()
    output = done.stdout + done.stderr
    assert done.returncode == 2, output[-3000:]
    assert f"cannot upload '{ckpt}/step_00000003/manifest.json': failed 3 times (2 retries" in output, output[-3000:]
    assert committed_steps(ckpt) == []
    assert proxy.done["reset"] >= 3
    assert not leaked([tmp_path / "run"], [output])
