"""Static report of the Triton kernels, compiled ahead of time for sm90 and sm100 (no GPU).

    python benchmarks/kernel_static.py                       # sm90 + sm100, head_dim 64 + 128
    python benchmarks/kernel_static.py --capabilities 90 --head-dims 128 --first-config
    python benchmarks/kernel_static.py --out benchmarks/results/kernel_static.json

Each kernel is compiled with a real launch's argument specialisation (`aot.compile_launch`) at
a training shape (16 heads x 4096 tokens; 4096^2 for quantize and the GEMM) and read with
`mxcompile.triton_templates.kernel_static`: registers and spilled bytes per thread, shared
memory, the byte width of global loads and stores (PTX), and the SASS instructions of the main
loop by class (per warp and iteration; the whole kernel for quantize, which has no loop).

Chosen config: every autotune config of a kernel is compiled (`--first-config`: only the first,
the Triton tutorial's shape) and the static choice taken (`kernel_static.static_choice`: fewest
spilled bytes, then fewest instructions issued per element). An attention kernel's every shape
(`configs.ATTENTION_SHAPES`) is compiled non-causal and causal at each head_dim, which is what
each shape's spill_free_head_dims state; the choice is among the shapes listed for the head_dim: the
fewest spilled bytes causal and not together, then the fewest instructions issued per element.
The bf16 flash-attention reference (`triton_templates/flash_attention.py`) is compiled with the
chosen tiles, warps and stages of the MX kernel it stands beside, non-causal and causal.

The figure: instructions issued per KV tile, MX against bf16 (`kernel_static.issued_per_element`,
per score element: loop instructions x warps / (BLOCK_M x BLOCK_N)); the backward's is the sum
of its dK/dV and dQ kernels'. The MX GEMM's main loops are compared per product (loop
instructions x warps / (BLOCK_M x BLOCK_N x BLOCK_K)) with each other and with a plain bf16
`tl.dot` GEMM compiled with the same tiles (`gemm_comparison`; `--gemm-only` recompiles just
these rows into an existing results file, `--attention-only` the attention rows). A static proxy: it counts instructions, not their latency or the
memory traffic, and a spilling kernel's local loads and stores count as instructions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.pop("TRITON_INTERPRET", None)  # compile for real targets
os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton 3.9's default, without its warning

from mxcompile.triton_templates import configs  # noqa: E402
from mxcompile.triton_templates.kernel_static import (  # noqa: E402
    CLASSES,
    KernelStatic,
    compile_static,
    issued_per_element,
    launchers,
    static_choice,
)

# The columns of the class table (abbreviations of kernel_static.CLASSES).
SHORT = {
    "mma": "mma", "float": "fp", "conversion": "cvt", "integer": "int", "global_load": "ldg",
    "global_store": "stg", "async_copy": "async", "shared_load": "lds", "shared_store": "sts",
    "tensor_memory": "tmem", "local": "local", "barrier": "bar", "control": "ctl", "other": "oth",
}  # fmt: skip
ATTENTION = ("fwd", "dkdv", "dq")


def _parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--capabilities", type=int, nargs="+", default=[90, 100])
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--first-config", action="store_true",
                   help="compile only each kernel's first autotune config (a quick look)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    p.add_argument("--gemm-only", action="store_true",
                   help="compile only the GEMM kernels and replace their entries in --out's file")
    p.add_argument("--attention-only", action="store_true",
                   help="compile only the attention kernels and replace their entries in --out's file")
    return p.parse_args()


def _attention_configs(kernel: str, head_dim: int | None = None) -> list[Any]:
    """The kernel's autotune configs for head_dim (None: every shape, all of which the report
    compiles)."""
    if kernel == "fwd":
        return configs.attention_autotune_configs(head_dim)
    return configs.attention_backward_autotune_configs(kernel, head_dim)


def _config_label(config: Any) -> str:
    tiles = " ".join(
        f"{k.removeprefix('BLOCK_')}={v}" for k, v in config.kwargs.items() if k != "GROUP_M"
    )
    return f"{tiles} w={config.num_warps} s={config.num_stages}"


def _widths(widths: dict[str, dict[int, int]]) -> str:
    names = {"load": "ld", "store": "st", "async_copy": "cp"}
    parts = []
    for kind, counts in widths.items():
        if counts:
            by_width = sorted(counts.items(), reverse=True)
            parts.append(names[kind] + " " + ",".join(f"{w}Bx{n}" for w, n in by_width))
    return "; ".join(parts)


def _row(sm: int, label: str, config: Any, static: KernelStatic, issued: float, mark: str) -> str:
    classes = static.loop_classes if static.loop_classes is not None else static.kernel_classes
    loop = static.loop_instructions
    if loop is None:
        loop = static.kernel_instructions
    counts = " ".join(f"{classes[c]:>5}" for c in CLASSES)
    return (f"{sm:>4} {label:30s} {_config_label(config):28s}{mark:1s} {static.registers:>4} "
            f"{static.spill_bytes:>6} {static.shared_bytes / 1024:>6.1f} {loop:>6} {issued:>7.3f} "
            f"{counts}   {_widths(static.global_widths)}")


def _header() -> str:
    counts = " ".join(f"{SHORT[c]:>5}" for c in CLASSES)
    return (f"{'sm':>4} {'kernel':30s} {'config (tiles, warps, stages)':29s} {'regs':>4} {'spill':>6} "
            f"{'smemK':>6} {'loop':>6} {'iss/el':>7} {counts}   global access widths")


def _record(config: Any, static: KernelStatic, issued: float) -> dict[str, Any]:
    return {"config": {**config.kwargs, "num_warps": config.num_warps, "num_stages": config.num_stages},
            "issued_per_element": issued, **static.to_json()}


def _sweep(sm: int, label: str, kernel_name: str, launch: Any, candidates: list[Any],
           elements: Any) -> tuple[list[dict[str, Any]], int]:  # fmt: skip
    """Compile every candidate config, print a row each, return (records, chosen index)."""
    rows = []
    for config in candidates:
        warps, stages = config.num_warps, config.num_stages
        static = compile_static(launch, kernel_name, config.kwargs, sm, warps, stages)
        rows.append((config, static, issued_per_element(static, warps, elements(config.kwargs))))
    chosen = static_choice([(static, issued) for _, static, issued in rows])
    for i, (config, static, issued) in enumerate(rows):
        print(_row(sm, label, config, static, issued, "*" if i == chosen else ""), flush=True)
    return [_record(*row) for row in rows], chosen


def _scores(tiles: dict[str, int]) -> int:
    return tiles["BLOCK_M"] * tiles["BLOCK_N"]


def _config_key(config: Any) -> tuple[Any, ...]:
    return (*sorted(config.kwargs.items()), config.num_warps, config.num_stages)


def _attention_choice(sm: int, label: str, noncausal: tuple[str, Any], causal: tuple[str, Any],
                      candidates: list[Any], listed: list[Any]) -> tuple[list[dict[str, Any]], int, KernelStatic]:
    """Every candidate compiled non-causal and causal (a row each; its record holds both); the
    choice, among the configs `listed` for this head_dim: the fewest spilled bytes (causal and
    not together), then the fewest instructions issued per element (non-causal). Returns
    (records, chosen index, the chosen config's causal figures)."""
    rows, causal_rows = [], []
    for config in candidates:
        warps, stages = config.num_warps, config.num_stages
        static = compile_static(noncausal[1], noncausal[0], config.kwargs, sm, warps, stages)
        causal_static = compile_static(causal[1], causal[0], config.kwargs, sm, warps, stages)
        rows.append((config, static, issued_per_element(static, warps, _scores(config.kwargs))))
        causal_rows.append(causal_static)
    listed_keys = {_config_key(c) for c in listed}
    eligible = [i for i, (config, _, _) in enumerate(rows) if _config_key(config) in listed_keys]
    chosen = min(eligible, key=lambda i: (rows[i][1].spill_bytes + causal_rows[i].spill_bytes, rows[i][2]))
    records = []
    for i, (config, static, issued) in enumerate(rows):
        causal_static = causal_rows[i]
        print(_row(sm, label, config, static, issued, "*" if i == chosen else ""), flush=True)
        print(_row(sm, f"{label} causal", config, causal_static,
                   issued_per_element(causal_static, config.num_warps, _scores(config.kwargs)), ""), flush=True)
        record = _record(config, static, issued)
        record["causal"] = {"registers": causal_static.registers, "spill_bytes": causal_static.spill_bytes,
                            "loop_instructions": causal_static.loop_instructions}
        records.append(record)
    return records, chosen, causal_rows[chosen]


def attention_report(sm: int, head_dim: int, first_only: bool) -> dict[str, Any]:
    """Every MX attention shape compiled non-causal and causal, the choice made among those
    listed for head_dim (`_attention_choice`); the chosen one compiled beside the bf16 reference,
    non-causal and causal; the per-KV-tile instruction ratios."""
    by_causal = {causal: launchers(head_dim, causal, capability=sm) for causal in (False, True)}
    result: dict[str, Any] = {}
    issued: dict[tuple[str, str, bool], float] = {}  # (mx | bf16, kernel, causal)
    for kernel in ATTENTION:
        mx, bf16 = f"mx_attention_{kernel}", f"bf16_attention_{kernel}"
        candidates = _attention_configs(kernel)[: 1 if first_only else None]
        listed = candidates if first_only else _attention_configs(kernel, head_dim)
        records, chosen, mx_causal = _attention_choice(sm, f"{mx} d{head_dim}", by_causal[False][mx],
                                                       by_causal[True][mx], candidates, listed)  # fmt: skip
        result[mx], result[bf16] = {"configs": records, "chosen": chosen}, {}
        issued[("mx", kernel, False)] = records[chosen]["issued_per_element"]
        config = candidates[chosen]
        for causal, label in ((False, bf16), (True, mx), (True, bf16)):
            kernel_name, launch = by_causal[causal][label]
            if label == mx:
                static = mx_causal
            else:
                static = compile_static(launch, kernel_name, config.kwargs, sm, config.num_warps,
                                        config.num_stages)  # fmt: skip
            value = issued_per_element(static, config.num_warps, _scores(config.kwargs))
            tag = f"{label} {'causal ' if causal else ''}d{head_dim}"
            print(_row(sm, tag, config, static, value, ""), flush=True)
            result[label]["causal" if causal else "chosen_figures"] = _record(config, static, value)
            issued[(label.split("_")[0], kernel, causal)] = value
    ratios = {}
    for causal in (False, True):
        suffix = "_causal" if causal else ""
        ratios["forward" + suffix] = issued[("mx", "fwd", causal)] / issued[("bf16", "fwd", causal)]
        backward = [sum(issued[(kind, k, causal)] for k in ("dkdv", "dq")) for kind in ("mx", "bf16")]
        ratios["backward" + suffix] = backward[0] / backward[1]
    result["ratios_mx_over_bf16"] = ratios
    print(f"{sm:>4} d{head_dim}: instructions issued per KV tile, MX / bf16: "
          + ", ".join(f"{k} {v:.2f}x" for k, v in ratios.items()), flush=True)
    return result


def quantize_report(sm: int, first_only: bool) -> dict[str, Any]:
    """The quantize kernel (bf16 in, both axes), every autotune config."""
    kernels = launchers(64, False)  # head_dim is not used by these
    quantize_configs = configs.quantize_autotune_configs()[: 1 if first_only else None]
    records, chosen = _sweep(sm, "quantize", *kernels["quantize"], quantize_configs, _scores)
    return {"quantize": {"configs": records, "chosen": chosen}}


def _products(tiles: dict[str, int]) -> int:
    return tiles["BLOCK_M"] * tiles["BLOCK_N"] * tiles["BLOCK_K"]


def _bytes_per_product(tiles: dict[str, int], element_bytes: int, scale_block: int | None) -> float:
    """Global bytes one program loads per K tile (its A and B tiles, and their scale bytes),
    per product of the tile."""
    bm, bn, bk = tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["BLOCK_K"]
    loaded = (bm + bn) * bk * element_bytes + ((bm + bn) * bk // scale_block if scale_block else 0)
    return loaded / _products(tiles)


def gemm_report(sm: int, first_only: bool) -> dict[str, Any]:
    """The MX GEMM's main loops, every autotune config (expand_bf16 and fp8_per_block on sm90
    only: sm100 has block-scaled MMA), and the plain bf16 GEMM compiled with the tiles of each
    path's chosen config. On sm90, the comparison that decides `gemm_kernel`'s "auto" path
    there (`triton_templates.resolve_gemm_path`): instructions issued and global bytes loaded
    per product, each path's chosen config."""
    kernels = launchers(64, False)
    paths = ["dot_scaled"] + (["expand_bf16", "fp8_per_block"] if sm < 100 else [])
    result: dict[str, Any] = {}
    comparison: dict[str, Any] = {}
    for path in paths:
        label = f"mx_gemm_{path}"
        gemm_configs = configs.mx_mm_autotune_configs(path=path)[: 1 if first_only else None]
        records, chosen = _sweep(sm, label, *kernels[label], gemm_configs, _products)
        config = gemm_configs[chosen]
        reference_name, reference_launch = kernels["bf16_gemm"]
        static = compile_static(reference_launch, reference_name, config.kwargs, sm, config.num_warps,
                                config.num_stages)  # fmt: skip
        reference = issued_per_element(static, config.num_warps, _products(config.kwargs))
        print(_row(sm, f"bf16_gemm (tiles of {path})", config, static, reference, ""), flush=True)
        issued = records[chosen]["issued_per_element"]
        result[label] = {"configs": records, "chosen": chosen,
                         "bf16_reference": _record(config, static, reference)}  # fmt: skip
        comparison[path] = {
            "config": records[chosen]["config"],
            "issued_per_product": issued,
            "spill_bytes": records[chosen]["spill_bytes"],
            "bytes_per_product": _bytes_per_product(config.kwargs, 1, 32),
            "bf16_reference_issued_per_product": reference,
            "bf16_reference_bytes_per_product": _bytes_per_product(config.kwargs, 2, None),
            "issued_over_bf16_reference": issued / reference,
        }
    if "expand_bf16" in comparison:
        expand, dot_scaled = comparison["expand_bf16"], comparison["dot_scaled"]
        comparison["expand_bf16_over_dot_scaled_issued"] = expand["issued_per_product"] / dot_scaled["issued_per_product"]
        comparison["expand_bf16_wins"] = (
            expand["spill_bytes"] <= dot_scaled["spill_bytes"]
            and expand["issued_per_product"] < dot_scaled["issued_per_product"]
            and expand["bytes_per_product"] <= dot_scaled["bytes_per_product"]
        )
        print(f"{sm:>4} MX GEMM, chosen configs, instructions issued per product: expand_bf16 / "
              f"dot_scaled {comparison['expand_bf16_over_dot_scaled_issued']:.2f}x, expand_bf16 / bf16 "
              f"{expand['issued_over_bf16_reference']:.2f}x, dot_scaled / bf16 "
              f"{dot_scaled['issued_over_bf16_reference']:.2f}x; expand_bf16 wins: "
              f"{comparison['expand_bf16_wins']}", flush=True)
    result["gemm_comparison"] = comparison
    return result


def main() -> int:
    import triton

    args = _parse()
    started = time.time()
    report: dict[str, Any] = {
        "command": ["python", "benchmarks/kernel_static.py", *sys.argv[1:]],
        "date": datetime.date.today().isoformat(),
        "triton": triton.__version__,
        "static": True,
        "shapes": {
            "attention": "16 heads x 4096 tokens, bf16 backward inputs",
            "gemm_quantize": "4096^2",
        },
        "choice": ("fewest spilled bytes, then fewest instructions issued per element; an attention kernel: "
                   "among the shapes listed for the head_dim (configs.attention_shapes), fewest spilled bytes "
                   "causal and not together, then fewest issued per element non-causal"),
        "first_config_only": args.first_config,
        "targets": {},
    }
    print(_header())
    if args.gemm_only:
        return _update_rows(args, started, "--gemm-only")
    if args.attention_only:
        return _update_rows(args, started, "--attention-only")
    for sm in args.capabilities:
        target: dict[str, Any] = {}
        for head_dim in args.head_dims:
            target[f"head_dim_{head_dim}"] = attention_report(sm, head_dim, args.first_config)
        target.update(quantize_report(sm, args.first_config))
        target.update(gemm_report(sm, args.first_config))
        report["targets"][f"sm{sm}"] = target
    report["seconds"] = round(time.time() - started, 1)
    print(f"compiled in {report['seconds']} s")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1) + "\n")
        print(f"wrote {args.out}")
    return 0


