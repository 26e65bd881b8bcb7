"""The laboratory: what icqs-fast measures about itself, kept out of the installed package.

Run from the repository root as ``python -m bench.<part> ...`` (bench/README.md lists each
part). Tests may import it; ``icqs_fast`` never does (tests/test_layers.py)."""
