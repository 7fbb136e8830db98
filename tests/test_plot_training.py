"""dart_train/training_plots.py: records -> plot series (garbled lines, eval records, resumed runs), the
error on a file with nothing usable, and a PNG drawn from a synthetic metrics.jsonl."""

from __future__ import annotations

import json
import math
import re

import pytest

from dart_train import training_plots as pt


def _train(step, loss, acc=(0.5, 0.3, 0.2, 0.1)):
    return {"kind": "train", "step": step, "loss": loss, "lr": 1e-4, "grad_norm": 1.0, "tokens_per_s": 100.0,
            "tokens_seen": step * 10, "epoch": 0, "accuracy_per_position": list(acc), "minutes": 0.1}


def _eval(step, dev_loss, acc, **extra):
    return {"kind": "eval", "step": step, "dev_loss": dev_loss, "dev_kl_per_position": [1.0] * len(acc),
            "dev_accuracy_per_position": list(acc), "dev_in_vocab_mass": 0.9, "dev_anchors": 40, **extra}


LINES = [
    json.dumps(_train(1, 10.0)),
    "",
    "not json at all",
    json.dumps(_train(10, 8.0, (0.6, 0.4, 0.2, 0.1))),
    '{"kind": "train", "step": 20, "loss": 7.',  # cut by a crash
    json.dumps([1, 2, 3]),  # JSON, not an object
    json.dumps({"kind": "train", "loss": 1.0}),  # no step
    json.dumps({"kind": "train", "step": True, "loss": 1.0}),  # a bool is not a step
    json.dumps({"kind": "summary", "step": 5}),  # unknown kind
    json.dumps(_train(20, 6.0, (0.7, 0.5, 0.3, 0.2))),
    json.dumps(_eval(20, 5.5, (0.4, 0.3, 0.2, 0.1, 0.05), tau_chain=1.3, tau_dart=1.9)),
    json.dumps({"kind": "eval", "step": 30}),  # an eval with no dev set: usable, contributes nothing
    "   ",
]


def test_parse_lines_keeps_train_and_eval_records_and_counts_garbled_ones():
    records, skipped = pt.parse_lines(LINES)
    assert skipped == 6
    assert [(r["kind"], r["step"]) for r in records] == [("train", 1), ("train", 10), ("train", 20), ("eval", 20),
                                                         ("eval", 30)]


def test_records_without_kind_are_classified_by_their_keys():
    records, skipped = pt.parse_lines([json.dumps({"step": 3, "loss": 2.0}), json.dumps({"step": 3, "dev_loss": 1.0})])
    assert skipped == 0
    assert [r["kind"] for r in records] == ["train", "eval"]


def test_series_from_records():
    records, _ = pt.parse_lines(LINES)
    run = pt.series_from_records([records], "a", smooth=2)
    assert run.label == "a"
    assert run.train_loss == ([1.0, 10.0, 20.0], [10.0, 8.0, 6.0])
    assert run.train_loss_smooth == ([1.0, 10.0, 20.0], [10.0, 9.0, 7.0])
    assert sorted(run.train_accuracy_smooth) == [1, 2, 3, 4]
    assert run.train_accuracy_smooth[1][0] == [1.0, 10.0, 20.0]
    assert run.train_accuracy_smooth[1][1] == pytest.approx([0.5, 0.55, 0.65])
    assert run.dev_loss == ([20.0], [5.5])
    assert sorted(run.dev_accuracy) == [1, 2, 3, 4, 5]  # all positions when there are few
    assert run.dev_accuracy[1] == ([20.0], [0.4])
    assert run.dev_accuracy[5] == ([20.0], [0.05])
    assert run.tau == {"tau_chain": ([20.0], [1.3]), "tau_dart": ([20.0], [1.9])}
    assert run.superseded == 0


def test_positions_are_capped_and_nan_loss_does_not_poison_the_average():
    many = [0.1 * i for i in range(12)]
    records = [_train(1, 4.0, many), _train(2, math.nan, many), _train(3, 2.0, many)]
    run = pt.series_from_records([records], "r", smooth=3)
    assert sorted(run.train_accuracy_smooth) == list(range(1, pt.MAX_POSITIONS + 1))
    assert math.isnan(run.train_loss[1][1])
    assert run.train_loss_smooth[1] == [4.0, 4.0, 3.0]


