"""Shared test helpers (tests/ is on sys.path; it is deliberately not a package, so the repository
root - whose kernels/ folder must never be importable as top-level `kernels` - stays off it)."""

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
