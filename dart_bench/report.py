"""Plots and the Markdown report of the benchmark (`jobs.bench report`: dart_bench/matrix.py), and plots
of a real pipeline job (`jobs.bench plots --job`).

Kept apart from the measuring code so that it needs only matplotlib (Agg: no display) and plain
dicts: the tests feed it synthetic figures, and the pipeline's job summary can call
`render_job_plots` without loading a model.

Figures dict (what dart_bench.matrix.measure returns and bench.json holds):
  config      the benchmark config
  conditions  machine, dtype, threads, prompts, max_new_tokens, head/trie fingerprints, date, ...
  summary     one entry per cell: mode, temperature, budget (None for ar/hf), headline (bool),
              tokens_per_second, speedup_vs_ar, tau, mean_tree_size, agreement_with_ar,
              ms_per_round {prefill, draft, tree, verify, commit}, tokens_per_round_histogram,
              accepted_tokens_by_source {head, context, job_cache}, ...
  records     one entry per run (prompt x repeat x cell)
"""

from __future__ import annotations

import json
import os
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

from dart_bench.modes import all_modes

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after use("Agg"): the backend must be chosen first

MODE_COLORS = {"ar": "#7f7f7f", "hf": "#bcbd22", "hf_prompt_lookup": "#9467bd",
               "chain": "#1f77b4", "ddtree": "#ff7f0e", "dart": "#2ca02c"}
MODE_NAMES = {"ar": "ar (engine)", "hf": "transformers generate", "hf_prompt_lookup": "transformers prompt lookup",
              "chain": "chain", "ddtree": "ddtree", "dart": "dart"}
STAGES = ("draft", "tree", "verify", "commit")
STAGE_COLORS = {"draft": "#1f77b4", "tree": "#ff7f0e", "verify": "#d62728", "commit": "#8c564b"}
PLOTS = {
    "speedup": "speedup_vs_ar.png",
    "tau_hist": "tau_histograms.png",
    "budget": "budget_sweep.png",
    "stages": "stage_time_per_round.png",
}


def _mode_key(entry: dict) -> tuple:
    order = all_modes()
    return order.index(entry["mode"]) if entry["mode"] in order else len(order), entry.get("budget") or 0


def _label(entry: dict) -> str:
    return entry["mode"] if entry.get("budget") is None else f"{entry['mode']}@{entry['budget']}"


def _temps(summary: list[dict]) -> list[float]:
    return sorted({e["temperature"] for e in summary})


def _headline(summary: list[dict], temperature: float) -> list[dict]:
    return sorted((e for e in summary if e["temperature"] == temperature and e.get("headline", True)), key=_mode_key)


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------ benchmark plots


