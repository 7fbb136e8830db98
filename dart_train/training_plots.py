"""Plot draft-head training curves from the `metrics.jsonl` files that `jobs.train_draft` appends:
`python -m jobs.plot_training <metrics.jsonl> [...] --out docs/training/curves.png [--labels a b]`.

    python -m jobs.plot_training runs/head/metrics.jsonl --out docs/training/curves.png

It exists so that a run's progress (is the loss still falling, which draft positions are learning)
can be looked at, and a figure for the docs drawn, from the files training already writes, without
reading JSON by eye. One PNG: training loss (raw and moving average), dev loss, dev top-1 accuracy
per draft position (eval records) and smoothed training accuracy per position.

Files sharing a label (no --labels: all files) are one run, read in the order given: a resumed run
keeps its step numbers, so the curves just continue. A record whose step does not go beyond what
came before is the resumed run re-logging steps after its checkpoint; it replaces the earlier
records from that step on. Blank lines are ignored and garbled ones (a line cut by a crash, not
JSON, no numeric step, unknown kind) skipped with a warning count; a file with no usable record
is an error naming it. `series_from_records` is pure (no matplotlib); `draw` makes the PNG.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

KINDS = ("train", "eval")
MAX_POSITIONS = 8  # accuracy panels show draft positions 1..8 (all of the default D = 8)

XY = tuple[list[float], list[float]]


class NoUsableRecords(ValueError):
    """A metrics file with no train or eval record in it."""


@dataclass
class RunSeries:
    """What `draw` plots for one run; draft positions are 1-based (position 1 = draft row 0)."""

    label: str
    train_loss: XY = field(default_factory=lambda: ([], []))
    train_loss_smooth: XY = field(default_factory=lambda: ([], []))
    train_accuracy_smooth: dict[int, XY] = field(default_factory=dict)
    dev_loss: XY = field(default_factory=lambda: ([], []))
    dev_accuracy: dict[int, XY] = field(default_factory=dict)
    tau: dict[str, XY] = field(default_factory=dict)  # "tau_dart" etc., when the run measured it
    superseded: int = 0  # records replaced by a resumed run's re-logged steps


def _number(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _numbers(value) -> list[float] | None:
    if not isinstance(value, list) or not value:
        return None
    out = [_number(v) for v in value]
    return None if any(v is None for v in out) else out


def parse_lines(lines: Iterable[str]) -> tuple[list[dict], int]:
    """(usable records, number of garbled lines skipped). Usable: a JSON object with a numeric
    `step` and kind train or eval (inferred from its keys when a record has no `kind`)."""
    records, skipped = [], 0
    for line in lines:
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError:
            skipped += 1
            continue
        if not isinstance(record, dict) or _number(record.get("step")) is None:
            skipped += 1
            continue
        kind = record.get("kind")
        if kind is None:
            kind = "eval" if any(k.startswith(("dev_", "tau_")) for k in record) else "train"
        if kind not in KINDS:
            skipped += 1
            continue
        records.append({**record, "kind": kind})
    return records, skipped


def read_metrics(path: str | Path) -> tuple[list[dict], int]:
    """The usable records of one metrics.jsonl and the count of garbled lines; raises
    NoUsableRecords (naming the file) when there is none."""
    path = Path(path)
    with open(path, encoding="utf-8", errors="replace") as f:
        records, skipped = parse_lines(f)
    if not records:
        raise NoUsableRecords(f"{path}: no usable train/eval records ({skipped} garbled line(s)); "
                              "is this a metrics.jsonl written by jobs.train_draft?")
    return records, skipped


def moving_average(values: Sequence[float], window: int) -> list[float]:
    """Trailing mean over the last `window` finite values' slots (fewer at the start); NaN-safe."""
    out = []
    for i in range(len(values)):
        finite = [v for v in values[max(0, i - window + 1) : i + 1] if math.isfinite(v)]
        out.append(sum(finite) / len(finite) if finite else math.nan)
    return out


def _resolve_resumes(records: Sequence[dict]) -> tuple[list[dict], int]:
    """Records in order, where one whose step is below the latest seen (or repeats its own kind's
    step) drops the earlier records it re-logs: those with a later step, or the same step and kind."""
    kept: list[dict] = []
    superseded, top = 0, -math.inf
    for r in records:
        step = float(r["step"])
        if step <= top:
            before = len(kept)
            kept = [k for k in kept if k["step"] < step or (k["step"] == step and k["kind"] != r["kind"])]
            superseded += before - len(kept)
        kept.append(r)
        top = step  # after a drop nothing kept lies beyond it
    return kept, superseded


def _by_position(rows: list[tuple[float, list[float]]]) -> dict[int, XY]:
    out: dict[int, XY] = {}
    for step, values in rows:
        for i, v in enumerate(values[:MAX_POSITIONS]):
            xs, ys = out.setdefault(i + 1, ([], []))
            xs.append(step)
            ys.append(v)
    return out


