"""Build script: the optional pybind11 CPU extension ``icqs_fast._C`` and the package layout.

The extension takes raw pointers and strides from Python (no torch headers), so building it
needs only a C++ compiler and pybind11 - never a torch install inside pip's build environment.
If it fails to build, the package still installs and falls back to the torch backend;
``icqs-fast info`` then says why.
"""

import os
import sys

from setuptools import find_packages, setup
from setuptools.command.build_ext import build_ext

try:
    from pybind11.setup_helpers import Pybind11Extension
except ImportError:  # pragma: no cover - pybind11 is in build-system.requires
    Pybind11Extension = None


class OptionalBuildExt(build_ext):
    """Build extensions, but never fail the install because of them."""

    def run(self):
        try:
            super().run()
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except Exception as exc:  # noqa: BLE001
            self._warn(exc)

    @staticmethod
    def _warn(exc):
        sys.stderr.write(
            f"WARNING: icqs_fast._C was not built ({exc}); the cpp backend is unavailable and "
            "the torch backend will be used on the CPU.\n"
        )


ext_modules = []
sources = sorted(
    os.path.join("csrc", f) for f in (os.listdir("csrc") if os.path.isdir("csrc") else [])
    if f.endswith(".cpp")
)
if Pybind11Extension is not None and sources and os.environ.get("ICQS_FAST_NO_EXT") != "1":
    ext_modules.append(
        Pybind11Extension(
            "icqs_fast._C",
            sources,
            # The shared header: a change rebuilds both files, and the sdist ships it.
            depends=sorted(os.path.join("csrc", f) for f in os.listdir("csrc") if f.endswith(".h")),
            cxx_std=17,
            # -Wno-psabi: the kernel's 64-byte vectors never cross a call (always-inlined helpers).
            extra_compile_args=[
                "-O3", "-fopenmp", "-march=x86-64-v2", "-mtune=native", "-Wno-psabi",
            ]
            if sys.platform.startswith("linux")
            else ["-O3"],
            extra_link_args=["-fopenmp"] if sys.platform.startswith("linux") else [],
        )
    )

setup(
    # Every sub-package of icqs_fast (a hand-written list once shipped without two of them).
    packages=find_packages(include=["icqs_fast", "icqs_fast.*"]) + ["icqs_fast.kernels"],
    # Triton kernels live in the top-level kernels/ folder but install as icqs_fast.kernels:
    # a top-level `kernels` module would shadow the `kernels` package bitsandbytes imports.
    # (From the repository root the folder is on sys.path anyway: kernels/__init__.py then
    # steps aside for any other `kernels`, or fails the import as if absent.)
    package_dir={"icqs_fast.kernels": "kernels"},
    package_data={"icqs_fast.data": ["*.txt", "*.json", "*.jsonl"]},
    ext_modules=ext_modules,
    cmdclass={"build_ext": OptionalBuildExt},
)