def plot_speedup(summary: list[dict], path: Path) -> Path:
    """Bars of speedup over `ar` (per token), one group per temperature, one bar per mode."""
    temps = _temps(summary)
    modes = [m for m in all_modes() if any(e["mode"] == m for e in summary)]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * len(modes) * len(temps) + 3), 4.2))
    width = 0.8 / max(len(modes), 1)
    for i, mode in enumerate(modes):
        xs, ys, labels = [], [], []
        for g, t in enumerate(temps):
            entry = next((e for e in _headline(summary, t) if e["mode"] == mode), None)
            if entry is None:
                continue
            xs.append(g + (i - (len(modes) - 1) / 2) * width)
            ys.append(entry["speedup_vs_ar"])
            labels.append(_label(entry))
        if not xs:
            continue
        bars = ax.bar(xs, ys, width * 0.92, color=MODE_COLORS.get(mode), label=MODE_NAMES.get(mode, mode))
        for bar, y, lab in zip(bars, ys, labels):
            ax.annotate(f"{y:.2f}x", (bar.get_x() + bar.get_width() / 2, y), ha="center", va="bottom",
                        fontsize=8, xytext=(0, 2), textcoords="offset points")
            if "@" in lab:
                ax.annotate(lab.split("@")[1], (bar.get_x() + bar.get_width() / 2, 0), ha="center", va="bottom",
                            fontsize=7, color="white", xytext=(0, 2), textcoords="offset points")
    ax.axhline(1.0, color="black", lw=0.8, ls="--")
    ax.set_xticks(range(len(temps)), [f"temperature {t:g}" for t in temps])
    ax.set_ylabel("speedup over ar (median of per-run ratios)")
    budget = next((e["budget"] for e in summary if e.get("headline") and e.get("budget")), None)
    ax.set_title("Decoding speed relative to autoregressive" + (f" (tree budget {budget})" if budget else ""))
    ax.set_ylim(0, max([e["speedup_vs_ar"] for e in summary] + [1.0]) * 1.2)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def plot_tau_histograms(summary: list[dict], path: Path) -> Path:
    """Per speculative mode: share of rounds by tokens committed per round (its mean is tau)."""
    temps = _temps(summary)
    modes = [m for m in all_modes() if any(e["mode"] == m and e.get("tokens_per_round_histogram")
                                          and m != "ar" for e in summary)]
    if not modes:
        fig, ax = plt.subplots(figsize=(6, 2.5))
        ax.axis("off")
        ax.text(0.5, 0.5, "no speculative mode measured", ha="center", va="center")
        return _save(fig, path)
    ncols = len(modes)
    fig, axes = plt.subplots(1, ncols, figsize=(4.2 * ncols, 3.6), squeeze=False, sharey=True)
    width = 0.8 / max(len(temps), 1)
    peak = 0.0
    for ax, mode in zip(axes[0], modes):
        titles = []
        top = 1
        for j, t in enumerate(temps):
            entry = next((e for e in _headline(summary, t) if e["mode"] == mode), None)
            if entry is None or not entry.get("tokens_per_round_histogram"):
                continue
            hist = entry["tokens_per_round_histogram"]
            total = sum(hist) or 1
            ks = [k for k in range(1, len(hist))]
            top = max(top, max((k for k in ks if hist[k]), default=1))
            peak = max(peak, max(hist) / total)
            ax.bar([k + (j - (len(temps) - 1) / 2) * width for k in ks], [hist[k] / total for k in ks],
                   width * 0.92, label=f"T={t:g} (tau {entry.get('tau', 0):.2f})", alpha=0.85)
            titles.append(_label(entry))
        top = max(top, 3)  # keep some room to the right even when nothing is accepted
        ax.set_xticks(range(1, top + 1))
        ax.set_xlim(0.4, top + 0.6)
        ax.set_xlabel("tokens committed per round")
        ax.set_title(titles[0] if titles else mode)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("share of rounds")
    axes[0][0].set_ylim(0, max(peak, 0.1) * 1.35)  # headroom keeps the legends off the bars
    fig.suptitle("Acceptance: tokens per verification round (accepted draft tokens + 1)", fontsize=10)
    return _save(fig, path)


