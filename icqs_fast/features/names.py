"""The names of the glass-box features and modes (no torch: the command line checks
``--features`` / ``--mode`` with these before a model loads)."""

from __future__ import annotations

FEATURE_DIRECTION: dict[str, int] = {
    "sent_logprob": +1,
    "softmax_ent": -1,
    "softmax_var": -1,
    "token_prob_var": -1,
    "softmax_combo": -1,
    "attn_ent_avg": -1,
    "attn_ent_min": -1,
    # ensembles (icqs_fast.features.ensembles)
    "unt_exp": +1,
    "unt_var": -1,
}
"""+1: higher value = better response; -1: lower value = better response."""

ALL_FEATURES: tuple[str, ...] = ("sent_logprob", "softmax_ent", "softmax_var", "token_prob_var",
                                 "softmax_combo", "attn_ent_avg", "attn_ent_min")
ATTN_FEATURES = ("attn_ent_avg", "attn_ent_min")
MODES = ("standard", "selfeval-compat")

__all__ = ["ALL_FEATURES", "ATTN_FEATURES", "FEATURE_DIRECTION", "MODES"]
