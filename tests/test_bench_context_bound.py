"""`jobs.bench context_bound`: the oracle span is the longest copy a context drafter could make
(brute-force reference), it only adds to the inner drafter's tree, and the job runs end to end."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dart_bench import context_bound
from dart_bench.context_bound import OracleContext, longest_copy, parse_config
from dart_bench.replay import TuneConfigError
from dart_train.replay import replay, target_references
from dart_worker.engine_factory import build_drafter
from dart_worker.sampling.params import SamplingParams
from jobs.bench import main as bench_main
from ngram_native import TreeParams
from tests.hypothesis_budget import examples
from tests.test_replay import parts, prompts  # noqa: F401 - the tiny target fixture


def brute_longest_copy(context, suffix, continuation) -> int:
    best, m = 0, len(suffix)
    for i in range(len(context) - m + 1):
        if list(context[i : i + m]) == list(suffix):
            k = 0
            while k < len(continuation) and i + m + k < len(context) and context[i + m + k] == continuation[k]:
                k += 1
            best = max(best, k)
    return best


@settings(max_examples=examples(300), deadline=None)
@given(st.lists(st.integers(0, 3), max_size=30), st.integers(1, 3), st.lists(st.integers(0, 3), max_size=6))
def test_longest_copy_matches_brute_force(context, m, continuation):
    suffix = context[-m:] if len(context) >= m else [0] * m
    assert longest_copy(np.asarray(context), suffix, continuation) == brute_longest_copy(context, suffix, continuation)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_oracle_only_adds_spans_the_context_holds(parts, temperature):  # noqa: F811
    refs = target_references(parts, prompts(), 24, params=SamplingParams(temperature=temperature, seed=3))
    tree = TreeParams(budget=6, job_ngram_tokens=0)
    proposed = []

    class Recording(OracleContext):
        def propose(self, tokens, max_depths):
            inner = self.inner.propose(tokens, max_depths)
            self.inner.propose = lambda *_: inner  # the same trees again, for the wrapper to extend
            out = super().propose(tokens, max_depths)
            del self.inner.propose
            proposed.extend(zip(inner, out, [list(t) for t in tokens], [self.live[b] for b in range(len(tokens))],
                                strict=True))
            return out

    oracle = replay(Recording(build_drafter(parts, "dart", tree), refs, 1, job=True), refs, 24,
                    parts.target.max_positions)
    plain = replay(build_drafter(parts, "dart", tree), refs, 24, parts.target.max_positions)
    grew = 0
    for inner, out, seq, r in proposed:
        paths = {tuple(p) for p in _paths(out)}
        assert {tuple(p) for p in _paths(inner)} <= paths  # nothing of the inner tree is lost
        added = paths - {tuple(p) for p in _paths(inner)}
        context = [t for ref in refs[:r] for t in ref.tokens] + seq
        for path in added:  # every added node spells the reply and is a copy the context holds
            assert list(path) == refs[r].tokens[len(seq) : len(seq) + len(path)]
            assert brute_longest_copy(context, seq[-1:], list(path)) == len(path)
        grew += bool(added)
    assert grew > 0  # the repeating prompts give the oracle something to copy
    assert sum(sum(s.accept_lengths) for s in oracle) > sum(sum(s.accept_lengths) for s in plain)


def _paths(tree) -> list[list[int]]:
    paths: list[list[int]] = []
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
        paths.append((paths[parent] if parent >= 0 else []) + [token])
    return paths


@pytest.mark.parametrize("args, message", [
    (["min_match=0"], "min_match >= 1"),
    (["budgets=[]"], "budgets"),
    (["temperature=-1"], "reply sampling"),
])
def test_bad_configs_are_clear_errors(args, message):
    with pytest.raises(TuneConfigError, match=message):
        parse_config(args)


def test_end_to_end_on_a_tiny_model(tmp_path):
    from tests.tiny_models import save_tiny_artifacts

    art = save_tiny_artifacts(tmp_path / "art")
    args = [f"target={art['target']}", f"head={art['head']}", f"trie={art['trie']}", "dtype=fp32", "threads=1",
            "num_prompts=3", "check_prompts=1", "max_new_tokens=8", "budgets=[4]", f"output_dir={tmp_path / 'out'}"]
    assert bench_main(["context_bound", *args]) == 0
    figures = json.loads((tmp_path / "out" / "context_bound.json").read_text())
    assert [r["cell"] for r in figures["results"]] == list(context_bound.CELLS)
    assert all(r["tau"] >= 1.0 and len(r["per_prompt_tau"]) == 3 for r in figures["results"])
    text = (tmp_path / "out" / "context_bound.md").read_text()
    assert "sampled at T=1, seed 0" in text and "| 4 | dart + oracle context + job |" in text
