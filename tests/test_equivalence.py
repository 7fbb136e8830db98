"""The before/after equality check (`python -m dart_bench.equivalence`) sees what it must.

Two runs of the same code agree to the byte (the synthetic clock makes the sizer's decisions
reproducible, whatever the real machine's load), and a planted change in a sizing rule that no
output token shows (drafting pauses one idle round later) is reported as a difference.
"""

from __future__ import annotations

import json

import pytest

from dart_bench import equivalence
from dart_bench.equivalence import Case, Runner, differences
from dart_worker.sizing import pacing

# A sampled batch where the lookup's trees are mostly cut: the drafting back-off decides rounds.
CASE = Case("lookup", "auto", "dear", "sampled")


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    return Runner(tmp_path_factory.mktemp("equivalence"))


def _run(runner: Runner) -> dict:
    return json.loads(json.dumps(runner.run(CASE)))  # what --out writes, read back


def test_two_runs_agree_and_a_planted_sizing_change_is_found(runner, monkeypatch):
    first, second = _run(runner), _run(runner)
    assert list(differences(first, second)) == []
    assert first["cost_model"]["predicted_vs_observed"]["rounds"] > 0  # the sizer sized rounds
    monkeypatch.setattr(pacing, "DRAFT_IDLE_ROUNDS", 3)
    planted = _run(runner)
    found = list(differences(first, planted))
    assert found and any("stats" in line or "cost_model" in line for line in found)


def test_the_synthetic_clock_moves_only_with_work(runner):
    import time

    clock = equivalence.SyntheticClock()
    with equivalence.synthetic_time(clock):
        before = time.perf_counter()
        assert time.perf_counter() == time.time() == before  # reading it moves nothing
        clock.advance(0.25)
        assert time.perf_counter() - before == 0.25
    assert time.perf_counter() != before  # the real clock again


def test_differences_name_the_path():
    assert list(differences({"a": [1, {"b": 2}]}, {"a": [1, {"b": 3}]})) == ["/a[1]/b: 2 != 3"]
    assert list(differences({"a": 1}, {"c": 1})) == ["/a: only in before", "/c: only in after"]
    assert list(differences([1, 2], [1, 2, 3])) == [": [1, 2] != [1, 2, 3]"]
    assert list(differences(1, 1.0)) == [": 1 != 1.0"]  # an int that became a float is a change
