"""python -m pretrain.plan: see pretrain.plan.memory."""

import sys

from pretrain.plan.memory import main

sys.exit(main())
