"""The job's own machinery at scale (issue #32): the pieces `jobs.bench load` measured and mended.

- The duplicate-id pass counts sorted runs of keys with pyarrow and merges the runs' edges on the
  driver: exact whatever the cut into runs (a key's rows may span any number of them).
- The resume scan finds the rows written whole (one sample, n 1) with Arrow, no Python object per
  row: the same progress as the per-sample bookkeeping, which it keeps for the other rows.
- The driver's tally keeps the progress line O(1) and its tau percentiles exact.
- The load benchmark's own helpers: the inputs it generates, Ray Data's stats it parses, the growth.
"""

from __future__ import annotations

import itertools
import json
import statistics
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import pipeline.data.outputs as outputs_module
from dart_bench.load import growth, operator_figures, write_inputs
from pipeline.data.inputs import ORDER_COLUMN, duplicate_key, merge_repeats, order_key, repeats_and_edges
from pipeline.data.outputs import part_name, resume_progress, sample_key, split_sample_key
from pipeline.data.summary import MAX_SETTING_GROUPS, RunTally, build_summary, tau_distribution
from tests.hypothesis_budget import examples

# ------------------------------------------------------------------------------ duplicate pass


@settings(max_examples=examples(300), deadline=None)
@given(keys=st.lists(st.sampled_from([f"id:{k}" for k in range(12)]), min_size=1, max_size=60),
       cuts=st.lists(st.integers(0, 60), max_size=12), done_bits=st.lists(st.booleans(), min_size=60, max_size=60),
       resumed=st.booleans())
def test_counting_sorted_runs_is_exact_whatever_the_cut(keys, cuts, done_bits, resumed):
    """Any contiguous cut of the sorted rows (Ray Data decides the blocks) gives the exact counts
    and first positions of the repeated keys, the number of rows, and, given the keys a resumed
    run finds written, the number of rows still to generate (what the job's keys will be: a key's
    first row keeps it, each later row gets its duplicate key)."""
    positions = [order_key("file:///in.jsonl", i, "line") for i in range(len(keys))]
    first = {}
    for key, order in zip(keys, positions):
        first.setdefault(key, order)
    final = [key if first[key] == order else duplicate_key(key, order) for key, order in zip(keys, positions)]
    done = frozenset(k for k, bit in zip(final, done_bits) if bit) | {"id:not-in-the-input"} if resumed else None
    rows = sorted(zip(keys, positions))
    table = pa.table({"row_key": [k for k, _ in rows], ORDER_COLUMN: [o for _, o in rows]})
    bounds = sorted({0, len(rows), *(c for c in cuts if c <= len(rows))})
    runs = [repeats_and_edges(table.slice(a, b - a), done) for a, b in itertools.pairwise(bounds)]
    scan = merge_repeats(runs, count_pending=resumed)
    counts = Counter(keys)
    assert scan.repeated == {key: (first[key], n) for key, n in counts.items() if n > 1}
    assert scan.rows == len(keys)
    assert scan.pending == (sum(k not in done for k in final) if resumed else None)
    # and each run sends the driver only its repeated keys, its two edges and one row of totals
    for (a, b), run in zip(itertools.pairwise(bounds), runs):
        inner = {k for k, n in Counter(keys_ for keys_, _ in rows[a:b]).items() if n > 1}
        sent = run.column("row_key").to_pylist()
        assert sent[-1] is None and set(sent[:-1]) <= inner | {rows[a][0], rows[b - 1][0]}


def test_an_empty_run_counts_nothing():
    empty = pa.table({"row_key": pa.array([], pa.string()), ORDER_COLUMN: pa.array([], pa.string())})
    scan = merge_repeats([repeats_and_edges(empty, frozenset())], count_pending=True)
    assert (scan.repeated, scan.rows, scan.pending) == ({}, 0, 0)


# ------------------------------------------------------------------------------ the resume scan


def reference_progress(parts: list[list[tuple[str, int | None]]]) -> tuple[frozenset, dict, int]:
    """The resume scan as it was: every row through the per-sample bookkeeping."""
    written: dict[str, set[int]] = {}
    wanted: dict[str, int] = {}
    rows = 0
    for part in parts:
        for key, n in part:
            rows += 1
            row_key, sample = split_sample_key(key)
            written.setdefault(row_key, set()).add(sample)
            wanted[row_key] = max(wanted.get(row_key, 1), int(n or 1))
    done = frozenset(k for k, s in written.items() if s.issuperset(range(wanted[k])))
    return done, {k: (wanted[k], tuple(sorted(s))) for k, s in written.items() if k not in done}, rows


