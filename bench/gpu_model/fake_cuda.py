"""Fake CUDA for a CPU-only torch: what :mod:`bench.gpu_model.dry_run` runs the package on.

Under ``torch._subclasses.fake_tensor.FakeTensorMode`` a CPU-only torch makes *fake* CUDA
tensors: ``torch.empty(..., device="cuda")`` gives a tensor with a shape, a dtype and the device
``cuda:0`` but no storage; every op propagates shapes, dtypes and devices (the custom ops of
:mod:`icqs_fast.torch_ops` through their fake implementations), and an op that mixes a CUDA
tensor with a CPU tensor raises as it would on a GPU.

:class:`FakeCuda` (a context manager) holds every patch that makes the package believe a GPU is
present (``torch.cuda.is_available`` and a few ``torch.cuda`` queries,
``torch.Generator(device="cuda")``, ``nn.Module._apply`` for fake parameters, ``"cuda"`` ->
``cuda:0`` device arguments) and undoes them when it exits. While it is active a
:class:`Recorder` collects:

* every Triton launch (``JITFunction.run`` intercepted): its arguments must all be CUDA tensors
  or scalars, its grid, threads and (once compiled) shared memory within the device's limits
  (:func:`bench.gpu_model.launches.limit_problems`; :class:`DeviceLimitError` names the
  kernel), its signature, constexprs and 16-divisibility are derived the way Triton's runtime
  specialises them (:func:`launch_of`), and the kernel is compiled for ``rec.arch`` with
  ``triton.compile`` (:class:`bench.gpu_model.compiler.Compiler`) instead of launched;
* host syncs (``.item()``, ``.tolist()``, ``bool(t)``, ``.cpu()``, ``.numpy()``, ``nonzero``, a
  CUDA -> CPU copy, boolean-mask indexing) on a fake CUDA tensor, with their call site and
  count, answered with a placeholder (1, 1.0, False, zeros, an empty selection) so the run goes
  on;
* the aten ops on fake CUDA tensors that would launch a kernel, and the top-level and
  decoder-layer forwards, outside the once-per-model setup (:data:`SETUP_FUNCS`).
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import icqs_fast

CUDA0 = torch.device("cuda", 0)
_PKG = str(Path(icqs_fast.__file__).resolve().parent)
_KERNELS = str(Path(__file__).resolve().parents[2] / "kernels")
# Frames of the fake GPU itself and of the dry run's path runners are not call sites.
_SKIP = frozenset(str(Path(__file__).resolve().with_name(n))
                  for n in ("fake_cuda.py", "dry_run.py"))

_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.float64: "fp64", torch.int64: "i64", torch.int32: "i32",
                 torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1"}


# ----------------------------------------------------------------------------------------------
# Call sites


def _site(skip_torch: bool = True) -> str:
    """The innermost frames of the package (or of transformers / lm_eval, when the call came
    from there) that led here, as ``file:line (fn)`` joined by `` < ``."""
    frames = []
    for fr in reversed(traceback.extract_stack()[:-1]):
        f = fr.filename
        if f in _SKIP:
            continue
        if f.startswith(_PKG) or f.startswith(_KERNELS):
            rel = os.path.relpath(f, os.path.dirname(_PKG))
            frames.append(f"{rel}:{fr.lineno} ({fr.name})")
        elif not frames and ("transformers" in f or "lm_eval" in f):
            frames.append(f"{f.split('site-packages/')[-1]}:{fr.lineno} ({fr.name})")
        if len(frames) == 3:
            break
    return " < ".join(frames) or "?"


# ----------------------------------------------------------------------------------------------
# Triton launches


# Functions that run once per model (the capability check, the capture's per-model mask
# causality): syncs and launches under them are "setup", not part of any batch.
SETUP_FUNCS = frozenset({"model_plan", "mask_causality"})


def in_setup() -> bool:
    """Whether the caller runs under one of :data:`SETUP_FUNCS` of the package (a frame walk,
    cheap enough to run per op)."""
    f = sys._getframe(1)
    while f is not None:
        if f.f_code.co_name in SETUP_FUNCS and f.f_code.co_filename.startswith(_PKG):
            return True
        f = f.f_back
    return False


@dataclass
class Recorder:
    """What a dry run saw: launches, compiles, host syncs, kernel-argument errors, and per path
    the batch forwards and the kernel launches (aten ops on CUDA tensors + Triton), outside
    the once-per-model setup."""

    arch: str = "sm_90"
    compile: bool = True
    path: str = "?"
    launches: list[dict] = field(default_factory=list)
    syncs: Counter = field(default_factory=Counter)
    compiler: Any = None
    forwards: Counter = field(default_factory=Counter)  # path -> top-level model forwards
    aten_launches: Counter = field(default_factory=Counter)  # (path, phase) -> ops
    layer_calls: Counter = field(default_factory=Counter)  # path -> decoder-layer forwards
    layer_launches: Counter = field(default_factory=Counter)  # path -> launches inside them
    depth: int = 0
    layer_depth: int = 0

    def sync(self, op: str) -> None:
        phase = "setup" if in_setup() else "batch"
        self.syncs[(self.path, phase, op, _site())] += 1


def _is_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def launch_of(fn, args: tuple, kwargs: dict, grid) -> tuple[Any, list[str]]:
    """The :class:`~bench.gpu_model.launches.Launch` Triton's runtime would compile for this
    call (signature and constexprs specialised as the JIT does: an int equal to 1 and None
    become constexprs, pointers and multiples of 16 are 16-divisible, except the ints of the
    kernel's ``do_not_specialize``) and the problems of its
    arguments (a CPU tensor passed to a CUDA kernel, a missing argument)."""
    from bench.gpu_model.launches import Launch

    kwargs = dict(kwargs)
    num_warps = int(kwargs.pop("num_warps", 4))
    num_stages = int(kwargs.pop("num_stages", 3))
    names = [p.name for p in fn.params]
    if len(args) > len(names):
        raise TypeError(f"{fn.__name__}: {len(args)} positional arguments for {len(names)} "
                        "parameters")
    values = dict(zip(names, args, strict=False))
    values.update({k: v for k, v in kwargs.items() if k in names})
    problems = [f"{fn.__name__}: no value for parameter {n!r}" for n in names
                if n not in values]
    unknown = sorted(set(kwargs) - set(names))
    if unknown:
        problems.append(f"{fn.__name__}: unknown launch arguments {unknown}")
    sig: dict[str, str] = {}
    const: dict[str, Any] = {}
    div16: list[str] = []
    for p in fn.params:
        v = values.get(p.name)
        if p.is_constexpr:
            sig[p.name], const[p.name] = "constexpr", v
        elif v is None:
            sig[p.name], const[p.name] = "constexpr", None
        elif isinstance(v, torch.Tensor):
            if not _is_cuda(v):
                problems.append(f"{fn.__name__}: argument {p.name!r} is a {v.device.type} "
                                f"tensor (a CUDA kernel needs CUDA tensors)")
            if v.dtype not in _TRITON_TYPES:
                problems.append(f"{fn.__name__}: argument {p.name!r} has dtype {v.dtype}")
            sig[p.name] = "*" + _TRITON_TYPES.get(v.dtype, "fp32")
            if (v.storage_offset() * v.element_size()) % 16 == 0:
                div16.append(p.name)
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            nospec = getattr(p, "do_not_specialize", False)  # @triton.jit(do_not_specialize=)
            if v == 1 and not nospec:
                sig[p.name], const[p.name] = "constexpr", 1
                continue
            sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0 and not nospec and not getattr(
                    p, "do_not_specialize_on_alignment", False):
                div16.append(p.name)
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            problems.append(f"{fn.__name__}: argument {p.name!r} of type {type(v).__name__}")
            sig[p.name] = "constexpr"
            const[p.name] = v
    if callable(grid):
        grid = grid(dict(values))
    grid = tuple(int(g) for g in grid) + (1,) * (3 - len(grid))
    launch = Launch(kernel=fn.__name__, fn=fn, signature=sig, constexprs=const,
                    num_warps=num_warps, num_stages=num_stages, grid=grid, hbm_bytes=0,
                    label=f"w{num_warps}_s{num_stages}", extra={"divisible_by_16": div16})
    return launch, problems


class KernelArgumentError(RuntimeError):
    """A Triton launch whose arguments a GPU run would reject (e.g. a CPU tensor)."""


class DeviceLimitError(KernelArgumentError):
    """A Triton launch past the device's grid, block or shared-memory limits (Triton's own
    launcher does not check them: the GPU answers "invalid argument" mid-job)."""


def _intercept_run(rec: Recorder):
    def run(self, *args, grid, warmup, **kwargs):
        from bench.gpu_model.compiler import compile_key
        from bench.gpu_model.launches import limit_problems
        from bench.gpu_model.model import hardware

        launch, problems = launch_of(self, args, kwargs, grid)
        entry = {"path": rec.path, "phase": "setup" if in_setup() else "batch",
                 "kernel": self.__name__, "grid": list(launch.grid),
                 "signature": {k: v for k, v in launch.signature.items() if v != "constexpr"},
                 "constexprs": {k: v if isinstance(v, (int, float, bool, str, type(None)))
                                else repr(v) for k, v in launch.constexprs.items()},
                 "num_warps": launch.num_warps, "num_stages": launch.num_stages,
                 "site": _site(), "key": repr(compile_key(launch, rec.arch))}
        rec.launches.append(entry)
        if rec.layer_depth and entry["phase"] == "batch":
            rec.layer_launches[rec.path] += 1
        if problems:
            entry["error"] = "; ".join(problems)
            raise KernelArgumentError(entry["error"])
        limits = limit_problems(self.__name__, launch.grid, launch.num_warps)
        if limits:
            entry["error"] = "; ".join(limits)
            raise DeviceLimitError(entry["error"])
        if rec.compile:
            out = rec.compiler(launch, rec.arch)
            entry["compiled"] = "error" not in out
            if "error" in out:
                entry["compile_error"] = out["error"][:500]
            else:
                entry["regs"] = out["res"]["regs"]
                entry["spill_bytes"] = out["res"]["stack"] + out["res"]["local"]
                entry["shared_bytes"] = out["res"]["static_smem"] + out["dynamic_smem"]
                limits = limit_problems(self.__name__, launch.grid, launch.num_warps,
                                        entry["shared_bytes"],
                                        hardware(rec.arch).smem_per_block)
                if limits:
                    entry["error"] = "; ".join(limits)
                    raise DeviceLimitError(entry["error"])
        return None

    return run


# ----------------------------------------------------------------------------------------------
# The fake GPU


def _norm_device(a):
    if isinstance(a, str) and a == "cuda":
        return CUDA0
    if isinstance(a, torch.device) and a.type == "cuda" and a.index is None:
        return CUDA0
    return a


def _placeholder(dtype: torch.dtype):
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point else 1


def _nested(shape, value):
    if not shape:
        return value
    return [_nested(shape[1:], value) for _ in range(shape[0])]


_A = torch.ops.aten


def _split_index(x: torch.Tensor, idx) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
    """``x[idx]`` without the Python binding (whose CUDA device guard a CPU-only torch cannot
    take): the basic part (ints, slices, None, ...) as aten views, the advanced part as
    ``{dim: index tensor}`` for ``aten.index`` / ``aten.index_put_``."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    consuming = sum(1 for i in idx if i is not None and i is not Ellipsis)
    adv: dict[int, torch.Tensor] = {}
    d = 0
    for i in idx:
        if i is None:
            x = _A.unsqueeze.default(x, d)
            d += 1
        elif i is Ellipsis:
            d += x.dim() - d - consuming
        elif isinstance(i, bool):
            raise NotImplementedError("bool index")
        elif isinstance(i, int):
            x = _A.select.int(x, d, int(i))
            consuming -= 1
        elif isinstance(i, slice):
            x = _A.slice.Tensor(x, d, i.start, i.stop, 1 if i.step is None else i.step)
            d += 1
            consuming -= 1
        else:
            t = i if isinstance(i, torch.Tensor) else torch.tensor(i, device=x.device)
            adv[d] = t
            d += 1
            consuming -= 1
    return x, adv


