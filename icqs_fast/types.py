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
        self.resolve()
        return {f.name: getattr(self, f.name) for f in fields(self)}

    # -- deferred checks: what a GPU op would otherwise stop the device queue for ------------
    #
    # On a GPU, ``ops.token_stats`` / ``ops.linear_token_stats`` check the targets on the
    # device and the triton backend leaves the rare float64 ``logprob_var`` fix of rows with a
    # non-finite target logit pending, instead of a host sync per call. Both are settled in
    # :meth:`to_host` from the same one device-to-host copy as the results (a second sync only
    # when a check fails or a fix is due), or by :meth:`resolve` (called by ``as_dict``,
    # ``map``, ``cat`` and a read of ``logprob_var``), so no reader sees an unchecked value.

    def defer_error(self, bad: torch.Tensor, values: torch.Tensor, message: str) -> None:
        """Raise ``ValueError(message.format(i=i, value=values[i]))`` for the first ``i`` with
        ``bad [N]`` bool set, when the results are read (:meth:`to_host` / :meth:`resolve`);
        ``values [N]`` (integer) names the offending input."""
        self.__dict__["_pending_error"] = (bad, values, message)

    def defer_var_fix(self, rows: torch.Tensor, fix) -> None:
        """``logprob_var`` of the rows flagged in ``rows [N]`` bool is to be replaced by
        ``fix(index [R] int64) -> [R]`` when it is read; until then the value is held aside
        (``fix`` keeps the op's inputs alive)."""
        self.__dict__["_pending_var"] = (self.__dict__.pop("logprob_var"), rows, fix)

    def __getattr__(self, name: str):
        # Only reached when ``logprob_var`` is held aside by defer_var_fix (or for a name that
        # does not exist).
        if name == "logprob_var" and "_pending_var" in self.__dict__:
            self.resolve()
            return self.__dict__["logprob_var"]
        raise AttributeError(name)

    def resolve(self, error_any: bool | None = None, var_any: bool | None = None) -> None:
        """Settle the deferred checks on the device (one host sync for both, unless the caller
        passes what it already read: ``error_any`` / ``var_any``)."""
        err = self.__dict__.get("_pending_error")
        var = self.__dict__.get("_pending_var")
        unknown = [p[idx].any() for p, known, idx in ((err, error_any, 0), (var, var_any, 1))
                   if p is not None and known is None]
        if unknown:
            flags = iter(torch.stack(unknown).tolist())
            if err is not None and error_any is None:
                error_any = next(flags)
            if var is not None and var_any is None:
                var_any = next(flags)
        pending = self.__dict__.pop("_pending_error", None)
        if pending is not None:
            bad, values, message = pending
            if error_any is None or error_any:
                idx = bad.nonzero()
                if idx.numel():
                    i = int(idx[0, 0])
                    raise ValueError(message.format(i=i, value=int(values[i])))
        pending = self.__dict__.pop("_pending_var", None)
        if pending is not None:
            var, rows, fix = pending
            if var_any is None or var_any:
                idx = rows.nonzero()[:, 0]
                if idx.numel():
                    var = var.clone()
                    var[idx] = fix(idx).to(var.dtype)
            self.__dict__["logprob_var"] = var

    def to_host(self, names: tuple[str, ...] | None = None) -> TokenStats:
        """The fields ``names`` (default: all) on the CPU in ONE device-to-host copy (packed as
        float64: exact for fp32 values, bools and ranks below 2^53), with the deferred checks
        read from the same copy. Fields not asked for are empty ``[0]`` tensors. Raises the
        deferred ``ValueError`` of an invalid input."""
        return self.to_host_with((), names)[0]

    def to_host_with(self, extra: tuple[torch.Tensor, ...] | list[torch.Tensor],
                     names: tuple[str, ...] | None = None
                     ) -> tuple[TokenStats, list[torch.Tensor]]:
        """:meth:`to_host` and the tensors ``extra`` (any shape, any real dtype, on the same
        device: a batch's other results) in the same one copy; returns the host stats and the
        host extras (float64, shaped as given)."""
        names = tuple(f.name for f in fields(self)) if names is None else tuple(names)
        err = self.__dict__.get("_pending_error")
        var = self.__dict__.get("_pending_var")
        parts = {k: (var[0] if k == "logprob_var" and var is not None else getattr(self, k))
                 for k in names}
        pieces = [t.detach().reshape(-1) for t in parts.values()]
        pieces += [t.detach().reshape(-1) for t in extra]
        if err is not None:
            pieces.append(err[0].any().reshape(1))
        if var is not None:
            pieces.append(var[1].any().reshape(1))
        packed = (torch.cat([t.double() for t in pieces]) if pieces
                  else torch.zeros(0, dtype=torch.float64)).to("cpu")
        flags = packed[len(packed) - (err is not None) - (var is not None):]
        error_any = bool(flags[0]) if err is not None else None
        var_any = bool(flags[-1]) if var is not None else None
        if err is not None or var is not None:
            self.resolve(error_any, var_any)  # raises; the fix needs the device (rare)
        out, at = {}, 0
        for name, t in parts.items():
            host = packed[at:at + t.numel()].reshape(t.shape)
            at += t.numel()
            if name == "logprob_var" and var_any:
                host = self.logprob_var.detach().to("cpu").double()
            out[name] = host.to(t.dtype)
        extras = []
        for t in extra:
            extras.append(packed[at:at + t.numel()].reshape(t.shape))
            at += t.numel()
        empty = torch.empty(0)
        return TokenStats(**{f.name: out.get(f.name, empty) for f in fields(self)}), extras

    def map(self, fn) -> TokenStats:
        """Apply ``fn`` to every field (e.g. reshape or index), returning a new TokenStats."""
        return TokenStats(**{k: fn(v) for k, v in self.as_dict().items()})

    @staticmethod
    def cat(parts: list[TokenStats]) -> TokenStats:
        names = [f.name for f in fields(TokenStats)]
        for p in parts:
            p.resolve()
        return TokenStats(**{n: torch.cat([getattr(p, n) for p in parts]) for n in names})


FLOAT_FIELDS = ("logprob", "entropy", "varentropy", "logprob_var", "max_logprob")


PRODUCTS = ("fp32", "bf16", "bf16x2", "bf16x3")
"""The products of :func:`icqs_fast.ops.linear`, by the kernel's mode number (the index):
``fp32`` one fp32 fused multiply-add per k; ``bf16`` the input rounded to bf16; ``bf16x2`` /
``bf16x3`` the input split into 2 / 3 bf16 terms (3 hold any fp32 value exactly). The weight
is fp32 for ``fp32`` and rounded to bf16 for the others."""


@dataclass(frozen=True)
class PackedLinear:
    """A linear layer's weight packed once for :func:`icqs_fast.ops.linear`.

    Attributes:
        data: the packed weight (the backend's own layout; see ``csrc/linear.cpp``).
        out_features, in_features: ``N`` and ``K`` of the ``[N, K]`` weight it came from.
        products: one of :data:`PRODUCTS`.
        backend: the backend that packed it, and the only one that reads it.
        source: ``(data_ptr, version)`` of the weight when packed, to tell a changed weight.
    """

    data: torch.Tensor
    out_features: int
    in_features: int
    products: str
    backend: str
    source: tuple[int, int]

    def is_current(self, weight: torch.Tensor) -> bool:
        """Whether ``weight`` is still the tensor this was packed from, unchanged."""
        return (weight.data_ptr(), weight._version) == self.source