def write_key_parts(directory, parts: list[list[tuple[str, int | None]]], legacy: list[bool]) -> str:
    for i, (part, old) in enumerate(zip(parts, legacy)):
        table = pa.table({"row_key": pa.array([k for k, _ in part], pa.string()),
                          "n": pa.array([n for _, n in part], pa.int64())})
        if old:  # written before schema 6: no n column
            table = table.drop_columns(["n"])
        pq.write_table(table, str(directory / part_name([f"{i}"] + [k for k, _ in part])))
    return str(directory)


@settings(max_examples=examples(150), deadline=None)
@given(parts=st.lists(st.lists(st.tuples(st.sampled_from(["id:a", "id:b", "row:c", "dup:d"]),
                                         st.integers(0, 3), st.sampled_from([None, 0, 1, 2, 3])),
                               min_size=1, max_size=8), min_size=1, max_size=5),
       legacy=st.lists(st.booleans(), min_size=5, max_size=5))
def test_the_resume_scan_finds_what_the_per_sample_bookkeeping_found(tmp_path_factory, parts, legacy):
    rows = [[(sample_key(key, sample), n) for key, sample, n in part] for part in parts]
    expected_rows = [[(k, None if old else n) for k, n in part] for part, old in zip(rows, legacy)]
    out = write_key_parts(tmp_path_factory.mktemp("out"), rows, legacy)
    progress = resume_progress(out)
    done, partial, count = reference_progress(expected_rows)
    assert (progress.done, progress.partial, progress.rows_written) == (done, partial, count)


def test_the_resume_scan_makes_no_python_object_per_row_written_whole(tmp_path, monkeypatch):
    """10,000 rows of one sample each, and 3 samples of one more row: only those 3 rows go through
    the per-row bookkeeping (it grew 20-25x from 10k to 100k rows: a set and two dict entries each)."""
    whole = [(f"id:r{i}", 1) for i in range(10_000)]
    several = [(sample_key("id:s", j), 3) for j in range(3)]
    out = write_key_parts(tmp_path, [whole[:5000], whole[5000:] + several], [False, False])
    calls = []
    monkeypatch.setattr(outputs_module, "split_sample_key",
                        lambda key: calls.append(key) or split_sample_key(key))
    progress = resume_progress(out)
    assert len(progress.done) == 10_001 and progress.rows_written == 10_003 and not progress.partial
    assert sorted(calls) == sorted(k for k, _ in several)


# ------------------------------------------------------------------------------ the driver's tally


def stats_batch(taus, errors=None, mode="dart"):
    n = len(taus)
    errors = errors or [None] * n
    return pa.table({"row_key": [f"id:{i}" for i in range(n)], "error": errors, "mode": [mode] * n,
                     "num_generated_tokens": [3] * n, "tau": taus, "rounds": [0 if t == 0 else 2 for t in taus],
                     "finish_reason": ["length" if e is None else "error" for e in errors]})


def test_the_tally_and_its_tau_distribution_are_exact():
    rng = np.random.default_rng(0)
    taus = [float(t) for t in rng.choice([0.0, 1.0, 1.5, 2.25, 3.0, 7.9, 8.0, 11.0], size=999)]
    tally = RunTally()
    for k in range(0, len(taus), 100):
        tally.add(stats_batch(taus[k: k + 100]))
    tally.add(stats_batch([1.0, 1.0], errors=["malformed JSON: x", "empty prompt"]))
    decoded = sorted(t for t in taus if t != 0)
    dist = tau_distribution(tally.taus)
    assert tally.rows == 1001 and tally.failed == 2 and tally.tokens == 3 * 999
    assert dist["count"] == len(decoded) and dist["mean"] == pytest.approx(statistics.mean(decoded))
    assert [dist["p10"], dist["p50"], dist["p90"]] == [decoded[int(q * len(decoded))] for q in (0.1, 0.5, 0.9)]
    assert (dist["min"], dist["max"]) == (decoded[0], decoded[-1])
    assert sum(dist["histogram"].values()) == len(decoded)
    assert dist["histogram"][">=8.0"] == sum(t >= 8.0 for t in decoded) and "<8.0" in dist["histogram"]
    assert f"mean tau {statistics.mean(decoded):.2f}" in tally.progress_line()
    assert tau_distribution([]) == {"count": 0}


