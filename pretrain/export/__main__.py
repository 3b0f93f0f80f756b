"""python -m pretrain.export: see pretrain.export.cli."""

import sys

from pretrain.export.cli import main

sys.exit(main())