def series_from_records(parts: Sequence[Sequence[dict]], label: str, smooth: int | None = None) -> RunSeries:
    """One run's plot series from its files' records (in order; later parts continue earlier ones).
    `smooth` is the moving-average window in logged points (None: about 1/20 of the points)."""
    records, superseded = _resolve_resumes([r for part in parts for r in part])
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    window = smooth if smooth is not None else min(50, max(1, len(train) // 20))
    window = max(1, window)
    run = RunSeries(label=label, superseded=superseded)

    loss = [(float(r["step"]), _number(r.get("loss"))) for r in train]
    steps = [s for s, _ in loss]
    values = [math.nan if v is None else v for _, v in loss]
    run.train_loss = (steps, values)
    run.train_loss_smooth = (steps, moving_average(values, window))

    acc_rows = [(float(r["step"]), a) for r in train if (a := _numbers(r.get("accuracy_per_position")))]
    for position, (xs, ys) in _by_position(acc_rows).items():
        run.train_accuracy_smooth[position] = (xs, moving_average(ys, window))

    dev = [(float(r["step"]), v) for r in evals if (v := _number(r.get("dev_loss"))) is not None]
    run.dev_loss = ([s for s, _ in dev], [v for _, v in dev])
    dev_rows = [(float(r["step"]), a) for r in evals if (a := _numbers(r.get("dev_accuracy_per_position")))]
    run.dev_accuracy = _by_position(dev_rows)
    for r in evals:
        for key, value in r.items():
            if key.startswith("tau_") and (v := _number(value)) is not None:
                xs, ys = run.tau.setdefault(key, ([], []))
                xs.append(float(r["step"]))
                ys.append(v)
    return run


def load_runs(paths: Sequence[str | Path], labels: Sequence[str] | None = None,
              smooth: int | None = None) -> list[RunSeries]:
    """Read the files (warning on stderr about garbled lines) and group them into runs by label."""
    if labels and len(labels) != len(paths):
        raise ValueError(f"--labels: {len(labels)} label(s) for {len(paths)} file(s)")
    if not labels:
        labels = [Path(paths[0]).resolve().parent.name or "run"] * len(paths)
    parts: dict[str, list[list[dict]]] = {}
    for path, label in zip(paths, labels):
        records, skipped = read_metrics(path)
        if skipped:
            print(f"warning: {path}: skipped {skipped} garbled line(s)", file=sys.stderr)
        parts.setdefault(label, []).append(records)
    runs = [series_from_records(p, label, smooth) for label, p in parts.items()]
    for run in runs:
        if run.superseded:
            print(f"note: {run.label}: {run.superseded} record(s) replaced by a resumed run's re-logged steps",
                  file=sys.stderr)
    return runs


def draw(runs: Sequence[RunSeries], out: str | Path, title: str | None = None) -> Path:
    """The 2x2 figure as a PNG at `out` (parent directories created)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    styles = ("-", "--", ":", "-.")
    many = len(runs) > 1
    fig, axes = plt.subplots(2, 2, figsize=(13, 8.5))
    (ax_loss, ax_dev), (ax_acc, ax_tacc) = axes
    for n, run in enumerate(runs):
        color = f"C{n}"
        prefix = f"{run.label} " if many else ""
        ax_loss.plot(*run.train_loss, color=color, alpha=0.25, lw=0.8)
        ax_loss.plot(*run.train_loss_smooth, color=color, label=f"{prefix}moving average".strip())
        if run.dev_loss[0]:
            ax_dev.plot(*run.dev_loss, "o-", color=color, ms=3, label=run.label if many else "dev loss")
        if run.tau:  # the last measured tau of each mode, as text
            text = ", ".join(f"{key} {ys[-1]:.2f} @ step {xs[-1]:g}" for key, (xs, ys) in run.tau.items())
            ax_dev.annotate(prefix + text, xy=(0.02, 0.04 + 0.06 * n), xycoords="axes fraction", fontsize=8,
                            color=color)
        cmap = plt.get_cmap("viridis")
        for ax, per_position, marker in ((ax_acc, run.dev_accuracy, "o"), (ax_tacc, run.train_accuracy_smooth, None)):
            for position, (xs, ys) in per_position.items():
                ax.plot(xs, ys, marker=marker, ms=2.5, ls=styles[n % len(styles)],
                        color=cmap((position - 1) / max(1, len(per_position) - 1) * 0.9),
                        label=f"pos {position}" if n == 0 else None)
    if many:  # positions by colour (labelled once), runs by line style
        for ax in (ax_acc, ax_tacc):
            for n, run in enumerate(runs):
                ax.plot([], [], color="gray", ls=styles[n % len(styles)], label=run.label)
    ax_loss.set_title("training loss (raw, light; moving average)")
    ax_dev.set_title("dev loss (eval records)")
    ax_acc.set_title("dev top-1 accuracy vs the target's argmax, by draft position")
    ax_tacc.set_title("training top-1 accuracy by draft position (moving average)")
    for ax in (ax_loss, ax_dev, ax_acc, ax_tacc):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, ncol=2 if many or ax in (ax_acc, ax_tacc) else 1)
        elif ax in (ax_dev, ax_acc):
            ax.text(0.5, 0.5, "no dev records", ha="center", va="center", transform=ax.transAxes, color="gray")
    ax_loss.set_ylabel("loss")
    ax_acc.set_ylabel("accuracy")
    fig.suptitle(title or "Draft-head training: " + ", ".join(run.label for run in runs))
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jobs.plot_training", description=__doc__.split("\n\n")[0])
    parser.add_argument("metrics", nargs="+", help="metrics.jsonl files written by jobs.train_draft")
    parser.add_argument("--out", default="docs/training/curves.png")
    parser.add_argument("--labels", nargs="+", help="one per file; files with the same label are one run")
    parser.add_argument("--title")
    parser.add_argument("--smooth", type=int, help="moving-average window in logged points (default: auto)")
    args = parser.parse_args(argv)
    try:
        runs = load_runs(args.metrics, args.labels, args.smooth)
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    out = draw(runs, args.out, args.title)
    print(f"plot {out}: " + "; ".join(f"{r.label}: {len(r.train_loss[0])} train, {len(r.dev_loss[0])} dev points"
                                       for r in runs))
    return 0
