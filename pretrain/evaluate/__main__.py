"""python -m pretrain.evaluate: see pretrain.evaluate.text."""

import sys

from pretrain.evaluate.text import main

sys.exit(main())
