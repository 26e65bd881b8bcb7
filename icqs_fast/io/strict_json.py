"""Values made strict JSON: JSON has no NaN or infinity, so every report, response and result
document that may hold one (a metric over no data, an undefined interval) goes through
:func:`finite_or_none` before it is written."""

from __future__ import annotations

import math
from typing import Any


def finite_or_none(obj: Any) -> Any:
    """``obj`` with every non-finite float (NaN, +-inf; numpy float64 too) replaced by None,
    recursively through dicts, lists and tuples (tuples become lists, as JSON has them); any
    other value is returned as it is."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj
