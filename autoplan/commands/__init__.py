"""The subcommands' argument wiring over the library: `check`, `show`, `export` and the `suggest
--sweep-gpus` what-if sweep (plans.py, sweep.py), and `list` (listing.py). `autoplan/cli.py` registers
them; they sit above `check` and `api`, which they call, and above the report they print with."""
