"""Packaging facts: the kernels live under icqs_fast.kernels, the package works without the
extension, and `icqs-fast info` reports the backends."""

import importlib.util
import json
import math
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import icqs_fast
from icqs_fast import backends, ops

REPO = pathlib.Path(__file__).resolve().parents[1]


_FROM_ROOT = r"""
import json, sys
out = {}
try:
    import kernels
except ImportError as exc:
    out["kernels"] = type(exc).__name__
else:
    out["kernels"] = list(kernels.__path__) if not kernels.__path__ else kernels.__file__
try:
    from kernels import get_kernel
except ImportError:
    out["get_kernel"] = "ImportError"
else:
    out["get_kernel"] = get_kernel()
import icqs_fast.kernels.attention_entropy, icqs_fast.kernels.linear_token_stats
import icqs_fast.kernels.token_stats
out["ours"] = [sys.modules[m].__file__ for m in
               ("icqs_fast.kernels", "icqs_fast.kernels.token_stats")]
from transformers import LlamaConfig  # transformers probes `kernels` (find_spec + import)
out["transformers"] = "ok"
print(json.dumps(out))
"""


def _run_from_root(**env):
    out = subprocess.run([sys.executable, "-c", _FROM_ROOT], capture_output=True, text=True,
                         cwd=REPO, env={**os.environ, **env})
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.subprocess
def test_kernels_are_namespaced(tmp_path):
    spec = importlib.util.find_spec("icqs_fast.kernels")
    assert spec is not None and pathlib.Path(spec.origin).parent.name == "kernels"
    # A top-level `kernels` module of ours would shadow the package bitsandbytes imports.
    top = subprocess.run(
        [sys.executable, "-c",
         "import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)"],
        capture_output=True, text=True, cwd="/", check=True,
    ).stdout.strip()
    assert str(REPO) not in top, f"top-level `kernels` resolves to our folder: {top}"

    # From the repository root (first on sys.path there), `import kernels` must not give our
    # kernels either: it is an empty package, as an empty folder would be (no submodules, so
    # `from kernels import get_kernel` is an ImportError, which bitsandbytes catches) ...
    ours = REPO / "kernels"
    res = _run_from_root(PYTHONPATH="")
    assert res["kernels"] == []
    assert res["get_kernel"] == "ImportError", res
    assert res["transformers"] == "ok", res
    # ... while icqs_fast.kernels still imports its kernel modules from the folder.
    assert [pathlib.Path(f) for f in res["ours"]] == [ours / "__init__.py",
                                                      ours / "token_stats.py"], res

    # An installed `kernels` package (later on sys.path than the root) is the one imported.
    other = tmp_path / "site" / "kernels"
    other.mkdir(parents=True)
    (other / "__init__.py").write_text("def get_kernel():\n    return 'installed'\n")
    res = _run_from_root(PYTHONPATH=str(tmp_path / "site"))
    assert res["kernels"] == str(other / "__init__.py"), res
    assert res["get_kernel"] == "installed", res
    assert pathlib.Path(res["ours"][1]) == ours / "token_stats.py", res


