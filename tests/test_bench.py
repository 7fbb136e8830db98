"""The benchmark report (dart_bench/matrix.py, dart_bench/report.py) without a real model.

Summary math on synthetic records against hand-computed medians and ratios; plots and report.md
from synthetic figures (non-empty PNGs, relative links that resolve); config validation; the
pipeline job plots from a small output written with pipeline.data.outputs.
"""

from __future__ import annotations

import re
import statistics
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_bench.matrix import (
    BenchConfigError,
    BenchReportConfig,
    cells_of,
    load_bench_config,
    summarize_cells,
    tokens_per_round_histogram,
    validate_config,
)
from dart_bench.report import PLOTS, render_job_plots, render_report, throughput_timeline
from jobs.bench import main as bench_main
from tests.hypothesis_budget import examples

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _record(mode, t, budget, prompt, repeat, tokens, seconds, tau=None, accept_hist=None, stages=None):
    r = {"mode": mode, "temperature": t, "budget": budget, "prompt": prompt, "repeat": repeat,
         "tokens": tokens, "seconds": seconds, "token_ids": list(range(tokens))}
    if tau is not None:
        hist = accept_hist or [1]
        r |= {"tau": tau, "rounds": sum(hist), "acceptance_histogram": hist, "per_position_acceptance": [0.5, 0.25],
              "mean_tree_size": 0.0 if mode == "ar" else float(budget or 0),
              **{f"{k}_s": v for k, v in (stages or {"prefill": 0.1, "draft": 0.01, "tree": 0.02, "verify": 0.5,
                                                    "commit": 0.03}).items()}}
    return r


def synthetic_figures() -> dict:
    records = []
    for t in (0.0, 1.0):
        for p in ("a", "b", "c"):
            records.append(_record("ar", t, None, p, 0, 64, 6.4, tau=1.0, accept_hist=[63]))
            records.append(_record("hf", t, None, p, 0, 64, 5.0))
            if t == 0:
                records.append(_record("hf_prompt_lookup", t, None, p, 0, 64, 3.2))
            for mode in ("chain", "ddtree", "dart"):
                for b in (16, 32):
                    records.append(_record(mode, t, b, p, 0, 64, 4.0 - b / 32, tau=1.5 + b / 64,
                                           accept_hist=[10, 8, 5, 2, 1]))
    return {"config": {"repeats": 1}, "summary": summarize_cells(records, headline_budget=32), "records": records,
            "conditions": {"date_utc": "2026-11-22 01:00 UTC", "cpu": "test cpu", "cpus_visible": 2, "threads": 2,
                           "load_average_start": [3.0, 3.0, 3.0], "dtype": "bf16", "prompts": 3,
                           "max_new_tokens": 64, "head": "untrained", "head_trained": False,
                           "head_fingerprint": None, "trie": "/x.ngram", "trie_fingerprint": "0123456789abcdef"},
            "command": "python -m jobs.bench report configs/bench.yaml"}


# ------------------------------------------------------------------------------ summary math


def test_speedup_is_median_of_per_run_ratios_against_ar_of_same_prompt_and_repeat():
    records = [
        _record("ar", 0.0, None, "a", 0, 10, 1.0, tau=1.0), _record("ar", 0.0, None, "b", 0, 10, 2.0, tau=1.0),
        _record("ar", 0.0, None, "c", 0, 20, 2.0, tau=1.0),
        _record("ar", 0.0, None, "a", 1, 10, 4.0, tau=1.0),  # a slow repeat: pairs only with repeat 1
        _record("dart", 0.0, 60, "a", 0, 10, 0.5, tau=2.0),  # 0.1 s/token vs 0.05 -> 2.0
        _record("dart", 0.0, 60, "b", 0, 5, 2.0, tau=2.0),  # 0.2 vs 0.4 -> 0.5
        _record("dart", 0.0, 60, "c", 0, 20, 0.5, tau=3.0),  # 0.1 vs 0.025 -> 4.0
        _record("dart", 0.0, 60, "a", 1, 10, 1.0, tau=2.0),  # 0.4 vs 0.1 -> 4.0
    ]
    by = {(e["mode"], e["budget"]): e for e in summarize_cells(records, 60)}
    dart = by["dart", 60]
    assert dart["speedup_vs_ar"] == pytest.approx(statistics.median([2.0, 0.5, 4.0, 4.0]))
    assert dart["tokens_per_second"] == pytest.approx(statistics.median([20, 2.5, 40, 10]))
    assert dart["tau"] == pytest.approx(statistics.mean([2.0, 2.0, 3.0, 2.0]))
    assert dart["runs"] == 4 and dart["headline"]
    assert by["ar", None]["speedup_vs_ar"] == pytest.approx(1.0)
    assert dart["agreement_with_ar"] == pytest.approx(0.75)  # synthetic ids are equal iff counts are


