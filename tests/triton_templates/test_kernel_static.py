"""Static figures of compiled kernels (`mxcompile.triton_templates.kernel_static`), no GPU:
the SASS and PTX readers on listings written here (each line in the form nvdisasm / Triton
emit it), then real compiles for sm90 of the bf16 flash-attention reference, the MX attention
forward and the quantize kernel, with a real launch's specialisation."""

from __future__ import annotations

import pytest
import triton

from mxcompile.triton_templates import configs
from mxcompile.triton_templates.kernel_static import (
    CLASSES,
    KernelStatic,
    class_counts,
    compile_static,
    global_access_widths,
    instruction_class,
    issued_per_element,
    launchers,
    main_loop,
    parse_sass,
    static_choice,
)

WARP = 32  # threads per warp
BF16_BYTES = 2
VECTOR_BYTES = 16  # ld/st.global.v4.b32, the widest global access per thread


@pytest.fixture(autouse=True)
def compiled_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning


def _sass(*lines: str) -> str:
    """A listing as `nvdisasm -c` prints it: instructions with their address, labels alone."""
    out, address = [], 0
    for line in lines:
        if line.endswith(":"):
            out.append(line)
        else:
            out.append(f"        /*{address:04x}*/                   {line} ;")
            address += 16
    return "\n".join(out)


# A prologue, an outer loop holding an inner loop and a forward branch, the epilogue, the EXIT,
# then what nvdisasm shows after it: an sm100 barrier wait's slow path, which branches back
# into the loop, and the trap (a branch to itself).
LISTING = _sass(
    "S2R R0, SR_TID.X", "LDC R1, c[0x0][0x28]",
    ".L_x_0:",
    "LDGSTS.E.BYPASS.128 [R2], desc[UR4][R4.64]", "HGMMA.64x64x16.F32.BF16 R24, gdesc[UR8], RZ",
    ".L_x_1:",
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3", "@!P0 BRA `(.L_x_3)",
    ".L_x_4:",
    "FMUL R5, R5, R6", "@P1 BRA `(.L_x_1)",
    "@P2 BRA `(.L_x_2)", "F2FP.BF16.F32.PACK_AB R7, R8, R9",
    ".L_x_2:",
    "UIADD3 UR4, UR4, 0x1, URZ", "@!P3 BRA `(.L_x_0)",
    "STG.E.128 desc[UR4][R10.64], R12", "EXIT",
    ".L_x_3:",
    "SYNCS.PHASECHK.TRANS64.TRYWAIT P0, [UR4], R3", "@!P0 BRA `(.L_x_3)", "BRA `(.L_x_4)",
    ".L_x_5:",
    "BRA `(.L_x_5)",
)  # fmt: skip


def test_main_loop_is_the_outermost_loop_before_the_exit() -> None:
    opcodes, loops = parse_sass(LISTING)
    assert len(opcodes) == 18 and opcodes[3] == "HGMMA.64x64x16.F32.BF16"
    assert sorted(loops) == [(2, 11), (4, 7)]  # the outer and the inner loop; nothing after EXIT
    loop = main_loop(LISTING)
    assert loop == opcodes[2:12] and loop[0].startswith("LDGSTS") and loop[-1] == "BRA"
    counts = class_counts(loop)
    assert list(counts) == list(CLASSES) and sum(counts.values()) == len(loop)
    expected = {"async_copy": 1, "mma": 1, "barrier": 1, "control": 4, "float": 1, "conversion": 1,
                "integer": 1}  # fmt: skip
    assert {name: n for name, n in counts.items() if n} == expected
    assert main_loop(_sass("S2R R0, SR_TID.X", "EXIT", ".L_x_0:", "BRA `(.L_x_0)")) is None


@pytest.mark.parametrize(
    "opcode,expected",
    [
        ("HGMMA.64x128x16.F32.BF16", "mma"), ("QGMMA.64x64x32.F32.E4M3.E4M3", "mma"),
        ("UTCQMMA", "mma"), ("HMMA.16816.F32.BF16", "mma"), ("MUFU.EX2", "float"),
        ("HMUL2.BF16_V2", "float"), ("FMNMX3", "float"), ("F2FP.F16.E4M3.UNPACK_B", "conversion"),
        ("F2F.BF16.F16", "conversion"), ("LOP3.LUT", "integer"), ("UIADD3", "integer"),
        ("ULDC.64", "integer"), ("SHFL.BFLY", "integer"), ("LDG.E.128", "global_load"),
        ("STG.E.128", "global_store"), ("LDGSTS.E.BYPASS.128", "async_copy"),
        ("UTMALDG.2D", "async_copy"), ("LDSM.16.M88.4", "shared_load"), ("STS.128", "shared_store"),
        ("LDTM.x64", "tensor_memory"), ("STL.128", "local"), ("LDL.LU", "local"),
        ("BAR.SYNC.DEFER_BLOCKING", "barrier"), ("WARPGROUP.ARRIVE", "barrier"),
        ("UTCBAR", "barrier"), ("BRA", "control"), ("NOP", "control"), ("FOO.BAR", "other"),
    ],
)  # fmt: skip
def test_instruction_classes(opcode: str, expected: str) -> None:
    assert instruction_class(opcode) == expected


