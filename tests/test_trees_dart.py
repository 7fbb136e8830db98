"""DART n-gram beam search: C++ builder vs a pure-Python reference of the same scoring.

The reference repeats the C++ arithmetic operation for operation (same libm calls, same
summation order), so trees must agree exactly - nodes, order and scores - including on
inputs full of ties, which hypothesis is steered towards by drawing values from a tiny set.
"""

from __future__ import annotations

import math
from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ngram_native import _core
from ngram_native.builders import build_dart_trees, ngram_probs
from ngram_native.trees import DraftTree
from tests.hypothesis_budget import examples

# ---------------------------------------------------------------------------------------
# Pure-Python reference
# ---------------------------------------------------------------------------------------


def ref_rows(values: np.ndarray, ids: np.ndarray | None, k: int) -> list[list[tuple[float, int]]]:
    """Per position: the best k (value, id) pairs by value desc, id asc."""
    rows = []
    for d in range(values.shape[0]):
        row_ids = range(values.shape[1]) if ids is None else ids[d].tolist()
        pairs = sorted(zip(values[d].tolist(), row_ids), key=lambda x: (-x[0], x[1]))
        rows.append(pairs[:k])
    return rows


def canonical_tree(nodes: list[dict]) -> DraftTree:
    """nodes: dicts with token, parent (index into `nodes`), depth, score; topological."""
    out_index: dict[int, int] = {}
    order: list[int] = []
    for depth in sorted({n["depth"] for n in nodes}):
        group = [i for i, n in enumerate(nodes) if n["depth"] == depth]

        def parent_out(i: int) -> int:
            return -1 if nodes[i]["parent"] < 0 else out_index[nodes[i]["parent"]]

        group.sort(key=lambda i: (parent_out(i), -nodes[i]["score"], nodes[i]["token"]))
        for i in group:
            out_index[i] = len(order)
            order.append(i)
    return DraftTree(
        tokens=np.array([nodes[i]["token"] for i in order], dtype=np.int32),
        parents=np.array(
            [-1 if nodes[i]["parent"] < 0 else out_index[nodes[i]["parent"]] for i in order], dtype=np.int32
        ),
        depths=np.array([nodes[i]["depth"] for i in order], dtype=np.int32),
        scores=np.array([nodes[i]["score"] for i in order], dtype=np.float64),
    )


def ref_dart(
    values: np.ndarray,
    ids: np.ndarray | None,
    context: list[int],
    scorer,
    *,
    budget: int = 60,
    top_k: int = 25,
    beam_width: int = 20,
    eos_ids: tuple[int, ...] = (),
    depth_decay: float = 0.7,
    draft_decay: float = 0.9,
    ngram_weight: float = 0.5,
    keep_pruned: bool = True,
    ngram_first_level: bool = False,
) -> DraftTree:
    rows = ref_rows(values, ids, top_k)
    draft_terms = []
    for row in rows:
        best = row[0][0]
        e = [math.exp(v - best) for v, _ in row]
        total = 0.0
        for x in e:
            total += x
        draft_terms.append([math.log(x / total + 1e-10) for x in e])
    use_ngram = scorer is not None and ngram_weight != 0.0
    ctx_width = max(_core._scorer_order(scorer) - 1, 0) if use_ngram else 0

    pool: list[dict] = []
    beam: list[int] = []
    for level, row in enumerate(rows):
        w = float(level + 1) ** -depth_decay
        a = draft_decay ** float(level)
        cand = [t for _, t in row]
        parents = [-1] if level == 0 else [b for b in beam if not pool[b]["eos"]]
        created = []
        for parent in parents:
            q = None
            if (level > 0 or ngram_first_level) and use_ngram:
                path = []
                x = parent
                while x >= 0:
                    path.append(pool[x]["token"])
                    x = pool[x]["parent"]
                full = list(context) + path[::-1]
                ctx = full[max(len(full) - ctx_width, 0) :] if ctx_width else []
                q = ngram_probs(scorer, ctx, cand).tolist()
            p_score = 0.0 if parent < 0 else pool[parent]["score"]
            p_key = math.inf if parent < 0 else pool[parent]["key"]
            for j, token in enumerate(cand):
                term = a * draft_terms[level][j]
                if q is not None:
                    term += ngram_weight * math.log(q[j] + 1e-10)
                score = p_score + w * term
                created.append(len(pool))
                pool.append(
                    dict(token=token, parent=parent, depth=level + 1, eos=token in eos_ids, kept=False,
                         score=score, key=min(score, p_key))
                )  # fmt: skip
        if not created:
            break
        created.sort(key=lambda i: (pool[i]["eos"], -pool[i]["score"], i))
        beam = created[:beam_width]
        for i in beam:
            pool[i]["kept"] = True
    eligible = [i for i in range(len(pool)) if keep_pruned or pool[i]["kept"]]
    eligible.sort(key=lambda i: (-pool[i]["key"], i))
    chosen = sorted(eligible[:budget])
    local = {x: i for i, x in enumerate(chosen)}
    nodes = [
        dict(token=pool[x]["token"], parent=-1 if pool[x]["parent"] < 0 else local[pool[x]["parent"]],
             depth=pool[x]["depth"], score=pool[x]["score"])
        for x in chosen
    ]  # fmt: skip
    return canonical_tree(nodes)