def test_speedup_compares_against_ar_at_the_same_temperature_and_agreement_is_none_when_sampling():
    records = [_record("ar", 0.0, None, "a", 0, 10, 1.0, tau=1.0), _record("ar", 1.0, None, "a", 0, 10, 2.0, tau=1.0),
               _record("hf", 0.0, None, "a", 0, 10, 0.5), _record("hf", 1.0, None, "a", 0, 10, 0.5)]
    by = {(e["mode"], e["temperature"]): e for e in summarize_cells(records)}
    assert by["hf", 0.0]["speedup_vs_ar"] == pytest.approx(2.0)
    assert by["hf", 1.0]["speedup_vs_ar"] == pytest.approx(4.0)
    assert by["hf", 0.0]["agreement_with_ar"] == 1.0
    assert by["hf", 1.0]["agreement_with_ar"] is None
    assert "tau" not in by["hf", 0.0]


def test_stage_ms_per_round_is_total_stage_time_over_total_rounds():
    stages_a = {"prefill": 1.0, "draft": 0.2, "tree": 0.1, "verify": 1.0, "commit": 0.1}
    stages_b = {"prefill": 1.0, "draft": 0.4, "tree": 0.1, "verify": 3.0, "commit": 0.1}
    records = [_record("ar", 0.0, None, "a", 0, 10, 1.0, tau=1.0),
               _record("chain", 0.0, 8, "a", 0, 10, 1.0, tau=2.0, accept_hist=[5, 5], stages=stages_a),
               _record("chain", 0.0, 8, "a", 1, 10, 1.0, tau=2.0, accept_hist=[20, 10], stages=stages_b)]
    chain = next(e for e in summarize_cells(records, 8) if e["mode"] == "chain")
    assert chain["ms_per_round"]["draft"] == pytest.approx(1000 * 0.6 / 40)
    assert chain["ms_per_round"]["verify"] == pytest.approx(1000 * 4.0 / 40)


@settings(max_examples=examples(50), deadline=None)
@given(st.lists(st.lists(st.integers(0, 9), min_size=1, max_size=8), min_size=1, max_size=5))
def test_tokens_per_round_histogram_counts_every_round_and_its_mean_is_tau(hists):
    rows = [{"acceptance_histogram": h} for h in hists]
    out = tokens_per_round_histogram(rows)
    assert out[0] == 0 and sum(out) == sum(map(sum, hists))
    rounds = sum(map(sum, hists))
    if rounds:
        accepted = sum(a * c for h in hists for a, c in enumerate(h))
        assert sum(k * c for k, c in enumerate(out)) / rounds == pytest.approx(accepted / rounds + 1)


# ------------------------------------------------------------------------------ report


def test_report_writes_non_empty_pngs_and_report_md_linking_them(tmp_path):
    figures = synthetic_figures()
    report = render_report(figures, tmp_path / "out")
    text = report.read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text)
    assert sorted(links) == sorted(PLOTS.values())
    for link in links:
        png = report.parent / link
        data = png.read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, link
    assert "| dart | 32 | 0 |" in text and "0123456789abcdef" in text
    assert "untrained" in text and "noisy" in text
    assert "python -m jobs.bench report configs/bench.yaml" in text


def test_report_handles_a_run_with_only_ar_and_hf(tmp_path):
    records = [_record("ar", 0.0, None, "a", 0, 8, 1.0, tau=1.0, accept_hist=[7]),
               _record("hf", 0.0, None, "a", 0, 8, 0.8)]
    report = render_report({"summary": summarize_cells(records), "conditions": {}}, tmp_path)
    assert all((tmp_path / name).stat().st_size > 0 for name in PLOTS.values())
    assert "| hf | - | 0 |" in report.read_text()


# ------------------------------------------------------------------------------ config


def test_shipped_config_validates_and_lists_every_cell():
    cfg = load_bench_config(REPO / "configs" / "bench.yaml", ["num_prompts=4", "budgets=[16,32]"])
    assert cfg.num_prompts == 4 and cfg.headline_budget == 32 and cfg.threads == 2
    labels = {(c.label, c.temperature) for c in cells_of(cfg)}
    assert ("hf_prompt_lookup", 0.0) in labels and ("hf_prompt_lookup", 1.0) not in labels
    assert {("dart@16", 1.0), ("dart@32", 1.0), ("ar", 1.0), ("hf", 1.0), ("lookup@16", 0.0),
            ("dart_lookup@32", 1.0)} <= labels
    assert len(labels) == 25  # 5 drafters x 2 budgets x 2 temperatures + ar, hf x 2 + hf_prompt_lookup
    cfg = load_bench_config(REPO / "configs" / "bench.yaml", ["modes=[ar,chain,dart]", "temperatures=[0.0]",
                                                              "budgets=[16,32,60]", "mode_budgets={chain: [16]}"])
    assert [c.label for c in cells_of(cfg)] == ["ar", "chain@16", "dart@16", "dart@32", "dart@60"]


