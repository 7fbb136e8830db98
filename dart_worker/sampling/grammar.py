"""A request's grammar over the target's vocabulary: compiled once per worker, walked per tree.

The grammar engine is xgrammar (docs/DESIGN.md says why: over Gemma-3's 262k vocabulary its
token mask costs microseconds, it compiles JSON schemas, regexes and EBNF alike, and it rolls back
without limit, which a tree walk needs). `GrammarBook` compiles each distinct constraint once
(cached by its canonical text) for one tokenizer; `GrammarState` is one request's matcher, at its
committed text, and does three jobs for a round:

- `cut(tree)`: a draft node whose token the grammar forbids after its ancestors can never be
  accepted (verification draws from masked rows), so it and its subtree leave the tree before the
  verify forward;
- `forced(limit)`: the text the grammar allows alone from here (`{"name": "` at the start of a
  record, `", "age": ` after a value), tokenised: draft nodes that are almost certainly accepted,
  grafted into the round's tree by the engine (`structured_drafting.shape_trees`);
- `masks(tree)`: the allowed tokens of every row of the tree (the root's and each node's, after
  its ancestors), which the logits processors apply (dart_worker/sampling/logits_processors.py).

Each walks the tree depth first, accepting a node's token on the way down and rolling it back on
the way up, so the matcher always returns to the committed text.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence

import numpy as np
import torch

from dart_worker.sampling.structured_output import (
    ANY_OBJECT_SCHEMA,
    JSON_LAYOUT,
    StructuredOutput,
    StructuredOutputError,
    engine_message,
)
from ngram_native.trees import SOURCE_GRAMMAR, SOURCE_HEAD, DraftTree, children, merge_trees, subtree

# Compiled grammars a worker keeps (least recently used go first): a job has a few distinct schemas,
# or one per row at worst; a compiled JSON schema over a 262k vocabulary is ~1 MB.
CACHE_SIZE = 128


class GrammarViolation(RuntimeError):
    """A committed token the request's grammar forbids: verification drew it from an unmasked
    row, which is a bug in the engine, never a property of the input."""


class GrammarBook:
    """Compiles constraints for one tokenizer and vocabulary size (the target's), each distinct
    constraint once. The tokenizer's vocabulary is read on first use (about a second for 262k
    tokens), so engines that never see a constraint never pay for it."""

    def __init__(self, tokenizer, vocab_size: int, cache_size: int = CACHE_SIZE):
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.cache_size = cache_size
        self._compiler = None
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()
        self.compilations = 0  # distinct constraints compiled (a test and the metrics read it)

    def _grammar_compiler(self):
        if self._compiler is None:
            import xgrammar

            if self.tokenizer is None:
                raise StructuredOutputError("structured output needs the target's tokenizer")
            info = xgrammar.TokenizerInfo.from_huggingface(self.tokenizer, vocab_size=self.vocab_size)
            self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        return self._compiler

    def compile(self, constraint: StructuredOutput):
        """The compiled grammar of `constraint` (cached); StructuredOutputError naming the problem
        when its schema, regex or grammar is invalid."""
        compiled = self._compiled.get(constraint)
        if compiled is not None:
            self._compiled.move_to_end(constraint)
            return compiled
        compiler = self._grammar_compiler()
        try:
            if constraint.kind == "json":
                compiled = compiler.compile_json_schema(constraint.spec, **JSON_LAYOUT)
            elif constraint.kind == "json_object":
                compiled = compiler.compile_json_schema(ANY_OBJECT_SCHEMA, **JSON_LAYOUT)
            elif constraint.kind == "regex":
                compiled = compiler.compile_regex(constraint.spec)
            else:
                compiled = compiler.compile_grammar(constraint.ebnf() or constraint.spec)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise StructuredOutputError(f"structured_output.{constraint.kind}: {engine_message(exc)}") from None
        self.compilations += 1
        self._compiled[constraint] = compiled
        if len(self._compiled) > self.cache_size:
            self._compiled.popitem(last=False)
        return compiled

    def start(self, constraint: StructuredOutput, stop_ids: Iterable[int]) -> GrammarState:
        """A matcher for one request at the start of its output. `stop_ids`: the tokens that end
        it (the model's end of sequence and the request's stop ids), which the grammar allows
        exactly where its text is complete."""
        return GrammarState(self.compile(constraint), stop_ids, self.tokenizer, self.vocab_size)


class GrammarState:
    """One request's grammar matcher at its committed text (see the module docstring)."""

    def __init__(self, compiled, stop_ids: Iterable[int], tokenizer, vocab_size: int):
        import xgrammar

        stops = sorted({int(t) for t in stop_ids})
        # Without stop tokens the matcher ends as soon as its text is complete.
        self.matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=stops or None,
                                               terminate_without_stop_token=not stops)
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.words = (self.vocab_size + 31) // 32

    # ------------------------------------------------------------------ committed text

    def commit(self, tokens: Sequence[int]) -> int:
        """Advance over tokens the request committed, up to the end of the grammar's text; returns
        how many it took (fewer than given when the text ended inside them: a round's bonus token
        drawn after a text that ends without a stop token is not part of the output)."""
        for taken, token in enumerate(tokens):
            if self.matcher.is_terminated():
                return taken
            if not self.matcher.accept_token(int(token)):
                if self.stuck:  # drawn from a row nothing was allowed in: the engine ends the request
                    return taken
                raise GrammarViolation(f"committed token {int(token)} is not allowed by the request's grammar")
        return len(tokens)

    def rollback(self, count: int) -> None:
        """Forget the last `count` committed tokens (a stop string cut them from the output)."""
        if count:
            self.matcher.rollback(count)

    @property
    def ended(self) -> bool:
        """No token can follow: a stop token was accepted, or (without stop tokens) the text is complete."""
        return bool(self.matcher.is_terminated())

    @property
    def stuck(self) -> bool:
        """Can no token of the vocabulary continue the text, though it has not ended? (A grammar
        whose next character no token spells: a constraint this tokenizer cannot write.)"""
        if self.matcher.is_terminated():
            return False
        row = torch.zeros((1, self.words), dtype=torch.int32)
        self.matcher.fill_next_token_bitmask(row, 0)
        return not bool(row.any())

    @property
    def complete(self) -> bool:
        """Is the committed text a whole sentence of the grammar (a valid record, a full match)?"""
        return bool(self.matcher.is_terminated() or self.matcher.is_completed())

    # ------------------------------------------------------------------ a round's tree

    def cut(self, tree: DraftTree) -> DraftTree:
        """`tree` without the nodes the grammar forbids after their ancestors (and their subtrees)."""
        if not tree.size:
            return tree
        keep = self._walk(tree, None)
        return tree if keep.all() else subtree(tree, keep)

    def shape(self, tree: DraftTree, max_depth: int, budget: int) -> DraftTree:
        """`cut(tree)` with the grammar's forced text drafted after every leaf (the root's, for a tree
        cut to nothing): the text a record forces between values (`", "age": `) follows the value
        a drafter proposed, in the same round. At most `budget` forced nodes, none deeper than
        `max_depth`; each is scored as its leaf (its own step is certain) and marked `SOURCE_GRAMMAR`."""
        forced: dict[int, list[int]] = {}
        keep = self._walk(tree, None, forced=forced, max_depth=max_depth, budget=budget)
        if not forced:
            return tree if keep.all() else subtree(tree, keep)
        return _extended(tree, keep, forced)

    def masks(self, tree) -> torch.Tensor:
        """int32 bitmask [N + 1, ceil(V / 32)] of the tokens allowed at each row of `tree`: row 0
        after the committed text, row i + 1 after node i's path. Rows of nodes the grammar forbids
        (a tree that was not `cut`) allow everything: verification never reaches them. A row where
        the grammar allows nothing (a text the tokenizer cannot continue) allows everything too, so
        verification draws a token there rather than failing the batch; committing it leaves the
        grammar `stuck`, and the engine ends that request with an error."""
        n = int(np.shape(tree.tokens)[0])
        bitmask = torch.full((n + 1, self.words), -1, dtype=torch.int32)
        if not self.matcher.is_terminated():
            self.matcher.fill_next_token_bitmask(bitmask, 0)
        if n:
            self._walk(tree, bitmask)
        bitmask[~bitmask.any(dim=-1)] = -1  # rows where nothing is allowed (see above)
        return bitmask

    def forced(self, limit: int) -> list[int]:
        """Up to `limit` tokens of the text the grammar allows alone from the committed text (its
        jump-forward string, tokenised as the tokenizer spells it), each checked by the grammar."""
        if limit <= 0 or self.tokenizer is None or self.matcher.is_terminated():
            return []
        text = self.matcher.find_jump_forward_string()
        if not text:
            return []
        accepted: list[int] = []
        for token in self.tokenizer.encode(text, add_special_tokens=False)[:limit]:
            if not 0 <= token < self.vocab_size or not self.matcher.accept_token(int(token)):
                break
            accepted.append(int(token))
        if accepted:
            self.matcher.rollback(len(accepted))
        return accepted

    def _walk(self, tree, bitmask: torch.Tensor | None, forced: dict[int, list[int]] | None = None,
              max_depth: int = 0, budget: int = 0) -> np.ndarray:
        """Depth first over `tree`: which nodes the grammar allows (bool [N]); with `bitmask`, fill
        each allowed node's row; with `forced`, collect the forced text after each allowed leaf
        (node -1: the root, when nothing under it is allowed), within `max_depth` and `budget`
        tokens in all. The matcher ends where it started."""
        matcher = self.matcher
        tokens = np.asarray(tree.tokens).tolist()
        depths = np.asarray(tree.depths).tolist()
        offsets, child_idx = tree.children() if isinstance(tree, DraftTree) else children(tree.parents)
        offsets, child_idx = offsets.tolist(), child_idx.tolist()
        keep = np.zeros(len(tokens), dtype=bool)
        # (node, next child slot, whether a child was allowed) frames; node -1 is the root.
        stack = [(-1, offsets[0], False)]
        while stack:
            node, slot, fertile = stack[-1]
            if slot == offsets[node + 2]:
                stack.pop()
                if forced is not None and not fertile and budget > 0:
                    text = self.forced(min(budget, max_depth - (depths[node] if node >= 0 else 0)))
                    if text:
                        forced[node] = text
                        budget -= len(text)
                if node >= 0:
                    matcher.rollback(1)
                continue
            stack[-1] = (node, slot + 1, fertile)
            child = child_idx[slot]
            if matcher.is_terminated() or not matcher.accept_token(tokens[child]):
                continue
            stack[-1] = (node, slot + 1, True)
            keep[child] = True
            if bitmask is not None and not matcher.is_terminated():  # after a stop token nothing is read
                matcher.fill_next_token_bitmask(bitmask, child + 1)
            stack.append((child, offsets[child + 1], False))
        return keep


