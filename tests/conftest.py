"""Test setup. Triton kernels run in Triton's CPU interpreter when there is no GPU; the variable
must be set before anything imports triton, hence here."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from _helpers import DEVICE  # noqa: E402,F401


@pytest.fixture(autouse=True)
def _seeded():
    # Fresh random inputs per test, but reproducible when a failure is rerun.
    torch.manual_seed(1234)
    yield