def _getitem(x, idx):
    x, adv = _split_index(x, idx)
    if not adv:
        return x
    return _A.index.Tensor(x, [adv.get(j) for j in range(max(adv) + 1)])


def _setitem(x, idx, value) -> None:
    view, adv = _split_index(x, idx)
    if not isinstance(value, torch.Tensor):
        value = torch.full((), value, dtype=x.dtype, device=x.device)
    if adv:
        _A.index_put_.default(view, [adv.get(j) for j in range(max(adv) + 1)],
                              value.to(x.dtype))
    else:
        _A.copy_.default(view, value)


class _CudaFunctionMode(torch.overrides.TorchFunctionMode):
    """Rewrites ``"cuda"`` device arguments to ``cuda:0`` (a CPU-only torch cannot resolve the
    current CUDA device), routes ``copy_`` / ``__setitem__`` around the Python bindings' CUDA
    device guard, and records host syncs on fake CUDA tensors."""

    def __init__(self, rec: Recorder):
        super().__init__()
        self.rec = rec
        T = torch.Tensor
        self.scalar = {T.item: "item()", T.__bool__: "bool(tensor)", T.__int__: "int(tensor)",
                       T.__float__: "float(tensor)", T.__index__: "tensor as index"}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        args = tuple(_norm_device(a) for a in args)
        kwargs = {k: _norm_device(v) for k, v in kwargs.items()}
        gen = kwargs.pop("generator", None)
        if gen is not None and id(gen) not in _FAKE_GENERATORS:
            kwargs["generator"] = gen
        elif gen is not None:
            dev = torch.device(kwargs.get("device") or "cpu")
            if _FAKE_GENERATORS[id(gen)].type != dev.type:
                raise RuntimeError(f"a cuda generator for a {dev.type} tensor")
        T = torch.Tensor
        self0 = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_cuda = self0 is not None and _is_cuda(self0)
        if func in self.scalar:
            if on_cuda:
                self.rec.sync(self.scalar[func])
            try:
                return func(*args, **kwargs)
            except Exception:  # noqa: BLE001 - a fake tensor has no value: a placeholder
                v = getattr(self0, "_dry_value", _placeholder(self0.dtype))
                cast = {T.__bool__: bool, T.__int__: int, T.__index__: int,
                        T.__float__: float}.get(func)
                return cast(v) if cast is not None else v
        if func in (torch.allclose, T.allclose, torch.equal, T.equal) and (on_cuda or any(
                isinstance(a, torch.Tensor) and _is_cuda(a) for a in args[1:2])):
            # A comparison answered on the host (the capability probes): the check holds.
            self.rec.sync(f"{func.__name__}()")
            return True
        if func is T.tolist:
            if on_cuda:
                self.rec.sync("tolist()")
            try:
                return func(*args, **kwargs)
            except Exception:  # noqa: BLE001
                return _nested(list(self0.shape), _placeholder(self0.dtype))
        if func is T.numpy:
            import numpy as np

            if on_cuda:
                self.rec.sync("numpy()")
            return np.zeros(tuple(self0.shape), dtype=np.float32)
        if func in (T.cpu, T.to, T.copy_) and on_cuda:
            dst = kwargs.get("device") or next((a for a in args[1:] if isinstance(
                a, (str, torch.device))), None)
            if func is T.cpu or (dst is not None and torch.device(dst).type == "cpu"):
                self.rec.sync("cuda -> cpu copy")
        if func is T.copy_ and self0 is not None and len(args) > 1 and _is_cuda(self0) \
                is False and isinstance(args[1], torch.Tensor) and _is_cuda(args[1]):
            self.rec.sync("cuda -> cpu copy_")
        if func in (T.nonzero, torch.nonzero, torch.argwhere, T.argwhere) and on_cuda:
            self.rec.sync("nonzero")
            return torch.zeros((0, self0.dim()), dtype=torch.int64, device=self0.device)
        if func is T.copy_:
            return _A.copy_.default(args[0], args[1], bool(kwargs.get("non_blocking", False)))
        if func is T.contiguous and self0 is not None:
            fmt = kwargs.get("memory_format", args[1] if len(args) > 1 else
                             torch.contiguous_format)
            if self0.is_contiguous(memory_format=fmt):
                return self0
            return _A.clone.default(self0, memory_format=fmt)
        if func is T.cuda:
            return self0.to(CUDA0, non_blocking=bool(kwargs.get("non_blocking", False)))
        if func is T.new_tensor:
            return torch.tensor(args[1], dtype=kwargs.get("dtype") or self0.dtype,
                                device=kwargs.get("device") or self0.device)
        if func is T.__getitem__ and self0 is not None:
            idx = args[1] if isinstance(args[1], tuple) else (args[1],)
            masks = [i for i in idx if isinstance(i, torch.Tensor) and i.dtype == torch.bool]
            if masks:
                if on_cuda or any(_is_cuda(m) for m in masks):
                    self.rec.sync("boolean-mask indexing")
                _check_devices(self0, masks)
                return self0.new_empty((0, *self0.shape[masks[0].dim():]))
            return _getitem(self0, args[1])
        if func is T.__setitem__ and self0 is not None:
            _setitem(self0, args[1], args[2])
            return None
        if func in (T.all, torch.all, T.any, torch.any):
            # Checks read ``bool(ok.all())`` / ``bool(bad.any())``: answer that the check holds.
            out = func(*args, **kwargs)
            out._dry_value = func in (T.all, torch.all)
            return out
        try:
            return func(*args, **kwargs)
        except RuntimeError as exc:
            # The Python binding of this op takes a CUDA device guard, which a CPU-only torch
            # cannot: call the aten op of the same name instead (same schema, no guard).
            if "not linked with support for cuda" not in str(exc):
                raise
            op, args = _aten_of(getattr(func, "__name__", ""), args)
            if op is None:
                raise
            return op(*args, **kwargs)


