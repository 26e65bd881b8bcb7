"""An lm-evaluation-harness model, ``icqs-fast``, with shared-prefix log-likelihoods.

lm-eval's Hugging Face model (``HFLM``) runs one full forward per request (one per context for
one-token continuations): every few-shot request recomputes the few-shot examples, every answer
option recomputes the question. :class:`ICQSFastLM` tokenizes exactly as ``HFLM`` does (its
context / continuation split, BOS policy and left truncation), then scores the requests through
:func:`icqs_fast.engine.continuations.score_continuations`: the contexts' shared leading tokens are
computed once (the prefix bank's token trie) and logits exist only at continuation positions
(``linear_token_stats``, is_greedy from the same pass). On the same model object every
``(loglik, is_greedy)`` equals ``HFLM``'s (tests/test_compat_lm_eval.py).

Use it from Python::

    from icqs_fast.compat.lm_eval import ICQSFastLM
    lm = ICQSFastLM(pretrained="embedded")            # or ICQSFastLM(model=m, tokenizer=tok)
    lm_eval.simple_evaluate(model=lm, tasks=[...])

or from lm-eval's command line. lm-eval 0.4.13 has no plugin discovery for models (its
registry knows only the models listed in ``lm_eval.models``), so ``lm_eval --model icqs-fast``
cannot find an installed package by itself; this module is lm-eval's CLI with the model
registered first::

    python -m icqs_fast.compat.lm_eval --model icqs-fast \\
        --model_args pretrained=embedded,dtype=float32 --tasks ... [any lm_eval option]

The package also declares the ``lm_eval.models`` entry point (``pyproject.toml``) for lm-eval
releases that load model plugins from entry points.
"""

from __future__ import annotations

