"""Test setup. Triton kernels run in Triton's CPU interpreter when there is no GPU; the variable
must be set before anything imports triton, hence here."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Every Ray node a test starts takes 127.0.0.1 as its address (the GCS, raylets, object stores
# and workers listen and connect there only) instead of the machine's interface address: Ray
# reads this when it is imported, hence here, before any test module imports it. The Ray tests
# assert it for every node (tests/test_ray_cluster.py, tests/test_distributed.py).
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # no usage report leaves the machine

import pytest  # noqa: E402
from _helpers import DEVICE  # noqa: E402,F401
from hypothesis import settings  # noqa: E402

# Every hypothesis test, whatever its own @settings add: the same examples on every run and
# machine, nothing stored between runs, no per-example deadline (a busy machine is not a bug).
settings.register_profile("icqs", derandomize=True, database=None, deadline=None)
settings.load_profile("icqs")


@pytest.fixture(autouse=True)
def _seeded():
    # Fresh random inputs per test, but reproducible when a failure is rerun.
    torch.manual_seed(1234)
    yield


@pytest.fixture(autouse=True)
def _own_cache(monkeypatch, tmp_path_factory):
    """Each test its own cache folder (icqs_fast.io.cache; created only when written): a
    self-check cached by one test is never read by another, and nothing goes to ~/.cache."""
    import uuid

    root = tmp_path_factory.getbasetemp() / "cache" / uuid.uuid4().hex
    monkeypatch.setenv("ICQS_FAST_CACHE_DIR", str(root))
    yield


@pytest.fixture(autouse=True)
def _poisoned_kernel_outputs(monkeypatch):
    """Kernel output buffers start as NaN (floats) or a huge negative sentinel (ints), so any
    element a kernel fails to write shows up as a wrong or non-finite result."""
    from icqs_fast.backends import state

    def poisoned(*shape, dtype, device="cpu"):
        fill = float("nan") if dtype.is_floating_point else -(2**40)
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(state, "new_buffer", poisoned)
    yield


def pytest_collection_modifyitems(items):
    """A test that takes the real embedded model through a fixture named ``embedded`` is in
    the ``embedded`` group (docs/TESTING.md) wherever it lives, so a new one cannot slip into
    the fast tier unmarked."""
    for item in items:
        if "embedded" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.embedded)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """``get(layers=1, max_positions=512)``: the folder of :func:`_helpers.save_tiny_llama`'s
    seeded tiny random Llama, saved once per session for each configuration and shared by every
    module that asks for it. Read-only: load it, never write into it."""
    from _helpers import save_tiny_llama

    saved = {}

    def get(layers: int = 1, max_positions: int = 512):
        key = (layers, max_positions)
        if key not in saved:
            d = tmp_path_factory.mktemp(f"tiny-llama-{layers}l-{max_positions}p")
            saved[key] = save_tiny_llama(d, layers=layers, max_positions=max_positions)
        return saved[key]

    return get


@pytest.fixture(scope="session")
def tiny_llama_model():
    """``(model, tokenizer)`` of :func:`_helpers.tiny_llama` (2 layers, hidden 64, GQA 4/2, on
    ``DEVICE``), built once per session. Read-only: a test that changes the model (dtype,
    weights, attention implementation, a hook left on it) builds its own."""
    from _helpers import tiny_llama

    return tiny_llama()


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch CPU thread for a module (``pytestmark = pytest.mark.usefixtures(...)``): two
    OpenMP threads on the shared, oversubscribed 2-core machine are many times slower than one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
