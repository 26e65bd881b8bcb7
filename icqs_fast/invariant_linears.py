"""Batch-invariant linear layers for a CPU model: every decoder ``nn.Linear`` multiplied
through :func:`icqs_fast.ops.linear` with its weight packed once and held once
(:func:`use_invariant_linears`), so that a row's output is the same bits whatever shares its
forward. :mod:`icqs_fast.models` switches every CPU model it loads.
"""

from __future__ import annotations

import types
import weakref
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from icqs_fast import ops

if TYPE_CHECKING:
    from icqs_fast.types import PackedLinear

# module -> its PackedLinear (ops.pack_linear), for use_invariant_linears' forward
_PACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def exact_bf16_products() -> str:
    """The products of a bf16-valued weight at fp32 precision, the faster of the two here:
    ``"bf16x3"`` (the input as 3 bf16 terms: exact products) where the C++ kernel runs them
    on AMX tiles, else ``"fp32"``."""
    from icqs_fast.backends import cpp_backend

    ok, _ = cpp_backend.available()
    return "bf16x3" if ok and cpp_backend.linear_level("bf16x3") == "amx" else "fp32"


def _packed_now(self: Any) -> PackedLinear | None:
    """The packed weight a switched layer's products read now; None once its weight changed
    (it then takes its own product). Installed as the layer's ``packed_now`` method, for a
    forward that multiplies two layers' weights in one call (``ops.linear(x, g, up=u)``)."""
    packed = _PACKED.get(self)
    held = isinstance(self, _PackedOnlyLinear)  # its weight is the packed copy: current
    return packed if packed is not None and (held or packed.is_current(self.weight)) else None


def _invariant_linear(self: Any, x: torch.Tensor) -> torch.Tensor:
    packed = _packed_now(self)
    if packed is None or torch.is_grad_enabled() or x.device.type != "cpu":
        # With autograd, or a weight changed since it was packed: the module's own product.
        return torch.nn.Linear.forward(self, x)
    return ops.linear(x, packed, self.bias).to(x.dtype)


class _PackedOnlyLinear(torch.nn.Linear):
    """An ``nn.Linear`` switched by :func:`use_invariant_linears` that holds its weight once, in
    the packed form the products read. Whatever asks for the weight gets it back: reading
    ``.weight``, assigning one, loading a state dict or moving the module (``.to``) first turn it
    back into a plain switched ``nn.Linear`` holding an equal weight of its own beside the
    packed copy (which then steps aside once the weight changes, as on any switched layer).
    ``state_dict`` holds an equal copy without holding it again."""

    @property
    def weight(self) -> torch.nn.Parameter:  # type: ignore[override]
        _hold_weight_again(self)
        return self.weight

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "weight":
            _hold_weight_again(self)
        torch.nn.Module.__setattr__(self, name, value)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        d = self.__dict__
        destination[prefix + "weight"] = ops.unpack_linear(d["_packed"]).to(d["_weight_dtype"])

    def _load_from_state_dict(self, *args: Any, **kwargs: Any) -> None:
        _hold_weight_again(self)
        torch.nn.Linear._load_from_state_dict(self, *args, **kwargs)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        _hold_weight_again(self)
        return torch.nn.Linear._apply(self, fn, recurse)