def assert_same_tree(got: DraftTree, want: DraftTree) -> None:
    got.validate()
    want.validate()
    np.testing.assert_array_equal(got.tokens, want.tokens)
    np.testing.assert_array_equal(got.parents, want.parents)
    np.testing.assert_array_equal(got.depths, want.depths)
    np.testing.assert_array_equal(got.scores, want.scores)


def corpus_scorer(corpus: list[list[int]], order: int):
    """A test scorer holding the exact counts of every 1..order-gram of `corpus`."""
    counts: Counter = Counter()
    for seq in corpus:
        for n in range(1, order + 1):
            for i in range(len(seq) - n + 1):
                counts[tuple(seq[i : i + n])] += 1
    return _core._DictScorer(order, dict(counts))


# ---------------------------------------------------------------------------------------
# Hypothesis inputs
# ---------------------------------------------------------------------------------------

# A tiny value set forces ties everywhere (equal softmax probabilities, equal scores).
TIE_VALUES = st.sampled_from([-2.0, -1.0, 0.0, 0.0, 1.0, 3.0, -math.inf])
WIDE_VALUES = st.floats(-8.0, 8.0, width=32)


@st.composite
def dart_case(draw):
    vocab = draw(st.integers(2, 9))
    batch = draw(st.integers(1, 3))
    positions = draw(st.integers(1, 4))
    element = draw(st.sampled_from([TIE_VALUES, WIDE_VALUES]))
    shape = (batch, positions, vocab)
    flat = draw(st.lists(element, min_size=int(np.prod(shape)), max_size=int(np.prod(shape))))
    logits = np.array(flat, dtype=np.float32).reshape(shape)
    logits[..., 0] = np.maximum(logits[..., 0], -1.0)  # at least one finite value per row
    params = dict(
        budget=draw(st.integers(0, 25)),
        top_k=draw(st.integers(1, vocab + 1)),
        beam_width=draw(st.integers(1, 6)),
        eos_ids=tuple(draw(st.sets(st.integers(0, vocab - 1), max_size=2))),
        keep_pruned=draw(st.booleans()),
        ngram_first_level=draw(st.booleans()),
    )
    if draw(st.booleans()):
        params.update(
            depth_decay=draw(st.sampled_from([0.7, 0.0, 2.0, -0.5])),
            draft_decay=draw(st.sampled_from([0.9, 1.0, 0.0, 0.5])),
            ngram_weight=draw(st.sampled_from([0.5, 0.0, 2.0])),
        )
    contexts = [draw(st.lists(st.integers(0, vocab - 1), max_size=5)) for _ in range(batch)]
    scorer = None
    if draw(st.booleans()):
        order = draw(st.integers(1, 4))
        corpus = draw(st.lists(st.lists(st.integers(0, vocab - 1), max_size=30), min_size=1, max_size=3))
        scorer = corpus_scorer(corpus, order)
    return logits, contexts, scorer, params


# ---------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------