def _extended(tree: DraftTree, keep: np.ndarray, forced: dict[int, list[int]]) -> DraftTree:
    """The kept nodes of `tree` with each chain of `forced[leaf]` under its leaf (-1: the root), in
    canonical order (`merge_trees` sorts a topological tree)."""
    kept = np.flatnonzero(keep)
    new_index = np.full(tree.size, -1, dtype=np.int64)
    new_index[kept] = np.arange(kept.shape[0])
    tokens = tree.tokens[kept].tolist()
    parents = [int(new_index[p]) if p >= 0 else -1 for p in tree.parents[kept].tolist()]
    depths = tree.depths[kept].tolist()
    scores = (tree.scores[kept] if tree.scores is not None else np.zeros(kept.shape[0])).tolist()
    sources = (tree.sources[kept] if tree.sources is not None else np.full(kept.shape[0], SOURCE_HEAD)).tolist()
    for leaf, chain in forced.items():
        parent = int(new_index[leaf]) if leaf >= 0 else -1
        depth = depths[parent] if parent >= 0 else 0
        score = scores[parent] if parent >= 0 else 0.0
        for token in chain:
            tokens.append(token)
            parents.append(parent)
            depth += 1
            depths.append(depth)
            scores.append(score)
            sources.append(SOURCE_GRAMMAR)
            parent = len(tokens) - 1
    out = DraftTree(np.asarray(tokens, np.int32), np.asarray(parents, np.int32), np.asarray(depths, np.int32),
                    np.asarray(scores, np.float64), np.asarray(sources, np.uint8))
    return merge_trees(out, _EMPTY, out.size)


_EMPTY = DraftTree(np.zeros(0, np.int32), np.zeros(0, np.int32), np.zeros(0, np.int32))