def parameter_count(model: torch.nn.Module) -> int:
    """The parameters of ``model``, each once, the weights its switched layers hold packed
    (:func:`use_invariant_linears`) included: what ``sum(p.numel() for p in
    model.parameters())`` gave before they were switched."""
    held = sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(m, _PackedOnlyLinear))
    return held + sum(p.numel() for p in model.parameters())


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes ``model``'s weights take: its parameters, each once, and the packed copies of
    its switched layers (a layer that holds its weight once counts only the packed one)."""
    packed = sum(p.data.numel() * p.data.element_size() for m in model.modules()
                 if (p := _PACKED.get(m)) is not None)
    return packed + sum(p.numel() * p.element_size() for p in model.parameters())


def _hold_weight_again(m: torch.nn.Module) -> None:
    """A :class:`_PackedOnlyLinear` back to a switched ``nn.Linear`` with a weight of its own
    (unpacked: equal), its packed copy current for that weight; anything else is left alone."""
    if not isinstance(m, _PackedOnlyLinear):
        return

    d = m.__dict__
    packed, dtype, grad = d.pop("_packed"), d.pop("_weight_dtype"), d.pop("_weight_grad")
    m.__class__ = torch.nn.Linear
    weight = torch.nn.Parameter(ops.unpack_linear(packed).to(dtype), requires_grad=grad)
    m.register_parameter("weight", weight)
    _PACKED[m] = replace(packed, source=(weight.data_ptr(), weight._version))


def use_invariant_linears(model: torch.nn.Module, products: str = "fp32", *,
                          hold_once: bool = True) -> int:
    """Have the plain ``nn.Linear`` layers inside ``model``'s module lists (the decoder's)
    multiply through :func:`icqs_fast.ops.linear` with their weights packed once
    (``products``: one of :data:`icqs_fast.types.PRODUCTS`), so that a row's output is the same
    bits whatever shares its forward: a library GEMM picks its kernel by the row count (MKL's
    fp32 path differs at 1-7 rows). Needs the C++ extension (the cpp backend); without it
    nothing is switched. 16-bit inputs widen exactly and the output returns to the input's
    dtype; with autograd on, or once a weight has changed, a layer takes its own product.

    Memory: with ``hold_once`` a layer whose weight the packing holds exactly (fp32 products;
    bf16 products of bf16-valued weights, as :func:`to_bf16_mixed` makes them) drops its own
    copy and keeps only the packed one, 4 bytes per weight for ``fp32`` products, 2 for the
    others (``.weight`` then reads back an equal copy; see :class:`_PackedOnlyLinear`). A
    weight that ties the layer to another module, or one the packing rounds, is kept, and
    the packed copy is extra. Returns the layers switched.
    """
    from icqs_fast.backends import cpp_backend

    if not cpp_backend.available()[0]:
        return 0
    # A parameter that appears twice (tied) is held by another module too: it stays.
    seen: set[int] = set()
    tied: set[int] = set()
    for _, p in model.named_parameters(remove_duplicate=False):
        (tied if id(p) in seen else seen).add(id(p))
    done = 0
    for lst in model.modules():
        if not isinstance(lst, torch.nn.ModuleList):
            continue
        for m in lst.modules():
            if (type(m) is not torch.nn.Linear or m in _PACKED
                    or m.weight.device.type != "cpu" or not m.weight.is_floating_point()):
                continue
            packed = ops.pack_linear(m.weight, products, backend="cpp")
            _PACKED[m] = packed
            m.forward = types.MethodType(_invariant_linear, m)
            m.packed_now = types.MethodType(_packed_now, m)
            done += 1
            if hold_once and id(m.weight) not in tied and _packs_exactly(m.weight, products):
                w = m._parameters.pop("weight")
                m.__dict__.update(_packed=packed, _weight_dtype=w.dtype,
                                  _weight_grad=w.requires_grad)
                m.__class__ = _PackedOnlyLinear
    return done


def _packs_exactly(weight: torch.Tensor, products: str) -> bool:
    """Whether packing ``weight`` for ``products`` kept every value (fp32 holds any fp32 / bf16
    / fp16 value; bf16 products round other values), checked in blocks of rows: a whole-weight
    temporary, freed at once, left the allocator holding more than the weight saves."""
    if products == "fp32" or weight.dtype == torch.bfloat16:
        return True
    for i in range(0, weight.shape[0], 16):
        rows = weight[i:i + 16]
        if not torch.equal(rows.bfloat16().to(rows.dtype), rows):
            return False
    return True


def uses_packed_weights(module: Any) -> bool:
    """Whether :func:`use_invariant_linears` switched ``module`` (its weight packed)."""
    return module in _PACKED