def test_global_access_widths_from_ptx() -> None:
    ptx = "\n".join([
        "\t@%p2 ld.global.v4.b32 { %r61, %r62, %r63, %r64 }, [ %rd10 + 0 ];",
        "\t@%p3 ld.global.v4.b32 { %r65, %r66, %r67, %r68 }, [ %rd11 + 0 ];",
        "\t@%p6 ld.global.b8 { %rs1 }, [ %rd14 + 0 ];",
        "\tld.global.nc.L1::evict_last.v2.b64 { %rd1, %rd2 }, [ %rd3 + 0 ];",
        "\t@%p9 st.global.b16 [ %rd5 + 0 ], { %rs9 };",
        "\tst.global.v4.b32 [ %rd112 + 0 ], { %r1863, %r1864, %r1865, %r1866 };",
        "\tcp.async.cg.shared.global [ %r109 + 0 ], [ %rd16 + 0 ], 0x10, %r110;",
        "\tcp.async.ca.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x4, %r2;",
        "\tld.shared.v4.b32 { %r1, %r2, %r3, %r4 }, [ %r5 + 0 ];",  # not global: not counted
    ])  # fmt: skip
    assert global_access_widths(ptx) == {
        "load": {1: 1, 16: 3}, "store": {2: 1, 16: 1}, "async_copy": {4: 1, 16: 1},
    }  # fmt: skip


def _figures(spill_bytes: int, loop: int | None, kernel: int) -> KernelStatic:
    classes = {name: 0 for name in CLASSES}
    return KernelStatic("k", 128, spill_bytes, 0, {}, loop, classes if loop else None, kernel, classes)


def test_issued_per_element_and_static_choice() -> None:
    assert issued_per_element(_figures(0, 500, 900), 4, 64 * 64) == 500 * 4 / (64 * 64)
    assert issued_per_element(_figures(0, None, 900), 8, 128 * 128) == 900 * 8 / (128 * 128)
    # Fewest spilled bytes first, then fewest instructions per element.
    candidates = [(_figures(24, 100, 0), 0.1), (_figures(0, 900, 0), 0.9), (_figures(0, 300, 0), 0.3)]
    assert static_choice(candidates) == 2
    with pytest.raises(ValueError, match="no config"):
        static_choice([])


def test_flash_attention_and_mx_forward_compile_sm90() -> None:
    """The bf16 reference's key-tile loop multiplies on the tensor cores (HGMMA) fed by 16-byte
    async copies, and spills nothing at 64 x 64 tiles, 4 warps; the MX forward compiled with the
    same tiles has a loop too, with the same number of MMAs (both products on bf16 wgmma)."""
    kernels = launchers(64, causal=False)
    tiles = {"BLOCK_M": 64, "BLOCK_N": 64}
    figures = {
        label: compile_static(kernels[label][1], kernels[label][0], tiles, 90, 4, 3)
        for label in ("bf16_attention_fwd", "mx_attention_fwd")
    }
    bf16, mx = figures["bf16_attention_fwd"], figures["mx_attention_fwd"]
    assert bf16.name == "flash_attention_fwd_kernel" and bf16.spill_bytes == 0
    assert bf16.loop_classes is not None and bf16.loop_classes["mma"] > 0
    assert bf16.loop_classes["local"] == 0
    assert set(bf16.global_widths["async_copy"]) == {VECTOR_BYTES}
    assert mx.loop_classes is not None and mx.loop_classes["mma"] == bf16.loop_classes["mma"]
    assert mx.spill_bytes == 0 and mx.loop_instructions > bf16.loop_instructions


@pytest.mark.parametrize("config", configs.quantize_autotune_configs(), ids=lambda c: str(c.kwargs))
def test_quantize_moves_its_data_in_16_byte_accesses_sm90(config: triton.Config) -> None:
    """Every autotune config of the quantize kernel (bf16 in, both MX copies from one read)
    loads the whole tile with 16-byte loads and writes both FP8 copies with 16-byte stores: per
    thread, 16-byte accesses x 16 bytes x threads = the tile's bytes. Only the scale bytes go
    narrower."""
    name, launch = launchers(64, causal=False)["quantize"]
    static = compile_static(launch, name, config.kwargs, 90, config.num_warps, config.num_stages)
    tile = config.kwargs["BLOCK_M"] * config.kwargs["BLOCK_N"]
    threads = WARP * config.num_warps
    loads, stores = static.global_widths["load"], static.global_widths["store"]
    assert set(loads) == {VECTOR_BYTES}
    assert loads[VECTOR_BYTES] * VECTOR_BYTES * threads == tile * BF16_BYTES
    copies = 2  # row-wise and column-wise FP8 data, one byte per element each
    assert stores[VECTOR_BYTES] * VECTOR_BYTES * threads == copies * tile
    assert max(w for w in stores if w != VECTOR_BYTES) < VECTOR_BYTES  # the scales