@settings(max_examples=examples(250), deadline=None)
@given(dart_case())
def test_dart_matches_python_reference(case):
    logits, contexts, scorer, params = case
    trees = build_dart_trees(logits=logits, contexts=contexts, scorer=scorer, **params)
    assert len(trees) == logits.shape[0]
    for b, tree in enumerate(trees):
        want = ref_dart(logits[b], None, contexts[b], scorer, **params)
        assert_same_tree(tree, want)
        assert tree.size == min(params["budget"], tree.size)
        assert tree.size <= params["budget"]
        if tree.size:
            assert tree.depths.max() <= logits.shape[1]
        for i in np.flatnonzero(np.isin(tree.tokens, params["eos_ids"])):
            assert i not in tree.parents, "an EOS node was expanded"


@settings(max_examples=examples(60), deadline=None)
@given(dart_case(), st.randoms(use_true_random=False))
def test_topk_input_equals_dense_input_in_any_column_order(case, rnd):
    """Pre-selected candidates give the same tree as dense logits, whatever their order."""
    logits, contexts, scorer, params = case
    vocab = logits.shape[2]
    k = rnd.randint(min(params["top_k"], vocab), vocab)  # at least the builder's top_k
    ids = np.argsort(-logits, axis=-1, kind="stable")[..., :k]
    perm = np.array(rnd.sample(range(k), k))
    ids = np.ascontiguousarray(ids[..., perm]).astype(np.int64)
    values = np.take_along_axis(logits, ids, axis=-1).astype(np.float64)
    dense = build_dart_trees(logits=logits, contexts=contexts, scorer=scorer, **params)
    given_k = build_dart_trees(
        topk_ids=ids, topk_values=values, contexts=contexts, scorer=scorer, vocab_size=vocab, **params
    )
    for a, b in zip(dense, given_k):
        assert_same_tree(b, a)


def test_default_parameters_follow_the_reference_config():
    """top-k 25, beam 20, budget 60, (l+1)^-0.7, 0.9^l, n-gram weight 0.5."""
    rng = np.random.default_rng(7)
    logits = rng.normal(0, 3, size=(2, 8, 300)).astype(np.float32)
    corpus = [rng.integers(0, 300, size=2000).tolist()]
    scorer = corpus_scorer(corpus, 3)
    contexts = [corpus[0][:50], corpus[0][100:103]]
    trees = build_dart_trees(logits=logits, contexts=contexts, scorer=scorer)
    for b, tree in enumerate(trees):
        assert tree.size == 60
        assert_same_tree(tree, ref_dart(logits[b], None, contexts[b], scorer))


def test_child_outscoring_parent_keeps_tree_prefix_closed():
    """With one candidate per position p = 1 and ln(1 + 1e-10) > 0: every child outscores
    its parent by ~1e-10, so ranking by raw score would drop the first node."""
    logits = np.zeros((1, 5, 4), dtype=np.float32)
    for budget in range(6):
        (tree,) = build_dart_trees(logits=logits, top_k=1, budget=budget)
        tree.validate()
        assert tree.size == budget
        np.testing.assert_array_equal(tree.parents, np.arange(budget) - 1)
        assert np.all(np.diff(tree.scores) > 0)  # the raw scores really do increase


def test_eos_nodes_are_not_expanded_and_sort_after_others_in_the_beam():
    # Position 0: token 0 (EOS) is the clear favourite, token 1 second.
    logits = np.full((1, 3, 3), -5.0, dtype=np.float32)
    logits[0, 0, 0] = 5.0
    logits[0, 0, 1] = 4.0
    (tree,) = build_dart_trees(logits=logits, top_k=3, beam_width=1, budget=60, eos_ids=[0])
    tree.validate()
    # The beam of width 1 keeps token 1 (non-EOS) although EOS scores higher.
    assert tree.tokens[0] == 0 and tree.parents[0] == -1
    kids_of_eos = np.flatnonzero(tree.parents == 0)
    assert kids_of_eos.size == 0
    assert set(tree.tokens[tree.depths == 2].tolist()) == {0, 1, 2}
    assert all(tree.tokens[tree.parents[tree.depths == 2]] == 1)


def test_all_eos_beam_stops_the_search():
    logits = np.zeros((1, 4, 2), dtype=np.float32)
    (tree,) = build_dart_trees(logits=logits, eos_ids=[0, 1], budget=60)
    np.testing.assert_array_equal(tree.depths, [1, 1])