def test_a_resumed_run_continues_its_steps_and_replaces_re_logged_ones():
    first = [_train(1, 9.0), _train(10, 8.0), _eval(10, 7.0, (0.1,)), _train(20, 7.5), _train(30, 7.4)]
    # crashed after step 30; resumed from the checkpoint at 10: re-logs 20, 30, then goes on
    second = [_train(20, 7.0), _train(30, 6.0), _eval(30, 5.0, (0.2,)), _train(40, 5.0), _eval(40, 4.0, (0.3,))]
    run = pt.series_from_records([first, second], "r", smooth=1)
    assert run.train_loss == ([1.0, 10.0, 20.0, 30.0, 40.0], [9.0, 8.0, 7.0, 6.0, 5.0])
    assert run.dev_loss == ([10.0, 30.0, 40.0], [7.0, 5.0, 4.0])
    assert run.superseded == 2
    # a resume at the final step repeats the final eval: the later one wins
    again = pt.series_from_records([[_train(40, 5.0), _eval(40, 4.0, (0.3,)), _eval(40, 3.9, (0.3,))]], "r")
    assert again.dev_loss == ([40.0], [3.9])
    assert again.superseded == 1


def test_load_runs_groups_files_by_label(tmp_path):
    a1, a2, b = tmp_path / "a1.jsonl", tmp_path / "a2.jsonl", tmp_path / "b.jsonl"
    a1.write_text("\n".join(json.dumps(r) for r in (_train(1, 9.0), _train(10, 8.0))) + "\n")
    a2.write_text("\n".join(json.dumps(r) for r in (_train(20, 7.0), _eval(20, 6.0, (0.2, 0.1)))) + "\n")
    b.write_text(json.dumps(_train(1, 5.0)) + "\n")
    runs = pt.load_runs([a1, a2, b], ["a", "a", "b"])
    assert [r.label for r in runs] == ["a", "b"]
    assert runs[0].train_loss[0] == [1.0, 10.0, 20.0]
    assert runs[0].dev_loss == ([20.0], [6.0])
    assert runs[1].train_loss == ([1.0], [5.0])
    assert len(pt.load_runs([a1, a2])) == 1  # no labels: the files are one run
    with pytest.raises(ValueError, match="2 label"):
        pt.load_runs([a1, a2, b], ["a", "b"])


def test_a_file_with_no_usable_records_is_an_error_naming_it(tmp_path, capsys):
    bad = tmp_path / "empty_run" / "metrics.jsonl"
    bad.parent.mkdir()
    bad.write_text("\n\ngarbage\n{\"kind\": \"train\"}\n")
    with pytest.raises(pt.NoUsableRecords, match=re.escape(str(bad))):
        pt.read_metrics(bad)
    out = tmp_path / "never.png"
    assert pt.main([str(bad), "--out", str(out)]) == 2
    assert "empty_run/metrics.jsonl" in capsys.readouterr().err
    assert not out.exists()


def test_main_writes_a_png(tmp_path, capsys):
    lines = []
    for step in [1, *range(10, 210, 10)]:
        acc = [min(0.9, 0.1 + step / 400 / (p + 1)) for p in range(8)]
        lines.append(json.dumps(_train(step, 10.0 / (1 + step / 50) + 0.3 * math.sin(step), acc)))
        if step % 50 == 0:
            lines.append(json.dumps(_eval(step, 9.0 / (1 + step / 60), [a * 0.8 for a in acc], tau_dart=1.5)))
    lines.insert(5, "{truncated")
    metrics = tmp_path / "run" / "metrics.jsonl"
    metrics.parent.mkdir()
    metrics.write_text("\n".join(lines) + "\n")
    other = tmp_path / "other.jsonl"
    other.write_text("\n".join(lines[:20]) + "\n")
    out = tmp_path / "plots" / "curves.png"
    assert pt.main([str(metrics), str(other), "--labels", "long", "short", "--out", str(out), "--title", "t"]) == 0
    captured = capsys.readouterr()
    assert "skipped 1 garbled line" in captured.err
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(data) > 20_000
