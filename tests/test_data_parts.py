"""Builds split into parts: N tasks plus a merge equal one process, and a killed build resumes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from data_pipeline import build as build_mod
from data_pipeline.build import build_parts, build_shards, merge_parts, plan_build
from data_pipeline.stream import PackedStream

REPO = Path(__file__).resolve().parents[1]
BOOKS = REPO / "data" / "demo" / "train"
FLAGS = {"shard_tokens": 20_000, "part_bytes": 30_000}


def _tree(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _corpus(tmp_path: Path) -> list[str]:
    """Four books as text files and one as a parquet file of paragraphs in many row groups."""
    paragraphs = (BOOKS / "lear.txt").read_text().split("\n\n")
    pq.write_table(pa.table({"text": paragraphs}), tmp_path / "lear.parquet", row_group_size=100)
    books = [str(BOOKS / f) for f in ("macbeth.txt", "midsummer_nights_dream.txt", "sonnets.txt", "tempest.txt")]
    return [str(tmp_path / "lear.parquet"), *books]


def _stream(out: Path) -> list[list[int]]:
    s = PackedStream([(str(out), 1.0)], seq_len=256, seed=1, shuffle_buffer=64)
    n = s.samples_per_epoch()[0]
    return [s.get(g)["input_ids"].tolist() for g in range(0, 2 * n, 7)]  # two epochs, every 7th sample


def _record_built_parts(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, every part the build actually builds (not skips) is appended to the returned list."""
    built: list[int] = []
    real = build_mod._build_part

    def spy(plan, part, *args):
        built.append(part)
        return real(plan, part, *args)

    monkeypatch.setattr(build_mod, "_build_part", spy)
    return built


def test_tasks_then_merge_equal_one_process(tmp_path: Path) -> None:
    inputs = _corpus(tmp_path)
    one = tmp_path / "one"
    build_shards(inputs, str(one), **FLAGS)
    split = tmp_path / "split"
    plan = plan_build(inputs, str(split), **FLAGS)
    assert len(plan.parts) >= 6
    assert sum(u.row_groups is not None for p in plan.parts for u in p) >= 2  # the parquet file is cut
    assert build_parts(plan, num_tasks=3, task_index=2) == list(range(2, len(plan.parts), 3))
    build_parts(plan, num_tasks=3, task_index=0, workers=2)
    missing = ", ".join(map(str, range(1, len(plan.parts), 3)))  # task 1's parts
    with pytest.raises(FileNotFoundError, match=rf"\(parts {missing}\); run the build tasks"):
        merge_parts(plan)
    args = ["--input", *inputs, "--output", str(split), "--shard-tokens", "20000", "--part-bytes", "30000"]
    assert build_mod.main([*args, "--num-tasks", "3", "--task-index", "1", "--no-progress"]) == 0
    assert not (split / "manifest.json").exists()
    assert build_mod.main([*args, "--merge"]) == 0
    assert _tree(split) == _tree(one)  # shards, part records and manifest byte for byte
    assert _stream(split) == _stream(one)


def test_interrupted_build_redoes_only_unfinished_parts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    inputs = _corpus(tmp_path)
    reference = build_shards(inputs, str(tmp_path / "ref"), **FLAGS)
    out = tmp_path / "out"
    real_write = build_mod._write_shard
    writes = 0

    def dies_at_the_ninth_shard(*args):
        nonlocal writes
        writes += 1
        if writes == 9:
            raise KeyboardInterrupt  # as if the process were stopped while writing
        return real_write(*args)

    monkeypatch.setattr(build_mod, "_write_shard", dies_at_the_ninth_shard)
    with pytest.raises(KeyboardInterrupt):
        build_shards(inputs, str(out), **FLAGS)
    monkeypatch.setattr(build_mod, "_write_shard", real_write)
    finished = sorted(p.name for p in (out / "parts").iterdir())
    assert 0 < len(finished) < len(plan_build(inputs, str(out), **FLAGS).parts)
    assert not (out / "manifest.json").exists()
    built = _record_built_parts(monkeypatch)
    resumed = build_shards(inputs, str(out), **FLAGS)
    parts = len(plan_build(inputs, str(out), **FLAGS).parts)
    assert built == list(range(len(finished), parts))  # parts are built in order, so the first ones are done
    assert _tree(out) == _tree(tmp_path / "ref") and resumed.fingerprint == reference.fingerprint
    built.clear()
    build_shards(inputs, str(out), shard_tokens=30_000, part_bytes=FLAGS["part_bytes"], overwrite=True)  # another plan
    assert built == list(range(parts))