@pytest.mark.parametrize("overrides, message", [
    (["modes=[ar,medusa]"], "unknown mode"),
    (["modes=[dart]"], "`ar` is required"),
    (["temperatures=[]"], "temperatures: empty"),
    (["temperatures=[-1.0]"], "must be >= 0"),
    (["budgets=[0,16]"], "budgets: [0]"),
    (["budgets=[16,16]"], "lists a budget twice"),
    (["headline_budget=99"], "headline_budget: 99"),
    (["num_prompts=0"], "num_prompts: 0"),
    (["threads=0"], "threads: 0"),
    (["no_such_key=1"], "no_such_key"),
    (["max_new_tokens=lots"], "max_new_tokens"),
    (["omp_wait_policy=spin"], "omp_wait_policy: 'spin'"),
    (["warmup_tokens=-1"], "warmup_tokens: -1"),
    (["modes=[ar,dart]", "mode_budgets={chain: [16]}"], "mode_budgets: 'chain' is not one of the selected"),
    (["mode_budgets={dart: [8]}"], "must be a non-empty subset of budgets"),
    (["mode_budgets={dart: []}"], "must be a non-empty subset of budgets"),
])
def test_bad_config_is_a_clear_error_naming_the_key(overrides, message):
    with pytest.raises(BenchConfigError, match=re.escape(message)):
        load_bench_config(REPO / "configs" / "bench.yaml", overrides)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(BenchConfigError, match="does not exist"):
        load_bench_config(tmp_path / "nope.yaml")


def test_budgets_may_be_empty_without_tree_modes():
    cfg = validate_config(BenchReportConfig(modes=["ar", "hf"], budgets=[]))
    assert [c.label for c in cells_of(cfg)] == ["ar", "hf", "ar", "hf"]


# ------------------------------------------------------------------------------ job plots


def test_throughput_timeline_groups_batches_by_worker_and_wall_time():
    rows = [{"row_key": "k1", "worker": "w0", "wall_s": 2.0, "num_generated_tokens": 10},
            {"row_key": "k2", "worker": "w0", "wall_s": 2.0, "num_generated_tokens": 30},
            {"row_key": "k3", "worker": "w0", "wall_s": 1.0, "num_generated_tokens": 5},
            {"row_key": "k4", "worker": "w1", "wall_s": 4.0, "num_generated_tokens": 8},
            {"row_key": "k5", "worker": "w1", "wall_s": None, "error": "bad prompt"}]
    tl = throughput_timeline(rows)
    assert tl["w0"] == [(2.0, 20.0, 40), (3.0, 5.0, 45)]
    assert tl["w1"] == [(4.0, 2.0, 8)]
    resumed = [r | {"run_id": "run-a"} for r in rows[:2]] + [rows[2] | {"run_id": "run-b"}]
    assert set(throughput_timeline(resumed)) == {"run-a/w0", "run-b/w0"}


def test_throughput_timeline_on_the_jobs_clock_with_finished_at():
    t = datetime(2026, 11, 22, 3, 0, 0, tzinfo=timezone.utc)
    rows = [{"row_key": "k1", "worker": "w0", "wall_s": 2.0, "num_generated_tokens": 10, "finished_at": t},
            {"row_key": "k2", "worker": "w0", "wall_s": 2.0, "num_generated_tokens": 30, "finished_at": t},
            # the same wall time, finished later: its rate counts from w0's previous point
            {"row_key": "k0", "worker": "w0", "wall_s": 2.0, "num_generated_tokens": 4,
             "finished_at": t + timedelta(seconds=5)},
            {"row_key": "k4", "worker": "w1", "wall_s": 4.0, "num_generated_tokens": 8,
             "finished_at": t + timedelta(seconds=3)},
            {"row_key": "k5", "worker": "w1", "wall_s": None, "error": "bad prompt", "finished_at": t}]
    tl = throughput_timeline(rows)  # the job began at t - 2 s (w0's first rows)
    assert tl["w0"] == [(2.0, 20.0, 40), (7.0, pytest.approx(0.8), 44)]
    assert tl["w1"] == [(5.0, 2.0, 8)]  # w1 began at t - 1 s


