"""Glass-box self-evaluation features (``extract``), prompt ensembles (``ensembles``) and the
attention-entropy capture (``attention``).

The package re-exports the public feature API: ``icqs_fast.features.glassbox`` and friends.
"""

from icqs_fast.features.extract import (
    ALL_FEATURES,
    MODES,
    ComboScale,
    GlassboxItem,
    calibrate,
    glassbox,
    illustrate,
)

__all__ = [
    "ALL_FEATURES",
    "MODES",
    "ComboScale",
    "GlassboxItem",
    "calibrate",
    "glassbox",
    "illustrate",
]
