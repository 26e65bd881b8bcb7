"""Built-in data: the demo files and the demo's prompt template.

The files (written for this project, shipped with the package):

* ``demo_good.jsonl`` / ``demo_bad.jsonl``: 24 headlines each, with the right sentiment
  (good demonstrations) or the opposite one (bad demonstrations);
* ``demo_financial.jsonl``: 16 other headlines with an answer to score, 8 right and 8 wrong
  (field ``quality``: ``"good"`` / ``"bad"``).
"""

from __future__ import annotations

from importlib import resources

from icqs_fast.engine.prompts import Template

TEMPLATE = Template(
    system="Sentiment of financial news headlines (positive or negative).\n\n",
    demo="Headline: {x}\nSentiment: {y}\n",
    query="Headline: {x}\nSentiment:",
    response=" {y}\n",
    separator="\n",
)


def data_file(name: str) -> str:
    """Path of a built-in data file."""
    return str(resources.files("icqs_fast.data").joinpath(name))
