"""``io.strict_json.finite_or_none``: the one NaN / inf -> None cleaner of reports, responses
and result documents (strict JSON has neither)."""

import json
import math

import numpy as np

from icqs_fast.io.strict_json import finite_or_none


def test_non_finite_floats_become_none_at_any_depth():
    doc = {"a": math.nan, "b": [1.5, math.inf, (-math.inf, 2)], "c": {"d": np.float64("nan")},
           "e": "nan", "f": 0, "g": None, "h": True, "i": -0.0}
    out = finite_or_none(doc)
    assert out == {"a": None, "b": [1.5, None, [None, 2]], "c": {"d": None}, "e": "nan",
                   "f": 0, "g": None, "h": True, "i": -0.0}
    json.dumps(out, allow_nan=False)  # strict JSON now
    assert doc["a"] is not None and math.isnan(doc["a"])  # the input is not changed


def test_finite_values_are_kept_as_they_are():
    for v in (0.0, 1e308, -5e-324, 3, "x", None, False):
        assert finite_or_none(v) == v and type(finite_or_none(v)) is type(v)
