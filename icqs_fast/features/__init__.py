"""Glass-box self-evaluation features (``extract``), prompt ensembles (``ensembles``) and the
attention-entropy capture (``attention``); the feature and mode names (``names``, no torch).

The package re-exports the public feature API: ``icqs_fast.features.glassbox`` and friends,
imported on first use (so ``icqs_fast.features.names`` does not pull in torch).
"""

from __future__ import annotations

from icqs_fast.features.names import ALL_FEATURES, MODES

__all__ = [
    "ALL_FEATURES",
    "MODES",
    "ComboScale",
    "GlassboxItem",
    "calibrate",
    "glassbox",
    "illustrate",
]


def __getattr__(name: str):
    if name in __all__:
        from icqs_fast.features import extract

        return getattr(extract, name)
    raise AttributeError(f"module 'icqs_fast.features' has no attribute {name!r}")
