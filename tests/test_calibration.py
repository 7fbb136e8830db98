"""Verify-cost calibration per live batch size, cached on disk per machine, model shape and kernels."""

from __future__ import annotations

import json

import pytest

from dart_worker import calibration
from dart_worker.calibration import calibration_key, grid, latency_curves, make_sizer
from dart_worker.hardware.contention import ContentionMeter
from dart_worker.sizing.latency import LatencyModel
from dart_worker.target.adapter import TargetAdapter
from tests.tiny_models import tiny_model


class QuietMeter(ContentionMeter):
    """The machine counted as quiet whatever else runs (a test suite on a busy machine must
    still see its curves cached; the contention rule has its own test below)."""

    @property
    def quiet(self) -> bool:
        return True


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("DART_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv(calibration.DISABLE_ENV, raising=False)
    monkeypatch.setattr(calibration, "ContentionMeter", QuietMeter)
    return tmp_path / "calibration"


def test_grid_is_per_sequence_doublings_up_to_the_row_cap():
    assert grid(1) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert grid(4) == [4, 8, 16, 32, 64, 128]
    assert grid(16) == [16, 32, 64, 128]
    assert grid(100) == [100, 200]  # at least two points: the curve needs a slope


def test_each_batch_size_is_measured_once_then_read_from_disk(cache, monkeypatch):
    measured = []
    real_measure = calibration.measure

    def counting(target, *, defer_logits, batch, passes=3):
        measured.append(batch)
        return real_measure(target, defer_logits=defer_logits, batch=batch, passes=1)

    monkeypatch.setattr(calibration, "measure", counting)
    curves = latency_curves(TargetAdapter(tiny_model("llama")), False, [4])
    assert sorted(curves) == [1, 4] and sorted(measured) == [1, 4]
    assert list(curves[4].rows) == grid(4)
    # A new adapter over another model of the same shape (weights do not matter): no measurement.
    measured.clear()
    again = latency_curves(TargetAdapter(tiny_model("llama", seed=5)), False, [4])
    assert measured == [] and again[4].describe() == curves[4].describe()
    # Only the batch size not measured yet is measured, and the file keeps both.
    latency_curves(TargetAdapter(tiny_model("llama", seed=5)), False, [4, 8])
    assert measured == [8]
    (stored,) = cache.glob("*.json")
    assert sorted(json.loads(stored.read_text())["curves"]) == ["1", "4", "8"]
    # Another logits strategy or model shape is another key: measured anew.
    measured.clear()
    latency_curves(TargetAdapter(tiny_model("llama", seed=5)), True, [4])
    latency_curves(TargetAdapter(tiny_model("llama", num_layers=3)), False, [4])
    assert sorted(measured) == [1, 1, 4, 4]


def test_a_corrupt_or_foreign_file_is_measured_over(cache, monkeypatch):
    target = TargetAdapter(tiny_model("qwen3"))
    key = calibration_key(target, False)
    path = calibration._path(key)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("{not json")
    monkeypatch.setattr(calibration, "measure", lambda target, *, defer_logits, batch, passes=3:
                        LatencyModel([batch, 2 * batch], [0.01, 0.02]))
    assert latency_curves(target, False, [2])[2].describe() == {2: 10.0, 4: 20.0}
    data = json.loads(path.read_text())
    assert data["key"]["shape"]["model_type"] == "qwen3" and sorted(data["curves"]) == ["1", "2"]
    data["key"]["machine"] = "another machine"
    path.write_text(json.dumps(data))
    calls = []
    monkeypatch.setattr(calibration, "measure", lambda target, *, defer_logits, batch, passes=3:
                        calls.append(batch) or LatencyModel([batch, 2 * batch], [0.03, 0.04]))
    latency_curves(TargetAdapter(tiny_model("qwen3")), False, [2])
    assert sorted(calls) == [1, 2]


def test_the_sizer_starts_with_a_curve_per_calibrated_batch(cache):
    sizer = make_sizer(TargetAdapter(tiny_model("gemma3")), "auto", 8, False, batches=(1, 4))
    assert set(sizer._latency_by_batch) == {1, 4}
    assert sizer.latency_for(4) is sizer._latency_by_batch[4]
    assert sizer.latency_for(3) is sizer._latency_by_batch[4]  # nearest in log batch size
    assert sizer.latency_for(16) is sizer._latency_by_batch[4]
    assert sizer.latency_for(1) is sizer._latency_by_batch[1]


def test_a_sizer_that_defers_logits_has_curves_of_full_logits_forwards_for_sampled_rounds(cache):
    """Greedy rounds of a deferring engine project a few rows to the vocabulary, sampled rounds all
    of them: each kind of round is priced and learnt on the curves of its own forwards."""
    target = TargetAdapter(tiny_model("gemma3"))
    sizer = make_sizer(target, "auto", 8, True, batches=(1, 4))
    full = sizer._full_logits_latency_by_batch
    assert set(full) == {1, 4} and set(sizer._latency_by_batch) == {1, 4}
    assert sizer.latency_for(4, full_logits=True) is full[4]
    assert sizer.latency_for(3, full_logits=True) is full[4]
    assert sizer.latency_for(4) is sizer._latency_by_batch[4]
    assert full[4].describe() == latency_curves(target, False, [4])[4].describe()
    assert make_sizer(target, "auto", 8, False, batches=(1, 4))._full_logits_latency_by_batch is None


def test_the_cache_can_be_switched_off(cache, monkeypatch):
    monkeypatch.setenv(calibration.DISABLE_ENV, "1")
    latency_curves(TargetAdapter(tiny_model("llama")), False, [2])
    assert not cache.exists() or not list(cache.glob("*.json"))


def test_a_second_start_measures_nothing(cache, monkeypatch):
    """A worker starting on a machine that ran the target before neither calibrates nor measures
    the logits decision again, even if that measurement would now come out the other way (load
    elsewhere): the decision keys the curves, so a flip would mean calibrating at every start."""
    from dart_worker.engine_factory import EngineParts, build_engine
    from ngram_native.builders import TreeParams

    measured, decided = [], []
    real_measure, real_decide = calibration.measure, TargetAdapter.deferred_logits_pay

    def counting(target, *, defer_logits, batch, passes=3):
        measured.append(batch)
        return real_measure(target, defer_logits=defer_logits, batch=batch, passes=1)

    def deciding(self, *args, **kwargs):
        decided.append(1)
        return real_decide(self, *args, **kwargs)

    monkeypatch.setattr(calibration, "measure", counting)
    monkeypatch.setattr(TargetAdapter, "deferred_logits_pay", deciding)

    def start():  # what a new worker process does: a fresh adapter, the engine with auto sizing
        parts = EngineParts(target=TargetAdapter(tiny_model("llama")))
        return build_engine(parts, "lookup", TreeParams(budget=8), sizing="auto", batches=(1, 4))

    first = start()
    assert sorted(measured) == [1, 4] and decided == [1]
    assert first.sizer.packed  # exact shapes: a block runs its real rows
    measured.clear()
    decided.clear()
    flipped = not first.defer_logits
    monkeypatch.setattr(TargetAdapter, "deferred_logits_pay", lambda self, *a, **k: decided.append(1) or flipped)
    second = start()
    assert measured == [] and decided == []
    assert second.defer_logits == first.defer_logits
    curves = "latency_ms_by_batch_and_rows"
    assert second.sizer.describe()[curves] == first.sizer.describe()[curves]
    # Switched off, the cache neither answers nor stores.
    monkeypatch.setenv(calibration.DISABLE_ENV, "1")
    start()
    # (an engine that defers measures its sampled rounds' full-logits forwards too)
    assert decided == [1] and sorted(measured) == ([1, 1, 4, 4] if flipped else [1, 4])


def test_a_curve_measured_under_load_is_used_but_not_stored(cache, monkeypatch):
    """A curve timed while other work held the CPUs describes that moment, not the machine: the
    process that measured it uses it, nothing is written, and the next start measures again."""
    shares = iter([0.0, 0.5])  # batch 1 quiet, batch 2 under load

    class FakeMeter(ContentionMeter):
        def __exit__(self, *exc):
            super().__exit__(*exc)
            self.share = next(shares)

    monkeypatch.setattr(calibration, "ContentionMeter", FakeMeter)
    measured = []
    monkeypatch.setattr(calibration, "measure", lambda target, *, defer_logits, batch, passes=3:
                        measured.append(batch) or LatencyModel([batch, 2 * batch], [0.01, 0.02]))
    curves = latency_curves(TargetAdapter(tiny_model("llama")), False, [2])
    assert sorted(curves) == [1, 2] and sorted(measured) == [1, 2]
    (stored,) = cache.glob("*.json")
    assert sorted(json.loads(stored.read_text())["curves"]) == ["1"]
    shares = iter([0.0])
    measured.clear()
    latency_curves(TargetAdapter(tiny_model("llama")), False, [2])
    assert measured == [2]
    assert sorted(json.loads(stored.read_text())["curves"]) == ["1", "2"]