def test_render_job_plots_from_output_url_and_from_summary_json(tmp_path):
    import json

    from pipeline.data.outputs import read_output, rows_to_table, write_part

    rows = [{"row_key": f"id:{i}", "id": str(i), "run_id": "r1", "mode": "dart", "worker": f"w{i % 2}",
             "num_generated_tokens": 32, "tau": 1.5 + 0.1 * i, "rounds": 10, "wall_s": 1.0 + (i // 4),
             "finish_reason": "length"} for i in range(8)]
    rows.append({"row_key": "id:bad", "id": "bad", "run_id": "r1", "error": "empty prompt", "finish_reason": "error"})
    out_url = (tmp_path / "output").as_uri()
    write_part(rows_to_table(rows), out_url, "r1")
    assert read_output(out_url).num_rows == 9
    plots = render_job_plots(out_url, tmp_path / "plots")
    for png in plots.values():
        assert png.read_bytes().startswith(PNG_MAGIC) and png.stat().st_size > 5000
    summary = tmp_path / "output" / "_job_summary.json"
    summary.write_text(json.dumps({"config": {"output": {"url": out_url}}, "this_run": {"tau": {}}}))
    plots = render_job_plots(str(summary), tmp_path / "plots2")
    assert set(plots) == {"tau", "throughput"} and all(p.stat().st_size > 0 for p in plots.values())
    bad = tmp_path / "not_a_summary.json"
    bad.write_text("{}")
    with pytest.raises(ValueError, match=re.escape("no config.output.url")):
        render_job_plots(str(bad), tmp_path / "plots3")


def test_report_can_be_rerendered_from_bench_json(tmp_path):
    import json

    (tmp_path / "bench.json").write_text(json.dumps(synthetic_figures()))
    assert bench_main(["plots", str(tmp_path / "bench.json")]) == 0
    assert (tmp_path / "report.md").is_file()
    assert all((tmp_path / name).stat().st_size > 0 for name in PLOTS.values())


def test_the_front_door_knows_every_kind_and_refuses_others(capsys):
    """`python -m jobs.bench KIND`: every kind names a dart_bench module with a main; an unknown
    kind or none is exit 2 with the list of kinds."""
    import importlib

    from jobs.bench import KINDS

    for kind, (module, _) in KINDS.items():
        assert callable(importlib.import_module(f"dart_bench.{module}").main), kind
    assert bench_main(["no_such_kind"]) == 2 and bench_main([]) == 2
    err = capsys.readouterr().err
    assert "no_such_kind" in err and all(kind in err for kind in KINDS)


# ------------------------------------------------------------------------------ end to end (tiny model)


@pytest.fixture(scope="module")
def tiny_artifacts(tmp_path_factory):
    from tests.tiny_models import save_tiny_artifacts

    return save_tiny_artifacts(tmp_path_factory.mktemp("bench_artifacts"))


def test_measure_and_report_end_to_end_on_a_tiny_fp32_model(tiny_artifacts, tmp_path):
    """Every cell runs on every prompt; in fp32 every greedy mode reproduces `ar` token for token."""
    out = tmp_path / "report"
    overrides = [f"target={tiny_artifacts['target']}", f"head={tiny_artifacts['head']}",
                 f"trie={tiny_artifacts['trie']}", "dtype=fp32", "device=cpu", "threads=1", "num_prompts=2",
                 "max_prompt_tokens=64", "max_new_tokens=6", "budgets=[4,8]", "repeats=2", "warmup_tokens=1",
                 f"output_dir={out}"]
    assert bench_main(["report", str(REPO / "configs" / "bench.yaml"), *overrides]) == 0
    import json

    figures = json.loads((out / "bench.json").read_text())
    cells = {(e["mode"], e["temperature"], e["budget"]) for e in figures["summary"]}
    assert len(cells) == 25 and len(figures["records"]) == 25 * 2 * 2
    for e in figures["summary"]:
        assert e["runs"] == 4 and e["speedup_vs_ar"] > 0
        if e["temperature"] == 0:
            assert e["agreement_with_ar"] == 1.0, e["mode"]
    cond = figures["conditions"]
    assert cond["head_trained"] and len(cond["head_fingerprint"]) > 8 and len(cond["trie_fingerprint"]) == 16
    assert cond["prompts"] == 2 and cond["max_new_tokens"] == 6
    assert (out / "report.md").is_file() and all((out / p).stat().st_size > 0 for p in PLOTS.values())


def test_bench_engine_sweeps_batch_sizes_and_fixed_budgets_losslessly(tmp_path, capsys):
    """The batch sweep runs every cell (auto-sized, fixed at each budget) at each batch size on
    the same prompts; in fp32 greedy every cell decodes what `ar` decodes."""
    from tests.tiny_models import save_tiny_artifacts

    art = save_tiny_artifacts(tmp_path / "art")
    report = bench_main(["engine", f"target={art['target']}", f"head={art['head']}", f"trie={art['trie']}",
                                "dtype=fp32", "device=cpu", "num_prompts=3", "max_prompt_tokens=200",
                                "max_new_tokens=6", "modes=[ar,dart_lookup]", "fixed_modes=[dart]",
                                "fixed_budgets=[4,8]", "batch_sizes=[1,2]", "budget=8"])
    assert set(report["sweep"]) == {"1", "2"}
    for summary in report["sweep"].values():
        assert set(summary) == {"ar", "dart_lookup", "dart+fixed@4", "dart+fixed@8"}
        assert all(cell["agreement_with_ar"] == 1.0 and cell["runs"] == 3 for cell in summary.values())
        assert summary["dart+fixed@4"]["mean_tree_size"] <= 4 < summary["dart+fixed@8"]["mean_tree_size"] <= 8
    assert "tok/s  x ar  tau  tree" in capsys.readouterr().out


def test_bench_engine_samples_share_the_prefill_and_equal_separate_rows(tmp_path, capsys):
    """samples=3: every mode decodes 3 seeded samples per prompt with one prefill per prompt; the
    "+separate" cell decodes the same samples as separate rows (3x the prompt tokens forwarded), and
    in fp32 every cell writes the tokens `ar` writes, sample by sample."""
    from tests.tiny_models import save_tiny_artifacts

    art = save_tiny_artifacts(tmp_path / "art")
    report = bench_main(["engine", f"target={art['target']}", f"head={art['head']}", f"trie={art['trie']}",
                                "dtype=fp32", "device=cpu", "num_prompts=2", "max_prompt_tokens=200",
                                "max_new_tokens=5", "modes=[ar,dart_lookup]", "temperature=0.8", "min_p=0.05",
                                "repetition_penalty=1.1", "samples=3", "batch_size=2", "budget=8"])
    cells = report["sweep"]["2"]["samples"]
    assert set(cells) == {"ar", "dart_lookup", "ar+separate"}
    assert all(cell["rows"] == 6 and cell["agreement_with_ar"] == 1.0 for cell in cells.values())
    assert cells["ar"]["prefill_tokens"] == cells["dart_lookup"]["prefill_tokens"]
    assert cells["ar+separate"]["prefill_tokens"] == 3 * cells["ar"]["prefill_tokens"] > 0
    assert "prefill tokens" in capsys.readouterr().out


def test_templated_job_cache_bench_runs_both_arms_on_a_tiny_fp32_model(tiny_artifacts, tmp_path):
    """`jobs.bench templated`: both arms decode every row; in fp32 greedy they agree token for token."""
    import json


    template = "w5 w6 w7 w8 {0} w9 w10 w11 w12 {1} w13 w14"
    out = tmp_path / "templated.json"
    report = bench_main(["templated", f"target={tiny_artifacts['target']}", "dtype=fp32", "device=cpu", "threads=1",
                             "rows=6", "max_new_tokens=8", "batch_size=2", "chunk_rows=3", "budget=8",
                             "sizing=fixed", f"template='{template}'", "slot_values=[[w20,w21],[w22,w23]]",
                             f"output={out}"])
    assert report["greedy_agreement"] == 1.0
    for arm in ("cache_off", "cache_on"):
        s = report["summary"][arm]
        assert s["rows"] == 6 and s["rows_failed"] == 0 and s["tokens"] > 0 and s["tau"] >= 1.0
        assert set(s["accepted_tokens_by_source"]) == {"head", "context", "job_cache", "grammar"}
        assert s["us_per_seq_round"]["index_plus_graft"]["p99"] >= s["us_per_seq_round"]["index_plus_graft"]["median"]
    assert report["summary"]["cache_off"]["accepted_tokens_by_source"]["job_cache"] == 0
    assert report["summary"]["cache_on"]["cache"]["documents"] == 6
    assert json.loads(out.read_text())["summary"]["cache_on"]["rows"] == 6


def test_verify_shapes_times_every_shape_within_the_row_limit():
    from dart_bench.verify_shapes import ShapesConfig, shape_table
    from dart_worker.target.adapter import TargetAdapter
    from tests.tiny_models import tiny_model

    cfg = ShapesConfig(context=12, passes=1, batch_sizes=[1, 3], rows_per_sequence=[1, 2, 5], max_rows=6)
    table = shape_table(TargetAdapter(tiny_model("gemma3", vocab_size=32)), cfg)
    assert {b: sorted(r) for b, r in table.items()} == {1: [1, 2, 5], 3: [1, 2]}
    assert all(ms > 0 for r in table.values() for ms in r.values())


def test_verify_shapes_times_the_projection_both_ways():
    from dart_bench.verify_shapes import ShapesConfig, projection_table
    from dart_worker.target.adapter import TargetAdapter
    from tests.tiny_models import tiny_model

    table = projection_table(TargetAdapter(tiny_model("llama", vocab_size=32)), ShapesConfig(passes=1,
                                                                                          projection_rows=[1, 3],
                                                                                          draft_vocab=40))
    assert sorted(table) == ["draft", "target"] and all(sorted(rows) == [1, 3] for rows in table.values())
    assert all(t["module"] > 0 and t["project"] > 0 for rows in table.values() for t in rows.values())


def test_verify_shapes_times_both_kv_caches_on_identical_logits():
    from dart_bench.verify_shapes import ShapesConfig, cache_table
    from dart_worker.target.adapter import TargetAdapter
    from tests.tiny_models import tiny_model

    table = cache_table(TargetAdapter(tiny_model("gemma3", vocab_size=32)),
                        ShapesConfig(context=10, cache_batch_sizes=[1, 3], cache_steps=4))
    assert sorted(table) == [1, 3]
    assert all(t["identical"] is True and t["dynamic"] > 0 and t["growing"] > 0 for t in table.values())


def test_compare_heads_scores_every_head_on_the_same_data(tiny_artifacts, tmp_path):
    """Two heads, one run: dev accuracy equals evaluate_dev computed here on the same examples, every
    bench cell is decoded with each head (fp32 greedy == ar), and the tables name both heads."""
    import json

    import torch

    from dart_bench.compare_heads import dev_examples
    from dart_train.draft_training import TeacherPass
    from dart_train.trainer import EvalConfig, TrainConfig, evaluate_dev, head_vocab
    from dart_worker.artifacts.loading import load_target
    from dart_worker.head.draft_checkpoint import load_draft_head, save_draft_head
    from dart_worker.head.draft_head import DartDraftHead
    from tests.test_teacher_cache import write_chats

    model, tokenizer = load_target(tiny_artifacts["target"], dtype="fp32", device="cpu")
    torch.manual_seed(5)
    other = tmp_path / "other_head"
    save_draft_head(DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=3), other)
    chats = write_chats(tmp_path / "chats.jsonl", n=6)
    out = tmp_path / "compare"
    overrides = [f"target={tiny_artifacts['target']}", f"heads=[{tiny_artifacts['head']},{other}]",
                 f"trie={tiny_artifacts['trie']}", "dtype=fp32", "device=cpu", "threads=1", "num_prompts=2",
                 "max_prompt_tokens=64", "max_new_tokens=5", "budgets=[4,6]", "mode_budgets={chain: [4]}",
                 "repeats=1", "warmup_tokens=0", "modes=[ar,chain,dart]", "temperatures=[0.0,1.0]",
                 f"dev_source={chats}", "dev_fraction=1.0", "dev_sequences=3", "dev_anchors_per_sequence=4",
                 "replay_prompts=2", f"output_dir={out}"]
    assert bench_main(["compare_heads", str(REPO / "configs" / "bench.yaml"), *overrides]) == 0
    figures = json.loads((out / "compare.json").read_text())
    heads = [tiny_artifacts["head"], str(other)]
    assert figures["heads"] == heads
    examples = dev_examples(tokenizer, str(chats), 1.0, 3)
    assert len(examples) == 3
    for path in heads:
        head = load_draft_head(path, model.config, model.get_input_embeddings(), device="cpu", dtype=torch.float32)
        want = evaluate_dev(head.eval(), TeacherPass(model, head_vocab(head)), examples,
                            TrainConfig(eval=EvalConfig(dev_anchors_per_sequence=4)), torch.device("cpu"), 1)
        got = figures["dev"][path]
        assert got["dev_accuracy_per_position"] == want["dev_accuracy_per_position"] and len(want[
            "dev_accuracy_per_position"]) == 4
        assert got["dev_loss"] == want["dev_loss"] and got["sequences"] == 3
        cells = {(e["mode"], e["budget"]): e for e in figures["decoding"][path]["summary"] if e["temperature"] == 0}
        assert set(cells) == {("ar", None), ("chain", 4), ("dart", 4), ("dart", 6)}
        assert all(e["agreement_with_ar"] == 1.0 for e in cells.values())
        assert figures["decoding"][path]["conditions"]["head"] == path
        for (mode, budget), entry in cells.items():  # the replay's greedy tau is the decoding's
            if budget is not None:
                assert figures["replay"]["cells"][f"{mode}@{budget}"][path]["tau"] == pytest.approx(entry["tau"])
    assert all(cell[heads[0]]["diff_vs_first"] == 0 for cell in figures["replay"]["cells"].values())
    sampled = {label for label in figures["replay"]["cells"] if label.endswith(" T=1")}
    assert sampled == {"chain@4 T=1", "dart@4 T=1", "dart@6 T=1"}  # replayed at temperature 1 too
    assert all(figures["replay"]["cells"][label][h]["tau"] >= 1.0 for label in sampled for h in heads)
    table = (out / "compare.md").read_text()
    assert "| 0 | dart@6 |" in table and f"`{other}` tau" in table


