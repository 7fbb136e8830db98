"""Structured output is lossless under every drafter, and every completed row has its shape.

Against brute force: a grammar walk over a tree (`GrammarState.cut`, `masks`) equals a fresh matcher
per node; the engine's output with a constraint equals `ar`'s with the same constraint, greedy and
seeded, for every registered drafter (hypothesis over constraints and prompts); a completed row
validates (jsonschema, re.fullmatch, the choice list); the distribution of a sampled constrained
completion equals the exact masked target distribution (chi-square over whole completions).
A planted bug (a node verified under its parent's grammar state) turns the lossless check red.
"""

from __future__ import annotations

import json
import re

import jsonschema
import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dart_worker.drafters import drafter_names
from dart_worker.engine_factory import EngineParts, build_engine
from dart_worker.head.draft_head import DartDraftHead
from dart_worker.sampling.grammar import GrammarBook, GrammarState, GrammarViolation
from dart_worker.sampling.params import SamplingParams
from dart_worker.sampling.structured_output import (
    StructuredOutput,
    StructuredOutputError,
    check_syntax,
    parse_structured_output,
)
from dart_worker.target.adapter import TargetAdapter
from ngram_native import NgramTrie, TreeParams, build_trie
from ngram_native.trees import SOURCE_GRAMMAR, DraftTree, merge_trees
from tests.tiny_grammar import json_tokenizer
from tests.tiny_models import TINY_VOCAB, tiny_model

EOS = 2
MODES = drafter_names()
EMPTY = DraftTree(*(np.zeros(0, np.int32),) * 3)


@pytest.fixture(scope="module")
def tokenizer():
    return json_tokenizer()


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", vocab_size=TINY_VOCAB)


@pytest.fixture(scope="module")
def trie(tmp_path_factory):
    rng = np.random.default_rng(0)
    docs = [rng.integers(4, TINY_VOCAB, size=40).astype(np.int32) for _ in range(20)]
    path = tmp_path_factory.mktemp("trie") / "t.ngram"
    build_trie(docs, path, order=3, vocab_size=TINY_VOCAB, tokenizer_fingerprint="tiny")
    return NgramTrie.open(path, verify=True)


@pytest.fixture(scope="module")
def engines(model, tokenizer, trie):
    """One engine per registered mode, over the same target and tokenizer (an engine is reused across
    examples: its grammar book then compiles each distinct constraint once)."""
    out = {}
    for mode in MODES:
        torch.manual_seed(123)
        head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
        parts = EngineParts(target=TargetAdapter(model), head=head, trie=trie, eos_token_ids=(EOS,),
                            tokenizer=tokenizer)
        out[mode] = build_engine(parts, mode, TreeParams(lookup_min_match=1))
    return out


# ----------------------------------------------------------------------------------- parsing


@pytest.mark.parametrize("value, kind", [
    ({"json": {"type": "object"}}, "json"),
    ({"json": '{"type": "integer"}'}, "json"),
    ('{"regex": "[a-z]+"}', "regex"),
    ({"choice": ["yes", "no"]}, "choice"),
    ({"json_object": True}, "json_object"),
    ({"grammar": 'root ::= "a" | "b"'}, "grammar"),
    ({"regex": "a+", "json": None}, "regex"),
])
def test_every_kind_parses_from_a_mapping_or_its_json(value, kind):
    parsed = parse_structured_output(value)
    assert parsed.kind == kind
    assert parse_structured_output(parsed.to_dict()) == parsed
    assert parse_structured_output(json.dumps(parsed.to_dict())) == parsed
    check_syntax(parsed)