import copy
import sys
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import lm_eval.models  # noqa: F401 - built-ins first: see register()
import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import model_registry, register_model
from lm_eval.models.utils import (
    DEFAULT_MAX_LENGTH,
    _add_special_kwargs,
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from tqdm import tqdm

from icqs_fast.invariant_linears import parameter_count
from icqs_fast.models import dtype_name

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

MODEL_NAME = "icqs-fast"
# Requests per score_continuations call (it bounds its prefix bank by KV bytes itself; this
# bounds the per-call request lists and sets the progress bar's steps). Requests are sorted by
# context first, so a chunk holds whole groups that share a few-shot prefix; a chunk boundary
# costs one recomputation of the runs shared across it.
DEFAULT_CHUNK_SIZE = 512


class ICQSFastLM(TemplateLM):
    """lm-eval ``LM`` scoring ``loglikelihood`` / ``loglikelihood_rolling`` requests with
    shared-prefix computation and fused token statistics.

    Args:
        pretrained: ``"embedded"`` (or None) for the embedded SmolLM2-135M-Instruct, a local
            Hugging Face folder, a GGUF file (or a folder holding one), a packaged model's
            name (``gemma3-270m``) or a cached hub id (:func:`icqs_fast.models.load_model`).
            Ignored when ``model`` is given.
        model, tokenizer: an already-loaded causal LM and its tokenizer (both or neither), e.g.
            the same objects given to lm-eval's ``HFLM(pretrained=model, tokenizer=tok)``.
        dtype, device: as :func:`icqs_fast.models.load_model` (``"auto"``: bf16 on CUDA, fp32
            on the CPU); a given model is moved to ``device`` unless it is None or "auto". A
            CUDA device without CUDA falls back to the CPU with a warning (lm-eval's CLI
            passes ``cuda:0`` by default).
        backend: token-statistics backend of :func:`icqs_fast.ops.linear_token_stats`
            (``"auto"``, ``"torch"``, ``"cpp"``, ``"triton"``). (lm-eval's own ``backend``
            attribute, ``"causal"``, is the class attribute and is not this.)
        batch_size: accepted because lm-eval's CLI always passes it (default 1); requests are
            batched by token budget, not by count, so it changes nothing.
        chunk_size: requests per :func:`score_continuations` call.
        max_bank_tokens: most context tokens one prefix bank holds (its default if None).
        max_length: model context length; default as ``HFLM`` (config, then tokenizer, then
            2048).
        add_bos_token, prefix_token_id: as ``HFLM``.
        token_budget: tokens per forward of :func:`score_continuations`; its default if None.
        max_gen_toks: default generation length of ``generate_until``.
        deterministic: batch-invariant mode (``--model_args deterministic=True``): each
            request is scored with shapes that depend on it alone
            (:func:`score_continuations` ``deterministic``), so its log-likelihood is
            bit-identical whatever the other requests, their order, ``chunk_size`` and the
            budgets. Slower (one suffix forward per request).
        quantization: ``--model_args quantization=int8`` (or ``nf4``): bitsandbytes weights, as
            ``icqs-fast score --quantization`` (:data:`icqs_fast.models.QUANTIZATIONS`; CUDA
            only, ValueError otherwise). Ignored when ``model`` is given.
        threads: CPU threads (``--model_args threads=1``). When the backend loads its own
            model (lm-eval's CLI: the backend is the job) or ``threads`` is given, it takes the
            ``icqs-fast`` commands' policy (:func:`icqs_fast.threads.apply_job_threads`: the
            cores other processes leave free, re-fitted while it runs; ``OMP_NUM_THREADS``
            when set); with a given model and no ``threads``, the caller's count stands.
    """

    def __init__(
        self,
        pretrained: str | None = "embedded",
        *,
        model: PreTrainedModel | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        dtype: str | torch.dtype = "auto",
        device: str | None = "auto",
        backend: str = "auto",
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        prefix_token_id: int | None = None,
        token_budget: int | None = None,
        max_bank_tokens: int | None = None,
        max_gen_toks: int = 256,
        deterministic: bool | str = False,
        threads: int | None = None,
        quantization: str = "none",
        device_map: str = "none",
    ) -> None:
        super().__init__()
        if model is None or threads is not None:
            from icqs_fast.threads import apply_job_threads

            apply_job_threads(None if threads is None else int(threads))
        if (model is None) != (tokenizer is None):
            raise ValueError("pass both model= and tokenizer= (an already-loaded pair), or neither")
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval's CLI passes device "cuda:0" unless told otherwise; HFLM then falls back
            # to the CPU too.
            warnings.warn(f"device {device!r} requested but CUDA is not available: using the "
                          "CPU", stacklevel=2)
            device = "cpu"
        if model is None:
            from icqs_fast.models import device_map_kwargs, load_model, quantization_kwargs

            name = None if pretrained in (None, "", "embedded") else pretrained
            model, tokenizer = load_model(name, dtype=dtype, device=device or "auto",
                                          **quantization_kwargs(str(quantization),
                                                                device or "auto"),
                                          **device_map_kwargs(str(device_map),
                                                              device or "auto"))
        elif device not in (None, "auto"):
            model = model.to(device)
        if isinstance(tokenizer, str):
            raise TypeError("tokenizer= must be a tokenizer object (pass a path as pretrained=)")
        if int(chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        self._model = model
        self.tokenizer = tokenizer
        self.stats_backend = str(backend)
        self.batch_size_arg = batch_size  # recorded only (see the class docstring)
        self.chunk_size = int(chunk_size)
        self._max_length = int(max_length) if max_length else None
        self.add_bos_token = add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.token_budget = token_budget
        self.max_bank_tokens = max_bank_tokens
        self._max_gen_toks = int(max_gen_toks)
        if isinstance(deterministic, str):  # a model_args string that lm-eval left as text
            if deterministic.strip().lower() not in ("true", "false", "1", "0"):
                raise ValueError(f"deterministic must be True or False, got {deterministic!r}")
            deterministic = deterministic.strip().lower() in ("true", "1")
        self.deterministic = bool(deterministic)
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad if pad is not None else tokenizer.eos_token_id or 0)
        self.requests_scored = 0  # loglikelihood requests (and rolling windows) so far

    # -- lm-eval's LM interface: properties -------------------------------------------------

    @property
    def model(self) -> Any:
        return self._model

    @property
    def device(self) -> torch.device:
        return next(self._model.parameters()).device

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # As HFLM: the token that stands for an empty context (and starts rolling windows).
        if self.custom_prefix_token_id is not None:
            return self.custom_prefix_token_id
        if self.tokenizer.bos_token_id is not None:
            return self.tokenizer.bos_token_id
        return self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        if self._max_length:
            return self._max_length
        return resolve_max_length(self._model.config, self.tokenizer, default=DEFAULT_MAX_LENGTH)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int | str | None:
        return self.batch_size_arg

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "name_or_path", "")).replace("/", "__")

    # -- tokenization (HFLM's rules, so that the ids and hence the numbers are its) ----------

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   left_truncate_len: int | None = None, **kwargs: Any) -> list[int]:
        """Token ids of ``string`` as ``HFLM.tok_encode``: the tokenizer's special tokens unless
        ``add_special_tokens`` / ``add_bos_token`` say otherwise, none when the string already
        starts with the BOS text; optionally the last ``left_truncate_len`` ids only."""
        special = _add_special_kwargs(add_special_tokens, self.add_bos_token)
        if add_special_tokens is None and has_bos_prefix(
                string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False
        ids = self.tokenizer.encode(string, **special)
        if left_truncate_len:
            ids = ids[-left_truncate_len:]
        return ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    # -- scoring ------------------------------------------------------------------------------

    def _loglikelihood_tokens(
        self,
        requests: Sequence[tuple[Any, list[int], list[int]]],
        disable_tqdm: bool = False,
        **kwargs: Any,
    ) -> list[tuple[float, bool]]:
        """``(loglik, is_greedy)`` of each ``(cache_key, context_ids, continuation_ids)``, in
        request order; ``loglik`` is a Python float (fp64 sum of fp32 token log-probs).

        As ``HFLM``: a request longer than ``max_length + 1`` tokens loses context tokens from
        the left (the continuation is kept whole; it must fit in ``max_length``)."""
        from icqs_fast.engine.continuations import score_continuations

        n_max = self.max_length
        prepared: list[tuple[list[int], list[int]]] = []
        for i, (_, ctx, cont) in enumerate(requests):
            if len(ctx) == 0 or len(cont) == 0:
                raise ValueError(f"loglikelihood request {i}: empty context or continuation "
                                 f"token ids ({len(ctx)} context, {len(cont)} continuation)")
            if len(cont) > n_max:
                raise ValueError(f"loglikelihood request {i}: the continuation has {len(cont)} "
                                 f"tokens, more than the model's max_length {n_max}")
            whole = (list(ctx) + list(cont))[-(n_max + 1):]
            prepared.append((whole[: len(whole) - len(cont)], list(cont)))
        # Lexicographic order of the context ids puts requests that share leading tokens next
        # to each other (same context -> adjacent), so each chunk's trie shares the most.
        order = sorted(range(len(prepared)), key=lambda i: prepared[i][0])
        res: list[tuple[float, bool] | None] = [None] * len(prepared)
        bar = tqdm(total=len(prepared), disable=disable_tqdm,
                   desc="Running loglikelihood requests (icqs-fast)")
        for start in range(0, len(order), self.chunk_size):
            idx = order[start: start + self.chunk_size]
            out = score_continuations(self._model, [prepared[i] for i in idx], pad_id=self.pad_id,
                                      backend=self.stats_backend, **self._budget_kwargs())
            self.requests_scored += len(idx)
            for i, r in zip(idx, out, strict=True):
                res[i] = (float(r.loglik), bool(r.is_greedy))
                key = requests[i][0]
                if key is not None:
                    # None keys are rolling windows; loglikelihood_rolling caches their total.
                    self.cache_hook.add_partial("loglikelihood", key, res[i])
            bar.update(len(idx))
        bar.close()
        return res  # type: ignore[return-value]

    def _budget_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = {"deterministic": self.deterministic}
        if self.token_budget is not None:
            kw["token_budget"] = int(self.token_budget)
        if self.max_bank_tokens is not None:
            kw["max_bank_tokens"] = int(self.max_bank_tokens)
        return kw

    def loglikelihood_rolling(self, requests: Sequence[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        """Log-likelihood of each whole string, in ``HFLM``'s rolling windows (first window
        after ``prefix_token_id``, each next one with one token of context, as
        ``get_rolling_token_windows(context_len=1)`` + ``make_disjoint_window``); the windows
        of all requests go through one :meth:`_loglikelihood_tokens` call."""
        windows: list[tuple[None, list[int], list[int]]] = []
        owner: list[int] = []
        strings = [req.args[0] for req in requests]
        for i, string in enumerate(strings):
            for ctx, cont in map(lm_utils.make_disjoint_window,
                                 lm_utils.get_rolling_token_windows(
                                     token_list=self.tok_encode(string),
                                     prefix_token=self.prefix_token_id,
                                     max_seq_len=self.max_length, context_len=1)):
                windows.append((None, ctx, cont))
                owner.append(i)
        scores = self._loglikelihood_tokens(windows, disable_tqdm=disable_tqdm) if windows else []
        totals = [0.0] * len(strings)
        for i, (ll, _) in zip(owner, scores, strict=True):
            totals[i] += ll  # window order, as HFLM sums them
        for string, total in zip(strings, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", (string,), total)
        return totals

    # -- generation (delegated to transformers' generate: correct, not accelerated) ----------

    def _encode_for_generation(self, context: str) -> list[int]:
        # HFLM.tok_batch_encode's special-token rule, for one string.
        special: dict[str, bool] = {}
        if has_bos_prefix(context, getattr(self.tokenizer, "bos_token", None)):
            special = {"add_special_tokens": False}
        elif self.add_bos_token is not None:
            special = {"add_special_tokens": self.add_bos_token}
        return list(self.tokenizer(context, **special)["input_ids"])

    @torch.no_grad()
    def generate_until(self, requests: Sequence[Any], disable_tqdm: bool = False) -> list[str]:
        """Continuations of each ``(context, gen_kwargs)`` by ``model.generate``, one request at
        a time (no padding), cut at the first stop sequence (``until`` plus the EOS text), with
        ``HFLM``'s defaults: greedy unless ``do_sample``, ``max_gen_toks`` new tokens, context
        left-truncated to ``max_length - max_gen_toks``."""
        from lm_eval.models.utils_hf import stop_sequences_criteria

        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        out: list[str] = []
        for req in tqdm(requests, disable=disable_tqdm, desc="generate_until (icqs-fast)"):
            context, gen_kwargs = req.args
            if not isinstance(gen_kwargs, dict):
                raise ValueError(f"generate_until: gen_kwargs must be a dict, got "
                                 f"{type(gen_kwargs).__name__}")
            kwargs = normalize_gen_kwargs(copy.deepcopy(gen_kwargs), self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            max_gen = int(kwargs.pop("max_gen_toks"))
            max_ctx = self.max_length - max_gen
            if max_ctx <= 0:
                raise ValueError(f"generate_until: max_gen_toks {max_gen} must be below the "
                                 f"model's max_length {self.max_length}")
            ids = self._encode_for_generation(context)[-max_ctx:]
            kwargs.pop("max_length", None)
            # As HFLM._model_generate: temperature 0 means greedy, without a temperature arg.
            kwargs["temperature"] = kwargs.get("temperature", 0.0)
            if kwargs["temperature"] == 0.0 and kwargs.get("do_sample") is None:
                kwargs["do_sample"] = False
            if kwargs.get("do_sample") is False and kwargs["temperature"] == 0.0:
                kwargs.pop("temperature")
            inp = torch.tensor([ids], dtype=torch.long, device=self.device)
            gen = self._model.generate(
                input_ids=inp, attention_mask=torch.ones_like(inp), max_length=len(ids) + max_gen,
                stopping_criteria=stop_sequences_criteria(self.tokenizer, until, len(ids), 1),
                pad_token_id=self.tokenizer.pad_token_id, use_cache=True, **kwargs)
            text = self.tok_decode(gen[0, len(ids):].tolist())
            text = postprocess_generated_text(generation=text, stop=until, think_end_token=None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def apply_chat_template(self, chat_history: list[dict[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template over ``chat_history`` (lm-eval's
        ``--apply_chat_template``), as ``HFLM``: retried without system messages when the
        template rejects them."""
        import jinja2

        kw = {"tokenize": False, "add_generation_prompt": add_generation_prompt,
              "continue_final_message": not add_generation_prompt}
        try:
            return self.tokenizer.apply_chat_template(chat_history, **kw)
        except jinja2.exceptions.TemplateError:
            history = [msg for msg in chat_history if msg["role"] != "system"]
            return self.tokenizer.apply_chat_template(history, **kw)

    def get_model_info(self) -> dict[str, Any]:
        """What lm-eval records about the model in its results."""
        n = parameter_count(self._model)
        return {"model_num_parameters": n,
                "model_dtype": dtype_name(self._model),
                "model_name": str(getattr(self._model, "name_or_path", "")),
                "icqs_fast_backend": self.stats_backend,
                "icqs_fast_deterministic": self.deterministic}


def register() -> None:
    """Register :class:`ICQSFastLM` as lm-eval model ``icqs-fast`` (idempotent).

    ``lm_eval.models`` is imported first (top of this module): ``get_model`` imports the
    built-in models only while the registry is empty, so registering ours before them would
    hide ``hf`` and the others."""
    if model_registry.get(MODEL_NAME, None) is not ICQSFastLM:
        register_model(MODEL_NAME)(ICQSFastLM)


def main(argv: Sequence[str] | None = None) -> int:
    """lm-eval's command line with ``icqs-fast`` registered: ``python -m
    icqs_fast.compat.lm_eval --model icqs-fast --model_args pretrained=embedded --tasks ...``."""
    from lm_eval.__main__ import cli_evaluate

    register()
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    cli_evaluate()
    return 0


if __name__ == "__main__":
    # Run as a script this file is module __main__; register the class of the importable
    # module (the one an entry point or a pickle names), not this copy of it.
    from icqs_fast.compat import lm_eval as _self

    sys.exit(_self.main())
else:
    register()

__all__ = ["ICQSFastLM", "MODEL_NAME", "main", "register"]
