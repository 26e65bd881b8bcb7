"""Triton kernels, installed as ``icqs_fast.kernels``. They hold no model logic.

Importing a submodule needs ``triton``; on a machine without a GPU set ``TRITON_INTERPRET=1``
before the import to run the kernels in Triton's CPU interpreter.

This folder is a package only under the name ``icqs_fast.kernels``. Python started from the
repository root has the root first on ``sys.path``, so ``import kernels`` (which bitsandbytes
tries, for the Hugging Face ``kernels`` package) would find this folder first. Imported under any
other name, it steps aside: the import resolves to the next ``kernels`` on ``sys.path`` or, when
there is none, to an empty package with no submodules - what an empty folder would give. So
``from kernels import get_kernel`` raises ImportError (bitsandbytes catches that) and
``import kernels`` itself succeeds (transformers finds the folder with ``find_spec`` and then
imports it, so failing there would break ``import transformers`` features from the root).
"""

if __name__ != "icqs_fast.kernels":

    def _step_aside(name: str) -> None:
        import importlib.util
        import os
        import sys
        from importlib.machinery import PathFinder

        root = os.path.realpath(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

        def elsewhere(entry) -> bool:
            try:
                return os.path.realpath(entry or os.getcwd()) != root
            except (TypeError, ValueError, OSError):
                return True

        spec = None
        if "." not in name:
            spec = PathFinder.find_spec(name, [p for p in sys.path if elsewhere(p)])
        if spec is None or spec.loader is None:
            # Nothing else to defer to: stay an empty package (no submodules, no names).
            globals()["__path__"] = []
            return
        # The import system returns whatever sys.modules holds under `name` once this file has
        # run: put the other package there.
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            sys.modules.pop(name, None)
            raise

    _step_aside(__name__)
    del _step_aside
