"""``scorer`` / ``model`` / ``tokenizer`` / ``tok`` parameters carry their real types
(``ICQSScorer``, ``PreTrainedModel`` or ``torch.nn.Module``, ``PreTrainedTokenizerBase``,
imported under ``TYPE_CHECKING``), so a reader or an IDE can follow a value into the engine.
A parameter left ``Any`` (or unannotated) must be listed in :data:`ALLOWED_ANY` with its
reason; at most :data:`MAX_ANY` of them."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NAMES = {"scorer", "model", "tokenizer", "tok"}
MAX_ANY = 10
# "path:function:parameter" -> why it stays Any. Only shrinks.
ALLOWED_ANY: dict[str, str] = {}
UNTYPED = {None, "Any", "typing.Any", "Any | None", "Optional[Any]"}


def untyped_params(source: str, path: str) -> list[str]:
    """``path:function:parameter`` of each parameter named in :data:`NAMES` whose annotation
    is missing or ``Any`` (lambdas cannot be annotated and are left out)."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        a = node.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is None or arg.arg not in NAMES:
                continue
            ann = None if arg.annotation is None else ast.unparse(arg.annotation)
            if ann in UNTYPED:
                out.append(f"{path}:{node.name}:{arg.arg}")
    return out


def _package_untyped() -> list[str]:
    out = []
    for p in sorted((ROOT / "icqs_fast").rglob("*.py")):
        rel = p.relative_to(ROOT).as_posix()
        if rel.startswith("icqs_fast/kernels/"):
            continue
        out += untyped_params(p.read_text(encoding="utf-8"), rel)
    return out


def test_scorer_model_tokenizer_parameters_are_typed():
    found = _package_untyped()
    assert len(ALLOWED_ANY) <= MAX_ANY
    bad = [f for f in found if f not in ALLOWED_ANY]
    assert not bad, "parameters typed Any or not at all (type them, or list them with a " \
                    "reason in ALLOWED_ANY):\n" + "\n".join(bad)
    stale = sorted(set(ALLOWED_ANY) - set(found))
    assert not stale, f"typed now: remove from ALLOWED_ANY: {stale}"


def test_the_scan_catches_an_untyped_parameter():
    """The check itself can fail: Any, a missing annotation and ``Any | None`` are found,
    real types are not."""
    src = ("from typing import Any\n"
           "def f(model: Any, tok, x: Any, *, scorer: Any | None = None): ...\n"
           "class C:\n"
           "    def m(self, tokenizer: 'PreTrainedTokenizerBase', model: Module): ...\n")
    assert untyped_params(src, "m.py") == ["m.py:f:model", "m.py:f:tok", "m.py:f:scorer"]