_DUNDER = {"invert": "bitwise_not", "and": "bitwise_and", "or": "bitwise_or",
           "xor": "bitwise_xor", "neg": "neg", "add": "add", "sub": "sub", "mul": "mul",
           "truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "pow": "pow",
           "matmul": "matmul", "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt",
           "ge": "ge", "abs": "abs", "lshift": "bitwise_left_shift",
           "rshift": "bitwise_right_shift"}


def _aten_of(name: str, args: tuple):
    """The aten op behind a torch function or Tensor method name (dunders included; a
    reflected ``__rsub__`` swaps its operands, an in-place ``__iadd__`` is ``add_``)."""
    if name.startswith("__") and name.endswith("__"):
        base = name[2:-2]
        if base in _DUNDER:
            return getattr(torch.ops.aten, _DUNDER[base]), args
        if base.startswith("r") and base[1:] in _DUNDER and len(args) == 2:
            return getattr(torch.ops.aten, _DUNDER[base[1:]]), (args[1], args[0])
        if base.startswith("i") and base[1:] in _DUNDER:
            return getattr(torch.ops.aten, _DUNDER[base[1:]] + "_", None), args
        return None, args
    return getattr(torch.ops.aten, name, None), args


def _check_devices(t: torch.Tensor, others) -> None:
    for o in others:
        if o.device != t.device:
            raise RuntimeError(f"Expected all tensors to be on the same device, but found at "
                               f"least two devices, {t.device} and {o.device}!")


