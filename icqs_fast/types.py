"""Small result types shared by the ops, their backends and the scoring code."""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch


@dataclass
class TokenStats:
    """Per-token statistics of softmax(z / T) at each row's target; every field is ``[N]``.

    Fields (fp32 unless noted):
        logprob: log softmax(z/T) at the target.
        entropy: H = -sum_v p_v log p_v.
        varentropy: Var_p[-log p] = sum_v p_v (log p_v)^2 - H^2 (clamped at 0).
        logprob_var: unbiased variance of log softmax(z/T) over the vocabulary with uniform
            weights, i.e. ``torch.var(log_softmax(z/T), dim=-1)``; ``-inf`` logits (masked
            vocabulary entries) are left out of this variance instead of turning it into NaN.
        max_logprob: max_v log softmax(z/T).
        is_greedy: bool; target == argmax(z) with ties resolved as ``torch.argmax`` (first index).
        target_rank: int64; how many entries have a strictly larger logit than the target.
        valid: bool; False where target == ignore_index. Every other field is 0 there.
    """

    logprob: torch.Tensor
    entropy: torch.Tensor
    varentropy: torch.Tensor
    logprob_var: torch.Tensor
    max_logprob: torch.Tensor
    is_greedy: torch.Tensor
    target_rank: torch.Tensor
    valid: torch.Tensor

    def as_dict(self) -> dict[str, torch.Tensor]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def map(self, fn) -> TokenStats:
        """Apply ``fn`` to every field (e.g. reshape or index), returning a new TokenStats."""
        return TokenStats(**{k: fn(v) for k, v in self.as_dict().items()})

    @staticmethod
    def cat(parts: list[TokenStats]) -> TokenStats:
        names = [f.name for f in fields(TokenStats)]
        return TokenStats(**{n: torch.cat([getattr(p, n) for p in parts]) for n in names})


FLOAT_FIELDS = ("logprob", "entropy", "varentropy", "logprob_var", "max_logprob")
