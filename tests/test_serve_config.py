"""The server's routes on one module-level router with their server injected (no closures in
``Server.app()``), and ``ServeConfig``'s declared options: bounds checked in the config, the
``serve`` flags derived from the declarations, a bad flag named in a one-line error (exit 2)."""

from __future__ import annotations

import ast
import inspect
import textwrap

import pytest
import torch

from icqs_fast.serve.app import ROUTES, Server, router
from icqs_fast.serve.config import ServeConfig


@pytest.fixture(scope="module")
def tiny_parts(tiny_llama_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    d = tiny_llama_dir()
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(d)


def test_router_holds_every_route():
    """Every route but FastAPI's own schema is on the module-level router."""
    paths = {r.path for r in router.routes}
    assert paths == set(ROUTES) - {"/openapi.json"}


def test_app_defines_no_function_inside():
    """``Server.app()`` builds the app from module-level pieces: no closure, no nested
    handler (a nested def or lambda would bind one server into the route)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(Server.app)))
    nested = [n for n in ast.walk(tree.body[0]) if n is not tree.body[0]
              and isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    assert not nested


@pytest.mark.server
def test_two_servers_each_answer_with_their_own(tiny_parts):
    """The handlers get the server of the app that received the request: two apps from the one
    router in one process answer with their own model id, errors and counters."""
    from starlette.testclient import TestClient

    model, tok = tiny_parts
    a = Server(model, tok, ServeConfig(model_name="a"))
    b = Server(model, tok, ServeConfig(model_name="b", max_queue=70))
    with TestClient(a.app()) as ca, TestClient(b.app()) as cb:
        assert [m["id"] for m in ca.get("/v1/models").json()["data"]] == ["a"]
        assert [m["id"] for m in cb.get("/v1/models").json()["data"]] == ["b"]
        assert cb.get("/health").json()["max_queue"] == 70
        assert ca.get("/health").json()["max_queue"] == 256
        # an error counted by the server that answered it, not the other
        wrong = ca.post("/v1/completions", json={"model": "b", "prompt": "x", "max_tokens": 0,
                                                 "echo": True})
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"
        assert "model_not_found" in ca.get("/metrics").text
        assert "model_not_found" not in cb.get("/metrics").text
        # validation errors are 400s from either app, and /openapi.json has no 422
        assert cb.post("/v1/score", json={"records": 3}).status_code == 400
        spec = cb.get("/openapi.json").json()
        assert not any("422" in op["responses"] for ops in spec["paths"].values()
                       for op in ops.values())


# -- ServeConfig: declared options, bounds in the config, flags derived ---------------------------


def _declared():
    from icqs_fast.options import declared

    return list(declared(ServeConfig))


def test_every_field_is_declared_with_a_flag_and_help():
    import dataclasses

    decls = {d.name: d for d in _declared()}
    assert set(decls) == {f.name for f in dataclasses.fields(ServeConfig)}
    for d in decls.values():
        assert d.flag and d.flag.startswith("--") and d.option.help.strip(), d.name


@pytest.mark.parametrize("name", [d.name for d in _declared()
                                  if d.option.ge is not None])
def test_below_its_bound_is_refused_naming_the_flag(name):
    """Each bounded option, just below its bound, from code as from the command line."""
    from icqs_fast.options import declaration

    d = declaration(ServeConfig, name)
    low = d.option.ge - (1 if d.option.kind == "int" else 0.5)
    other = {"max_prompts": 1} if name == "max_queue" else {}  # at most --max-queue
    bound = rf"(>= {int(d.option.ge)}|in \[{int(d.option.ge)}, .*\])"  # [ge, le] when both
    with pytest.raises(ValueError, match=f"^{d.flag} must be .* {bound}, got"):
        ServeConfig(**{name: low, **other})
    assert getattr(ServeConfig(**{name: d.option.ge, **other}), name) == d.option.ge


@pytest.mark.parametrize("kw, flag", [
    ({"request_timeout": float("nan")}, "--request-timeout"),
    ({"shutdown_timeout": float("inf")}, "--shutdown-timeout"),
    ({"max_queue": 2.5}, "--max-queue"),
    ({"backend": None}, "--backend"),
])
def test_wrong_kinds_are_refused_naming_the_flag(kw, flag):
    with pytest.raises(ValueError, match=f"^{flag} must be"):
        ServeConfig(**kw)


def test_max_prompts_over_max_queue_is_refused_in_the_config():
    with pytest.raises(ValueError, match=r"--max-prompts \(65\) must not exceed --max-queue "
                                         r"\(64\)"):
        ServeConfig(max_prompts=65, max_queue=64)
    assert ServeConfig(max_prompts=64, max_queue=64).max_queue == 64


def _parse(*argv):
    from icqs_fast.cli import build_parser

    args, extra = build_parser(["serve", *argv]).parse_known_args(["serve", *argv])
    assert not extra
    return args


def test_serve_flags_are_derived_from_the_declarations(monkeypatch):
    """Every field has its ``serve`` flag; unset flags give the declared defaults (the model id:
    --model, else 'embedded'; the API key: $ICQS_FAST_API_KEY); set ones reach the config."""
    from icqs_fast.cli.serve import serve_config

    monkeypatch.delenv("ICQS_FAST_API_KEY", raising=False)
    plain = serve_config(_parse())
    assert plain == ServeConfig(model_name="embedded")
    argv, want = [], {}
    for i, d in enumerate(_declared()):
        if d.option.kind in ("int", "float"):
            value = d.default + i + 1
            argv += [d.flag, str(value)]
            want[d.name] = value
    want["max_prompts"] = want["max_queue"]  # at most --max-queue
    argv += ["--max-prompts", str(want["max_prompts"]), "--served-model-name", "m",
             "--api-key", "k", "--backend", "torch"]
    cfg = serve_config(_parse(*argv))
    assert cfg == ServeConfig(**want, model_name="m", api_key="k", backend="torch")
    monkeypatch.setenv("ICQS_FAST_API_KEY", "from-env")
    assert serve_config(_parse("--model", "/some/dir")) == ServeConfig(
        model_name="/some/dir", api_key="from-env")


@pytest.mark.parametrize("argv, message", [
    (["--max-queue", "0"], "--max-queue must be an int >= 1, got 0"),
    (["--max-stop", "-1"], "--max-stop must be an int >= 0, got -1"),
    (["--request-timeout", "nan"], "--request-timeout must be a finite number >= 0, got nan"),
    (["--max-prompts", "100", "--max-queue", "50"], "--max-prompts (100) must not exceed "
     "--max-queue (50)"),
    (["--num-ratios", "1"], "--num-ratios must be an int >= 2, got 1"),
    (["--self-check-max", "-1"], "--self-check-max must be an int >= 0, got -1"),
    (["--port", "70000"], "--port must be in [0, 65535], got 70000"),
])
def test_bad_serve_flag_exits_2_naming_it_before_the_model_loads(argv, message, capsys,
                                                                  monkeypatch):
    from icqs_fast import models
    from icqs_fast.cli import main

    def no_load(*a, **k):
        raise AssertionError("the model loaded before the options were checked")

    monkeypatch.setattr(models, "load_model", no_load)
    assert main(["serve", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("icqs-fast: error: ") and message in err, err
    assert len(err.strip().splitlines()) == 1, err


@pytest.mark.server
def test_server_holds_one_settings_within_its_limits(tiny_parts):
    """The server's ICQS settings (a ScoringSettings or the fields to change) take the engine
    options from its config, a request's options replace fields of them, and settings over the
    config's limits are refused naming both flags."""
    from icqs_fast.engine.settings import ScoringSettings

    model, tok = tiny_parts
    pools = {"good": [("q", "yes")] * 4, "bad": [("q", "no")] * 4}
    cfg = ServeConfig(max_num_ratios=3, backend="torch", token_budget=512)
    with pytest.raises(ValueError, match=r"^--num-ratios 5 is over --max-num-ratios 3$"):
        Server(model, tok, cfg, **pools)
    for given in ({"num_ratios": 3, "seed": 7}, ScoringSettings(num_ratios=3, seed=7)):
        srv = Server(model, tok, cfg, **pools, icqs_options=given)
        st = srv.scoring.settings
        assert (st.num_ratios, st.seed, st.backend, st.token_budget) == (3, 7, "torch", 512)
        assert srv.scoring.settings_for({}) is st
        assert srv.scoring.settings_for({"seed": 1}) == st.replace(seed=1)
        with pytest.raises(ValueError, match="^--demos-per-set must be an int >= 1, got 0"):
            srv.scoring.settings_for({"demos_per_set": 0})


def test_readme_limits_state_the_declared_defaults():
    """The README's *Server limits* table says each flag's default; it must be the declared
    one (the table is written by hand for its 'over it' column)."""
    import re
    from pathlib import Path

    from icqs_fast.options import declared

    text = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    table = text.split("## Server limits", 1)[1].split("\n## ", 1)[0]
    defaults = {d.flag: d.default for d in declared(ServeConfig)}
    stated = re.findall(r"`(--[\w-]+)` \((\d+(?:\.\d+)?)( MiB)?", table)
    assert len(stated) >= 15, stated
    for flag, number, mib in stated:
        assert float(number) * (2**20 if mib else 1) == defaults[flag], flag


def test_a_new_request_option_is_a_serve_flag(monkeypatch, capsys):
    """One declared request option of ScoringSettings (a subclass stands in for the edit) is a
    ``serve`` flag, reaches the server's settings, and out of bounds exits 2 naming it."""
    from dataclasses import dataclass

    from icqs_fast import models
    from icqs_fast.cli import main
    from icqs_fast.cli.serve import served_settings
    from icqs_fast.engine import settings
    from icqs_fast.options import option

    @dataclass(frozen=True)
    class Extended(settings.ScoringSettings):
        novelty: int = option(3, ge=1, le=9, request=True, help="a new option, for this test")

    monkeypatch.setattr(settings, "ScoringSettings", Extended)
    from icqs_fast.cli import build_parser

    assert "--novelty N" in build_parser(["serve"]).commands[("serve",)].format_help()
    got = served_settings(_parse("--novelty", "5", "--num-ratios", "3"))
    assert type(got) is Extended and (got.novelty, got.num_ratios) == (5, 3)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("model loaded"))
    assert main(["serve", "--novelty", "0"]) == 2
    assert "--novelty must be an int in [1, 9], got 0" in capsys.readouterr().err
