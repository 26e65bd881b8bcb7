"""The run report of ``icqs-fast report``: a run's output read back (:mod:`.run_output`), inline
SVG charts (:mod:`.svg`), the self-contained page (:mod:`.run_report`) and the drift between two
runs (:mod:`.drift`)."""
