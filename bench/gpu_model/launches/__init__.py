"""Launch descriptions: what a backend would launch on a GPU, as plain data (no tensors).

Each kernel has a module here (:mod:`.token_stats`, :mod:`.linear_token_stats`,
:mod:`.attention_entropy`) whose ``gpu_launches(...) -> list[Launch]`` is built from the same
launch-settings function the kernel's launcher uses, so the static compiler
(``python -m bench.gpu_model.static``) compiles exactly the configurations a GPU run picks. The
workload fields are what the performance model (:mod:`bench.gpu_model.model`) needs besides the
SASS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Launch:
    """One kernel launch.

    Attributes:
        kernel: short name of the operation, e.g. ``"token_stats"``.
        fn: the ``@triton.jit`` function.
        signature: every parameter of ``fn`` in order -> Triton type (``"*bf16"``, ``"*fp32"``,
            ``"*i64"``, ``"i32"``, ``"i64"``, ``"fp32"``) or ``"constexpr"``.
        constexprs: value of each ``constexpr`` parameter.
        num_warps, num_stages: launch options.
        grid: programs per grid axis (3 entries).
        hbm_bytes: compulsory DRAM traffic of the whole launch (each input byte read once,
            each output byte written once), a lower bound on its memory time.
        tensor_flops: ``tl.dot`` FLOPs of the whole launch (``2 M N K``); 0 when none.
        elements: the logits / scores the launch reduces (for per-element figures).
        loop_iters: trip count of the hot (innermost) loop per program, averaged over programs.
        loop_elements: elements one program handles per hot-loop iteration.
        outer_iters: trip count per program of the loop enclosing the hot loop (a persistent
            kernel's tile loop, whose epilogue runs once per tile); 1 when there is none.
        outer2_iters: trip count per program of the loop around that one (what it holds
            besides the tile loop runs that often: a cold path kept out of the tile loop); 1
            when there is none.
        label: configuration in words (block sizes, warps), for names and reports.
        extra: anything else a report should carry (e.g. ``{"variant": "no_entropy"}``).
    """

    kernel: str
    fn: Any
    signature: dict[str, str]
    constexprs: dict[str, Any]
    num_warps: int
    num_stages: int
    grid: tuple[int, int, int]
    hbm_bytes: int
    tensor_flops: int = 0
    elements: int = 0
    loop_iters: float = 1.0
    loop_elements: int = 0
    outer_iters: float = 1.0
    outer2_iters: float = 1.0
    label: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def programs(self) -> int:
        return self.grid[0] * self.grid[1] * self.grid[2]


TRITON_PTR = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16"}
"""torch dtype name (``str(dtype).split('.')[-1]``) -> Triton pointer type."""


def ptr(dtype) -> str:
    """Triton pointer type of a torch float dtype (``torch.bfloat16`` -> ``"*bf16"``)."""
    return TRITON_PTR[str(dtype).split(".")[-1]]


# CUDA's launch limits (CUDA C++ Programming Guide, "Technical Specifications per Compute
# Capability", cc 7.0 - 9.0): Triton's launcher checks none of them, so a grid past them fails
# mid-job with "invalid argument". The kernels put rows x heads on axis x, whose 2^31 - 1
# programs no tensor that fits a GPU reaches (2^31 rows of 64 bf16 values are 256 GiB).
MAX_GRID = (2 ** 31 - 1, 65535, 65535)
MAX_THREADS_PER_BLOCK = 1024


def limit_problems(kernel: str, grid: tuple[int, ...], num_warps: int,
                   shared_bytes: int | None = None,
                   shared_limit: int | None = None) -> list[str]:
    """What a launch of ``kernel`` with ``grid`` (programs per axis), ``num_warps`` and
    ``shared_bytes`` of shared memory per program (None: not known yet) breaks of CUDA's limits
    (:data:`MAX_GRID`, :data:`MAX_THREADS_PER_BLOCK`, ``shared_limit`` bytes per block); empty
    when nothing. Each problem names the kernel, the value and the limit."""
    problems = []
    for axis, (g, top) in enumerate(zip(tuple(grid) + (1,) * (3 - len(grid)), MAX_GRID,
                                        strict=True)):
        if g > top:
            problems.append(f"{kernel}: grid axis {'xyz'[axis]} has {g} programs, CUDA's limit "
                            f"is {top}")
        elif g < 0:
            problems.append(f"{kernel}: grid axis {'xyz'[axis]} has {g} programs")
    if num_warps * 32 > MAX_THREADS_PER_BLOCK:
        problems.append(f"{kernel}: {num_warps} warps = {num_warps * 32} threads per block, "
                        f"CUDA's limit is {MAX_THREADS_PER_BLOCK}")
    if shared_bytes is not None and shared_limit is not None and shared_bytes > shared_limit:
        problems.append(f"{kernel}: {shared_bytes} bytes of shared memory per block, the "
                        f"device's limit is {shared_limit}")
    return problems

