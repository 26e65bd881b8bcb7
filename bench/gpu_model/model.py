"""A static performance model of one Triton kernel launch on an NVIDIA H100 (sm_90) or A100 (sm_80).

No GPU is needed: the kernel is compiled for the target (:mod:`bench.gpu_model.static`), and this
module reads the SASS and the resource usage of the cubin and predicts the launch time from them
and from the workload of its :class:`~bench.gpu_model.launches.Launch` (bytes, tensor FLOPs, loop
trip count).

The model (all times in seconds, ``P`` programs, ``W`` warps per program, ``S`` SMs, ``f`` the SM
clock, ``B`` resident blocks per SM from :func:`occupancy`)::

    per program, warp-instructions:  I = W * (body * loop_iters + outer * (outer_iters - 1)
                                              + (total - body))
    busiest SM runs p = ceil(P / S) programs in ceil(p / B) waves of up to B programs;
    a wave of b programs issues at min(4, b * W) warp-instructions per clock (4 schedulers, each
    issuing at most one instruction of one warp per clock), so
    t_issue  = sum over waves of  b * I / (min(4, b * W) * f * issue_efficiency)
    t_mufu   = p * W * 32 * mufu_per_warp / (16 * f)            (16 MUFU results / clk / SM)
    t_shfl   = p * W * 32 * shfl_per_warp / (32 * f)            (32 shuffle results / clk / SM)
    t_tensor = p * (tensor_flops / P) / (tensor_peak / S)       (only when the SASS has
                                                                 HGMMA/HMMA; else the FLOPs are
                                                                 FFMAs, already in t_issue)
    t_hbm    = hbm_bytes / hbm_bandwidth
    t_cuda   = max(t_issue, t_mufu, t_shfl)       (the CUDA-core instruction stream)
    predicted_low  = max(t_cuda, t_tensor, t_hbm) + launch_overhead
    predicted_high = max(t_serial, t_hbm) + launch_overhead
    bound     = the name of the largest term

**Overlap, stated.** ``predicted_low`` assumes perfect overlap: whichever resource is busiest
hides all the others. ``predicted_high`` keeps DRAM traffic overlapped (the software pipeline's
stages; the memory-bound validation points support that) but serialises the CUDA-core work
that cannot run beside the tensor cores, ``t_serial``:

* hot loop with MUFU work (a softmax on the loop's own MMA results, flash attention):
  ``t_tensor + t_cuda`` -- each block's MMA waits for the softmax and vice versa;
* hot loop without (a GEMM K loop: its loads, address arithmetic and MMA issue run beside the
  asynchronous MMAs): ``max(t_tensor, t_cuda_loop) + t_cuda_rest``, the part outside the loop
  (the epilogue) added;
* no tensor-core instructions: ``t_cuda`` (then low = high).

``*_loop`` / ``*_rest`` split each CUDA-core term by the hot loop's share of its instructions.
The compute-bound validation points (``bench static``: Triton's fused-attention tutorial on
A100 / H100, Cut Cross-Entropy's forward on A100) all lie within 35% of ``predicted_high``
while perfect overlap misses five of the seven by 36-54%, so targets are judged at
``predicted_high``. ``predicted_s`` is ``predicted_low`` (its old meaning).

``*_per_warp`` counts an instruction once per execution: loop-body instructions ``loop_iters``
times, the rest once. The bandwidth and tensor peak used for the prediction are the
*achievable* figures (measured on this workplace's H100: device copy ~3.0 TB/s, bf16 matmul
~798 TFLOP/s; on the A100 the spec scaled by the same measured/spec ratios). ``frac_hbm`` and
``frac_tensor`` are reported against both the achievable and the spec figures.

**Hot loop.** The SASS is split into instructions with their addresses; every branch whose
target label lies at or before the branch is a loop (body = target .. branch). A one-instruction
self-branch (the ``BRA`` trap after ``EXIT``) is not a loop. The hot loop is the innermost loop
(one containing no other loop) with the most instructions; ``Launch.loop_iters`` is its trip count
per program. A kernel with no loop has an empty body and ``loop_iters`` is ignored.

What the model leaves out (see ``docs/GPU_MODEL.md``): L2 reuse (every byte is HBM traffic),
latency (small grids, dependent chains, memory latency not hidden by too few warps), clock
throttling under load, dual issue and per-pipe latencies other than MUFU/shuffle, bank conflicts;
the overlap of tensor and CUDA-core work is bounded (low / high), not predicted.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class Hardware:
    """One GPU: the figures the model needs, each with its public source.

    Attributes:
        name, arch: product name and SASS target (``"sm_90"``).
        sms: streaming multiprocessors.
        clock_hz: SM clock used for issue/MUFU rates (the boost clock).
        schedulers_per_sm: warp schedulers, each issuing one warp-instruction per clock.
        mufu_per_clk_sm: special-function (MUFU: ex2, lg2, rcp, rsq, sin, cos) results / clk / SM.
        shfl_per_clk_sm: warp-shuffle results / clk / SM.
        tensor_bf16_spec, tensor_tf32_spec: dense tensor-core peaks, FLOP/s.
        tensor_bf16_achievable: what a good bf16 matmul reaches (measured, or spec x ratio).
        hbm_spec: DRAM bandwidth from the data sheet, bytes/s.
        hbm_achievable: device-to-device copy bandwidth (read + write bytes / s).
        smem_per_sm, smem_per_block: shared memory per SM / max per block (opt-in), bytes.
        regs_per_sm, max_warps_per_sm, max_blocks_per_sm: occupancy limits.
        l2_bytes: L2 cache size (reported, not modelled).
        launch_overhead_s: fixed cost added to each launch.
        issue_efficiency: fraction of the ideal issue rate reached (the one global calibration
            factor; 1.0 = uncalibrated).
        sources: where each figure comes from.
    """

    name: str
    arch: str
    sms: int
    clock_hz: float
    schedulers_per_sm: int
    mufu_per_clk_sm: int
    shfl_per_clk_sm: int
    tensor_bf16_spec: float
    tensor_tf32_spec: float
    tensor_bf16_achievable: float
    hbm_spec: float
    hbm_achievable: float
    smem_per_sm: int
    smem_per_block: int
    regs_per_sm: int
    max_warps_per_sm: int
    max_blocks_per_sm: int
    l2_bytes: int
    launch_overhead_s: float = 3e-6
    issue_efficiency: float = 1.0
    sources: dict[str, str] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_GUIDE = ("CUDA C++ Programming Guide, 'Technical Specifications per Compute Capability' "
          "(cc 8.0 / 9.0 columns)")
_THROUGHPUT = ("CUDA C++ Programming Guide, 'Arithmetic Instructions' throughput table "
               "(results per clock per SM, cc 8.0 / 9.0): 32-bit exp2/log2/reciprocal 16, "
               "warp shuffle 32")
MEASURED_H100 = ("this workplace's H100 SXM: torch device-to-device copy "
                 "~3.0 TB/s counting read + write bytes; bf16 torch.matmul ~798 TFLOP/s")

# Measured/spec ratios on the H100, applied to the A100 spec where nothing was measured there.
_HBM_RATIO = 3.0e12 / 3.35e12
_TENSOR_RATIO = 798e12 / 989.4e12

HARDWARE: dict[str, Hardware] = {
    "sm_90": Hardware(
        name="NVIDIA H100 SXM5 80GB", arch="sm_90", sms=132, clock_hz=1.98e9,
        schedulers_per_sm=4, mufu_per_clk_sm=16, shfl_per_clk_sm=32,
        tensor_bf16_spec=989.4e12, tensor_tf32_spec=494.7e12, tensor_bf16_achievable=798e12,
        hbm_spec=3.35e12, hbm_achievable=3.0e12,
        smem_per_sm=228 * 1024, smem_per_block=227 * 1024, regs_per_sm=65536,
        max_warps_per_sm=64, max_blocks_per_sm=32, l2_bytes=50 * 1024 * 1024,
        sources={
            "sms, clock_hz, tensor_*_spec, hbm_spec, l2_bytes": (
                "NVIDIA H100 Tensor Core GPU Architecture whitepaper (Hopper), Table 3 "
                "H100 SXM5: 132 SMs, 1.98 GHz max boost (non-tensor), BF16 dense 989.4 "
                "TFLOP/s, TF32 dense 494.7 TFLOP/s, HBM3 3.35 TB/s, 50 MB L2; also the H100 "
                "data sheet (989 / 494 TFLOP/s dense = half the 'with sparsity' figures)"),
            "schedulers_per_sm": "Hopper whitepaper, SM diagram: 4 SM sub-partitions, one warp "
                                 "scheduler each dispatching 1 warp-instruction / clk",
            "mufu_per_clk_sm, shfl_per_clk_sm": _THROUGHPUT,
            "smem_per_sm, smem_per_block, regs_per_sm, max_warps_per_sm, max_blocks_per_sm":
                _GUIDE + ": 228 KB / SM, 227 KB / block, 64K 32-bit registers, 64 warps, "
                         "32 blocks",
            "hbm_achievable, tensor_bf16_achievable": MEASURED_H100,
            "launch_overhead_s": "typical CUDA kernel launch latency, a few microseconds",
        },
    ),
    "sm_80": Hardware(
        name="NVIDIA A100 SXM4 80GB", arch="sm_80", sms=108, clock_hz=1.41e9,
        schedulers_per_sm=4, mufu_per_clk_sm=16, shfl_per_clk_sm=32,
        tensor_bf16_spec=312e12, tensor_tf32_spec=156e12,
        tensor_bf16_achievable=312e12 * _TENSOR_RATIO,
        hbm_spec=2.039e12, hbm_achievable=2.039e12 * _HBM_RATIO,
        smem_per_sm=164 * 1024, smem_per_block=163 * 1024, regs_per_sm=65536,
        max_warps_per_sm=64, max_blocks_per_sm=32, l2_bytes=40 * 1024 * 1024,
        sources={
            "sms, clock_hz, tensor_*_spec, l2_bytes": (
                "NVIDIA A100 Tensor Core GPU Architecture whitepaper (Ampere), Table 3 / "
                "A100 data sheet: 108 SMs, 1410 MHz boost, BF16 dense 312 TFLOP/s, TF32 dense "
                "156 TFLOP/s, 40 MB L2"),
            "hbm_spec": "NVIDIA A100 data sheet: A100 80GB SXM, HBM2e 2,039 GB/s",
            "schedulers_per_sm": "Ampere whitepaper, SM diagram: 4 sub-partitions, one warp "
                                 "scheduler each",
            "mufu_per_clk_sm, shfl_per_clk_sm": _THROUGHPUT,
            "smem_per_sm, smem_per_block, regs_per_sm, max_warps_per_sm, max_blocks_per_sm":
                _GUIDE + ": 164 KB / SM, 163 KB / block, 64K registers, 64 warps, 32 blocks",
            "hbm_achievable, tensor_bf16_achievable": (
                "not measured on an A100: the spec times the H100's measured/spec ratios "
                f"({_HBM_RATIO:.3f} for bandwidth, {_TENSOR_RATIO:.3f} for bf16 matmul)"),
            "launch_overhead_s": "typical CUDA kernel launch latency, a few microseconds",
        },
    ),
}

ISSUE_EFFICIENCY_ENV = "ICQS_GPU_ISSUE_EFFICIENCY"
OVERRIDE_ENV = "ICQS_GPU_MODEL"


def hardware(arch: str, **overrides: Any) -> Hardware:
    """The table entry for ``arch`` (``"sm_90"``/``"sm_80"``, or ``90``/``80``) with overrides.

    Overrides come, in increasing priority, from ``$ICQS_GPU_MODEL`` (comma-separated
    ``field=value``, e.g. ``clock_hz=1.755e9,hbm_achievable=2.9e12``),
    ``$ICQS_GPU_ISSUE_EFFICIENCY`` and keyword arguments.
    """
    key = arch if str(arch).startswith("sm_") else f"sm_{arch}"
    if key not in HARDWARE:
        raise ValueError(f"unknown arch {arch!r}; known: {sorted(HARDWARE)}")
    hw = HARDWARE[key]
    env: dict[str, Any] = {}
    for item in filter(None, os.environ.get(OVERRIDE_ENV, "").split(",")):
        name, _, value = item.partition("=")
        env[name.strip()] = float(value)
    if os.environ.get(ISSUE_EFFICIENCY_ENV):
        env["issue_efficiency"] = float(os.environ[ISSUE_EFFICIENCY_ENV])
    env.update(overrides)
    unknown = set(env) - set(hw.__dataclass_fields__)
    if unknown:
        raise ValueError(f"unknown hardware fields {sorted(unknown)}")
    cast = {k: type(getattr(hw, k))(v) for k, v in env.items()}
    return replace(hw, **cast)


# ----------------------------------------------------------------------------------------------
# SASS parsing

_INSTR = re.compile(r"^\s*/\*([0-9a-fA-F]+)\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"^\s*(\.L_\w+|[A-Za-z_$][\w$.]*):\s*$")
_TARGET = re.compile(r"`\(([^)]+)\)")
_BRANCHES = ("BRA", "BRX", "JMP", "JMX")


@dataclass(frozen=True)
class Instr:
    """One SASS instruction: byte address, opcode with modifiers (``"MUFU.EX2"``), predicate
    (``"@!P0"`` or ``""``), operand text and, for a branch, its target label."""

    addr: int
    opcode: str
    pred: str
    operands: str
    target: str | None = None

    @property
    def base(self) -> str:
        """Opcode without modifiers (``"MUFU"``)."""
        return self.opcode.split(".", 1)[0]


def parse_sass(text: str) -> tuple[list[Instr], dict[str, int]]:
    """Instructions and label addresses of ``nvdisasm -c`` (or ``cuobjdump -sass``) output.

    Only the first function in ``text`` is read when it holds several (Triton cubins hold one).
    Returns ``(instructions in address order, {label: address of the next instruction})``.
    """
    instrs: list[Instr] = []
    labels: dict[str, int] = {}
    pending: list[str] = []
    for line in text.splitlines():
        m = _INSTR.match(line)
        if m:
            addr = int(m.group(1), 16)
            body = m.group(2).strip().lstrip("{").strip()
            pred = ""
            if body.startswith("@"):
                pred, _, body = body.partition(" ")
                body = body.strip()
            opcode, _, operands = body.partition(" ")
            target = None
            if opcode.split(".", 1)[0] in _BRANCHES:
                t = _TARGET.search(operands)
                target = t.group(1) if t else None
            for name in pending:
                labels[name] = addr
            pending = []
            instrs.append(Instr(addr, opcode, pred, operands.strip(), target))
            continue
        lm = _LABEL.match(line)
        if lm:
            pending.append(lm.group(1))
    return instrs, labels


@dataclass(frozen=True)
class Loop:
    """A backward branch: instructions ``[start, end]`` (indices into the instruction list)."""

    start: int
    end: int

    @property
    def size(self) -> int:
        return self.end - self.start + 1

    def contains(self, other: Loop) -> bool:
        return self.start <= other.start and other.end <= self.end and self != other


def find_loops(instrs: list[Instr], labels: dict[str, int]) -> list[Loop]:
    """Every loop: a branch to a label at or before it. A branch to itself (the trap after
    ``EXIT``) is not a loop. Loops sharing a head are merged into the widest one."""
    index = {ins.addr: i for i, ins in enumerate(instrs)}
    by_start: dict[int, int] = {}
    for i, ins in enumerate(instrs):
        if ins.target is None or ins.target not in labels:
            continue
        j = index.get(labels[ins.target])
        if j is None or j > i or j == i:
            continue
        by_start[j] = max(by_start.get(j, i), i)
    return [Loop(s, e) for s, e in sorted(by_start.items())]


def hot_loop(loops: list[Loop]) -> Loop | None:
    """The innermost loop (containing no other) with the most instructions, or None."""
    inner = [lp for lp in loops if not any(lp.contains(o) for o in loops)]
    if not inner:
        return None
    return max(inner, key=lambda lp: (lp.size, -lp.start))


# Instruction classes counted per hot-loop iteration (by opcode base name).
CLASSES: dict[str, tuple[str, ...]] = {
    "barrier": ("BAR", "BARRIER", "SYNCS"),
    "shuffle": ("SHFL",),
    "mufu": ("MUFU",),
    "tensor": ("HGMMA", "HMMA", "WGMMA", "IMMA"),
    "global_load": ("LDG", "LDGSTS", "UTMALDG", "UBLKCP", "LDGDEPBAR"),
    "global_store": ("STG", "UTMASTG", "RED", "ATOMG"),
    "shared": ("LDS", "STS", "LDSM", "STSM", "ATOMS"),
    "local": ("LDL", "STL"),
}


def classify(instrs: list[Instr]) -> dict[str, int]:
    """Counts per class of :data:`CLASSES` plus ``instructions`` (all of them)."""
    out = {name: 0 for name in CLASSES}
    out["instructions"] = len(instrs)
    for ins in instrs:
        base = ins.base
        for name, bases in CLASSES.items():
            if base in bases:
                out[name] += 1
    return out


def tensor_kind(instrs: list[Instr]) -> str | None:
    """``"hgmma"``, ``"hmma"`` or None: the tensor-core instructions the kernel uses."""
    bases = {ins.base for ins in instrs}
    if bases & {"HGMMA", "WGMMA"}:
        return "hgmma"
    if "HMMA" in bases:
        return "hmma"
    return None


def tensor_is_tf32(instrs: list[Instr]) -> bool:
    """Whether the tensor-core instructions take TF32 operands (then the TF32 peak applies)."""
    return any(ins.base in ("HGMMA", "HMMA", "WGMMA") and "TF32" in ins.opcode for ins in instrs)


@dataclass(frozen=True)
class SassSummary:
    """What the model needs from the SASS of one kernel."""

    total: int
    body: int
    loop_counts: dict[str, int]
    rest_counts: dict[str, int]
    tensor: str | None
    tf32: bool
    loops: int
    outer_counts: dict[str, int] | None = None
    outer2_counts: dict[str, int] | None = None

    def per_execution(self, loop_iters: float, name: str, outer_iters: float = 1.0,
                      outer2_iters: float = 1.0) -> float:
        """Executions of class ``name`` (or ``"instructions"``) per warp of one program.

        ``outer_iters``: trip count of the loop enclosing the hot loop (a persistent kernel's
        tile loop); its instructions outside the hot loop (``outer_counts``, part of
        ``rest_counts``) run that many times. ``outer2_iters``: trip count of the loop around
        that one (``outer2_counts``: its instructions outside the tile loop, e.g. a cold path
        taken out of it); the rest once."""
        outer = self.outer_counts[name] if self.outer_counts else 0
        outer2 = self.outer2_counts[name] if self.outer2_counts else 0
        return (self.loop_counts[name] * loop_iters + self.rest_counts[name]
                + outer * (outer_iters - 1.0) + outer2 * (outer2_iters - 1.0))


def summarize(sass_text: str) -> SassSummary:
    """Parse ``sass_text`` and count the hot loop and the rest (see the module docstring)."""
    instrs, labels = parse_sass(sass_text)
    if not instrs:
        raise ValueError("no SASS instructions found")
    loops = find_loops(instrs, labels)
    hot = hot_loop(loops)
    body = instrs[hot.start: hot.end + 1] if hot else []
    rest = instrs[: hot.start] + instrs[hot.end + 1:] if hot else instrs
    # The innermost loop around the hot loop (a persistent kernel's tile loop), less the hot
    # loop: its epilogue runs once per outer iteration, not once per program.
    around = [lp for lp in loops if hot and lp.contains(hot)]
    enc = min(around, key=lambda lp: lp.size) if around else None
    outer = (instrs[enc.start: hot.start] + instrs[hot.end + 1: enc.end + 1]) if enc else []
    # And the loop around that one, less the tile loop (a cold path the kernel keeps out of its
    # tile loop, run ``Launch.outer2_iters`` times per program).
    around2 = [lp for lp in loops if enc and lp.contains(enc)]
    enc2 = min(around2, key=lambda lp: lp.size) if around2 else None
    outer2 = (instrs[enc2.start: enc.start] + instrs[enc.end + 1: enc2.end + 1]) if enc2 else []
    return SassSummary(
        total=len(instrs), body=len(body), loop_counts=classify(body),
        rest_counts=classify(rest), tensor=tensor_kind(instrs), tf32=tensor_is_tf32(instrs),
        loops=len(loops), outer_counts=classify(outer), outer2_counts=classify(outer2),
    )


# ----------------------------------------------------------------------------------------------
# Resources and occupancy

_RES = re.compile(r"REG:(\d+)\s+STACK:(\d+)\s+SHARED:(\d+)\s+LOCAL:(\d+)")


def parse_res_usage(text: str) -> dict[str, int]:
    """``cuobjdump -res-usage`` output -> ``{"regs", "stack", "static_smem", "local"}``."""
    m = _RES.search(text)
    if not m:
        raise ValueError("no 'REG:.. STACK:.. SHARED:.. LOCAL:..' line in res-usage output")
    regs, stack, smem, local = (int(g) for g in m.groups())
    return {"regs": regs, "stack": stack, "static_smem": smem, "local": local}


def occupancy(hw: Hardware, regs: int, smem_bytes: int, num_warps: int) -> dict[str, int]:
    """Resident blocks per SM and what limits them.

    Registers are allocated per warp in units of 256 (``regs`` rounded up to a multiple of 8 per
    thread); each block also reserves 1 KB of shared memory for the system (cc 8.0+).

    Returns ``{"blocks_per_sm", "by_regs", "by_smem", "by_warps", "warps_per_sm"}``.
    """
    regs_per_warp = math.ceil(max(regs, 1) * 32 / 256) * 256
    by_regs = hw.regs_per_sm // (regs_per_warp * num_warps)
    by_smem = hw.smem_per_sm // (smem_bytes + 1024)
    by_warps = hw.max_warps_per_sm // num_warps
    blocks = max(0, min(by_regs, by_smem, by_warps, hw.max_blocks_per_sm))
    return {"blocks_per_sm": blocks, "by_regs": by_regs, "by_smem": by_smem,
            "by_warps": by_warps, "warps_per_sm": blocks * num_warps}


# ----------------------------------------------------------------------------------------------
# Prediction

def _waves(programs: int, sms: int, blocks_per_sm: int) -> list[int]:
    """Programs per wave on the busiest SM (round-robin placement)."""
    per_sm = math.ceil(programs / sms)
    b = max(1, blocks_per_sm)
    full, last = divmod(per_sm, b)
    return [b] * full + ([last] if last else [])


def _serial_compute(sass: SassSummary, t_issue: float, t_mufu: float, t_shfl: float,
                    t_tensor: float, num_warps: int, per_sm: int, loop_iters: float,
                    outer_iters: float, hw: Hardware, outer2_iters: float = 1.0) -> float:
    """Compute time (s) at the pessimistic end of the overlap model (module docstring).

    A hot loop with MUFU work (a softmax on the loop's own MMA results, as in flash attention)
    serialises all CUDA-core work with the tensor cores: ``t_tensor + t_cuda``. A loop without
    (a GEMM K loop: loads, address arithmetic, MMA issue) overlaps with the MMAs, and only the
    work outside the loop (the epilogue) is added: ``max(t_tensor, t_cuda_loop) + t_cuda_rest``.
    Without tensor work nothing is serialised: ``max(t_issue, t_mufu, t_shfl)``.
    """
    t_cuda = max(t_issue, t_mufu, t_shfl)
    if not t_tensor:
        return t_cuda
    if not sass.body or sass.loop_counts["mufu"]:
        return t_tensor + t_cuda
    total = sass.per_execution(loop_iters, "instructions", outer_iters, outer2_iters)
    in_loop = sass.loop_counts["instructions"] * loop_iters
    rest_share = (total - in_loop) / total if total else 0.0
    lanes = per_sm * num_warps * 32 / hw.clock_hz

    def split(name: str, rate: int) -> tuple[float, float]:
        loop = sass.loop_counts[name] * loop_iters
        rest = sass.per_execution(loop_iters, name, outer_iters, outer2_iters) - loop
        return lanes * loop / rate, lanes * rest / rate

    mufu_loop, mufu_rest = split("mufu", hw.mufu_per_clk_sm)
    shfl_loop, shfl_rest = split("shuffle", hw.shfl_per_clk_sm)
    issue_rest = t_issue * rest_share
    loop = max(t_issue - issue_rest, mufu_loop, shfl_loop)
    return max(t_tensor, loop) + max(issue_rest, mufu_rest, shfl_rest)


def predict(hw: Hardware, sass: SassSummary, *, num_warps: int, programs: int,
            loop_iters: float, hbm_bytes: float, tensor_flops: float, regs: int,
            smem_bytes: int, launches: int = 1, outer_iters: float = 1.0,
            outer2_iters: float = 1.0) -> dict[str, Any]:
    """Predicted time of one launch (see the module docstring for every term).

    Args:
        hw: target hardware (:func:`hardware`).
        sass: :func:`summarize` of the kernel's SASS.
        num_warps, programs: warps per program and programs in the grid.
        loop_iters: hot-loop trip count per program.
        hbm_bytes, tensor_flops: compulsory DRAM bytes and ``tl.dot`` FLOPs of the launch.
        regs, smem_bytes: registers per thread, shared memory per block (static + dynamic).
        launches: launch overheads to add (1 per kernel launch).
        outer_iters: trip count of the loop enclosing the hot loop, per program (1: none).
        outer2_iters: trip count of the loop around that one, per program (1: none).

    Returns a dict with ``predicted_low_s`` / ``predicted_high_s`` (the two ends of the overlap
    model, seconds; ``predicted_s`` = low), ``bound``, every term ``t_<name>_s``,
    ``occupancy``, ``waves``, ``warp_instructions`` (per program) and the fractions of peak
    (``frac_*`` at the low end, ``frac_*_high`` at the high end).
    """
    occ = occupancy(hw, regs, smem_bytes, num_warps)
    waves = _waves(programs, hw.sms, occ["blocks_per_sm"])
    per_sm = sum(waves)
    instr = num_warps * sass.per_execution(loop_iters, "instructions", outer_iters, outer2_iters)
    t_issue = 0.0
    for b in waves:
        rate = min(hw.schedulers_per_sm, b * num_warps) * hw.clock_hz * hw.issue_efficiency
        t_issue += b * instr / rate
    mufu = num_warps * 32 * sass.per_execution(loop_iters, "mufu", outer_iters, outer2_iters)
    shfl = num_warps * 32 * sass.per_execution(loop_iters, "shuffle", outer_iters, outer2_iters)
    t_mufu = per_sm * mufu / (hw.mufu_per_clk_sm * hw.clock_hz)
    t_shfl = per_sm * shfl / (hw.shfl_per_clk_sm * hw.clock_hz)
    t_tensor = 0.0
    peak = 0.0
    if sass.tensor and tensor_flops:
        peak = hw.tensor_bf16_achievable
        if sass.tf32:
            peak = hw.tensor_tf32_spec * (hw.tensor_bf16_achievable / hw.tensor_bf16_spec)
        t_tensor = per_sm * (tensor_flops / programs) / (peak / hw.sms)
    t_hbm = hbm_bytes / hw.hbm_achievable
    terms = {"issue": t_issue, "mufu": t_mufu, "shuffle": t_shfl, "tensor": t_tensor,
             "hbm": t_hbm}
    bound = max(terms, key=terms.get)
    fixed = launches * hw.launch_overhead_s
    total = terms[bound] + fixed
    high = max(_serial_compute(sass, t_issue, t_mufu, t_shfl, t_tensor, num_warps, per_sm,
                               loop_iters, outer_iters, hw, outer2_iters), t_hbm) + fixed
    out: dict[str, Any] = {f"t_{k}_s": v for k, v in terms.items()}
    out.update(predicted_s=total, predicted_low_s=total, predicted_high_s=high, bound=bound,
               occupancy=occ, waves=len(waves), warp_instructions=instr)
    out["frac_hbm"] = (hbm_bytes / total) / hw.hbm_achievable if hbm_bytes else 0.0
    out["frac_hbm_spec"] = (hbm_bytes / total) / hw.hbm_spec if hbm_bytes else 0.0
    out["frac_hbm_high"] = (hbm_bytes / high) / hw.hbm_achievable if hbm_bytes else 0.0
    if tensor_flops and sass.tensor:
        spec = hw.tensor_tf32_spec if sass.tf32 else hw.tensor_bf16_spec
        out["frac_tensor"] = (tensor_flops / total) / spec
        out["frac_tensor_achievable"] = (tensor_flops / total) / peak
        out["frac_tensor_high"] = (tensor_flops / high) / spec
    return out
