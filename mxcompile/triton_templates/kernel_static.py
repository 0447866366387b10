"""Static figures of a kernel compiled ahead of time (`aot.compile_launch`), read without a GPU.

From the cubin: registers and spilled bytes per thread (`aot.resource_usage`) and the SASS
(`nvdisasm`, shipped with Triton), whose instructions are counted by class, for the whole kernel
and for its main loop (the largest span closed by a backward branch: the K loop of a GEMM, the
key/query-tile loop of an attention kernel). From the PTX: the width in bytes of each global
load and store (`ld.global.v4.b32` moves 16 bytes) and of each asynchronous global -> shared
copy (`cp.async ... 0x10`). From the compile's metadata: shared memory.

A main loop's instruction count is static: per warp and per iteration, with both sides of any
branch inside it counted. Every warp runs the loop body once per iteration, so loop instructions
times num_warps are the instructions one program issues per tile, and two kernels compiled with
the same tiles and warps compare by their loop counts alone. `launchers` builds the launches the
static report (`benchmarks/kernel_static.py`) and the tests compile: the MX attention kernels
beside the bf16 flash-attention reference, the quantize kernel and the MX GEMM.
"""

from __future__ import annotations

import functools
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from .aot import resource_usage

# SASS instruction classes, in report order. "float": fp32 and packed fp16/bf16 arithmetic and
# the special-function unit (MUFU: exp2, rcp); "integer": integer, logic, select, move and
# predicate instructions, uniform-datapath (U*) ones included; "async_copy": global -> shared
# copies that bypass registers (LDGSTS, TMA) and their commit; "tensor_memory": sm100's tensor
# memory loads and stores; "local": local-memory loads and stores, i.e. register spills.
CLASSES = (
    "mma", "float", "conversion", "integer", "global_load", "global_store", "async_copy",
    "shared_load", "shared_store", "tensor_memory", "local", "barrier", "control", "other",
)  # fmt: skip

# Opcode stems (the opcode up to its first '.') of each class, except "mma" (any stem ending in
# MMA: HGMMA, QGMMA, HMMA, UTCQMMA, ...).
_STEMS = {
    "float": {"FADD", "FADD2", "FMUL", "FMUL2", "FFMA", "FFMA2", "FMNMX", "FMNMX3", "FSEL",
              "FSETP", "FSET", "FRND", "FCHK", "FSWZADD", "MUFU", "HADD2", "HMUL2", "HFMA2",
              "HMNMX2", "HSETP2", "HSET2", "DADD", "DMUL", "DFMA", "DSETP"},
    "conversion": {"F2F", "F2I", "I2F", "F2FP", "I2FP", "F2IP", "I2I", "I2IP"},
    "integer": {"IADD", "IADD3", "IMAD", "IMUL", "IMNMX", "VIMNMX", "VIMNMX3", "VIADD",
                "VIADDMNMX", "IABS", "ISETP", "ISCADD", "LOP", "LOP3", "PLOP3", "SHF", "SHL",
                "SHR", "SEL", "LEA", "PRMT", "SGXT", "BMSK", "BREV", "FLO", "POPC", "MOV",
                "CS2R", "S2R", "S2UR", "R2UR", "R2P", "P2R", "UP2UR", "LDC", "LDCU", "VOTE", "VOTEU",
                "REDUX", "IDP", "IDP4A", "BFE", "BFI", "SHFL"},
    "global_load": {"LDG"},
    "global_store": {"STG", "RED", "ATOM", "ATOMG", "REDG"},
    "async_copy": {"LDGSTS", "LDGDEPBAR", "UBLKCP", "UTMALDG", "UTMAPF", "UTMASTG", "UBLKPF",
                   "UTMACCTL"},
    "shared_load": {"LDS", "LDSM"},
    "shared_store": {"STS", "STSM", "ATOMS"},
    "tensor_memory": {"LDTM", "STTM", "UTCATOMSWS", "UVIRTCOUNT"},
    "local": {"LDL", "STL"},
    "barrier": {"BAR", "DEPBAR", "WARPGROUP", "MEMBAR", "FENCE", "SYNCS", "WARPSYNC", "UTCBAR",
                "ELECT", "NANOSLEEP", "ERRBAR", "CCTL"},
    "control": {"BRA", "BRX", "JMP", "EXIT", "CALL", "RET", "BSSY", "BSYNC", "NOP", "BPT",
                "YIELD", "KILL", "WARPGROUPSET"},
}  # fmt: skip