def _module_apply(self, fn, recurse=True):
    """``nn.Module._apply`` for fake parameters: a new Parameter per tensor (fake tensors
    cannot be swapped in place), tied weights kept tied."""
    memo: dict[int, Any] = {}
    mods = self.modules() if recurse else [self]
    for m in mods:
        for key, p in list(m._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                with torch.no_grad():
                    memo[id(p)] = torch.nn.Parameter(fn(p), requires_grad=p.requires_grad)
            m._parameters[key] = memo[id(p)]
        for key, b in list(m._buffers.items()):
            if b is not None:
                m._buffers[key] = fn(b)
    return self


_REAL_GENERATOR = torch.Generator
_FAKE_GENERATORS: dict[int, torch.device] = {}


class _FakeGenerator(_REAL_GENERATOR):
    """``torch.Generator(device="cuda")`` stand-in: a CPU generator remembered as a CUDA one
    (a CPU-only torch has no CUDA generator); fake tensors hold no values, so the function mode
    checks its device against the tensor's and drops it."""

    def __new__(cls, device="cpu"):
        dev = torch.device(device)
        if dev.type != "cuda":
            return _REAL_GENERATOR(device=dev)
        g = _REAL_GENERATOR()
        _FAKE_GENERATORS[id(g)] = dev
        return g


# aten ops that launch no kernel: views and metadata, allocation, the host read of a scalar.
_NO_KERNEL = frozenset({
    "empty", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense", "detach",
    "alias", "lift_fresh", "lift_fresh_copy", "sym_size", "sym_stride", "sym_numel",
    "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "set_",
    "resize_", "_reshape_alias"})


class _LaunchCounter(TorchDispatchMode):
    """Counts the aten ops on fake CUDA tensors that would launch a kernel on a GPU (one per
    op: a close count for elementwise / reductions / GEMMs; SDPA or a fused op may launch a
    few, a view none)."""

    def __init__(self, rec: Recorder):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in _NO_KERNEL:
            return out
        res = out if isinstance(out, (tuple, list)) else (out,)
        cuda = any(isinstance(t, torch.Tensor) and _is_cuda(t) for t in res)
        if cuda:
            phase = "setup" if in_setup() else "batch"
            self.rec.aten_launches[(self.rec.path, phase)] += 1
            if self.rec.layer_depth and phase == "batch":
                self.rec.layer_launches[self.rec.path] += 1
        return out


def _forward_hooks(rec: Recorder):
    """Global module hooks counting the top-level forwards (a model, or the decoder body the
    engine calls directly) outside the setup: the path's batch forwards."""
    from torch.nn.modules import module as nn_module

    def is_layer(mod) -> bool:
        return type(mod).__name__.endswith("DecoderLayer")

    def pre(mod, args):
        if rec.depth == 0 and hasattr(mod, "config") and not in_setup():
            rec.forwards[rec.path] += 1
        if is_layer(mod):
            rec.layer_depth += 1
            if not in_setup():
                rec.layer_calls[rec.path] += 1
        rec.depth += 1

    def post(mod, args, out):
        rec.depth -= 1
        if is_layer(mod):
            rec.layer_depth -= 1

    return [nn_module.register_module_forward_pre_hook(pre),
            nn_module.register_module_forward_hook(post, always_call=True)]


@contextlib.contextmanager
def FakeCuda(rec: Recorder):  # noqa: N802 - reads as a mode
    """Fake CUDA tensors, a GPU the package believes in, Triton launches compiled for
    ``rec.arch`` instead of run. Everything patched is restored on exit."""
    import triton.runtime.jit as tjit
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    fake_tolist0 = FakeTensor.tolist

    def fake_tolist(self):
        # FakeTensor's own tolist reads element by element (item() each): one sync here, as
        # on a GPU (one copy).
        if not _is_cuda(self):
            return fake_tolist0(self)
        rec.sync("tolist()")
        return _nested(list(self.shape), _placeholder(self.dtype))

    props = SimpleNamespace(name="dry-run (fake) H100", major=9, minor=0,
                            multi_processor_count=132, total_memory=80 * 2**30)
    patches = [
        (torch.cuda, "is_available", lambda: True),
        (torch.cuda, "device_count", lambda: 1),
        (torch.cuda, "current_device", lambda: 0),
        (torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
        (torch.cuda, "get_device_name", lambda device=None: props.name),
        (torch.cuda, "get_device_properties", lambda device=None: props),
        (torch.cuda, "is_bf16_supported", lambda *a, **k: True),
        (torch.cuda, "synchronize", lambda device=None: None),
        (torch.cuda, "empty_cache", lambda: None),
        (torch.cuda, "reset_peak_memory_stats", lambda device=None: None),
        (torch.cuda, "max_memory_allocated", lambda device=None: 0),
        (torch.cuda, "memory_allocated", lambda device=None: 0),
        # The memory plan reads the free memory (80 GB, 70 GB of it free).
        (torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, props.total_memory)),
        (torch, "Generator", _FakeGenerator),
        (FakeTensor, "tolist", fake_tolist),
        (torch.nn.Module, "_apply", _module_apply),
        (tjit.JITFunction, "run", _intercept_run(rec)),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, new in patches:
        setattr(obj, name, new)
    class _Mode(FakeTensorMode):
        # A CPU-only torch: lift constants on the CPU and never initialise CUDA, although
        # torch.cuda.is_available() answers True here.
        avoid_device_init = True

    hooks = _forward_hooks(rec)
    rec.depth = rec.layer_depth = 0
    try:
        with _Mode(allow_non_fake_inputs=True), _LaunchCounter(rec), _CudaFunctionMode(rec):
            yield
    finally:
        for h in hooks:
            h.remove()
        for obj, name, old in saved:
            setattr(obj, name, old)
