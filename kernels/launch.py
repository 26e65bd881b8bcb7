"""Whether Triton runs kernels in its CPU interpreter (the one such check: the backends and the
launchers ask here)."""

from __future__ import annotations

import os
import sys


def triton_interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter: ``TRITON_INTERPRET`` set (not 0),
    or Triton's own ``knobs.runtime.interpret`` switched on in code (triton >= 3.4; read only
    when triton is already imported, so asking costs no import). The one such check: the
    backends, the launchers and the benchmarks all ask here."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return True
    knobs = getattr(sys.modules.get("triton"), "knobs", None)
    return bool(getattr(getattr(knobs, "runtime", None), "interpret", False))