def test_the_summary_reports_tokens_per_sample_the_settings_in_force_and_tau_per_setting():
    tally = RunTally()
    rows = {"row_key": ["id:a", "sample:1:id:a", "id:b", "id:c", "id:d"], "error": [None, None, None, None, "bad"],
            "mode": ["dart"] * 5, "num_generated_tokens": [4, 10, 6, 8, 0], "tau": [2.0, 3.0, 1.0, 1.5, 0.0],
            "rounds": [2, 3, 6, 5, 0], "finish_reason": ["length"] * 4 + ["error"],
            "temperature": [0.8, 0.8, 0.8, 0.0, None], "top_p": [1.0] * 4 + [None], "top_k": [0] * 4 + [None],
            "min_p": [0.05, 0.05, 0.05, 0.0, None], "repetition_penalty": [1.1, 1.1, 1.1, 1.0, None],
            "presence_penalty": [0.0] * 4 + [None], "frequency_penalty": [0.0] * 4 + [None],
            "sample_index": [0, 1, 0, 0, 0], "n": [2, 2, 1, 1, 1]}
    tally.add(pa.table(rows))
    config = {"decoding": {"temperature": 0.8, "min_p": 0.05, "repetition_penalty": 1.1, "n": 2, "mode": "dart"}}
    summary = build_summary(tally, run_id="r", config=config, resumed_rows=0, duplicates={}, output_totals={})
    this = summary["this_run"]
    assert this["tokens_per_sample"] == {"count": 4, "mean": 7.0, "p10": 4, "p50": 8, "p90": 10, "min": 4, "max": 10}
    assert this["sampling"]["config"] == {"temperature": 0.8, "min_p": 0.05, "repetition_penalty": 1.1, "n": 2}
    sampled, greedy = this["sampling"]["per_setting"]
    assert sampled["settings"]["temperature"] == 0.8 and sampled["settings"]["min_p"] == 0.05
    assert (sampled["rows"], sampled["tokens"], sampled["mean_tau"]) == (3, 20, pytest.approx(2.0))
    assert (greedy["settings"]["temperature"], greedy["rows"], greedy["mean_tau"]) == (0.0, 1, 1.5)
    # past MAX_SETTING_GROUPS distinct settings, the rest are tallied together
    many = RunTally()
    many.add(pa.table({**{k: v[:1] * 70 for k, v in rows.items()}, "temperature": [0.01 * (k + 1) for k in range(70)]}))
    report = many.settings_report()
    assert len(report) == MAX_SETTING_GROUPS + 1
    assert {"settings": {"other": True}, "rows": 70 - MAX_SETTING_GROUPS, "tokens": 4 * (70 - MAX_SETTING_GROUPS),
            "mean_tau": 2.0} in report


# ------------------------------------------------------------------------------ the benchmark's helpers


def test_generated_inputs_hold_the_rows_duplicates_and_bad_lines_they_report(tmp_path):
    counts = write_inputs(tmp_path, 2000, files=3, duplicate_fraction=0.05, bad_fraction=0.05)
    lines = [line for f in sorted(tmp_path.glob("*.jsonl")) for line in f.read_text().splitlines()]
    assert len(lines) == counts["lines"] == 2000 and len(list(tmp_path.glob("*.jsonl"))) == 3
    ids = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record.get("prompt"), str) and record["prompt"] and "id" in record:
            ids.append(record["id"])
    assert 50 < counts["bad"] < 150 and 50 < counts["duplicate"] < 150
    assert len(ids) - len(set(ids)) == counts["duplicate"]


STATS = """Operator 1 ReadJsonlPrompt->MapBatches(mark): 4 tasks executed, 160 blocks produced in 23.14s
* Remote wall time: 222.1us min, 509.27ms max, 17.92ms mean, 1.2s total
* Output num rows per block: 52 min, 64 max, 62 mean, 10000 total

Operator 2 MapBatches(GenerationWorker): 157 tasks executed, 157 blocks produced in 155.79s
* Remote wall time: 296.42ms min, 1.69s max, 781.89ms mean, 150.64s total
* Output num rows per block: 52 min, 116 max, 68 mean, 10000 total
"""


def test_operator_figures_come_from_ray_datas_stats():
    read, generate = operator_figures(STATS)
    assert read["operator"] == "ReadJsonlPrompt->MapBatches(mark)" and read["rows"] == 10000
    assert (read["span_s"], read["busy_s"], read["blocks"]) == (23.14, 1.2, 160)
    assert generate["rows_per_busy_s"] == pytest.approx(10000 / 150.64)


def test_growth_is_the_ratio_between_the_smallest_and_largest_size():
    small = {"fresh": {"wall_s": 10.0, "memory": {"driver_peak_rss_mib": 600.0}}, "resume": {"wall_s": 5.0}}
    large = {"fresh": {"wall_s": 80.0, "memory": {"driver_peak_rss_mib": 660.0}}, "resume": {"wall_s": 20.0}}
    g = growth({1000: small, 10000: large})
    assert g["rows"]["ratio"] == 10 and g["wall_s"]["ratio"] == 8 and g["resume wall_s"]["ratio"] == 4
    assert g["driver_peak_rss_mib"]["ratio"] == pytest.approx(1.1) and g["startup_s"]["ratio"] is None


# ------------------------------------------------------------------------------ a resume with nothing left


