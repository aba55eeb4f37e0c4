"""`python -m autoplan ...` (what `torchrun -m autoplan run plan.json` starts on every rank)."""

from autoplan.cli import console_main

console_main()