def test_compare_heads_refuses_a_directory_that_is_not_a_head(tmp_path, capsys):

    assert bench_main(["compare_heads", f"heads=[{tmp_path}]"]) == 2
    assert "not a draft head directory" in capsys.readouterr().err


def test_pipeline_bench_alternates_the_order_of_whole_jobs_and_reports_medians():
    from dart_bench.pipeline_job import median_run, run_order

    assert run_order(["ar", "dart"], 1) == [(0, "ar"), (0, "dart")]
    order = run_order(["ar", "dart", "x/16/4"], 4)
    assert [c for _, c in order] == ["ar", "dart", "x/16/4", "x/16/4", "dart", "ar"] * 2
    # every cell runs once per repeat, and as often early as late: the mean slot is the same for all
    slots = {c: [i for i, (_, cell) in enumerate(order) if cell == c] for c in ("ar", "dart", "x/16/4")}
    assert {len(v) for v in slots.values()} == {4} and len({sum(v) for v in slots.values()}) == 1
    with pytest.raises(ValueError, match="repeats must be >= 1"):
        run_order(["ar"], 0)
    runs = [{"rows_per_s": v, "repeat": i, "startup_s": t}
            for i, (v, t) in enumerate(zip([0.30, 0.10, 0.20, 0.40], [9.0, 7.0, 30.0, 8.0], strict=True))]
    median = median_run(runs)
    assert median["rows_per_s"] == 0.20 and median["repeat"] == 2
    assert median["repeats_rows_per_s"] == [0.30, 0.10, 0.20, 0.40]
    # start-up: its own median over the repeats (one slow start does not pick it)
    assert median["repeats_startup_s"] == [9.0, 7.0, 30.0, 8.0] and median["startup_s_median"] == 8.0
    assert median_run(runs[:3])["rows_per_s"] == 0.20


