"""Checks on a model and on the responses given to the engine: the capability check's plan
(:mod:`icqs_fast.engine.capability`), the context length, and one response's type.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# --------------------------------------------------------------------------- shared helpers
# (the naive reference uses model_max_length, parse_response and summarise; it tokenizes the
# prompts with its own code, so a seam difference in the engine's tokenization shows in tests)


def model_max_length(model: PreTrainedModel, max_length: int | None) -> int | None:
    """The longest prompt the model takes: ``max_length`` if given, capped by the config's
    ``max_position_embeddings`` / ``n_positions``; None if neither is known."""
    from icqs_fast.engine.layout import text_config

    cfg = text_config(model.config)
    lim = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)
    if not isinstance(lim, int) or lim < 2:  # XLNet: -1 (relative positions, no limit)
        lim = None
    if max_length is not None:
        if not isinstance(max_length, int) or max_length < 2:
            raise ValueError(f"max_length must be an int >= 2, got {max_length!r}")
        return min(max_length, lim) if lim else max_length
    return int(lim) if lim else None


def check_model(model: PreTrainedModel) -> Any:
    """The engine's :class:`~icqs_fast.engine.capability.ModelPlan` for ``model`` (its path,
    decoder body and head epilogue; see :func:`icqs_fast.engine.capability.model_plan`). Never
    refuses a causal LM: a model the prefix bank or the fused head cannot serve exactly gets the
    plain path.

    Raises:
        TypeError: when the model has no output embeddings (LM head) at all.
    """
    from icqs_fast.engine.capability import model_plan

    return model_plan(model)


def parse_response(i: int, item: Any, *, noun: str = "response", allow_empty: bool = False
                   ) -> tuple[str, str]:
    """Validate the i-th response: an (x, y) pair or a dict with "x" and "y", both str, y
    non-empty unless ``allow_empty``; errors start with ``"{noun} {i}: "``."""
    if isinstance(item, dict):
        missing = [k for k in ("x", "y") if k not in item]
        if missing:
            raise ValueError(f"{noun} {i}: missing field(s) {missing} (need 'x' and 'y')")
        x, y = item["x"], item["y"]
    elif isinstance(item, (tuple, list)) and len(item) == 2:
        x, y = item
    else:
        raise TypeError(f"{noun} {i}: expected an (x, y) pair or a dict with 'x'/'y', "
                        f"got {type(item).__name__}")
    for name, v in (("x", x), ("y", y)):
        if not isinstance(v, str):
            raise TypeError(f"{noun} {i}: field '{name}' must be a str, got {type(v).__name__}")
    if y == "" and not allow_empty:
        raise ValueError(f"{noun} {i}: field 'y' is empty (nothing to score)")
    return x, y