@pytest.mark.subprocess
def test_falls_back_without_extension():
    """With icqs_fast._C unimportable, the package imports, cpp reports why (the import error),
    auto picks torch, and token_stats still computes the right values."""
    code = (
        "import json, sys; sys.modules['icqs_fast._C'] = None\n"
        "import torch, icqs_fast\n"
        "from icqs_fast import backends\n"
        "ok, why = backends.availability()['cpp']\n"
        "z = torch.tensor([[0.0, 1.0, 2.0], [3.0, -1.0, 0.5]])\n"
        "s = icqs_fast.token_stats(z, torch.tensor([2, 1]))\n"
        "print(json.dumps({'ok': ok, 'why': why, 'logprob': s.logprob.tolist(),\n"
        "                  'auto': backends.resolve('auto', torch.device('cpu'))}))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["ok"] is False and "import" in res["why"].lower(), res
    assert res["auto"] == "torch"
    want = [2 - math.log(1 + math.e + math.e**2), -1 - math.log(math.e**3 + math.e**-1
                                                               + math.e**0.5)]
    assert res["logprob"] == pytest.approx(want, abs=1e-6)


@pytest.mark.subprocess
def test_info_json_lists_backends():
    """`icqs-fast info --json` in a subprocess reports what this process finds."""
    out = subprocess.run([sys.executable, "-m", "icqs_fast.cli", "info", "--json"],
                         capture_output=True, text=True, check=True)
    info = json.loads(out.stdout)
    assert info["icqs_fast"] == icqs_fast.__version__
    assert info["torch"] == torch.__version__
    here = backends.availability()
    assert set(info["backends"]) == set(here) == {"torch", "cpp", "triton"}
    for name, (ok, _) in here.items():
        assert info["backends"][name]["available"] is ok, name
        assert isinstance(info["backends"][name]["reason"], str)
        assert info["backends"][name]["reason"], name


def test_cpp_extension_is_built():
    """CI builds the extension: a missing compiler or a build error must fail here, loudly."""
    ok, why = backends.availability()["cpp"]
    assert ok, f"cpp backend unavailable: {why}"
    assert backends.resolve("auto", torch.device("cpu")) == "cpp"


def test_auto_matches_float64():
    """backend="auto" on CPU tensors: every field against a direct float64 computation."""
    z = torch.randn(4, 300) * 3
    t = torch.randint(0, 300, (4,))
    a = ops.token_stats(z, t)
    lp = torch.log_softmax(z.double(), -1)
    p = lp.exp()
    ent = -(p * lp).sum(-1)
    want = {
        "logprob": lp.gather(1, t[:, None])[:, 0],
        "entropy": ent,
        "varentropy": (p * (lp + ent[:, None]) ** 2).sum(-1),
        "logprob_var": lp.var(-1),
        "max_logprob": lp.amax(-1),
    }
    for name, w in want.items():
        torch.testing.assert_close(getattr(a, name).double(), w, atol=2e-5, rtol=1e-5,
                                   msg=name)
    zt = z.gather(1, t[:, None])
    assert torch.equal(a.target_rank, (z > zt).sum(-1))
    assert torch.equal(a.is_greedy, z.argmax(-1) == t)
    assert a.valid.all()


@pytest.mark.subprocess
def test_wheel_holds_every_subpackage_and_its_commands_run(tmp_path):
    """`pip wheel .` ships every sub-package of icqs_fast (and the kernels as icqs_fast.kernels);
    installed from that wheel alone (not the editable checkout), `score --help` (with the --ray
    options) and `audit --help` run."""
    env = {**os.environ, "ICQS_FAST_NO_EXT": "1", "PIP_NO_INPUT": "1"}
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(tmp_path / "dist"), str(REPO)],
                   check=True, capture_output=True, env=env, cwd=tmp_path)
    (wheel,) = (tmp_path / "dist").glob("icqs_fast-*.whl")
    import zipfile

    names = set(zipfile.ZipFile(wheel).namelist())
    want = {p.relative_to(REPO).as_posix() for p in (REPO / "icqs_fast").rglob("__init__.py")}
    want |= {"icqs_fast/kernels/__init__.py", "icqs_fast/data/demo_good.jsonl"}
    assert want <= names, sorted(want - names)
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    "--target", str(site), str(wheel)], check=True, capture_output=True,
                   env=env)
    run_env = {**env, "PYTHONPATH": str(site)}
    where = subprocess.run([sys.executable, "-c", "import icqs_fast; print(icqs_fast.__file__)"],
                           capture_output=True, text=True, env=run_env, cwd=tmp_path, check=True)
    assert where.stdout.strip().startswith(str(site))
    for cmd, must in ((["score", "--help"], "--ray"), (["audit", "--help"], "--task")):
        out = subprocess.run([sys.executable, "-m", "icqs_fast.cli", *cmd], capture_output=True,
                             text=True, env=run_env, cwd=tmp_path)
        assert out.returncode == 0, out.stderr
        assert must in out.stdout
