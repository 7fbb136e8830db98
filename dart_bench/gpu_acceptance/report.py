"""The acceptance run's short markdown report (everything else stays in acceptance.json)."""

from __future__ import annotations

from typing import Any

CHECK_COLUMNS = ("greedy, alone", "greedy, ragged batch", "greedy, continuous batching", "seeded sampling = ar")


def markdown(report: dict[str, Any]) -> str:
    env = report["environment"]
    device = env.get("gpu") or env["cpu"]
    lines = [f"# GPU acceptance run: {'PASSED' if report['passed'] else 'FAILED'}", "",
             f"{device} ({env['device']}), torch {env['torch']} (CUDA {env['torch_cuda'] or 'none'}), "
             f"transformers {env['transformers']}, Python {env['python']}; timed dtype {env['dtype']}; "
             f"{report['seconds']} s in all.", ""]
    if "correctness" in report:
        lines += _correctness(report["correctness"])
    for shape in report.get("speed", []):
        lines += _speed(shape)
    return "\n".join(lines) + "\n"


def _cell(case: dict[str, Any]) -> str:
    text = f"{case['identical'] + case['ties']}/{case['requests']}"
    if case["ties"]:
        text += f" ({case['ties']} float tie{'s' if case['ties'] > 1 else ''})"
    return text if case["passed"] else f"**FAIL {text}**"


def _correctness(section: dict[str, Any]) -> list[str]:
    lines = [f"## Correctness (fp32 tiny models, against transformers' generate): "
             f"{'passed' if section['passed'] else 'FAILED'}", "",
             "| family | mode | " + " | ".join(CHECK_COLUMNS) + " | tau |",
             "|---|---|" + "---|" * (len(CHECK_COLUMNS) + 1)]
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for case in section["cases"]:
        rows.setdefault((case["family"], case["mode"]), {})[case["check"]] = case
    for (family, mode), checks in rows.items():
        cells = [_cell(checks[c]) if c in checks else "-" for c in CHECK_COLUMNS]
        tau = checks.get("greedy, ragged batch", {}).get("tau", "-")
        lines.append(f"| {family} | {mode} | " + " | ".join(cells) + f" | {tau} |")
    chi = section.get("chi_square")
    if chi:
        lines += ["", f"Chi-square of the first two tokens at T=1 ({chi['mode']}, {chi['draws']} draws): "
                      f"p = {chi['p_value']:.3g} ({'passed' if chi['passed'] else '**FAILED**'}; "
                      f"{chi['accepted_in_first_round']} draft tokens accepted in the first round on average)."]
    return [*lines, ""]


def _speed(shape: dict[str, Any]) -> list[str]:
    lines = [f"## {shape['shape']} ({shape['parameters_b']:.2f} B parameters, random weights, {shape['dtype']}; "
             f"kernels {shape['kernels']}; peak memory {shape['peak_memory_gib']:.1f} GiB)", ""]
    if "per_token" in shape:
        p = shape["per_token"]
        lines += [f"`ar` at batch 1: {p['ar_ms_per_token']:.2f} ms/token; transformers' generate "
                  f"{p['transformers_ms_per_token']:.2f} ms/token ({p['ar_vs_transformers']:.2f}x).", ""]
    if "verify" in shape:
        rows = sorted({c["rows"] for c in shape["verify"]})
        lines += ["Verify forward, ms (x one row), by batch and tree rows per sequence:", "",
                  "| batch | " + " | ".join(str(r) for r in rows) + " |", "|---|" + "---|" * len(rows)]
        for batch in sorted({c["batch"] for c in shape["verify"]}):
            cells = {c["rows"]: c for c in shape["verify"] if c["batch"] == batch}
            lines.append(f"| {batch} | " + " | ".join(
                f"{cells[r]['ms']:.2f} ({cells[r]['vs_one_row']:.2f}x)" if r in cells else "-" for r in rows) + " |")
        lines.append("")
    if "gqa" in shape:
        cells = shape["gqa"]
        shapes = sorted({(c["batch"], c["rows"]) for c in cells})
        lines += ["Verify forward ms by `gqa` strategy (masked attention over grouped K/V heads):", "",
                  "| strategy | " + " | ".join(f"B={b} x {r}" for b, r in shapes) + " |",
                  "|---|" + "---|" * len(shapes)]
        for gqa in dict.fromkeys(c["gqa"] for c in cells):
            ms = {(c["batch"], c["rows"]): c["ms"] for c in cells if c["gqa"] == gqa}
            lines.append(f"| {gqa} | " + " | ".join(f"{ms[s]:.2f}" for s in shapes) + " |")
        lines.append("")
    if "drafting" in shape:
        lines += ["| mode | batch | draft head ms/round | tree build ms/round | verify ms/round | mean tree |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {c['mode']} | {c['batch']} | {c['draft_head_ms_per_round']:.2f} | "
                  f"{c['tree_build_ms_per_round']:.2f} | {c['verify_ms_per_round']:.2f} | {c['mean_tree_size']:.1f} |"
                  for c in shape["drafting"]]
        lines.append("")
    if "syncs" in shape:
        lines.append("Device-to-host syncs per round (counted): " + ", ".join(
            f"{c['mode']} B={c['batch']}: {c['syncs_per_round']:.1f}" for c in shape["syncs"]) + ".")
        lines.append("")
    if "throughput" in shape:
        lines.append("Throughput: " + ", ".join(
            f"{c['mode']} at B={c['batch']}: {c['tokens_per_s']:.0f} tokens/s (mean tree {c['mean_tree_size']:.1f}, "
            f"tau {c['tau']:.2f})" for c in shape["throughput"]) + ".")
        lines.append("")
    if shape["skipped"]:
        lines += [f"Skipped for time: {', '.join(shape['skipped'])}.", ""]
    return lines
