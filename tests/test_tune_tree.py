"""`jobs.bench tune_tree`: the coordinate search finds the best grid point of a known function, configs
fail clearly, and the job runs end to end on a tiny model (replies reused on a second run)."""

from __future__ import annotations

import json

import pytest

from dart_bench.tune_tree import DEFAULT_GRID, TuneConfigError, coordinate_search, parse_config, setting
from jobs.bench import main as bench_main
from ngram_native import TreeParams


class Bowl:
    """A fake replayer: tau peaks at ngram_weight 1.0, depth_decay 0.35, beam_width 40."""

    def __init__(self):
        self.calls = 0

    def __call__(self, params: TreeParams) -> dict:
        self.calls += 1
        tau = 3.0 - (params.ngram_weight - 1.0) ** 2 - (params.depth_decay - 0.35) ** 2 \
            - 0.001 * abs(params.beam_width - 40)
        return {"tau": tau}


def test_coordinate_search_reaches_the_best_point_of_a_separable_function():
    best = coordinate_search(Bowl(), TreeParams(), {k: DEFAULT_GRID[k] for k in
                                                    ("ngram_weight", "depth_decay", "beam_width")}, passes=3)
    assert (best.ngram_weight, best.depth_decay, best.beam_width) == (1.0, 0.35, 40)
    assert (best.top_k, best.draft_decay) == (TreeParams().top_k, TreeParams().draft_decay)  # not searched


def test_ties_keep_the_starting_setting():
    flat = coordinate_search(lambda p: {"tau": 2.0}, TreeParams(), DEFAULT_GRID, passes=2)
    assert flat == TreeParams()


@pytest.mark.parametrize("args, message", [
    (["grid={budget: [4]}"], "grid.budget: not a searchable knob"),
    (["grid={top_k: []}"], "grid.top_k: no values"),
    (["grid={top_k: [0, 5]}"], "top_k: must be >= 1"),
    (["mode=ar"], "mode: 'ar' is not a tree drafter"),
    (["mode=nope"], "mode: 'nope' is not a tree drafter"),
    (["base={budget: 8}"], "base.budget: not a TreeParams field"),
    (["budgets=[]"], "budgets"),
    (["passes=0"], "passes >= 1"),
    (["no_such_key=1"], "no_such_key"),
    (["temperature=-1"], "reply sampling: temperature must be finite and >= 0"),
    (["temperature=1", "top_p=0"], "reply sampling: top_p must be in"),
])
def test_bad_configs_are_clear_errors(args, message):
    with pytest.raises(TuneConfigError, match=message):
        parse_config(args)


def test_a_given_grid_replaces_the_default_and_base_sets_the_start():
    cfg = parse_config(["grid={ngram_weight: [0, 1]}", "base={top_k: 50}"])
    assert cfg.grid == {"ngram_weight": [0, 1]}
    assert setting(cfg.base, budget=16) == TreeParams(top_k=50, budget=16)
    assert parse_config([]).grid == DEFAULT_GRID


def test_end_to_end_on_a_tiny_model_and_replies_are_reused(tmp_path, monkeypatch):
    from tests.tiny_models import save_tiny_artifacts

    art = save_tiny_artifacts(tmp_path / "art")
    args = [f"target={art['target']}", f"head={art['head']}", f"trie={art['trie']}", "dtype=fp32", "threads=1",
            "num_prompts=3", "check_prompts=1", "max_new_tokens=8", "budgets=[4,8]",
            "grid={ngram_weight: [0.0, 1.0], top_k: [2, 8]}", f"output_dir={tmp_path / 'out'}"]
    assert bench_main(["tune_tree", *args]) == 0
    figures = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert [r["budget"] for r in figures["results"]] == [4, 8]
    for row in figures["results"]:
        assert row["search_tau"]["best"] >= row["search_tau"]["base"] >= 1.0
        assert set(row["check_tau"]) == {"base", "best"}
        best = [m["tau"] for m in figures["measured"] if m["budget"] == row["budget"]]
        assert row["search_tau"]["best"] == max(best)  # each knob at its best: here the grid's best
    assert len(figures["search_prompts"]) == 3 and len(figures["check_prompts"]) == 1
    assert "| 4 |" in (tmp_path / "out" / "tune.md").read_text()

    def no_generation(*args, **kwargs):
        raise AssertionError("replies should come from replies.json")

    monkeypatch.setattr("dart_train.replay.target_replies", no_generation)
    assert bench_main(["tune_tree", *args]) == 0


def test_sampled_replies_are_replayed_and_cached_apart_from_greedy_ones(tmp_path, monkeypatch):
    from dart_train import replay as replay_module
    from tests.tiny_models import save_tiny_artifacts

    art = save_tiny_artifacts(tmp_path / "art")
    base = [f"target={art['target']}", f"head={art['head']}", f"trie={art['trie']}", "dtype=fp32", "threads=1",
            "num_prompts=2", "check_prompts=0", "max_new_tokens=8", "budgets=[8]", "grid={top_k: [2]}",
            f"output_dir={tmp_path / 'out'}"]
    made = []
    real = replay_module.target_replies

    def recording(*args, **kwargs):
        made.append(kwargs.get("params"))
        return real(*args, **kwargs)

    monkeypatch.setattr("dart_train.replay.target_replies", recording)
    assert bench_main(["tune_tree", *base]) == 0
    assert bench_main(["tune_tree", *base, "temperature=1.0", "seed=5"]) == 0  # another key: sampled anew
    assert bench_main(["tune_tree", *base, "temperature=1.0", "seed=5"]) == 0  # the same: reused
    assert [(p.temperature, p.seed) for p in made] == [(0.0, 0), (1.0, 5)]
    assert "sampled at T=1, seed 5" in (tmp_path / "out" / "tune.md").read_text()
