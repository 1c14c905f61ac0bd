"""Suite results as JSON (everything, absolute times included) and as a markdown report
(ratios only, plus a PASS/FAIL summary of the targets)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

__all__ = ["render_markdown", "summary_rows", "write_outputs"]


def _num(x: float | None, digits: int = 2) -> str:
    if x is None:
        return "-"
    if math.isinf(x):
        return "inf"
    return f"{x:.{digits}f}"


def _diff(x: float | None) -> str:
    if x is None:
        return ""
    return "0" if x == 0 else f"{x:.1e}"


def summary_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per target (and per reported ratio without target) over all cases."""
    rows = []
    for case in result["cases"]:
        for t in case["targets"]:
            status = "report" if t["pass"] is None else ("PASS" if t["pass"] else "FAIL")
            rows.append(
                {
                    "case": case["key"],
                    "measure": t["name"],
                    "ratio": t["ratio"],
                    "target": None if t["target"] is None else f"{t['op']} {t['target']:g}",
                    "status": status,
                }
            )
    return rows


def _case_table(case: dict[str, Any]) -> list[str]:
    base = case["baseline"]
    lines = [f"## {case['title']}", ""]
    setup = ", ".join(f"{k}: {v}" for k, v in case["setup"].items())
    lines.append(setup + ".")
    if len(base["candidates"]) > 1:
        cands = ", ".join(f"`{c}`" for c in base["candidates"])
        lines.append(f"Baseline: the faster of {cands} (here `{base['chosen']}`).")
    else:
        lines.append(f"Baseline: `{base['chosen']}`.")
    agree = case["agreement"]
    if agree.get("reference"):
        lines.append(
            f"Agreement: max abs diff vs `{agree['reference']}` (max abs value "
            f"{agree['max_abs_reference']:.2g}; tolerance rtol {agree['rtol']:g}, "
            f"atol {agree['atol']:g}): {'all agree' if agree['all_agree'] else 'MISMATCH'}."
        )
    peak = any(m.get("peak_mib") is not None for m in case["methods"])
    lines += [
        "",
        "| method | x baseline | paired IQR | max abs diff |" + (" peak MiB |" if peak else ""),
        "|---|---:|---:|---:|" + ("---:|" if peak else ""),
    ]
    for m in case["methods"]:
        iqr = f"{_num(m['paired_ratio_q1'])}-{_num(m['paired_ratio_q3'])}"
        flag = "" if m["agree"] is not False else " (MISMATCH)"
        row = f"| `{m['label']}` | {_num(m['ratio'])} | {iqr} | {_diff(m['max_abs_diff'])}{flag} |"
        lines.append(row + (f" {_num(m.get('peak_mib'), 1)} |" if peak else ""))
    for k, v in case["extras"].items():
        lines.append("")
        lines.append(f"{k}: {_diff(v) if isinstance(v, float) else v}")
    for note in case["notes"]:
        lines += ["", note]
    lines.append("")
    return lines


def _device_text(machine: dict[str, Any]) -> str:
    if machine.get("device_name") is None:
        return ""
    return (
        f", on {machine['device']} ({machine['device_name']}, CUDA {machine['cuda']}; times "
        "from CUDA events, 'peak MiB' from torch.cuda.max_memory_allocated)"
    )


def render_markdown(result: dict[str, Any]) -> str:
    """The report: machine line, one table per case, and the summary of targets."""
    mach = result["machine"]
    cfg = result["config"]
    lines = [
        f"# gradkit benchmarks: {result['suite']}",
        "",
        f"torch {mach['torch']}, {mach['threads']} thread(s), {mach['cpu']} "
        f"({mach['logical_cpus']} logical CPUs){_device_text(mach)}, {mach['date']}; "
        f"{cfg['mode']} run ({cfg['repeats']} interleaved rounds by default, scaled per case).",
        "",
        "Each row is the median time of a method divided by the median time of the case's",
        "baseline, measured side by side in one process (lower is faster); 'paired IQR' is the",
        "interquartile range of the per-round ratios. Absolute times are in the JSON file.",
        "",
    ]
    for case in result["cases"]:
        lines += _case_table(case)
    lines += [
        "## Summary",
        "",
        "| case | measure | ratio | target | result |",
        "|---|---|---:|---:|---|",
    ]
    for row in summary_rows(result):
        lines.append(
            f"| {row['case']} | {row['measure']} | {_num(row['ratio'])} | "
            f"{row['target'] or '-'} | {row['status']} |"
        )
    s = result["summary"]
    lines += [
        "",
        f"Targets passed: {s['targets_passed']} of {s['targets_total']}. "
        f"Numerical agreement: {'all results agree' if s['all_agree'] else 'MISMATCH'}.",
        "",
    ]
    return "\n".join(lines)


def write_outputs(result: dict[str, Any], out_dir: Path) -> tuple[Path, Path]:
    """Write ``<out_dir>/<suite>.json`` and ``<out_dir>/<suite>.md``; returns both paths."""
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path = out_dir / f"{result['suite']}.json"
    md_path = out_dir / f"{result['suite']}.md"
    json_path.write_text(json.dumps(result, indent=2, allow_nan=True) + "\n", encoding="utf-8")
    md_path.write_text(render_markdown(result), encoding="utf-8")
    return json_path, md_path
