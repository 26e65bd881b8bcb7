"""icqs-fast: fast LLM-based quality scoring (ICQS, glass-box self-evaluation features)."""

from __future__ import annotations

__version__ = "0.1.0"

from .ops import linear_token_stats, token_stats  # noqa: E402
from .types import TokenStats  # noqa: E402

__all__ = [
    "__version__",
    "TokenStats",
    "token_stats",
    "linear_token_stats",
    "ICQSScorer",
    "ICQSResult",
]


def __getattr__(name: str):
    # The scoring engine pulls in transformers; import it only when asked for.
    if name in ("ICQSScorer", "ICQSResult"):
        from . import icqs

        return getattr(icqs, name)
    raise AttributeError(f"module 'icqs_fast' has no attribute {name!r}")
