"""One-off measurement scripts, each ``python -m bench.scripts.<name> --help``."""
