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
