"""`python -m autoplan ...` (what `torchrun -m autoplan run plan.json` starts on every rank)."""

import sys

from autoplan.cli import main

sys.exit(main())
