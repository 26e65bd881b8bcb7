"""Triton kernels, installed as ``icqs_fast.kernels``. They hold no model logic.

Importing a submodule needs ``triton``; on a machine without a GPU set ``TRITON_INTERPRET=1``
before the import to run the kernels in Triton's CPU interpreter.
"""