def test_a_schema_keeps_its_property_order():
    schema = {"type": "object", "properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}
    assert list(parse_structured_output({"json": schema}).schema["properties"]) == ["z", "a"]


@pytest.mark.parametrize("value, words", [
    ({"json": {"type": "object"}, "regex": "a"}, "exactly one"),
    ({}, "exactly one"),
    ({"jsonschema": {}}, "unknown key 'jsonschema'"),
    ({"choice": []}, "non-empty list"),
    ({"choice": ["a", 3]}, "non-empty strings"),
    ({"choice": "a"}, "non-empty list"),
    ({"json_object": "yes"}, "must be true"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": [1]}, "JSON schema object"),
    ({"regex": ""}, "non-empty string"),
    ("[1, 2]", "mapping"),
    ("{bad", "not valid JSON"),
    (7, "mapping"),
])
def test_bad_settings_are_refused_naming_the_problem(value, words):
    with pytest.raises(StructuredOutputError, match=re.escape(words)):
        parse_structured_output(value)


@pytest.mark.parametrize("value, words", [
    ({"regex": "[a-"}, "structured_output.regex: Regex parsing error"),
    ({"json": {"type": "objectx"}}, 'structured_output.json: Unsupported type "objectx"'),
    ({"grammar": "root ::= foo"}, 'structured_output.grammar: EBNF parser error'),
])
def test_invalid_schemas_regexes_and_grammars_name_the_problem(value, words):
    with pytest.raises(StructuredOutputError) as info:
        check_syntax(parse_structured_output(value))
    assert str(info.value).startswith(words)
    assert ".cc:" not in str(info.value)  # the engine's source location is not the user's business


def test_sampling_params_parse_and_hash_the_constraint():
    a = SamplingParams(structured_output={"choice": ["x", "y"]})
    b = SamplingParams(structured_output='{"choice": ["x", "y"]}')
    assert a == b and hash(a) == hash(b) and a.structured_output.kind == "choice"
    with pytest.raises(StructuredOutputError):
        SamplingParams(structured_output={"choice": []})


# ------------------------------------------------------------------- the grammar over a tree


def fresh_mask(book: GrammarBook, constraint: StructuredOutput, path: list[int]) -> torch.Tensor | None:
    """Brute force: a new matcher fed `path`; its mask after it, or None if it refuses the path."""
    state = book.start(constraint, [EOS])
    for token in path:
        if state.matcher.is_terminated() or not state.matcher.accept_token(token):
            return None
    out = torch.full((1, state.words), -1, dtype=torch.int32)
    if not state.matcher.is_terminated():
        state.matcher.fill_next_token_bitmask(out, 0)
    return out[0]


TREE_TOKENS = [4, 5, 6, 10, 12, 13, 14, 22, 23, 24, 50, 51, 53, 56, 73, 86, 88, EOS]


@st.composite
def trees(draw, vocab=TINY_VOCAB, max_nodes=14):
    """Random draft trees as builders make them: distinct tokens among siblings, canonical order."""
    n = draw(st.integers(0, max_nodes))
    parents, depths, tokens = [], [], []
    for _ in range(n):
        parent = draw(st.integers(-1, len(tokens) - 1))
        used = {t for p, t in zip(parents, tokens) if p == parent}
        token = draw(st.sampled_from(TREE_TOKENS))
        if token in used:
            continue
        parents.append(parent)
        depths.append(1 if parent < 0 else depths[parent] + 1)
        tokens.append(token)
    n = len(tokens)
    topological = DraftTree(np.asarray(tokens, np.int32), np.asarray(parents, np.int32), np.asarray(depths, np.int32))
    return merge_trees(topological, EMPTY, n)  # canonical order, as every builder gives it


CONSTRAINTS = [
    StructuredOutput("json", json.dumps({"type": "object", "properties": {"name": {"type": "string"},
                                                                          "age": {"type": "integer"}},
                                         "required": ["name", "age"]})),
    StructuredOutput("regex", "[a-c]{1,3}-[0-9]{2}"),
    StructuredOutput("choice", json.dumps(["cat", "dog", "catalog"])),
    StructuredOutput("json_object", ""),
]


def path_of(tree: DraftTree, node: int) -> list[int]:
    path = []
    while node >= 0:
        path.append(int(tree.tokens[node]))
        node = int(tree.parents[node])
    return path[::-1]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(tree=trees(), which=st.integers(0, len(CONSTRAINTS) - 1), prefix=st.sampled_from([[], [51], [51, 86, 53]]))
def test_cut_and_masks_equal_a_fresh_matcher_per_node(tokenizer, tree, which, prefix):
    book = GrammarBook(tokenizer, TINY_VOCAB)
    constraint = CONSTRAINTS[which]
    state = book.start(constraint, [EOS])
    if fresh_mask(book, constraint, prefix) is None:
        return
    state.commit(prefix)
    before = state.masks(EMPTY)[0].clone()
    cut = state.cut(tree)
    kept = {tuple(path_of(cut, i)) for i in range(cut.size)}
    expected = {tuple(path_of(tree, i)) for i in range(tree.size)
                if fresh_mask(book, constraint, prefix + path_of(tree, i)) is not None}
    assert kept == expected
    shaped = state.shape(tree, 12, 10)
    shaped.validate()
    shaped_paths = {tuple(path_of(shaped, i)) for i in range(shaped.size)}
    assert kept <= shaped_paths and len(shaped_paths) <= len(kept) + 10
    assert all(fresh_mask(book, constraint, prefix + list(p)) is not None for p in shaped_paths)
    assert all(len(p) <= max(12, max(map(len, kept), default=0)) for p in shaped_paths)
    masks = state.masks(cut)
    assert torch.equal(masks[0], fresh_mask(book, constraint, prefix))
    for i in range(cut.size):
        assert torch.equal(masks[i + 1], fresh_mask(book, constraint, prefix + path_of(cut, i))), i
    # The walk leaves the matcher at the committed text.
    assert torch.equal(state.masks(EMPTY)[0], before)


def test_forced_text_is_drafted_as_certain_grammar_nodes(tokenizer):
    book = GrammarBook(tokenizer, TINY_VOCAB)
    state = book.start(CONSTRAINTS[0], [EOS])
    chain = state.shape(EMPTY, 10, 16)
    assert tokenizer.decode(chain.tokens.tolist()) == '{"name": "'
    assert (chain.sources == SOURCE_GRAMMAR).all() and (chain.scores == 0).all()
    assert chain.parents.tolist() == list(range(-1, chain.size - 1))
    assert state.shape(EMPTY, 2, 16).size == 2  # no deeper than asked
    assert state.shape(EMPTY, 10, 1).size == 1  # no more than the budget
    state.commit(chain.tokens.tolist())
    assert state.forced(10) == []  # inside a free string nothing is forced
    # After a drafted value that closes the string, the text up to the next value follows it.
    value = tokenizer('dog"', add_special_tokens=False)["input_ids"]
    tree = DraftTree(np.asarray(value, np.int32), np.arange(-1, len(value) - 1, dtype=np.int32),
                     np.arange(1, len(value) + 1, dtype=np.int32), np.asarray([-0.5, -0.75][: len(value)]),
                     np.ones(len(value), np.uint8))
    shaped = state.shape(tree, 10, 16)
    assert shaped.tokens[: len(value)].tolist() == value
    assert tokenizer.decode(shaped.tokens[len(value):].tolist()) == ', "age": '
    assert (shaped.sources[len(value):] == SOURCE_GRAMMAR).all()
    assert (shaped.scores[len(value):] == tree.scores[-1]).all()  # certain given the leaf
    shaped.validate()


def test_each_distinct_constraint_compiles_once(tokenizer):
    book = GrammarBook(tokenizer, TINY_VOCAB)
    for _ in range(3):
        for constraint in CONSTRAINTS:
            book.start(constraint, [EOS])
    assert book.compilations == len(CONSTRAINTS)


def test_a_committed_token_the_grammar_forbids_is_an_engine_error(tokenizer):
    state = GrammarBook(tokenizer, TINY_VOCAB).start(CONSTRAINTS[1], [EOS])
    with pytest.raises(GrammarViolation):
        state.commit([51])  # '{"' is not [a-c]


# ------------------------------------------------------------------ the engine, every drafter


def valid(constraint: StructuredOutput, text: str) -> bool:
    if constraint.kind in ("json", "json_object"):
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            return False
        if constraint.kind == "json_object":
            return isinstance(value, dict)
        try:
            jsonschema.validate(value, constraint.schema)
        except jsonschema.ValidationError:
            return False
        return True
    if constraint.kind == "regex":
        return re.fullmatch(constraint.spec, text) is not None
    if constraint.kind == "choice":
        return text in constraint.choices
    return True


@st.composite
def constraints(draw):
    kind = draw(st.sampled_from(["json", "regex", "choice"]))
    if kind == "choice":
        words = draw(st.lists(st.sampled_from(["cat", "dog", "red", "blue", "catalog", "yes", "no", "a1", "b.c"]),
                              min_size=1, max_size=4, unique=True))
        return StructuredOutput("choice", json.dumps(words))
    if kind == "regex":
        first = draw(st.sampled_from(["[a-c]{1,3}", "(cat|dog)", "[0-9]{2,4}", "x?y+"]))
        second = draw(st.sampled_from(["", "-[0-9]{2}", "\\.(red|blue)", "_[a-z]{0,2}"]))
        return StructuredOutput("regex", first + second)
    properties = {}
    for name in draw(st.lists(st.sampled_from(["name", "age", "ok", "tags", "color", "id"]), min_size=1,
                              max_size=4, unique=True)):
        properties[name] = draw(st.sampled_from([
            {"type": "string", "maxLength": 4}, {"type": "integer", "minimum": 0, "maximum": 999},
            {"type": "boolean"}, {"enum": ["red", "blue", "dog"]},
            {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}]))
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return StructuredOutput("json", json.dumps(schema))


def decode_all(engines, prompts, params, modes=MODES):
    return {mode: engines[mode].generate(prompts, params) for mode in modes}


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(constraint=constraints(), temperature=st.sampled_from([0.0, 0.8, 1.0]), seed=st.integers(0, 2**20),
       batch=st.integers(1, 3))
def test_every_drafter_commits_ars_tokens_and_completed_rows_validate(engines, constraint, temperature, seed, batch):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(4, TINY_VOCAB, size=int(rng.integers(3, 12))).tolist() for _ in range(batch)]
    params = [SamplingParams(temperature=temperature, seed=seed + b, max_new_tokens=48, structured_output=constraint)
              for b in range(batch)]
    assert_lossless_and_valid(engines, prompts, params, constraint)


def assert_lossless_and_valid(engines, prompts, params, constraint):
    results = decode_all(engines, prompts, params)
    reference = results["ar"]
    for mode, rows in results.items():
        for row, ref in zip(rows, reference):
            assert row.error is None, (mode, row.error)
            assert row.token_ids == ref.token_ids, mode
            assert row.structured_complete == ref.structured_complete
            if row.finish_reason == "stop":
                assert row.structured_complete and valid(constraint, row.text), (mode, row.text)
            else:
                assert row.finish_reason == "length"


def test_grammar_nodes_are_drafted_and_accepted(engines):
    constraint = CONSTRAINTS[0]
    params = SamplingParams(temperature=0.0, max_new_tokens=40, structured_output=constraint)
    result = engines["dart_lookup"].generate([[5, 6, 7]], params)[0]
    assert result.stats.accepted_by_source["grammar"] >= 3  # '{"', 'name', '": ' at least
    assert result.stats.stage_seconds["grammar"] > 0
    assert engines["ar"].generate([[5, 6, 7]], params)[0].stats.accepted_by_source["grammar"] == 0


def test_a_verified_node_under_its_parents_grammar_state_is_caught(engines, monkeypatch):
    """The planted bug: each node's row masked as its parent's (the state before the node's own
    token). A row then allows what its parent allowed, so a draw can commit a token the grammar
    forbids there, or differ from `ar`: the lossless check must go red."""
    original = GrammarState.masks

    def parents_masks(self, tree):
        masks = original(self, tree)
        parents = np.asarray(tree.parents, dtype=np.int64)
        if parents.size:
            masks[1:] = masks[torch.as_tensor(parents + 1)].clone()
        return masks

    prompts = [[5, 6, 7], [9, 10, 11, 12]]
    failures = 0
    for constraint in CONSTRAINTS[:3]:
        for temperature in (0.0, 1.0):
            params = [SamplingParams(temperature=temperature, seed=s, max_new_tokens=40, structured_output=constraint)
                      for s in range(len(prompts))]
            with monkeypatch.context() as patch:
                patch.setattr(GrammarState, "masks", parents_masks)
                try:
                    assert_lossless_and_valid(engines, prompts, params, constraint)
                except (AssertionError, GrammarViolation):
                    failures += 1
    assert failures >= 1


def test_penalties_min_p_logprobs_and_n_work_with_a_grammar(engines):
    constraint = CONSTRAINTS[0]
    base = dict(temperature=0.9, min_p=0.02, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.3,
                logprobs=3, max_new_tokens=40, structured_output=constraint)
    samples = [[SamplingParams(seed=7, **base), SamplingParams(seed=8, **base)]]
    reference = engines["ar"].generate_samples([[5, 6, 7, 8]], samples)[0]
    for mode in ("dart_lookup", "ddtree", "lookup"):
        rows = engines[mode].generate_samples([[5, 6, 7, 8]], samples)[0]
        for row, ref in zip(rows, reference):
            assert row.token_ids == ref.token_ids
            assert np.allclose(row.logprobs, ref.logprobs, atol=1e-4)
            assert all(np.isfinite(row.logprobs))  # committed tokens are allowed ones
    assert reference[0].token_ids != reference[1].token_ids


def test_greedy_deferred_logits_mask_the_rows_the_walk_reads(model, tokenizer, trie):
    torch.manual_seed(123)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
    outputs = []
    for defer in (True, False):
        parts = EngineParts(target=TargetAdapter(model), head=head, trie=trie, eos_token_ids=(EOS,),
                            tokenizer=tokenizer)
        engine = build_engine(parts, "dart_lookup", TreeParams(), defer_logits=defer)
        params = [SamplingParams(temperature=0.0, max_new_tokens=40, structured_output=c) for c in CONSTRAINTS]
        outputs.append([r.token_ids for r in engine.generate([[5, 6, 7]] * len(CONSTRAINTS), params)])
    assert outputs[0] == outputs[1]


def test_bad_constraints_and_short_limits_lose_nothing(engines):
    engine = engines["dart_lookup"]
    params = [SamplingParams(temperature=0.0, max_new_tokens=40, structured_output={"regex": "[a-"}),
              SamplingParams(temperature=0.0, max_new_tokens=3, structured_output=CONSTRAINTS[0]),
              SamplingParams(temperature=0.0, max_new_tokens=40, structured_output=CONSTRAINTS[2]),
              SamplingParams(temperature=0.0, max_new_tokens=40)]
    bad, short, good, free = engine.generate([[5, 6, 7]] * 4, params)
    assert bad.finish_reason == "error" and bad.error.startswith("structured_output.regex: Regex parsing error")
    assert short.finish_reason == "length" and short.structured_complete is False and len(short.token_ids) == 3
    assert good.finish_reason == "stop" and good.structured_complete and good.text in CONSTRAINTS[2].choices
    assert free.structured_complete is None and free.error is None


def test_a_grammar_without_stop_tokens_ends_when_its_text_is_complete(model, tokenizer):
    parts = EngineParts(target=TargetAdapter(model), eos_token_ids=(), tokenizer=tokenizer)
    engine = build_engine(parts, "lookup", TreeParams(lookup_min_match=1))
    result = engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_new_tokens=30,
                                                         structured_output={"choice": ["catalog"]}))[0]
    assert result.text == "catalog" and result.finish_reason == "stop" and result.structured_complete