def test_engine_bench_alternates_which_cell_runs_first_batch_by_batch():
    """A cell that always ran second met the machine as the first left it: the order flips every
    batch, so over two batches every cell runs once in every position."""
    from types import SimpleNamespace

    from dart_bench.engine import cell_order, run_cells

    assert cell_order(["ar", "dart_lookup"], 0) == ["ar", "dart_lookup"]
    assert cell_order(["ar", "dart_lookup"], 1) == ["dart_lookup", "ar"]
    calls = []

    class Recording:
        def __init__(self, name):
            self.name = name

        def generate(self, prompts, params, max_live=None):
            calls.append((self.name, max_live))
            stats = SimpleNamespace(wall_seconds=1.0, to_row=dict)
            return [SimpleNamespace(token_ids=[1], stats=stats) for _ in prompts]

    modes = ["ar", "dart", "dart_lookup"]
    cfg = SimpleNamespace(modes=modes, repeats=2, temperature=0.0, seed=0, max_new_tokens=4, min_p=0.0,
                          repetition_penalty=1.0, max_live=None)
    records = run_cells(cfg, {m: Recording(m) for m in modes}, None, [], [(f"p{i}", [1, 2]) for i in range(3)], 2)
    # 2 batches a repeat, 2 repeats: turns 0, 1, 2, 3
    assert [name for name, _ in calls] == modes + modes[::-1] + modes + modes[::-1]
    assert all(len(rows) == 6 for rows in records.values())
    assert {live for _, live in calls} == {None} and not any("group_seconds" in r for r in records["ar"])
    # Continuous batching: each call decodes its prompts max_live at a time and is timed whole.
    calls.clear()
    cfg.max_live = 1
    records = run_cells(cfg, {m: Recording(m) for m in modes}, None, [], [(f"p{i}", [1, 2]) for i in range(3)], 2)
    assert {live for _, live in calls} == {1} and all(r["group_seconds"] >= 0 for r in records["dart"])


