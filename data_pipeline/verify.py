"""Check a whole shard set against its manifest: ``python -m data_pipeline.verify <manifest dir or URL>``.

Reads every shard through fsspec, checks its sha256, tar/npy structure and token/document counts,
and prints one line per problem (each naming the shard). Exit status 0 when all shards are good,
2 otherwise (a bad shard, or a manifest that cannot be read, points outside its directory or
records totals its shards do not add up to). Useful after copying a dataset to an object store;
training checks each shard again when it reads it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from tqdm import tqdm

from data_pipeline import storage
from data_pipeline.errors import DATA_ERRORS, report_data_error
from data_pipeline.shards import ShardError, checked_shard, load_manifest, read_bytes, sha256_hex


def verify_shards(source: str, progress: bool = False) -> list[str]:
    """Problems found in the shard set of manifest ``source`` (empty list: all good)."""
    manifest = load_manifest(source)
    problems = []
    for i in tqdm(range(len(manifest.shards)), desc="verify", disable=not progress, file=sys.stderr):
        entry, url = manifest.shards[i], manifest.shard_url(i)
        try:
            data, _ = read_bytes(url, retries=1)
            checked_shard(data, url, entry, manifest.dtype, sha256_hex(data))
        except ShardError as exc:
            problems.append(str(exc))
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    """CLI: print problems, exit 2 if any."""
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.verify", description=__doc__)
    parser.add_argument("manifest", help="manifest.json URL or the directory holding it")
    parser.add_argument("--no-progress", action="store_true")
    storage.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        storage.configure_from_args(args)
        problems = verify_shards(args.manifest, progress=not args.no_progress)
    except DATA_ERRORS as err:
        return report_data_error(err)
    for line in problems:
        print(line)
    print(f"{len(problems)} problem(s) in {args.manifest}")
    return 2 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