def test_keep_pruned_false_only_uses_beam_nodes():
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(1, 3, 10)).astype(np.float32)
    (pruned,) = build_dart_trees(logits=logits, top_k=10, beam_width=2, budget=100, keep_pruned=False)
    (full,) = build_dart_trees(logits=logits, top_k=10, beam_width=2, budget=100)
    assert pruned.size == 2 + 2 + 2  # beam-kept nodes of three levels
    assert full.size == 10 + 20 + 20  # every scored child


def test_scorer_changes_the_tree_and_weight_zero_ignores_it():
    vocab = 6
    logits = np.zeros((1, 3, vocab), dtype=np.float32)  # draft has no preference
    scorer = corpus_scorer([[1, 2, 3, 1, 2, 3, 1, 2, 3]], 2)
    (guided,) = build_dart_trees(logits=logits, contexts=[[1]], scorer=scorer, budget=7, top_k=vocab)
    (plain,) = build_dart_trees(logits=logits, contexts=[[1]], scorer=scorer, budget=7, top_k=vocab,
                                ngram_weight=0.0)  # fmt: skip
    (none,) = build_dart_trees(logits=logits, budget=7, top_k=vocab)
    assert_same_tree(plain, none)
    # Six equal depth-1 nodes, then the single best depth-2 node. Without the scorer all
    # children tie and creation order picks 0 -> 0; the corpus makes "2 after 1" certain
    # (q = 1), and "3 after 2" ties with it but is created later.
    deeper = [(int(plain.tokens[plain.parents[i]]), int(plain.tokens[i])) for i in np.flatnonzero(plain.depths == 2)]
    assert deeper == [(0, 0)]
    deeper = [
        (int(guided.tokens[guided.parents[i]]), int(guided.tokens[i])) for i in np.flatnonzero(guided.depths == 2)
    ]
    assert deeper == [(1, 2)]
    assert guided.find_child(guided.find_child(-1, 1), 2) == 6


def test_context_is_cut_to_the_last_n_minus_1_tokens():
    rng = np.random.default_rng(5)
    logits = rng.normal(size=(1, 4, 8)).astype(np.float32)
    scorer = corpus_scorer([rng.integers(0, 8, 200).tolist()], 3)
    long_ctx = rng.integers(0, 8, 40).tolist()
    (a,) = build_dart_trees(logits=logits, contexts=[long_ctx], scorer=scorer, top_k=8)
    (b,) = build_dart_trees(logits=logits, contexts=[np.array(long_ctx[-2:])], scorer=scorer, top_k=8)
    assert_same_tree(a, b)
    assert_same_tree(a, ref_dart(logits[0], None, long_ctx, scorer, top_k=8))


def test_batch_sequences_are_independent():
    rng = np.random.default_rng(11)
    logits = rng.normal(size=(4, 5, 12)).astype(np.float32)
    scorer = corpus_scorer([rng.integers(0, 12, 300).tolist()], 3)
    contexts = [rng.integers(0, 12, n).tolist() for n in (0, 1, 2, 9)]
    batch = build_dart_trees(logits=logits, contexts=contexts, scorer=scorer, budget=20)
    for b in range(4):
        (single,) = build_dart_trees(logits=logits[b : b + 1], contexts=contexts[b : b + 1], scorer=scorer,
                                     budget=20)  # fmt: skip
        assert_same_tree(batch[b], single)


def test_budget_zero_and_one_and_single_position():
    logits = np.array([[[0.0, 2.0, 1.0]]], dtype=np.float32)
    assert build_dart_trees(logits=logits, budget=0)[0].size == 0
    (one,) = build_dart_trees(logits=logits, budget=1)
    np.testing.assert_array_equal(one.tokens, [1])
    (all_,) = build_dart_trees(logits=logits, budget=60)
    np.testing.assert_array_equal(all_.tokens, [1, 2, 0])
    np.testing.assert_array_equal(all_.depths, [1, 1, 1])


def test_empty_batch():
    assert build_dart_trees(logits=np.zeros((0, 3, 5), dtype=np.float32)) == []


def test_trees_are_read_only():
    (tree,) = build_dart_trees(logits=np.zeros((1, 2, 3), dtype=np.float32))
    with pytest.raises(ValueError):
        tree.tokens[0] = 5


