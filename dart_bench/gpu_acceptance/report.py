"""The acceptance run's short markdown report (everything else stays in acceptance.json).

It is rewritten after every result (`runner`), so it may be read at any moment: the headline says
whether the run is still going or how it ended, the section table lists every section in run
order with its status (`pending`, `running`, `passed`, `failed`, `error: ...`, `skipped: ...`),
and the tables below hold whatever results the sections have yielded so far.
"""

from __future__ import annotations

from typing import Any

from dart_bench.gpu_acceptance.runner import CORRECTNESS, FAILED, PASSED, SPEED

CHECK_COLUMNS = ("greedy, alone", "greedy, ragged batch", "greedy, continuous batching", "seeded sampling = ar")


def verdict(report: dict[str, Any]) -> str:
    """FAILED (a correctness section failed or raised: exit 1), RUNNING (a partial report),
    ERRORS (a timing section raised), INCOMPLETE (a section skipped or cut off) or PASSED."""
    records = report["sections"]
    if report.get("exit_code"):
        return "FAILED"
    if report["state"] == "running":
        return "RUNNING"
    if any(r["status"].startswith("error") for r in records):
        return "ERRORS"
    if any(r["status"] != PASSED for r in records):
        return "INCOMPLETE"
    return "PASSED"


def markdown(report: dict[str, Any]) -> str:
    env, cfg, records = report["environment"], report["config"], report["sections"]
    device = env.get("gpu") or env["cpu"]
    forced = ", ".join(f"{k}={v}" for k, v in cfg.get("kernels", {}).items())
    done = sum(r["status"] not in ("pending", "running") for r in records)
    lines = [f"# GPU acceptance run: {verdict(report)}", "",
             f"{device} ({env['device']}), torch {env['torch']} (CUDA {env['torch_cuda'] or 'none'}), "
             f"transformers {env['transformers']}, Python {env['python']}; timed dtype {env['dtype']}"
             + (f"; kernels forced: {forced}" if forced else "") + ".", "",
             f"State: {report['state']} at {report.get('seconds', 0)} s from process start (deadline "
             f"{report['deadline_s']:.0f} s); {done} of {len(records)} sections done; exit code "
             f"{report.get('exit_code', 0)}.", "",
             "| section | status | s | results |", "|---|---|---|---|"]
    for r in records:
        status = r["status"] + (" (cut off)" if r.get("cut_off") else "")
        if r["status"] in (FAILED,) or r["status"].startswith("error"):
            status = f"**{status}**"
        lines.append(f"| {r['name']} | {status} | {r.get('seconds', '')} | {len(r.get('results', []))} |")
    lines.append("")
    errors = [r for r in records if "error" in r]
    for r in errors:
        lines += [f"`{r['name']}` raised {r['error']['type']}: {r['error']['message']}", "", "```",
                  *r["error"]["frames"], "```", ""]
    correctness = [r for r in records if r["kind"] == CORRECTNESS and r.get("results")]
    if correctness:
        lines += _correctness(correctness)
    shapes: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if r["kind"] == SPEED:
            shapes.setdefault(r["name"].split("/")[1], []).append(r)
    for shape, shape_records in shapes.items():
        lines += _speed(shape, shape_records)
    return "\n".join(lines) + "\n"


def _cell(case: dict[str, Any]) -> str:
    text = f"{case['identical'] + case['ties']}/{case['requests']}"
    if case["ties"]:
        text += f" ({case['ties']} float tie{'s' if case['ties'] > 1 else ''})"
    return text if case["passed"] else f"**FAIL {text}**"


def _correctness(records: list[dict[str, Any]]) -> list[str]:
    cases = [c for r in records for c in r["results"] if "family" in c]
    lines = ["## Correctness (fp32 tiny models, against transformers' generate)", "",
             "| family | mode | " + " | ".join(CHECK_COLUMNS) + " | tau |",
             "|---|---|" + "---|" * (len(CHECK_COLUMNS) + 1)]
    rows: dict[tuple[str, str], dict[str, dict]] = {}
    for case in cases:
        rows.setdefault((case["family"], case["mode"]), {})[case["check"]] = case
    for (family, mode), checks in rows.items():
        cells = [_cell(checks[c]) if c in checks else "-" for c in CHECK_COLUMNS]
        tau = checks.get("greedy, ragged batch", {}).get("tau", "-")
        lines.append(f"| {family} | {mode} | " + " | ".join(cells) + f" | {tau} |")
    for chi in (c for r in records for c in r["results"] if c.get("check", "").startswith("chi-square")):
        lines += ["", f"Chi-square of the first two tokens at T=1 ({chi['mode']}, {chi['draws']} draws): "
                      f"p = {chi['p_value']:.3g} ({'passed' if chi['passed'] else '**FAILED**'}; "
                      f"{chi['accepted_in_first_round']} draft tokens accepted in the first round on average)."]
    return [*lines, ""]


def _speed(shape_name: str, records: list[dict[str, Any]]) -> list[str]:
    by_name = {r["name"].rsplit("/", 1)[1]: r for r in records}
    build = by_name.get("build", {}).get("results") or [{}]
    info = build[0]
    peak = max((r.get("peak_memory_gib", 0.0) for r in records), default=0.0)
    if info:
        lines = [f"## {shape_name} ({info['parameters_b']:.2f} B parameters, random weights, {info['dtype']}; "
                 f"kernels {info['kernels']}; peak memory {peak:.1f} GiB)", ""]
    else:
        lines = [f"## {shape_name} (not built: {by_name.get('build', {}).get('status', 'pending')})", ""]
    shape = {name: r["results"] for name, r in by_name.items() if name != "build" and r.get("results")}
    if "per_token" in shape:
        p = shape["per_token"][0]
        lines += [f"`ar` at batch 1: {p['ar_ms_per_token']:.2f} ms/token; transformers' generate "
                  f"{p['transformers_ms_per_token']:.2f} ms/token ({p['ar_vs_transformers']:.2f}x).", ""]
    if "verify" in shape:
        lines += ["Verify forward, ms (x one row), by batch and tree rows per sequence:", "",
                  *_grid(shape["verify"], lambda c: f"{c['ms']:.2f} ({c['vs_one_row']:.2f}x)"), ""]
    if "gqa" in shape:
        lines += ["Verify forward ms by `gqa` strategy (masked attention over grouped K/V heads):", ""]
        for gqa in dict.fromkeys(c["gqa"] for c in shape["gqa"]):
            lines += [f"`{gqa}`:", "", *_grid([c for c in shape["gqa"] if c["gqa"] == gqa],
                                               lambda c: f"{c['ms']:.2f}"), ""]
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
    missing = [name for name, r in by_name.items() if r["status"] != PASSED]
    if missing:
        lines += ["Not measured in full: " + ", ".join(f"{n} ({by_name[n]['status']})" for n in missing) + ".", ""]
    return lines


def _grid(cells: list[dict[str, Any]], text) -> list[str]:
    """batch x rows table of `text(cell)`; a batch that ran out of memory says so in its row."""
    rows = sorted({c["rows"] for c in cells if c.get("rows") is not None})
    lines = ["| batch | " + " | ".join(str(r) for r in rows) + " |", "|---|" + "---|" * len(rows)]
    for batch in sorted({c["batch"] for c in cells}):
        mine = {c["rows"]: c for c in cells if c["batch"] == batch}
        if None in mine:
            lines.append(f"| {batch} | {mine[None]['error']} |" + " |" * max(0, len(rows) - 1))
            continue
        lines.append(f"| {batch} | " + " | ".join(text(mine[r]) if r in mine else "-" for r in rows) + " |")
    return lines