@pytest.mark.integration
def test_a_resume_that_finds_everything_written_starts_no_worker(tmp_path, tiny_artifacts, shared_ray):
    """The duplicate pass counts the rows left to generate; when none are, the job ends without
    starting a generation worker (before, it loaded the model to process zero rows). A resume with
    rows left still generates exactly those. The three jobs share one connection to the session's
    Ray cluster (one Ray job, whose idle workers they reuse); the actors counted for a job are the
    ones of this Ray job that did not exist before it started."""
    import ray
    from ray.util.state import list_actors

    from pipeline.data.outputs import read_output
    from pipeline.run import run_pipeline
    from pipeline.settings.config import load_config

    artifacts = tiny_artifacts
    lines = [json.dumps({"id": f"r{k % 7}", "prompt": f"w{5 + k} w9"}) for k in range(9)]  # r0, r1 twice
    (tmp_path / "in.jsonl").write_text("\n".join([*lines, "{broken", json.dumps({"id": "e", "prompt": ""})]) + "\n")
    overrides = [f"input.urls=[{tmp_path}/in.jsonl]", f"output.url={tmp_path}/out",
                 f"model.target={artifacts['target']}", "model.dtype=fp32", "model.device=cpu", "decoding.mode=ar",
                 "decoding.max_new_tokens=2",
                 "resources.num_cpus_per_worker=0.5", "resources.batch_size=2", "output.rows_per_file=2",
                 "run.run_id=resume-test"]

    def actors_of_this_job() -> dict[str, str]:
        job_id = ray.get_runtime_context().get_job_id()
        return {a.actor_id: a.class_name for a in list_actors(filters=[("job_id", "=", job_id)], limit=1000)}

    def job(*extra: str) -> tuple[dict, list[str]]:
        before = actors_of_this_job()
        summary = run_pipeline(load_config(None, [*overrides, *extra]))
        return summary, [name for actor, name in actors_of_this_job().items() if actor not in before]

    ray.shutdown()
    ray.init()  # joins the shared cluster as a Ray job of this test's; the pipeline keeps this connection
    try:
        first, actors = job()
        assert first["this_run"]["rows"] == 11 and any("GenerationWorker" in a for a in actors)
        again, actors = job("run.resume=true")
        assert again["this_run"]["rows"] == 0 and again["this_run"]["rows_skipped_as_done"] == 11
        assert not any("GenerationWorker" in a for a in actors), actors
        assert again["output"]["rows"] == 11 and len(read_output(f"{tmp_path}/out", ["row_key"])) == 11

        lost = sorted((tmp_path / "out").glob("part-*.parquet"))[0]
        lost_keys = set(read_output(f"{tmp_path}/out", ["row_key"])["row_key"].to_pylist())
        lost.unlink()
        lost_keys -= set(read_output(f"{tmp_path}/out", ["row_key"])["row_key"].to_pylist())
        partial, actors = job("run.resume=true")
        assert lost_keys and partial["this_run"]["rows"] == len(lost_keys)
        assert any("GenerationWorker" in a for a in actors), actors
        assert len(set(read_output(f"{tmp_path}/out", ["row_key"])["row_key"].to_pylist())) == 11
    finally:
        ray.shutdown()


@pytest.mark.integration
def test_the_driver_starts_the_trie_store_of_a_one_node_cluster(tmp_path, shared_ray):
    """On a one-node cluster whose node can hold a worker, the driver starts the node's N-gram
    store at job start (pipeline/run.py), so the workers find the trie placed; where the workers
    need what the node lacks (a GPU node still to come), it starts none. A trie of its own: the
    store is this test's alone, stopped at the end without touching other jobs' stores."""
    import ray

    from pipeline.cluster import ngram_store
    from tests.test_ngram_store import make_trie

    url = str(make_trie(tmp_path / "early.trie", seed=11))
    name_of = lambda: ngram_store.store_actor_name(  # noqa: E731
        ray.get_runtime_context().get_node_id(), ngram_store.check_trie_url(url).content_key)
    ray.shutdown()
    ray.init()  # joins the shared cluster (one node, 2 CPUs)
    try:
        assert not ngram_store.start_store_for_one_node_cluster(url, worker_cpus=0.5, worker_gpus=1)
        assert not ngram_store.start_store_for_one_node_cluster(url, worker_cpus=64, worker_gpus=0)
        assert name_of() not in ngram_store.list_ngram_stores()
        assert ngram_store.start_store_for_one_node_cluster(url, worker_cpus=0.5, worker_gpus=0)
        store = ray.get_actor(name_of(), namespace=ngram_store.NAMESPACE)
        answer = ray.get(store.path.remote(), timeout=120)
        assert answer.get("placement") == "in-place" and Path(answer["path"]) == Path(url), answer
        ray.get(store.close.remote(), timeout=60)
        ray.kill(store)
    finally:
        ray.shutdown()