@pytest.mark.parametrize("bad", [0.5, 1.5])
def test_scorer_returning_invalid_probabilities_is_an_error(bad):
    """A corrupt count table (n-gram seen more often than its context) is reported."""
    scorer = _core._DictScorer(2, {(1,): 1, (1, 2): 3} if bad > 1 else {(1,): 2, (1, 2): 1})
    logits = np.zeros((1, 2, 3), dtype=np.float32)
    if bad > 1:
        with pytest.raises(RuntimeError, match="outside"):
            build_dart_trees(logits=logits, contexts=[[1]], scorer=scorer)
    else:
        build_dart_trees(logits=logits, contexts=[[1]], scorer=scorer)


def test_real_trie_scorer_matches_reference_and_dict_scorer(tmp_path):
    """The mmap'd trie is a drop-in NgramScorer: same trees as the reference and as a dict
    scorer holding the trie's own counts."""
    from ngram_native.trie import NgramTrie, build_trie

    rng = np.random.default_rng(13)
    vocab = 40
    docs = [rng.zipf(1.5, size=400).clip(1, vocab) - 1 for _ in range(5)]
    path = tmp_path / "small.trie"
    build_trie(docs, path, vocab_size=vocab, tokenizer_fingerprint="test", order=3)
    logits = rng.normal(0, 2, size=(3, 6, vocab)).astype(np.float32)
    contexts = [docs[0][:10], docs[1][50:52], []]
    with NgramTrie.open(path, verify=True) as trie:
        dict_scorer = _core._DictScorer(trie.order, trie.ngram_counts())
        with_trie = build_dart_trees(logits=logits, contexts=contexts, scorer=trie, top_k=10, budget=40)
        with_dict = build_dart_trees(logits=logits, contexts=contexts, scorer=dict_scorer, top_k=10, budget=40)
        for b in range(3):
            assert_same_tree(with_trie[b], with_dict[b])
            assert_same_tree(with_trie[b], ref_dart(logits[b], None, list(contexts[b]), trie, top_k=10, budget=40))
        # The scorer made a difference somewhere (else this test proves little).
        plain = build_dart_trees(logits=logits, top_k=10, budget=40)
        assert any(not np.array_equal(a.tokens, p.tokens) for a, p in zip(with_trie, plain))


@st.composite
def larger_dart_case(draw):
    vocab = draw(st.integers(5, 60))
    positions = draw(st.integers(1, 7))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    scale = draw(st.sampled_from([0.0, 0.5, 2.0, 6.0]))  # 0: all ties
    logits = (rng.normal(0, 1, size=(2, positions, vocab)) * scale).round(draw(st.sampled_from([0, 1, 6])))
    corpus = [rng.integers(0, vocab, size=draw(st.integers(0, 400))).tolist() for _ in range(2)]
    scorer = corpus_scorer(corpus, draw(st.integers(1, 4))) if draw(st.booleans()) else None
    contexts = [corpus[0][:8], corpus[1][-3:]]
    params = dict(
        budget=draw(st.integers(0, 90)),
        top_k=draw(st.integers(1, 30)),
        beam_width=draw(st.integers(1, 25)),
        eos_ids=tuple(draw(st.sets(st.integers(0, vocab - 1), max_size=3))),
        keep_pruned=draw(st.booleans()),
        depth_decay=draw(st.sampled_from([0.7, 0.0, 3.0, -1.0])),
        draft_decay=draw(st.sampled_from([0.9, 1.0, 0.0])),
        ngram_weight=draw(st.sampled_from([0.5, 0.0, 4.0])),
    )
    return logits.astype(np.float32), contexts, scorer, params


@settings(max_examples=examples(150), deadline=None)
@given(larger_dart_case())
def test_pruning_never_changes_the_tree(case):
    """Skipping children that cannot reach the budget-th best key is exact."""
    logits, contexts, scorer, params = case
    fast = build_dart_trees(logits=logits, contexts=contexts, scorer=scorer, **params)
    full = build_dart_trees(logits=logits, contexts=contexts, scorer=scorer, prune=False, **params)
    for a, b in zip(fast, full):
        assert_same_tree(a, b)