def test_killed_build_process_resumes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGKILL a real build process while it waits on its fourth input (a FIFO no one writes yet),
    then finish the build in this process: the three finished parts are not rebuilt."""
    src = tmp_path / "in"
    src.mkdir()
    for name in ("a", "b", "c", "e"):
        (src / f"{name}.txt").write_bytes((BOOKS / "sonnets.txt").read_bytes()[: 5000 + ord(name)])
    os.mkfifo(src / "d.txt")
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "data_pipeline.build", "--input", str(src / "*.txt"), "--output", str(out)]
    cmd += ["--part-bytes", "1", "--no-progress"]
    proc = subprocess.Popen(cmd, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        deadline = time.monotonic() + 120
        while not (out / "parts" / "part-000002.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the build died or hung before part 2"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert sorted(p.name for p in (out / "parts").iterdir()) == [f"part-{i:06d}.json" for i in range(3)]
    (src / "d.txt").unlink()
    (src / "d.txt").write_bytes(b"")  # same size the FIFO reported, so the same plan
    built = _record_built_parts(monkeypatch)
    m = build_shards([str(src / "*.txt")], str(out), part_bytes=1)
    assert built == [3] and m.total_documents == 4 and m.stats["empty_documents"] == 1
    build_shards([str(src / "*.txt")], str(tmp_path / "ref"), part_bytes=1)
    assert _tree(out) == _tree(tmp_path / "ref")


def test_slurm_array_template_builds_then_merges(tmp_path: Path) -> None:
    """launch/slurm/build_shards.sbatch as SLURM runs it: array tasks 10-12 (out of order), then the
    merge job without an array; the result is the one-process build."""
    inputs = _corpus(tmp_path)
    build_shards(inputs, str(tmp_path / "one"), **FLAGS)
    args = ["--input", *inputs, "--output", str(tmp_path / "array"), "--shard-tokens", "20000"]
    args += ["--part-bytes", "30000", "--no-progress"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHON=sys.executable, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    array = {"SLURM_ARRAY_TASK_COUNT": "3", "SLURM_ARRAY_TASK_MIN": "10", "SLURM_CPUS_PER_TASK": "1"}
    template = str(REPO / "launch" / "slurm" / "build_shards.sbatch")
    for task in (12, 10, 11):
        task_env = {**env, **array, "SLURM_ARRAY_TASK_ID": str(task)}
        subprocess.run(["bash", template, *args], cwd=REPO, env=task_env, check=True, capture_output=True)
        assert not (tmp_path / "array" / "manifest.json").exists()
    merged = subprocess.run(["bash", template, *args], cwd=REPO, env=env, check=True, capture_output=True, text=True)
    assert "wrote" in merged.stdout
    assert _tree(tmp_path / "array") == _tree(tmp_path / "one")


def test_reading_and_writing_run_beside_tokenizing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Documents are read in the reader thread and shards written in the writer thread, so both overlap
    the tokenizer (main thread or worker processes); the progress bar reports tokens on stderr."""
    threads: dict[str, set[str]] = {"read": set(), "write": set()}
    real_read, real_write = build_mod.read_unit, build_mod._write_shard

    def read(*args):
        threads["read"].add(threading.current_thread().name)
        yield from real_read(*args)

    def write(*args):
        threads["write"].add(threading.current_thread().name)
        return real_write(*args)

    monkeypatch.setattr(build_mod, "read_unit", read)
    monkeypatch.setattr(build_mod, "_write_shard", write)
    books = [str(BOOKS / f) for f in ("macbeth.txt", "sonnets.txt", "tempest.txt")]
    m = build_shards(books, str(tmp_path / "out"), shard_tokens=20_000, progress=True)
    assert len(m.shards) == 3  # one book per shard: documents are never split
    assert threads == {"read": {"build-reader"}, "write": {"build-writer_0"}}
    assert threading.main_thread().name not in threads["read"] | threads["write"]
    assert "build shards" in capsys.readouterr().err
