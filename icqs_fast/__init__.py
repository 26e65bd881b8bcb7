"""icqs-fast: fast LLM-based quality scoring (ICQS, glass-box self-evaluation features)."""

from __future__ import annotations

from icqs_fast.version import __version__

__all__ = [
    "__version__",
    "TokenStats",
    "token_stats",
    "linear_token_stats",
    "ICQSScorer",
    "ICQSResult",
]

# Everything but the version is imported on first use (module __getattr__), so that
# ``import icqs_fast`` - and ``icqs-fast --help`` - does not pull in torch / transformers.
_LAZY = {
    "TokenStats": "icqs_fast.types",
    "token_stats": "icqs_fast.ops",
    "linear_token_stats": "icqs_fast.ops",
    "ICQSScorer": "icqs_fast.engine.scorer",
    "ICQSResult": "icqs_fast.engine.scorer",
}


def __getattr__(name: str):
    modname = _LAZY.get(name)
    if modname is None:
        raise AttributeError(f"module 'icqs_fast' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(modname), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
