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
def _poisoned_kernel_outputs(monkeypatch):
    """Kernel output buffers start as NaN (floats) or a huge negative sentinel (ints), so any
    element a kernel fails to write shows up as a wrong or non-finite result."""
    from icqs_fast.backends import state

    def poisoned(*shape, dtype, device="cpu"):
        fill = float("nan") if dtype.is_floating_point else -(2**40)
        return torch.full(shape, fill, dtype=dtype, device=device)

    monkeypatch.setattr(state, "new_buffer", poisoned)
    yield


@pytest.fixture(scope="module")
def one_torch_thread():
    """One torch CPU thread for a module (``pytestmark = pytest.mark.usefixtures(...)``): two
    OpenMP threads on the shared, oversubscribed 2-core machine are many times slower than one."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
