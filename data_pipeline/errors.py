"""How the data command-line tools report a bad input: one line, exit status 2.

A corrupt, edited or missing input is the user's to fix, so the tools print one line naming the file
and what was expected instead of a traceback; the traceback still goes to the log at debug level for
whoever needs to dig further.
"""

from __future__ import annotations

import logging
import sys

from data_pipeline.shards import ShardError

DATA_ERRORS = (ValueError, OSError, ShardError)
"""What bad input raises: ValueError (ManifestError, malformed JSONL or parquet, symlinks), OSError
(missing or unreadable files) and ShardError (a shard that disagrees with its manifest)."""

log = logging.getLogger("data_pipeline")


def report_data_error(err: BaseException) -> int:
    """Log the traceback at debug level, print `error: <message>` on stderr, return exit status 2."""
    log.debug("data error", exc_info=err)
    print(f"error: {err}", file=sys.stderr)
    return 2