@functools.cache
def instruction_class(opcode: str) -> str:
    """The class (one of CLASSES) of a SASS opcode such as "HGMMA.64x64x16.F32.BF16"; a uniform
    datapath opcode (UIADD3, ULDC, ...) takes the class of its vector form."""
    stem = opcode.split(".", 1)[0]
    if stem.endswith("MMA"):
        return "mma"
    for name, stems in _STEMS.items():
        if stem in stems:
            return name
    if stem.startswith("U") and stem[1:] in _STEMS["integer"] | {"LDC"}:
        return "integer"
    return "other"


def sass(kernel: Any) -> str:
    """The SASS of a compiled kernel (from `aot.compile_launch`), by the nvdisasm Triton ships."""
    from triton import knobs

    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(kernel.asm["cubin"])
        cubin.flush()
        return subprocess.run([knobs.nvidia.nvdisasm.path, "-c", cubin.name],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip


# nvdisasm -c: "        /*0a70*/  @!P1 BRA `(.L_x_1) ;" and labels ".L_x_1:".
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH_TARGET = re.compile(r"\((\.L_x_\d+)\)")


def parse_sass(text: str) -> tuple[list[str], list[tuple[int, int]]]:
    """(opcodes in order, loops): each loop is (first, last) indices into the opcodes, from a
    branch at `last` back to the label before instruction `first`. Only branches before the
    last EXIT count: after it come the trap (a branch to itself) and, on sm100, the
    out-of-line slow paths of barrier waits, which branch back into the code they left."""
    opcodes: list[str] = []
    labels: dict[str, int] = {}
    branches: list[tuple[int, str]] = []
    for line in text.splitlines():
        label = _LABEL.match(line)
        if label:
            labels[label.group(1)] = len(opcodes)
            continue
        instruction = _INSTRUCTION.match(line)
        if not instruction:
            continue
        opcode, operands = instruction.groups()
        if opcode.split(".", 1)[0] == "BRA":
            target = _BRANCH_TARGET.search(operands)
            if target:
                branches.append((len(opcodes), target.group(1)))
        opcodes.append(opcode)
    exits = [i for i, op in enumerate(opcodes) if op.split(".", 1)[0] == "EXIT"]
    end = exits[-1] if exits else len(opcodes)
    loops = [(labels[t], i) for i, t in branches if t in labels and labels[t] < i < end]
    return opcodes, loops


def main_loop(text: str) -> list[str] | None:
    """The opcodes of the kernel's main loop, one iteration: the longest span closed by a
    backward branch (loops nested in it included); None for a kernel without a loop."""
    opcodes, loops = parse_sass(text)
    if not loops:
        return None
    first, last = max(loops, key=lambda span: span[1] - span[0])
    return opcodes[first : last + 1]


def class_counts(opcodes: list[str]) -> dict[str, int]:
    """Instructions per class, every class of CLASSES listed (zeros included)."""
    counts = Counter(instruction_class(op) for op in opcodes)
    return {name: counts.get(name, 0) for name in CLASSES}


# PTX: "ld.global.v4.b32", "st.global.b8", "ld.global.nc.L1::evict_last.v2.b64"; asynchronous
# copies "cp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;" (bytes last but one).
_GLOBAL_ACCESS = re.compile(r"\b(ld|st)\.global((?:\.[\w:]+)*)")
_VECTOR = re.compile(r"\.v(\d+)\b")
_ELEMENT_BITS = re.compile(r"\.[bsuf](8|16|32|64|128)\b")
_ASYNC_COPY = re.compile(r"cp\.async\.c[ag]\.shared\.global\S*\s+\[[^]]*\],\s*\[[^]]*\],\s*(\w+)")


def global_access_widths(ptx: str) -> dict[str, dict[int, int]]:
    """Bytes moved per instruction -> number of such instructions in the PTX, for "load" and
    "store" (ld/st.global) and "async_copy" (cp.async global -> shared, Ampere-style)."""
    widths: dict[str, Counter[int]] = {"load": Counter(), "store": Counter(), "async_copy": Counter()}
    for kind, suffix in _GLOBAL_ACCESS.findall(ptx):
        vector = _VECTOR.search(suffix)
        bits = _ELEMENT_BITS.search(suffix)
        if bits is None:
            raise ValueError(f"no element type in PTX access {kind}.global{suffix}")
        width = (int(vector.group(1)) if vector else 1) * int(bits.group(1)) // 8
        widths["load" if kind == "ld" else "store"][width] += 1
    for size in _ASYNC_COPY.findall(ptx):
        widths["async_copy"][int(size, 0)] += 1
    return {kind: dict(sorted(counter.items())) for kind, counter in widths.items()}


@dataclass(frozen=True)
class KernelStatic:
    """The static figures of one compiled kernel. Per thread: registers, spill_bytes (its stack:
    the kernels declare no local arrays). shared_bytes per program. global_widths: see
    `global_access_widths`. loop_*: the main loop's instructions per warp and iteration (None
    for a kernel without a loop); kernel_*: the whole kernel's, statically."""

    name: str
    registers: int
    spill_bytes: int
    shared_bytes: int
    global_widths: dict[str, dict[int, int]]
    loop_instructions: int | None
    loop_classes: dict[str, int] | None
    kernel_instructions: int
    kernel_classes: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        record = asdict(self)
        record["global_widths"] = {
            kind: {str(width): n for width, n in counts.items()}
            for kind, counts in self.global_widths.items()
        }
        return record


def kernel_static(kernel: Any) -> KernelStatic:
    """The static figures of a compiled kernel (from `aot.compile_launch`)."""
    text = sass(kernel)
    opcodes, _ = parse_sass(text)
    loop = main_loop(text)
    registers, stack_bytes = resource_usage(kernel)
    return KernelStatic(
        name=kernel.metadata.name,
        registers=registers,
        spill_bytes=stack_bytes,
        shared_bytes=int(kernel.metadata.shared),
        global_widths=global_access_widths(kernel.asm["ptx"]),
        loop_instructions=len(loop) if loop is not None else None,
        loop_classes=class_counts(loop) if loop is not None else None,
        kernel_instructions=len(opcodes),
        kernel_classes=class_counts(opcodes),
    )


# A launch for the static report: call it with (tiles, wrap); it launches on meta tensors.
Launch = Callable[[dict[str, int], Any], object]


def launchers(head_dim: int, causal: bool, *, heads: int = 16, seq: int = 4096,
              gemm_size: int = 4096, capability: int | None = None) -> dict[str, tuple[str, Launch]]:  # fmt: skip
    """Label -> (kernel name, launch) of every kernel the static report compiles, on meta
    tensors at a training-sized shape (sizes divisible by 16, as real launches are): the MX
    attention forward, dK/dV and dQ kernels and the bf16 flash-attention ones (bf16 inputs to
    the backward, as training gives them), the quantize kernel (bf16, both axes from one read)
    the MX GEMM (its three main loops, `mx_gemm.GEMM_PATHS`) and the plain bf16 GEMM reference
    (`mx_gemm.bf16_mm_launch`). capability: the target the MX attention kernels are compiled
    for, which picks how they turn P back into bf16 (`attention.direct_fp8_cvt`; None: the
    sm90 way, which compiles for every target)."""
    from ..numerics.formats import DEFAULT_BLOCK_SIZE as block
    from ..numerics.formats import E4M3, ScaleMode
    from .attention import AttentionKey, attention_launch
    from .attention_backward import AttentionBackwardKey, attention_backward_launch, empty_operands
    from .flash_attention import flash_attention_backward_launch, flash_attention_launch
    from .mx_gemm import MXMMKey, bf16_mm_launch, mx_mm_launch
    from .quantize import quantize_launch

    meta = torch.device("meta")

    def empty(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(*shape, dtype=dtype, device=meta)

    fp8, u8, bf16, fp32 = torch.float8_e4m3fn, torch.uint8, torch.bfloat16, torch.float32
    q8, qs = empty(heads, seq, head_dim, dtype=fp8), empty(heads, seq, head_dim // block, dtype=u8)
    vs = empty(heads, seq // block, head_dim, dtype=u8)
    x, lse = empty(heads, seq, head_dim, dtype=bf16), empty(heads, seq, dtype=fp32)
    a, sa = empty(gemm_size, gemm_size, dtype=fp8), empty(gemm_size, gemm_size // block, dtype=u8)
    sb = empty(gemm_size // block, gemm_size, dtype=u8)
    sm_scale = head_dim**-0.5
    attention = dict(sm_scale=sm_scale, causal=causal, interpret=False)
    mx_forward = functools.partial(attention_launch, q8, qs, q8, qs, q8, vs, key=AttentionKey(),
                                   block_size=block, out_dtype=bf16, capability=capability,
                                   **attention)  # fmt: skip
    mx_backward = functools.partial(attention_backward_launch,
                                    empty_operands(heads, seq, seq, head_dim, device=meta), x, x, lse,
                                    key=AttentionBackwardKey(), mx_qk=True, mx_pv=True,
                                    block_size=block, out_dtypes=(bf16,) * 3, capability=capability,
                                    **attention)  # fmt: skip
    bf16_forward = functools.partial(flash_attention_launch, x, x, x, **attention)
    bf16_backward = functools.partial(flash_attention_backward_launch, x, x, x, x, x, lse, **attention)
    quantize = functools.partial(quantize_launch, empty(gemm_size, gemm_size, dtype=bf16),
                                 rowwise=True, colwise=True, fmt=E4M3, scale_mode=ScaleMode.RCEIL,
                                 block_size=block, interpret=False)  # fmt: skip
    gemm = functools.partial(mx_mm_launch, a, sa, a, sb, block_size=block, out_dtype=bf16,
                             key=MXMMKey(), interpret=False)  # fmt: skip
    g16 = empty(gemm_size, gemm_size, dtype=bf16)
    bf16_gemm = functools.partial(bf16_mm_launch, g16, g16, interpret=False)

    def call(launch: Callable[..., object], **fixed: Any) -> Launch:
        return lambda tiles, wrap: launch(tiles=tiles, wrap=wrap, **fixed)

    return {
        "mx_attention_fwd": ("mx_attention_fwd_kernel", call(mx_forward)),
        "mx_attention_dkdv": ("mx_attention_bwd_dkdv_kernel", call(mx_backward)),
        "mx_attention_dq": ("mx_attention_bwd_dq_kernel", call(mx_backward)),
        "bf16_attention_fwd": ("flash_attention_fwd_kernel", call(bf16_forward)),
        "bf16_attention_dkdv": ("flash_attention_dkdv_kernel", call(bf16_backward)),
        "bf16_attention_dq": ("flash_attention_dq_kernel", call(bf16_backward)),
        "quantize": ("mx_quantize_kernel", call(quantize)),
        "mx_gemm_dot_scaled": ("mx_mm_kernel", call(gemm, path="dot_scaled")),
        "mx_gemm_expand_bf16": ("mx_mm_kernel", call(gemm, path="expand_bf16")),
        "mx_gemm_fp8_per_block": ("mx_mm_kernel", call(gemm, path="fp8_per_block")),
        "bf16_gemm": ("bf16_mm_kernel", call(bf16_gemm)),
    }


def compile_static(launch: Launch, kernel_name: str, tiles: dict[str, int], capability: int,
                   num_warps: int, num_stages: int) -> KernelStatic:  # fmt: skip
    """Compile one launch's kernel `kernel_name` with `tiles` for `capability` and read it."""
    from .aot import compile_launch

    (kernel,) = compile_launch(
        lambda wrap: launch(tiles, wrap), capability, num_warps=num_warps, num_stages=num_stages,
        only=kernel_name,
    )  # fmt: skip
    return kernel_static(kernel)


def issued_per_element(static: KernelStatic, num_warps: int, elements: int) -> float:
    """Instructions one program issues per element of work: its main loop's per iteration (the
    whole kernel's, for a kernel without a loop) times num_warps, over the elements that
    iteration (or program) covers: BLOCK_M x BLOCK_N scores for an attention kernel, so two
    kernels' figures compare per KV tile even when their tiles differ; BLOCK_M x BLOCK_N x
    BLOCK_K products for a GEMM; BLOCK_M x BLOCK_N inputs for the quantize kernel."""
    count = static.loop_instructions
    if count is None:
        count = static.kernel_instructions
    return count * num_warps / elements


def static_choice(candidates: list[tuple[KernelStatic, float]]) -> int:
    """Index of the config a static comparison takes among (figures, issued per element) of one
    kernel's autotune configs: the fewest spilled bytes, then the fewest instructions issued
    per element. (On a GPU the autotuner picks by time among all of them.)"""
    if not candidates:
        raise ValueError("no config to choose from")
    order = [(static.spill_bytes, issued) for static, issued in candidates]
    return order.index(min(order))