def test_engine_bench_throughput_takes_each_batch_at_its_longest_request():
    """Requests of one batch join together and finish apart: the batch took as long as its
    slowest request, whatever order the records come in, in throughput and in the speedup."""
    from dart_bench.common import summarize

    def row(prompt, group, tokens, seconds):
        return {"prompt": prompt, "repeat": 0, "group": group, "tokens": tokens, "seconds": seconds,
                "token_ids": [0] * tokens}

    records = {"ar": [row("a", 0, 10, 4.0), row("b", 0, 10, 1.0), row("c", 1, 10, 2.0)]}
    assert summarize(records)["ar"]["throughput"] == pytest.approx(30 / (4.0 + 2.0))
    # The speedup pairs whole batches too: batch 0 took 3 s against ar's 4, batch 1 1 s against 2
    # (per request it would be the median of 4, 1/3 and 2).
    records["dart"] = [row("a", 0, 10, 1.0), row("b", 0, 10, 3.0), row("c", 1, 10, 1.0)]
    assert summarize(records)["dart"]["speedup_vs_ar"] == pytest.approx(statistics.median([4 / 3, 2.0]))
    # Runs without a batch are batches of their own: per prompt and repeat.
    alone = {mode: [{k: v for k, v in r.items() if k != "group"} for r in rows] for mode, rows in records.items()}
    assert summarize(alone)["dart"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert summarize(alone)["ar"]["throughput"] == pytest.approx(30 / 7.0)


def test_engine_bench_speedup_if_drafting_were_free_takes_the_drafting_stages_off_both_sides():
    """The bound pairs batches as the speedup does, each batch's seconds its longest request's
    with that request's draft and tree seconds taken off; the other stages stay."""
    from dart_bench.common import summarize

    def row(prompt, group, seconds, draft=0.0, tree=0.0, verify=0.0):
        return {"prompt": prompt, "repeat": 0, "group": group, "tokens": 10, "seconds": seconds,
                "token_ids": [0] * 10, "draft_s": draft, "tree_s": tree, "verify_s": verify}

    records = {"ar": [row("a", 0, 4.0, tree=0.5, verify=3.0), row("b", 0, 3.0)],
               "dart": [row("a", 0, 3.0, draft=1.0, tree=0.5, verify=1.0), row("b", 0, 2.8, draft=0.1)]}
    summary = summarize(records)["dart"]
    assert summary["speedup_vs_ar"] == pytest.approx(4.0 / 3.0)
    # ar: max(4 - 0.5, 3) = 3.5 s; dart: max(3 - 1.5, 2.8 - 0.1) = 2.7 s (the other request is now the longest)
    assert summary["speedup_if_drafting_free"] == pytest.approx(3.5 / 2.7)
    assert summarize(records)["ar"]["speedup_if_drafting_free"] == pytest.approx(1.0)


def test_engine_bench_times_a_continuously_batched_call_whole_and_gives_no_drafting_free_figure():
    """Requests of a continuously batched call join as others finish, so each one's own wall time
    starts late: the call's wall time is the batch's. No request was live in all of its rounds, so
    no drafting-free figure is made up for it."""
    from dart_bench.common import summarize

    def row(prompt, seconds, call):
        return {"prompt": prompt, "repeat": 0, "group": 0, "tokens": 10, "seconds": seconds,
                "token_ids": [0] * 10, "group_seconds": call, "draft_s": 0.5, "tree_s": 0.1}

    records = {"ar": [row("a", 2.0, 6.0), row("b", 3.0, 6.0)], "dart": [row("a", 1.0, 4.0), row("b", 2.0, 4.0)]}
    summary = summarize(records)
    assert summary["dart"]["throughput"] == pytest.approx(20 / 4.0)  # not 20 / 2.0, its longest request
    assert summary["dart"]["speedup_vs_ar"] == pytest.approx(6.0 / 4.0)
    assert summary["dart"]["speedup_if_drafting_free"] is None


def test_bench_coupling_runs_on_a_tiny_model_and_its_rates_are_consistent(tiny_artifacts, tmp_path):
    """`jobs.bench coupling` end to end: every method's per-depth agreement is a rate, the top-k
    memberships grow with k, and Gumbel-max's top-1 membership is Gumbel-max's agreement itself."""
    import json

    from jobs.bench import main as jobs_bench_main

    jobs_bench_main(["coupling", f"target={tiny_artifacts['target']}", f"head={tiny_artifacts['head']}",
                     "num_prompts=2", "check_prompts=0", "max_new_tokens=8", "temperatures=[1.0]",
                     "noise_rows=[1]", f"output_dir={tmp_path}"])
    report = json.loads((tmp_path / "coupling.json").read_text())
    [result] = report["results"]
    rates = result["rates"]
    assert all(0.0 <= r <= 1.0 for values in rates.values() for r in values)
    for family in ("gumbel", "partition", "q"):
        for depth in range(4):
            assert rates[f"{family}_top1"][depth] <= rates[f"{family}_top2"][depth] <= rates[f"{family}_top4"][depth]
    assert rates["gumbel_top1"] == rates["gumbel"] and rates["partition_top1"] == rates["gumbel_partition"]