def _is_gemm_key(key: str) -> bool:
    return key.startswith("mx_gemm_") or key == "gemm_comparison"


def _is_attention_key(key: str) -> bool:
    return key.startswith("head_dim_")


def _update_rows(args: argparse.Namespace, started: float, flag: str) -> int:
    """--gemm-only / --attention-only: those entries of each target, replaced in the results
    file `--out` (the other kernels' entries kept as they are)."""
    if args.out is None or not args.out.exists():
        print(f"{flag} updates an existing results file: pass --out FILE", file=sys.stderr)
        return 2
    report = json.loads(args.out.read_text())
    is_row = _is_gemm_key if flag == "--gemm-only" else _is_attention_key
    for sm in args.capabilities:
        target = report["targets"].setdefault(f"sm{sm}", {})
        for key in [k for k in target if is_row(k)]:
            del target[key]
        if flag == "--gemm-only":
            target.update(gemm_report(sm, args.first_config))
        else:
            for head_dim in args.head_dims:
                target[f"head_dim_{head_dim}"] = attention_report(sm, head_dim, args.first_config)
    rows = "gemm_rows" if flag == "--gemm-only" else "attention_rows"
    report[rows] = {
        "command": ["python", "benchmarks/kernel_static.py", *sys.argv[1:]],
        "date": datetime.date.today().isoformat(),
        "seconds": round(time.time() - started, 1),
    }
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"{rows} compiled in {report[rows]['seconds']} s; updated {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
