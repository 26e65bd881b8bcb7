"""Options declared once: a dataclass field with its flag, default, help and bounds.

    @dataclass(frozen=True)
    class Settings:
        demos_per_set: int = option(8, ge=1, help="demonstrations per set")

        def __post_init__(self) -> None:
            check_declared(self)  # ValueError: "--demos-per-set must be an int >= 1, got 0"

Everything else is derived from the declarations (:func:`declared`): the command-line flags
(:func:`add_declared`), the server's request models (``icqs_fast.serve.
schemas``), the docs' option tables (:func:`options_table`), the resume fingerprint (the
``result`` options) and the flag an error message names. Standard library only, so every layer
may declare its options here.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Iterator, Sequence
from dataclasses import MISSING
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the flags take a parser; the declarations need no argparse
    import argparse

# The key of an option's declaration in its dataclass field's metadata.
OPTION_KEY = "icqs_fast.option"
KINDS = ("int", "float", "bool", "str", "strs", "any")
# --quantization's names (the option is declared in jobs/config.py JobConfig; load_model's
# quantization_kwargs, serve, eval and the lm-eval adapter take the same names). Here, not in
# models.py, because `--help` must not import torch.
QUANTIZATIONS = ("none", "int8", "nf4")
# --device-map's names (declared in jobs/config.py JobConfig, like --quantization): "auto"
# spreads the layers over every visible GPU (transformers' device_map="auto", accelerate).
DEVICE_MAPS = ("none", "auto")


@dataclasses.dataclass(frozen=True)
class Option:
    """The declaration of one option (see :func:`option`)."""

    help: str
    kind: str
    flag: str | bool | None = None  # None: derived from the field name; False: no flag
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    choices: tuple | None = None
    nullable: bool = False
    result: bool = True
    request: bool = False
    metavar: str | None = None
    unit: str | None = None


@dataclasses.dataclass(frozen=True)
class Declared:
    """One declared field of a dataclass, as :func:`declared` yields it."""

    name: str
    option: Option
    default: Any  # the default value (``default_factory()`` called), MISSING if required

    @property
    def flag(self) -> str | None:
        """The command-line flag (``demos_per_set`` -> ``--demos-per-set``); None: no flag."""
        f = self.option.flag
        if f is False:
            return None
        return f if isinstance(f, str) else "--" + self.name.replace("_", "-")

    @property
    def dest(self) -> str | None:
        """The attribute argparse stores the flag's value in (``--self-check-seed`` ->
        ``self_check_seed``): unique as the flags of one command are, where field names of two
        classes may meet (``ScoringSettings.seed``, ``SelfCheckOptions.seed``)."""
        return None if self.flag is None else self.flag.lstrip("-").replace("-", "_")

    @property
    def label(self) -> str:
        """What a message calls the option: its flag, else its field name."""
        return self.flag or self.name

    def check(self, value: Any) -> Any:
        """``value`` checked against the declaration (ints stay ints, a float option's int
        becomes a float, a ``strs`` sequence a tuple); ValueError naming :attr:`label`."""
        return check_value(self.option, self.label, value)


def _kind_of(default: Any) -> str | None:
    if isinstance(default, bool):
        return "bool"
    if isinstance(default, int):
        return "int"
    if isinstance(default, float):
        return "float"
    if isinstance(default, str):
        return "str"
    if isinstance(default, tuple) and all(isinstance(s, str) for s in default):
        return "strs"
    return None


def option(default: Any = MISSING, *, help: str, default_factory: Any = MISSING,  # noqa: A002
           flag: str | bool | None = None, kind: str | None = None, ge: float | None = None,
           gt: float | None = None, le: float | None = None, choices: Sequence | None = None,
           nullable: bool | None = None, result: bool = True, request: bool = False,
           metavar: str | None = None, unit: str | None = None) -> Any:
    """A dataclass field declaring an option.

    Args:
        default / default_factory: as :func:`dataclasses.field`.
        help: one plain sentence for ``--help`` and the docs (no markup; no default: the
            renderers add it).
        flag: the command-line flag; None (default): ``--`` + the name with dashes; False:
            none (the option is set in code or by its own parser).
        kind: "int", "float" (finite), "bool", "str", "strs" (a non-empty sequence of str,
            kept as a tuple; a repeated flag) or "any" (checked by the class itself); default:
            from the default's type.
        ge / gt / le: bounds of an int or float option.
        choices: the allowed values.
        nullable: None is allowed (default: when the default is None).
        result: the option changes a result (it is in the resume fingerprint); False: it
            changes only how the result is computed.
        request: a server request may set it (``/v1/score``'s ``icqs_options``).
        metavar: the value's name in ``--help``.
        unit: the unit, said after the default in ``--help`` and the docs.
    """
    base = default if default is not MISSING else (
        default_factory() if default_factory is not MISSING else None)
    kind = kind or _kind_of(base) or ("str" if choices else None)
    if kind not in KINDS:
        raise TypeError(f"option(): give kind= (one of {KINDS}) for a default of {base!r}")
    decl = Option(help=help, kind=kind, flag=flag, ge=ge, gt=gt, le=le,
                  choices=tuple(choices) if choices is not None else None,
                  nullable=(default is None) if nullable is None else nullable, result=result,
                  request=request, metavar=metavar, unit=unit)
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={OPTION_KEY: decl})


def declared(cls_or_obj: Any) -> Iterator[Declared]:
    """The declared options of a dataclass (class or instance), in field order (fields made
    with a plain :func:`dataclasses.field` are skipped)."""
    for f in dataclasses.fields(cls_or_obj):
        decl = f.metadata.get(OPTION_KEY)
        if decl is None:
            continue
        default = (f.default if f.default is not MISSING else
                   f.default_factory() if f.default_factory is not MISSING else MISSING)
        yield Declared(f.name, decl, default)


def declaration(cls_or_obj: Any, name: str) -> Declared:
    """The declared option ``name`` of a dataclass (KeyError if it has none)."""
    for d in declared(cls_or_obj):
        if d.name == name:
            return d
    raise KeyError(name)


def bounds_text(opt: Option) -> str:
    """The bounds as a message says them (" >= 1", " in (0, 1]")."""
    if opt.ge is not None and opt.le is not None:
        return f" in [{_num(opt.ge)}, {_num(opt.le)}]"
    if opt.gt is not None and opt.le is not None:
        return f" in ({_num(opt.gt)}, {_num(opt.le)}]"
    parts = [f" >= {_num(opt.ge)}" if opt.ge is not None else "",
             f" > {_num(opt.gt)}" if opt.gt is not None else "",
             f" <= {_num(opt.le)}" if opt.le is not None else ""]
    return " and".join(p for p in parts if p)


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else str(v)


def check_value(opt: Option, label: str, value: Any) -> Any:
    """``value`` for the option ``opt`` (normalised: see :meth:`Declared.check`), or ValueError
    "``label`` must be an int >= 1, got 0"."""
    if value is None and opt.nullable:
        return None
    kind = opt.kind
    if kind == "any":
        return value
    ok = True
    if kind == "bool":
        what, ok = "a bool", isinstance(value, bool)
    elif kind == "int":
        what = "an int"
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        what = "a finite number"
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and math.isfinite(value))
        if ok:
            value = float(value)
    elif kind == "str":
        what, ok = "a str", isinstance(value, str)
    else:  # strs
        what = "a non-empty list of str"
        ok = (not isinstance(value, str) and isinstance(value, Sequence) and len(value) > 0
              and all(isinstance(s, str) for s in value))
        if ok:
            value = tuple(value)
    if ok and kind in ("int", "float"):
        ok = ((opt.ge is None or value >= opt.ge) and (opt.gt is None or value > opt.gt)
              and (opt.le is None or value <= opt.le))
    what += bounds_text(opt) if kind in ("int", "float") else ""
    if ok and opt.choices is not None:
        ok = value in opt.choices
        what = "one of " + ", ".join(repr(c) for c in opt.choices)
    if not ok:
        raise ValueError(f"{label} must be {what}, got {value!r}")
    return value


def check_declared(obj: Any) -> None:
    """Check every declared option of the dataclass instance ``obj`` (frozen or not), storing
    the normalised values; ValueError naming the first bad option's flag."""
    for d in declared(obj):
        value = getattr(obj, d.name)
        checked = d.check(value)
        if checked is not value:
            object.__setattr__(obj, d.name, checked)


def default_text(d: Declared) -> str:
    """The default as ``--help`` and the docs say it ("" for a bool switch or a required
    option)."""
    v = d.default
    if v is MISSING or (d.option.kind == "bool" and v is False):
        return ""
    if v is None:
        return "none"
    if isinstance(v, tuple):
        return ", ".join(repr(s) for s in v)
    text = _num(v) if isinstance(v, float) else str(v)
    return text + (f" {d.option.unit}" if d.option.unit else "")


def options_table(cls: Any, *, names: Sequence[str] | None = None) -> str:
    """A markdown table of the declared options of ``cls`` that have a flag (``names``: only
    these fields, in this order): flag, default, meaning."""
    decls = [d for d in declared(cls) if d.flag is not None]
    if names is not None:
        by_name = {d.name: d for d in decls}
        decls = [by_name[n] for n in names if n in by_name]
    rows = ["| option | default | meaning |", "| --- | --- | --- |"]
    for d in decls:
        value = d.flag if d.option.kind == "bool" else f"{d.flag} {metavar(d)}"
        if d.option.choices is not None:
            value = f"{d.flag} {{{','.join(map(str, d.option.choices))}}}"
        meaning = d.option.help.replace("|", "\\|")
        if d.option.result is False:
            meaning += " (not in the resume fingerprint)"
        default = default_text(d)
        rows.append(f"| `{value}` | {f'`{default}`' if default else ''} | {meaning} |")
    return "\n".join(rows) + "\n"


def metavar(d: Declared) -> str:
    """The value's name in ``--help`` and the docs (``N``, ``X``, ``TEXT``)."""
    if d.option.metavar:
        return d.option.metavar
    return {"int": "N", "float": "X", "strs": "TEXT"}.get(d.option.kind, "TEXT")


# --------------------------------------------------------------------------- flags


@dataclasses.dataclass(frozen=True)
class OutputOptions:
    """A flag of many commands that belongs to no settings object, declared once:
    :func:`add_json_argument` adds it (``args.json``)."""

    json: bool = option(False, result=False, help="print one JSON document instead")


def add_json_argument(p: argparse.ArgumentParser | Any, help: str | None = None  # noqa: A002
                      ) -> None:
    """``--json`` (:class:`OutputOptions`); ``help``: what this command prints, in place of
    "print one JSON document instead"."""
    add_declared(p, OutputOptions, helps=None if help is None else {"json": help})


def add_declared(p: argparse.ArgumentParser | Any, cls: Any, *,
                 names: Collection[str] | None = None, exclude: Collection[str] = (),
                 defaults: dict[str, Any] | None = None, required: bool = True,
                 helps: dict[str, str] | None = None) -> None:
    """Add the declared options of the dataclass ``cls`` (:func:`option`) that have
    a flag to ``p`` (a parser or an argument group): ``dest`` is the flag's (``--calibrate``:
    ``args.calibrate``; read them back by field name with :func:`declared_values`), the type,
    choices, default and help come from the declaration. ``names``: only these fields;
    ``exclude``: not these; ``defaults``: other defaults for this command; ``required``
    False: an option without a default is optional here (the command checks it); ``helps``:
    this command's own words for an option (what its ``--json`` prints), in place of the
    declared help. A bool option is a switch that turns it on; a ``strs`` option is repeated
    (unset: the declared default)."""
    for d in declared(cls):
        if d.flag is None or d.name in exclude or (names is not None and d.name not in names):
            continue
        default = (defaults or {}).get(d.name, d.default)
        opt = d.option
        # A None default is explained by the help itself ("none: the model's").
        shown = "" if default is None else (default_text(d) if default == d.default
                                            else str(default))
        text = (helps or {}).get(d.name, opt.help).replace("%", "%%") + (
            f" (default {shown})" if shown else "")
        kw: dict[str, Any] = dict(dest=d.dest, help=text)
        if d.default is MISSING:
            kw["required"] = required
        if opt.kind == "bool":
            kw.update(action="store_true", default=bool(default))
        elif opt.kind == "strs":
            kw.update(action="append", default=None, metavar=metavar(d))
        else:
            kw.update(type={"int": int, "float": float}.get(opt.kind, str), default=default)
            if opt.choices is not None:
                kw["choices"] = list(opt.choices)
            else:
                kw["metavar"] = metavar(d)
        p.add_argument(d.flag, **kw)


def declared_values(args: argparse.Namespace, cls: Any, *,
                    names: Collection[str] | None = None) -> dict[str, Any]:
    """The parsed values of the options :func:`add_declared` added for ``cls`` (by field
    name; a repeated option given no time is left out, so the declared default holds)."""
    out = {}
    for d in declared(cls):
        if d.flag is None or (names is not None and d.name not in names) \
                or not hasattr(args, d.dest):
            continue
        v = getattr(args, d.dest)
        if d.option.kind == "strs" and v is None:
            continue
        out[d.name] = v
    return out


__all__ = ["DEVICE_MAPS", "OPTION_KEY", "QUANTIZATIONS",
           "Declared", "Option", "OutputOptions", "add_declared", "add_json_argument",
           "bounds_text", "check_declared",
           "check_value", "declaration", "declared", "declared_values", "default_text",
           "metavar", "option",
           "options_table"]
