"""report.html of `mxcompile profile`: one self-contained page (inline CSS, no script, no
external resource) built from the profile document; its images are the PNGs beside it."""

from __future__ import annotations

from html import escape
from typing import Any, Iterable, Sequence

from .formatting import format_bytes, format_db, format_flops, format_percent, format_seconds

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 70em; color: #222; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ccc; }
table { border-collapse: collapse; margin: 0.5em 0; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
th { background: #f2f2f2; }
figure { margin: 1em 0; } figcaption { font-size: 0.85em; color: #555; }
img { max-width: 100%; border: 1px solid #ddd; }
.note { font-size: 0.85em; color: #555; }
"""

Cell = str | tuple[str, str]  # text, or (text, css class)


def _cell(tag: str, value: Cell) -> str:
    if isinstance(value, tuple):
        text, css = value
        return f'<{tag} class="{escape(css)}">{escape(text)}</{tag}>'
    return f"<{tag}>{escape(value)}</{tag}>"


def table(headers: Sequence[str], rows: Iterable[Sequence[Cell]]) -> str:
    head = "".join(_cell("th", h) for h in headers)
    body = "".join("<tr>" + "".join(_cell("td", c) for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def num(text: str) -> tuple[str, str]:
    return text, "num"


def figure(src: str, caption: str) -> str:
    return (f'<figure><img src="{escape(src)}" alt="{escape(caption)}">'
            f"<figcaption>{escape(caption)}</figcaption></figure>")


def _ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}×"


def summary_section(doc: dict[str, Any]) -> str:
    rows = []
    for name, v in doc["variants"].items():
        times = [format_seconds(v[key]) for key in ("compile_s", "median_step_s", "min_step_s")]
        sizes = [format_bytes(v[key]) for key in ("peak_rss_bytes", "peak_step_increase_bytes", "peak_tensor_bytes")]
        rows.append([name, *(num(text) for text in times + sizes)])
    comparison = doc["comparison"]
    ratio_line = (f"{comparison['candidate']} / {comparison['reference']}: median step time "
                  f"{_ratio(comparison['median_step_ratio'])}, fastest step "
                  f"{_ratio(comparison['min_step_ratio'])}, peak resident set "
                  f"{_ratio(comparison['peak_rss_ratio'])}, peak tensor memory "
                  f"{_ratio(comparison['peak_tensor_ratio'])}")
    headers = ["variant", "compile + step 1", "median step", "fastest step", "peak RSS (VmHWM)",
               "RSS growth in the step", "peak tensor memory (profiler)"]
    return f"<h2>Step time and memory</h2>{table(headers, rows)}<p>{escape(ratio_line)}</p>"


def rewrite_section(doc: dict[str, Any]) -> str:
    totals = doc["rewrite"]["totals"]
    rows = [
        ["GEMMs converted", num(f"{totals['converted']} of {totals['gemms']}")],
        ["GEMM FLOPs converted", num(f"{format_flops(totals['gemm_flops_converted'])} "
                                     f"({format_percent(totals['converted_flop_fraction'])})")],
        ["saved activations before → after", num(f"{format_bytes(totals['saved_activation_bytes_before'])} → "
                                                 f"{format_bytes(totals['saved_activation_bytes_after'])}")],
    ]
    coverage = doc["variants"].get(doc["comparison"]["candidate"], {}).get("step_coverage")
    if coverage is not None:  # measured while training: eager GEMMs outside the compiled graphs count too
        rows.append(["GEMM FLOPs in MX in the first training step (run time)",
                     num(f"{format_percent(coverage['mx_flop_fraction'])}, "
                         f"{coverage['eager_gemms']} GEMMs eager")])
    return f"<h2>MXFP8 rewrite</h2>{table(['measure', 'value'], rows)}"


def _operand_summary(operands: Sequence[dict[str, Any]]) -> str:
    parts = []
    for o in operands:
        exponents = (f"2^{o['min_scale_exponent']}..2^{o['max_scale_exponent']}"
                     if o["min_scale_exponent"] is not None else "no nonzero block")
        parts.append(f"{o['role']} along {o['axis_name']}: sat {format_percent(o['saturated_block_fraction'], 2)}, "
                     f"flushed {format_percent(o['flushed_fraction'], 2)}, scales {exponents}")
    return "; ".join(parts)


def _sqnr_text(gemm: dict[str, Any]) -> str:
    if gemm["status"] == "exact":
        return "exact"
    return format_db(gemm["sqnr_db"])


def layers_section(doc: dict[str, Any]) -> str:
    rows = []
    for layer in doc["layers"]:
        for gemm in layer["gemms"]:
            sqnr = _sqnr_text(gemm)
            rows.append([layer["module"], f"{layer['m']}×{layer['k']}×{layer['n']}", gemm["kind"],
                         num(sqnr), _operand_summary(gemm["operands"]) or gemm["note"]])
    headers = ["module", "M×K×N", "GEMM", "SQNR", "operand blocks (saturated, flushed to zero, scale range) or note"]
    note = ("Each nn.Linear is run eagerly; each of its GEMMs is recomputed in float64 from the "
            "captured operands and from their MX-quantized copies (axes as the backend quantizes "
            "them). Attention GEMMs are not covered.")
    return f"<h2>Per-layer GEMM error</h2>{table(headers, rows)}<p class=\"note\">{escape(note)}</p>"


def operators_section(doc: dict[str, Any]) -> str:
    parts = ["<h2>Top operators (self CPU time, one profiled step)</h2>"]
    for name, v in doc["variants"].items():
        rows = [[o["name"], o["op_class"], num(f"{o['self_cpu_us'] / 1000:.3f} ms"), num(str(o["calls"]))]
                for o in v["operators"]]
        parts.append(f"<h3>{escape(name)}</h3>{table(['operator', 'class', 'self CPU', 'calls'], rows)}")
    return "".join(parts)


def plots_section(doc: dict[str, Any], captions: dict[str, str]) -> str:
    figures = "".join(figure(src, captions.get(key, key)) for key, src in doc["plots"].items())
    return f"<h2>Plots</h2>{figures}"


def render_html(doc: dict[str, Any], captions: dict[str, str]) -> str:
    """The whole page for a profile document (`profiling.profile_document`)."""
    settings = (f"target {doc['target']}; {doc['steps']} timed steps after {doc['warmup']} warm-up; "
                f"bf16 autocast {'on' if doc['autocast_bf16'] else 'off'}; torch {doc['torch_version']}")
    notes = "".join(f"<li>{escape(n)}</li>" for n in doc["notes"])
    body = "".join([
        f"<h1>mxcompile profile: {escape(doc['target'])}</h1>",
        f"<p>{escape(settings)}</p>",
        summary_section(doc), rewrite_section(doc), plots_section(doc, captions),
        layers_section(doc), operators_section(doc),
        f"<h2>Notes</h2><ul>{notes}</ul>" if notes else "",
    ])
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>mxcompile profile: {escape(doc['target'])}</title><style>{CSS}</style></head>"
            f"<body>{body}</body></html>\n")