def plot_budget_sweep(summary: list[dict], path: Path) -> Path:
    """Speedup and tau against the tree budget: a line per tree mode, solid T=0, dashed T>0."""
    fig, (ax_s, ax_t) = plt.subplots(1, 2, figsize=(10, 4))
    styles = ["-", "--", ":", "-."]
    budgets: set[int] = set()
    for j, t in enumerate(_temps(summary)):
        for mode in all_modes():
            pts = sorted((e["budget"], e) for e in summary
                         if e["mode"] == mode and e["temperature"] == t and e.get("budget") is not None)
            if not pts:
                continue
            budgets.update(b for b, _ in pts)
            kw = {"color": MODE_COLORS.get(mode), "ls": styles[j % len(styles)], "marker": "o",
                  "label": f"{mode} T={t:g}"}
            ax_s.plot([b for b, _ in pts], [e["speedup_vs_ar"] for _, e in pts], **kw)
            ax_t.plot([b for b, _ in pts], [e.get("tau", 0.0) for _, e in pts], **kw)
    baselines = []
    for e in sorted(summary, key=lambda e: (_mode_key(e), e["temperature"])):  # budget-free baselines
        if e["mode"] in ("hf", "hf_prompt_lookup") and budgets:
            ls = styles[_temps(summary).index(e["temperature"]) % len(styles)]
            baselines.append(ax_s.axhline(e["speedup_vs_ar"], color=MODE_COLORS[e["mode"]], lw=1.2, ls=ls,
                                          label=f"{e['mode']} T={e['temperature']:g}"))
    for ax, ylabel in ((ax_s, "speedup over ar"), (ax_t, "tau (tokens per round)")):
        ax.axhline(1.0, color="black", lw=0.8, ls="--")
        ax.set_xlabel("tree budget (draft nodes per round)")
        ax.set_ylabel(ylabel)
        if budgets:
            ax.set_xticks(sorted(budgets))
        ax.grid(alpha=0.3)
    ax_s.set_title("Speedup vs tree budget")
    ax_t.set_title("tau vs tree budget")
    taus = [e.get("tau", 1.0) for e in summary if e.get("budget") is not None]
    ax_t.set_ylim(0.9, max([*taus, 1.4]) * 1.1)  # a flat tau = 1 line should look flat, not zoomed noise
    if budgets:  # one legend outside the panels: lines never hide behind it
        handles = ax_t.get_legend_handles_labels()[0] + baselines
        ax_t.legend(handles=handles, fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        ax_s.text(0.5, 0.5, "no tree mode measured", ha="center", va="center", transform=ax_s.transAxes)
    return _save(fig, path)


def plot_stage_times(summary: list[dict], path: Path) -> Path:
    """Stacked bars of ms per round by stage (draft / tree / verify / commit), per engine mode."""
    temps = _temps(summary)
    fig, axes = plt.subplots(1, len(temps), figsize=(5.0 * len(temps), 4.2), squeeze=False, sharey=True)
    for ax, t in zip(axes[0], temps):
        entries = [e for e in _headline(summary, t) if e.get("ms_per_round")]
        labels = [_label(e) for e in entries]
        bottom = [0.0] * len(entries)
        for stage in STAGES:
            vals = [e["ms_per_round"].get(stage, 0.0) for e in entries]
            ax.bar(labels, vals, bottom=bottom, color=STAGE_COLORS[stage], label=stage)
            bottom = [b + v for b, v in zip(bottom, vals)]
        for x, total in enumerate(bottom):
            ax.annotate(f"{total:.0f}", (x, total), ha="center", va="bottom", fontsize=8,
                        xytext=(0, 2), textcoords="offset points")
        ax.set_title(f"temperature {t:g}")
        ax.tick_params(axis="x", labelrotation=20)
        if not entries:
            ax.text(0.5, 0.5, "no engine mode measured", ha="center", va="center", transform=ax.transAxes)
    axes[0][0].set_ylabel("ms per round")
    axes[0][-1].legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle("Time per decoding round by stage (prefill excluded)", fontsize=10)
    return _save(fig, path)


def render_plots(summary: list[dict], out_dir: str | os.PathLike) -> dict[str, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return {
        "speedup": plot_speedup(summary, out / PLOTS["speedup"]),
        "tau_hist": plot_tau_histograms(summary, out / PLOTS["tau_hist"]),
        "budget": plot_budget_sweep(summary, out / PLOTS["budget"]),
        "stages": plot_stage_times(summary, out / PLOTS["stages"]),
    }


# ------------------------------------------------------------------------------ markdown


def _fmt(value: Any, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def _provenance(entry: dict) -> str:
    """Accepted draft tokens by source (records of older runs lack some sources, or all)."""
    by_source = entry.get("accepted_tokens_by_source")
    if not by_source:
        return "-"
    return " / ".join(str(by_source.get(s, 0)) for s in ("head", "context", "job_cache"))


def summary_table(summary: list[dict]) -> list[str]:
    lines = ["| mode | budget | T | tok/s | speedup vs ar | tau | mean tree | agrees with ar (T=0) |"
             " ms/round draft / tree / verify / commit | accepted head / context / job cache | runs |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---|---:|"]
    for t in _temps(summary):
        for e in sorted((e for e in summary if e["temperature"] == t), key=_mode_key):
            ms = e.get("ms_per_round")
            stages = " / ".join(f"{ms.get(s, 0.0):.1f}" for s in STAGES) if ms else "-"
            lines.append(f"| {e['mode']} | {e.get('budget') or '-'} | {t:g} | {e['tokens_per_second']:.1f} | "
                         f"{e['speedup_vs_ar']:.2f} | {_fmt(e.get('tau'))} | {_fmt(e.get('mean_tree_size'), '.1f')} | "
                         f"{_fmt(e.get('agreement_with_ar'))} | {stages} | {_provenance(e)} | {e['runs']} |")
    return lines


def conditions_table(conditions: dict[str, Any]) -> list[str]:
    keys = ("date_utc", "host", "cpu", "cpus_visible", "threads", "omp_wait_policy", "load_average_start",
            "load_average_end", "target", "dtype", "device", "prompts", "prompt_tokens", "max_new_tokens", "repeats",
            "head", "head_fingerprint", "trie", "trie_fingerprint", "torch", "transformers", "git_commit",
            "measure_seconds")
    lines = ["| condition | value |", "|---|---|"]
    for k in keys:
        if k in conditions:
            v = conditions[k]
            if isinstance(v, float):
                v = f"{v:.0f}"
            elif isinstance(v, list) and v and isinstance(v[0], float):
                v = ", ".join(f"{x:.2f}" for x in v)
            lines.append(f"| {k} | {v} |")
    return lines


def render_markdown(figures: dict[str, Any], plots: dict[str, Path], out_dir: Path) -> str:
    summary, cond = figures["summary"], figures.get("conditions", {})
    cfg = figures.get("config", {})
    rel = {k: os.path.relpath(p, out_dir) for k, p in plots.items()}
    notes = []
    if cond.get("head_trained") is False:
        notes.append("The draft head is **untrained** (random init): its candidates are noise, so chain, ddtree "
                     "and dart accept almost nothing (the N-gram trie only re-scores the draft's candidates) and "
                     "pay the draft and tree cost for nothing. These figures exercise the machinery only.")
    loads = [cond[k][0] for k in ("load_average_start", "load_average_end") if cond.get(k)]
    if loads and cond.get("cpus_visible") and max(loads) > 0.5 * cond["cpus_visible"]:
        notes.append(f"The machine was shared (1-minute load average up to {max(loads):.1f} on "
                     f"{cond['cpus_visible']} CPUs at the start or end): timings are noisy; compare modes within "
                     "this run only.")
    lines = [
        "# Decoding benchmark",
        "",
        f"All modes decoded the same {cond.get('prompts', '?')} ShareGPT dev prompts in one process, interleaved "
        f"prompt by prompt, {cond.get('repeats', cfg.get('repeats', '?'))} repeat(s); figures are medians over runs. "
        "Speedup is per generated token, each run paired with the `ar` run of the same prompt and repeat at the "
        "same temperature. `hf` is transformers' `generate` (greedy at T=0, `do_sample=True` above); "
        "`hf_prompt_lookup` is greedy only. tau = tokens committed per verification round.",
        "",
        "\n>\n".join(f"> {n}" for n in notes),
        "",
        "## Figures",
        "",
        *summary_table(summary),
        "",
        f"![speedup vs ar]({rel['speedup']})",
        "",
        f"![tau histograms]({rel['tau_hist']})",
        "",
        f"![speedup and tau vs tree budget]({rel['budget']})",
        "",
        f"![time per round by stage]({rel['stages']})",
        "",
        "## Conditions",
        "",
        *conditions_table(cond),
        "",
    ]
    if figures.get("command"):
        lines += ["Command:", "", f"    {figures['command']}", ""]
    return "\n".join(lines)


def render_report(figures: dict[str, Any], out_dir: str | os.PathLike) -> Path:
    """PNG plots + report.md (embedding them by relative links) in out_dir; returns report.md."""
    out = Path(out_dir)
    plots = render_plots(figures["summary"], out)
    path = out / "report.md"
    path.write_text(render_markdown(figures, plots, out))
    return path


def print_summary(summary: list[dict]) -> None:
    print("\n".join(summary_table(summary)))


# ------------------------------------------------------------------------------ pipeline job plots

JOB_COLUMNS = ["row_key", "run_id", "id", "error", "mode", "worker", "num_generated_tokens", "tau", "rounds", "wall_s",
               "finished_at"]


def _is_summary_json(src: str) -> bool:
    return src.rstrip("/").endswith(".json")


def _read_json_url(url: str) -> dict:
    import fsspec

    with fsspec.open(url, "r") as f:
        return json.load(f)


def _ok_rows(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r.get("error") and r.get("wall_s")]


def _timed(rows: list[dict]) -> bool:
    """Whether every successful row has `finished_at` (then the job's real clock is known)."""
    ok = _ok_rows(rows)
    return bool(ok) and all(r.get("finished_at") is not None for r in ok)


def throughput_timeline(rows: list[dict]) -> dict[str, list[tuple[float, float, int]]]:
    """Per worker: (seconds, tokens/s, cumulative tokens) at each moment rows finished.

    Rows with `finished_at` (output schema 2) are placed on the job's clock: seconds since the
    first row began decoding (`finished_at - wall_s`), the same axis for every worker; the rate
    at a point is the tokens of the rows finishing then over the time since the worker's previous
    point (its first row's start for the first point). `finished_at` is each row's own finish
    (outputs written before 2026-11-25: the batch's end, one point per batch). Older rows have only their batch's
    wall time (`wall_s`, equal for every row of one batch): a batch is then the rows of one worker
    sharing one wall_s, its rate batch tokens / wall_s, and the worker's axis the running sum of
    its batch times in row_key order (its busy time).
    """
    ok, timed = _ok_rows(rows), _timed(rows)
    several_runs = len({r.get("run_id") for r in ok}) > 1  # a resumed job: workers of each attempt apart
    batches: dict[tuple[str, Any], list[dict]] = defaultdict(list)
    for r in ok:
        worker = r.get("worker") or "?"
        worker = f"{r.get('run_id')}/{worker}" if several_runs else worker
        batches[worker, r["finished_at"].timestamp() if timed else float(r["wall_s"])].append(r)
    per_worker: dict[str, list[tuple[float, float, int]]] = defaultdict(list)
    total: dict[str, int] = defaultdict(int)
    if timed:  # by worker, then finishing time
        starts: dict[str, float] = {}
        for (worker, end), batch in batches.items():
            start = min(end - float(r["wall_s"]) for r in batch)
            starts[worker] = min(starts.get(worker, start), start)
        origin = min(starts.values(), default=0.0)
        previous = dict(starts)
        for (worker, end), batch in sorted(batches.items(), key=lambda kv: kv[0]):
            tokens = sum(int(r.get("num_generated_tokens") or 0) for r in batch)
            total[worker] += tokens
            per_worker[worker].append((end - origin, tokens / max(end - previous[worker], 1e-9), total[worker]))
            previous[worker] = end
        return dict(per_worker)
    # by worker, then row_key (the processing order is not recorded)
    order = sorted(batches.items(), key=lambda kv: (kv[0][0], min(str(r.get("row_key", "")) for r in kv[1])))
    clock: dict[str, float] = defaultdict(float)
    for (worker, wall), batch in order:
        tokens = sum(int(r.get("num_generated_tokens") or 0) for r in batch)
        clock[worker] += wall
        total[worker] += tokens
        per_worker[worker].append((clock[worker], tokens / wall, total[worker]))
    return dict(per_worker)


def plot_job_tau(rows: list[dict], path: Path, summary: dict | None = None) -> Path:
    """Distribution of per-row tau, one histogram per decoding mode."""
    by_mode: dict[str, list[float]] = defaultdict(list)
    for r in rows:
        if not r.get("error") and r.get("rounds") and r.get("tau") is not None:
            by_mode[r.get("mode") or "?"].append(float(r["tau"]))
    fig, ax = plt.subplots(figsize=(6.5, 4))
    if by_mode:
        top = max(max(v) for v in by_mode.values())
        bins = [1 + 0.25 * i for i in range(int((max(top, 1.0) - 1) / 0.25) + 2)]
        for mode, taus in sorted(by_mode.items()):
            ax.hist(taus, bins=bins, alpha=0.6, color=MODE_COLORS.get(mode),
                    label=f"{mode}: {len(taus)} rows, mean {statistics.mean(taus):.2f}, "
                          f"median {statistics.median(taus):.2f}")
        ax.legend(fontsize=8)
    elif summary and summary.get("this_run", {}).get("tau", {}).get("histogram"):
        hist = summary["this_run"]["tau"]["histogram"]
        ax.bar(list(hist), list(hist.values()), color=MODE_COLORS["dart"])
        ax.set_xlabel("tau bucket")
    else:
        ax.text(0.5, 0.5, "no row with a verification round", ha="center", va="center", transform=ax.transAxes)
    ax.set_xlabel(ax.get_xlabel() or "tau (tokens committed per round), per row")
    ax.set_ylabel("rows")
    ax.set_title("Acceptance per row")
    return _save(fig, path)


def plot_job_throughput(rows: list[dict], path: Path) -> Path:
    """Tokens/s of finished rows and cumulative tokens over the job's clock (or each worker's busy time)."""
    timeline = throughput_timeline(rows)
    fig, (ax_r, ax_c) = plt.subplots(1, 2, figsize=(11, 4))
    for worker, pts in sorted(timeline.items()):
        xs = [p[0] for p in pts]
        ax_r.plot(xs, [p[1] for p in pts], marker=".", label=worker)
        ax_c.plot([0.0, *xs], [0, *[p[2] for p in pts]], label=worker)
    if not timeline:
        ax_r.text(0.5, 0.5, "no successful row", ha="center", va="center", transform=ax_r.transAxes)
    ax_r.set_ylabel("tokens/s (rows finished since the last point)" if _timed(rows) else "tokens/s per batch")
    ax_c.set_ylabel("generated tokens (cumulative)")
    for ax in (ax_r, ax_c):
        ax.set_xlabel("seconds since the first row began" if _timed(rows)
                      else "worker busy time (s, reconstructed from wall_s)")
        ax.grid(alpha=0.3)
    ax_r.set_title("Throughput over time")
    ax_c.set_title("Tokens generated")
    if 1 < len(timeline) <= 12:
        ax_c.legend(fontsize=7, loc="upper left")
    return _save(fig, path)


def render_job_plots(summary_json_or_output_url: str, out_dir: str | os.PathLike) -> dict[str, Path]:
    """Plots of a real pipeline job: tau distribution and throughput over time.

    Accepts the job summary (`<output>/_job_summary.json`, whose config names the output) or the
    output URL itself (any fsspec URL). Rows come from pipeline.data.outputs.read_output. Returns
    {"tau": png, "throughput": png}.
    """
    from pipeline.data.outputs import read_output

    src = str(summary_json_or_output_url)
    summary = None
    if _is_summary_json(src):
        summary = _read_json_url(src)
        try:
            output_url = summary["config"]["output"]["url"]
        except (KeyError, TypeError):
            raise ValueError(f"{src} is not a job summary: it has no config.output.url") from None
    else:
        output_url = src
        try:
            summary = _read_json_url(f"{src.rstrip('/')}/_job_summary.json")
        except (OSError, ValueError):
            summary = None
    rows = read_output(output_url, columns=JOB_COLUMNS).to_pylist()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return {"tau": plot_job_tau(rows, out / "job_tau.png", summary),
            "throughput": plot_job_throughput(rows, out / "job_throughput.png")}


def main(argv: list[str] | None = None) -> int:
    """Re-render a report from its bench.json, or plot a pipeline job (--job)."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m jobs.bench plots", description=main.__doc__)
    parser.add_argument("source", help="bench.json of a benchmark run, or with --job a job summary / output URL")
    parser.add_argument("out_dir", nargs="?", help="where to write (default: the folder of bench.json)")
    parser.add_argument("--job", action="store_true", help="plot a pipeline job instead of a benchmark")
    args = parser.parse_args(argv)
    if args.job:
        for name, path in render_job_plots(args.source, args.out_dir or ".").items():
            print(f"{name}: {path}")
        return 0
    figures = json.loads(Path(args.source).read_text())
    print(f"wrote {render_report(figures, args.out_dir or Path(args.source).parent)}")
    return 0