# --------------------------------------------------------------- sampled: the exact distribution


def exact_completions(model, tokenizer, prompt, constraint, temperature):
    """Every token sequence the grammar allows (to the stop token) with its exact probability under
    the target masked by the grammar at each step and warped at `temperature` (brute force)."""
    book = GrammarBook(tokenizer, TINY_VOCAB)
    out = {}

    def expand(path, prob):
        state = book.start(constraint, [EOS])
        state.commit(path)
        if state.ended:
            out[tuple(path)] = prob
            return
        mask = state.masks(EMPTY)[0]
        allowed = [t for t in range(TINY_VOCAB) if (int(mask[t // 32]) >> (t % 32)) & 1]
        with torch.no_grad():
            logits = model(torch.tensor([prompt + path])).logits[0, -1].double() / temperature
        masked = torch.full_like(logits, float("-inf"))
        masked[allowed] = logits[allowed]
        probs = masked.softmax(-1)
        for t in allowed:
            if probs[t] > 0:
                expand([*path, t], prob * float(probs[t]))

    expand([], 1.0)
    return out


@pytest.mark.parametrize("mode", ["dart_lookup", "ddtree", "lookup"])
def test_sampled_constrained_completions_follow_the_masked_target(model, tokenizer, trie, mode):
    """Chi-square over whole completions: a choice whose words have several spellings in the
    tokenizer ('cat' is c|a|t, ca|t or cat), so the grammar's mask and its rows matter at every step."""
    from scipy.stats import chisquare

    constraint = StructuredOutput("choice", json.dumps(["cat", "catalog", "dog", "red"]))
    prompt = [5, 6, 7, 8]
    exact = exact_completions(model, tokenizer, prompt, constraint, 1.0)
    torch.manual_seed(123)
    head = DartDraftHead.random_init(model.config, model.get_input_embeddings(), draft_length=4)
    parts = EngineParts(target=TargetAdapter(model), head=head, trie=trie, eos_token_ids=(EOS,), tokenizer=tokenizer)
    engine = build_engine(parts, mode, TreeParams(lookup_min_match=1))
    draws = 3000
    results = engine.generate([prompt] * draws, [SamplingParams(temperature=1.0, seed=s, max_new_tokens=12,
                                                                structured_output=constraint) for s in range(draws)])
    counts: dict[tuple, int] = {}
    for r in results:
        counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    assert set(counts) <= set(exact)
    cells = sorted(exact, key=exact.get, reverse=True)
    big = [c for c in cells if exact[c] * draws >= 5]
    observed = [counts.get(c, 0) for c in big] + [draws - sum(counts.get(c, 0) for c in big)]
    expected = [exact[c] * draws for c in big] + [draws * (1 - sum(exact[c] for c in big))]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    assert chisquare(observed, expected).pvalue > 1e-3
    assert sum(r.stats.accepted_tokens for r in results) > draws * 0.3  # drafts were really accepted


def test_a_constraint_the_tokenizer_cannot_write_is_that_rows_error(engines):
    """The tiny tokenizer has no capital letters: a regex that needs one can never be finished. At the
    start it is refused at admission; reached mid-way, the row stops with an error naming the text, and
    its neighbours decode as usual."""
    engine = engines["dart_lookup"]
    params = [SamplingParams(temperature=0.0, max_new_tokens=20, structured_output={"regex": "[A-Z]+"}),
              SamplingParams(temperature=0.0, max_new_tokens=20, structured_output={"regex": "ab[A-Z]"}),
              SamplingParams(temperature=0.0, max_new_tokens=20, structured_output=CONSTRAINTS[2])]
    start, midway, fine = engine.generate([[5, 6, 7]] * 3, params)
    assert start.finish_reason == "error" and "can start its text" in start.error
    assert midway.finish_reason == "error" and "can continue the text 'ab'" in midway.error
    assert fine.error is None and fine.structured_complete
