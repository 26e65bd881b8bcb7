"""icqs-fast: fast LLM-based quality scoring (ICQS, glass-box self-evaluation features)."""

from __future__ import annotations

from icqs_fast.ops import linear_token_stats, token_stats  # noqa: E402
from icqs_fast.types import TokenStats  # noqa: E402
from icqs_fast.version import __version__

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
        from icqs_fast.engine import scorer

        return getattr(scorer, name)
    raise AttributeError(f"module 'icqs_fast' has no attribute {name!r}")
