"""``python -m model.soe`` (see model.soe.cli)."""

from model.soe.cli import main

raise SystemExit(main())
