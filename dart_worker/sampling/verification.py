"""Lossless verification of a draft tree against the target's distributions.

The target's verify forward runs over rows [root, node_0, ..., node_{N-1}]: row 0 holds the
distribution of the token after the root (the last committed token), row i + 1 the
distribution after node i's path. Verification walks down the tree from the root, commits the
accepted nodes' tokens and one more token (the bonus), which becomes the next round's root.

Greedy (temperature 0): at each row move to the child whose token is the row's argmax; stop
when there is none; the bonus is the argmax of the last row reached. The committed tokens are
exactly what plain argmax decoding would produce, one forward per token.

Sampling: coupled Gumbel-max draws. Every sampled token is drawn with noise that belongs to its
position: the token at generated index t is

    y_t = argmax_i (log p_t,i + g_t,i),   g_t = the noise rows of row_seeds(key, t)

(dart_worker/sampling/gumbel.py: `gumbel_sample_threshold`, Gumbel-max over a partition of the
vocabulary that p_t decides - heavy tokens alone, the rest in blocks of ids), where p_t is the
warped target distribution after the committed prefix (temperature, min-p, top-k, top-p, the
penalties and a grammar's masks applied exactly as before: a token of weight 0 is never drawn) and
`key` the request's (from its seed, or fresh entropy drawn once per request). Verifying a tree
whose root row predicts index t: at the current row (depth d, predicting index t + d) draw y from
the row's p with g_{t+d}; move to the child whose token is y (the first such sibling); stop when
there is none, and commit y as the bonus. This is the greedy walk with each row's argmax replaced
by its coupled draw. (Until issue #48 the draw was the inverse CDF of one uniform per position;
a drafter that reads the Gumbel noise can rank its candidates by the draw they would win,
dart_worker/drafters/coupling.py, which the inverse CDF's token-id order did not allow.)

Why the committed tokens are distributed exactly as the target's. Each committed token is
y = argmax(log p(. | prefix) + g_t) with the committed prefix and p exactly the target's (the row
reached spells the prefix), and g_t is fresh: the prefix depends only on g_0..g_{t-1}, and noise
rows of different positions are independent. The argmax of log p plus a fresh row of Gumbel noise
is distributed as p (Gumbel-max; over a partition the weights decide, a cell wins with
probability its mass / the total and a token inside it with its weight / the cell's mass), so the
sequence factorises as the target's chain rule. More: the committed token is the same function of
(prefix, g_t) that plain sampling (`ar`, an empty tree every round) computes, so for a given key
every drafter commits *the same tokens* as `ar` (up to float rounding of p between differently
shaped forwards) - drafts decide only how many positions one forward settles, never which tokens,
whatever the batch, whatever a job-level drafter learnt before and whatever noise the drafter
read (a drafter told the wrong position's noise only loses acceptance). Acceptance at a row is the
probability that y is one of its children's tokens, sum over distinct children of p(child): what
recursive rejection over deterministic proposals accepts too (speculative sampling with
point-mass proposals), so nothing is lost against it. Repeated sibling tokens are harmless (the
first is taken).

Device use per batch of sampling requests:
1. Rows with children (the only rows the walk can leave) are warped, requests sharing a warp
   (temperature, top-k, top-p) together, in memory-bounded chunks, and each gets its coupled
   draw (one batched Gumbel-max draw over the chunk, each row with the noise of its position: the
   rows' seeds travel with the rows' indices in one small upload, the noise is computed on the
   device, so no vocabulary-sized array crosses). The draws and those rows' sums (a finiteness
   check) cross to the host in ONE transfer.
2. The walks run on the host: a few dozen comparisons.
3. A walk that ends on a leaf row (every node of the path accepted) needs that row's draw: only
   those rows are warped and drawn, in a second transfer.
Greedy requests need one argmax and one transfer. Or, where the logits were deferred
(`verify_greedy_by_rows`), one small vocabulary projection per tree level of the walk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dart_worker.hardware.transfer import to_device, to_host
from dart_worker.sampling.gumbel import BLOCK_STREAM, TOKEN_STREAM, gumbel_sample_threshold, row_seeds
from dart_worker.sampling.logits_processors import RowControls, controlled_logits
from dart_worker.sampling.params import SamplingParams, warp_logits_to_probs
from ngram_native.trees import SOURCE_COPIED, TreeLike, check_tree, children

# Row sums of warped probabilities must be 1 up to float32 rounding over the vocabulary;
# anything further off means non-finite or otherwise broken logits.
_ROW_SUM_TOLERANCE = 1e-3
# Most float32 probabilities materialised by one warp call (256 MiB).
_WARP_BUDGET = 1 << 26


@dataclass(frozen=True)
class Acceptance:
    """Outcome of verifying one tree: the accepted path and the bonus token."""

    accepted: np.ndarray  # int64 node indices (into the tree arrays), in path order
    accepted_tokens: np.ndarray  # int64 tokens of those nodes
    bonus: int

    @property
    def num_accepted(self) -> int:
        return int(self.accepted.shape[0])

    @property
    def tokens(self) -> np.ndarray:
        """Tokens committed this round: the accepted path, then the bonus."""
        return np.append(self.accepted_tokens, self.bonus).astype(np.int64)

    @property
    def committed_rows(self) -> np.ndarray:
        """Verify-block rows whose K/V stay in the cache: the root (row 0), then accepted nodes."""
        return np.concatenate([[0], self.accepted + 1]).astype(np.int64)

    @property
    def bonus_row(self) -> int:
        """Row whose distribution produced the bonus (0 = root, i + 1 = node i)."""
        return int(self.accepted[-1]) + 1 if self.num_accepted else 0


@dataclass(frozen=True)
class VerifyRow:
    """One request's part of a verify forward: its tree, what changes its logits (`controls`, which
    hold its sampling settings) and, for a sampling request, its noise key
    (`sampling.request_key`) and the generated-token index its root row predicts (`position`: how
    many tokens it has generated so far)."""

    tree: TreeLike
    controls: RowControls
    key: int | None = None
    position: int = 0

    @property
    def params(self) -> SamplingParams:
        return self.controls.params


def _acceptance(tree: TreeLike, path: list[int], bonus: int) -> Acceptance:
    nodes = np.asarray(path, dtype=np.int64)
    return Acceptance(nodes, np.asarray(tree.tokens, dtype=np.int64)[nodes], int(bonus))


# ------------------------------------------------------------------------------ greedy


def verify_greedy(tree: TreeLike, argmax_tokens: np.ndarray | Sequence[int]) -> Acceptance:
    """Walk `tree` following the target's argmax: argmax_tokens[0] at the root, [i + 1] at node i."""
    n = check_tree(tree)
    argmax = np.asarray(argmax_tokens).reshape(-1)
    if argmax.shape[0] != n + 1:
        raise ValueError(f"argmax_tokens has {argmax.shape[0]} entries, tree needs N + 1 = {n + 1}")
    return _greedy_walk(tree, argmax)


def _greedy_walk(tree: TreeLike, argmax: np.ndarray) -> Acceptance:
    parents = np.asarray(tree.parents)
    tokens = np.asarray(tree.tokens)
    path: list[int] = []
    node = -1
    while True:
        match = np.flatnonzero((parents == node) & (tokens == argmax[node + 1]))
        if match.size == 0:
            return _acceptance(tree, path, int(argmax[node + 1]))
        node = int(match[0])
        path.append(node)


def verify_greedy_by_rows(
    trees: Sequence[TreeLike], row_logits: Callable[[np.ndarray, np.ndarray], torch.Tensor]
) -> list[Acceptance]:
    """Greedy verification of B trees that projects to the vocabulary only rows the walk may read.

    `row_logits(batch_index, rows)` returns [len(rows), V] logits of those (sequence, row) pairs
    (row 0 = root, i + 1 = node i). Each call asks, per tree still walking, for the row of its
    current node and, ahead of the walk, the rows of the chain of first children below it that
    context lookup or the job cache proposed (`SOURCE_COPIED` nodes: copied text, accepted in long
    runs; head nodes are accepted about one level at a time, so projecting ahead through them
    mostly wastes rows). One call then covers a whole accepted lookup span; a walk that leaves the predicted
    chain asks again from where it is. The result equals `verify_batch` on full logits (same
    argmax rule: the first maximum), while the projection runs on about the accepted path instead
    of all N + 1 rows (on a CPU most of a verify forward's cost).
    """
    tables = [children(np.asarray(t.parents)) for t in trees]
    node = [-1] * len(trees)
    paths: list[list[int]] = [[] for _ in trees]
    results: list[Acceptance | None] = [None] * len(trees)
    walking = list(range(len(trees)))
    while walking:
        chains = [_predicted_chain(tables[b], trees[b], node[b]) for b in walking]
        index = np.repeat(np.asarray(walking, dtype=np.int64), [len(c) for c in chains])
        rows = np.concatenate([np.asarray(c, dtype=np.int64) + 1 for c in chains])
        argmax = to_host(row_logits(index, rows).max(dim=-1).indices)[0].tolist()
        still, offset = [], 0
        for b, chain in zip(walking, chains):
            tree, table = trees[b], tables[b]
            for k, current in enumerate(chain):
                token = argmax[offset + k]
                child = _child_with(tree, table, current, token)
                if child < 0:
                    results[b] = _acceptance(tree, paths[b], token)
                    break
                paths[b].append(child)
                node[b] = child
                if k + 1 == len(chain) or chain[k + 1] != child:
                    still.append(b)  # off the predicted path (or past its end): ask from here
                    break
            offset += len(chain)
        walking = still
    return results


def _predicted_chain(table: tuple[np.ndarray, np.ndarray], tree: TreeLike, node: int) -> list[int]:
    """`node` (-1 = the root), then its first child, that child's first child, ... as long as
    each is a copied-text node (context lookup or the job cache; trees that do not record sources:
    `node` alone)."""
    sources = getattr(tree, "sources", None)
    offsets, child_idx = table
    chain = [node]
    while sources is not None and offsets[node + 2] > offsets[node + 1]:
        node = int(child_idx[offsets[node + 1]])
        if not sources[node] & SOURCE_COPIED:
            break
        chain.append(node)
    return chain


def _child_with(tree: TreeLike, table: tuple[np.ndarray, np.ndarray], node: int, token: int) -> int:
    offsets, child_idx = table
    kids = child_idx[offsets[node + 1] : offsets[node + 2]]
    hit = np.flatnonzero(np.asarray(tree.tokens)[kids] == token)
    return int(kids[hit[0]]) if hit.shape[0] else -1


# ---------------------------------------------------------------------------- sampling


def _warp_chunks(requests: Sequence[int], rows: Sequence[int], params: Sequence[SamplingParams],
                 vocab: int) -> list[list[int]]:
    """Group requests with the same warp into chunks of at most `_WARP_BUDGET` probabilities.

    One warp call per chunk keeps kernel launches per batch low; the budget keeps the float32
    copy bounded (a [B, S, V] float32 copy of a 262k vocabulary would be gigabytes).
    """
    by_key: dict[tuple, list[int]] = {}
    for k in requests:
        by_key.setdefault(params[k].warp_key, []).append(k)
    max_rows = max(1, _WARP_BUDGET // vocab)
    chunks: list[list[int]] = []
    for members in by_key.values():
        chunk: list[int] = []
        used = 0
        for k in members:
            if chunk and used + rows[k] > max_rows:
                chunks.append(chunk)
                chunk, used = [], 0
            chunk.append(k)
            used += rows[k]
        chunks.append(chunk)
    return chunks


def _verify_sampled(requests: Sequence[VerifyRow], logits: torch.Tensor,
                    batch_index: Sequence[int]) -> list[Acceptance]:
    """Coupled verification (module doc) of the sampling requests k, whose rows are
    logits[batch_index[k]]; each row is changed by request k's logits processors by its own path."""
    trees = [r.tree for r in requests]
    params = [r.params for r in requests]
    keys = [int(r.key) for r in requests]  # type: ignore[arg-type]  # checked by verify_batch
    positions = [int(r.position) for r in requests]
    controls = [r.controls for r in requests]
    device = logits.device
    count = len(trees)
    vocab = int(logits.shape[-1])
    depths = [np.asarray(t.depths, dtype=np.int64) for t in trees]

    # 1. The coupled draw of every row with children (the root's too, unless the tree is empty),
    # a chunk of same-warp requests at a time. Request k's rows: its distinct parents (+1 = row).
    parent_nodes = [np.unique(t.parents).astype(np.int64) for t in trees]
    draw_parts: list[torch.Tensor] = []
    sum_parts: list[torch.Tensor] = []
    row_offset = np.zeros(count, dtype=np.int64)  # request k's rows, in transfer order
    rows_done = 0
    for chunk in _warp_chunks(range(count), [u.shape[0] for u in parent_nodes], params, vocab):
        rows_per = np.array([parent_nodes[k].shape[0] for k in chunk], dtype=np.int64)
        row_offset[chunk] = rows_done + np.cumsum(rows_per) - rows_per
        num_rows = int(rows_per.sum())
        rows_done += num_rows
        if num_rows == 0:  # only empty trees
            continue
        sequence = np.repeat(np.asarray([batch_index[k] for k in chunk], dtype=np.int64), rows_per)
        row = np.concatenate([parent_nodes[k] for k in chunk]) + 1
        seeds = _rows_seeds(keys, positions, depths, {k: parent_nodes[k] for k in chunk})
        index = to_device(np.concatenate([sequence, row, *seeds]), device)  # one upload
        rows_logits = controlled_logits(logits[index[:num_rows], index[num_rows : 2 * num_rows]],
                                        [(trees[k], controls[k], parent_nodes[k]) for k in chunk])
        probs = warp_logits_to_probs(rows_logits, params[chunk[0]])
        draw_parts.append(gumbel_sample_threshold(probs, index[2 * num_rows : 3 * num_rows],
                                                  index[3 * num_rows :]).double())
        sum_parts.append(probs.sum(dim=-1).double())
    (host,) = to_host(torch.cat([*draw_parts, *sum_parts])) if rows_done else (np.zeros(0),)  # THE transfer
    host_draws, host_sums = host[:rows_done].astype(np.int64), host[rows_done:]

    # 2. The walks, on the host, after one vectorised check that every row is a distribution.
    bad = np.flatnonzero(~(np.abs(host_sums - 1.0) <= _ROW_SUM_TOLERANCE))
    if bad.size:
        where = int(bad[0])
        k = next(k for k in range(count) if row_offset[k] <= where < row_offset[k] + parent_nodes[k].shape[0])
        _raise_bad_row(batch_index[k], int(parent_nodes[k][where - row_offset[k]]) + 1, host_sums[where])
    walks = []
    for k in range(count):
        drawn = dict(zip(parent_nodes[k].tolist(), host_draws[row_offset[k] : row_offset[k] + parent_nodes[k].shape[0]]
                         .tolist(), strict=True))
        walks.append(_coupled_walk(trees[k], drawn))

    # 3. Walks that ended on a leaf row: that row's draw, in a second transfer.
    leaves = [k for k, (_, bonus) in enumerate(walks) if bonus is None]
    if leaves:
        leaf_node = [walks[k][0][-1] if walks[k][0] else -1 for k in leaves]
        leaf_index = to_device([[batch_index[k] for k in leaves], [n + 1 for n in leaf_node]], device)
        picked = logits[leaf_index[0], leaf_index[1]]
        seeds = to_device(_rows_seeds(keys, positions, depths,
                                      {k: np.asarray([n]) for k, n in zip(leaves, leaf_node, strict=True)}), device)
        draws = torch.empty(len(leaves), dtype=torch.float64, device=device)
        sums = torch.empty(len(leaves), dtype=torch.float64, device=device)
        for chunk in _warp_chunks(range(len(leaves)), [1] * len(leaves), [params[k] for k in leaves], vocab):
            chunk_dev = to_device(chunk, device, torch.long)
            chunk_logits = controlled_logits(picked[chunk_dev], [(trees[leaves[j]], controls[leaves[j]],
                                                                  np.asarray([leaf_node[j]])) for j in chunk])
            probs = warp_logits_to_probs(chunk_logits, params[leaves[chunk[0]]])
            draws[chunk_dev] = gumbel_sample_threshold(probs, seeds[0, chunk_dev], seeds[1, chunk_dev]).double()
            sums[chunk_dev] = probs.sum(dim=-1).double()
        (host,) = to_host(torch.cat([draws, sums]))  # the second transfer
        bad = np.flatnonzero(~(np.abs(host[len(leaves):] - 1.0) <= _ROW_SUM_TOLERANCE))
        if bad.size:  # a leaf row: not checked in step 2
            j = int(bad[0])
            _raise_bad_row(batch_index[leaves[j]], leaf_node[j] + 1, host[len(leaves) + j])
        for j, k in enumerate(leaves):
            walks[k] = (walks[k][0], int(host[j]))
    return [_acceptance(t, path, bonus) for t, (path, bonus) in zip(trees, walks, strict=True)]


def _row_positions(position: int, depths: np.ndarray, nodes: np.ndarray) -> np.ndarray:
    """The generated-token index each row of `nodes` (-1 = the root) predicts: the row of a node at
    depth d predicts index position + d (the root's, position)."""
    row_depth = np.where(nodes < 0, 0, depths[np.maximum(nodes, 0)]) if depths.size else np.zeros(len(nodes), np.int64)
    return position + row_depth


def _rows_seeds(keys: Sequence[int], positions: Sequence[int], depths: Sequence[np.ndarray],
                nodes: dict[int, np.ndarray]) -> np.ndarray:
    """The noise seeds [2, n] (token stream, block stream: `gumbel.gumbel_sample_threshold`) of the
    rows of `nodes[k]` of each request k, in the dict's order, made in one pass over all of them
    (each row with its own request's key and the generated index it predicts)."""
    at = np.concatenate([_row_positions(positions[k], depths[k], rows) for k, rows in nodes.items()])
    row_keys = np.repeat(np.asarray([keys[k] for k in nodes], dtype=np.uint64), [len(rows) for rows in nodes.values()])
    return np.stack([row_seeds(row_keys, at, TOKEN_STREAM), row_seeds(row_keys, at, BLOCK_STREAM)])


def _coupled_walk(tree: TreeLike, drawn: dict[int, int]) -> tuple[list[int], int | None]:
    """(path, bonus) following each row's coupled draw (`drawn`: node -> draw of its row, for the
    nodes with children, -1 = the root); bonus None when the path ends on a leaf (drawn later)."""
    tokens = np.asarray(tree.tokens).tolist()
    first_child: dict[tuple[int, int], int] = {}
    for i, parent in enumerate(np.asarray(tree.parents).tolist()):
        first_child.setdefault((parent, tokens[i]), i)  # index order = sibling (proposal) order
    path: list[int] = []
    node = -1
    while node in drawn:
        child = first_child.get((node, drawn[node]))
        if child is None:
            return path, drawn[node]
        path.append(child)
        node = child
    return path, None  # a leaf row (the root's, for an empty tree)


def _raise_bad_row(request: int, row: int, total: float) -> None:
    raise ValueError(f"request {request}: warped probabilities of row {row} sum to {total} (non-finite logits?)")


# ---------------------------------------------------------------------------- batched


def verify_batch(rows: Sequence[VerifyRow], logits: torch.Tensor) -> list[Acceptance]:
    """Verify B trees against the target logits of one verify forward (`rows[b]`: request b's tree,
    controls, key and position: `VerifyRow`); one Acceptance per tree.

    The trees must be well-formed (`check_tree`); the engine checks them once, when it builds
    the verify block from them (`TreeBatch.from_trees`), and they are not checked again here.

    logits: [B, S, V] (S >= 1 + N_b, padded; any float dtype, computed in float32), row 0 = root.
    Every row of request b is changed by its controls (its penalties' history, its grammar's masks:
    `logits_processors.RowControls`) by its own path. A sampling request needs its key.
    """
    batch = len(rows)
    trees = [r.tree for r in rows]
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, rows, vocab], got shape {tuple(logits.shape)}")
    if logits.shape[0] != batch:
        raise ValueError(f"batch sizes differ: {batch} trees, logits batch {logits.shape[0]}")
    width = int(logits.shape[1])
    sizes = [int(np.shape(t.tokens)[0]) for t in trees]  # trees were checked where they entered
    for b, n in enumerate(sizes):
        if n + 1 > width:
            raise ValueError(f"trees[{b}] has {n} nodes but logits have only {width} rows (need N + 1)")
    results: list[Acceptance | None] = [None] * batch

    greedy = [b for b in range(batch) if rows[b].params.is_greedy]
    if greedy:
        # max().indices is argmax with the same tie rule (first maximum) and about twice as fast
        # on CPU over a 262k vocabulary, where this is the largest cost of a round after verify.
        # A request with penalties or a grammar takes the argmax of each row's changed logits.
        argmaxes = []
        for b in greedy:
            row_logits = controlled_logits(logits[b, : sizes[b] + 1], [(trees[b], rows[b].controls,
                                                                         np.arange(-1, sizes[b]))])
            argmaxes.append(row_logits.max(dim=-1).indices)
        (argmax,) = to_host(torch.cat(argmaxes))
        offset = 0
        for b in greedy:
            results[b] = _greedy_walk(trees[b], argmax[offset : offset + sizes[b] + 1])
            offset += sizes[b] + 1

    sampled = [b for b in range(batch) if not rows[b].params.is_greedy]
    for b in sampled:
        if rows[b].key is None:
            raise ValueError(f"request {b} samples (temperature {rows[b].params.temperature}) but has no key")
        if rows[b].position < 0:
            raise ValueError(f"request {b}: position {rows[b].position} < 0")
    if sampled:
        for b, acceptance in zip(sampled, _verify_sampled([rows[b] for b in sampled], logits, sampled), strict=True):
            results[b] = acceptance
    return results  # type: ignore[return-value]


def verify_sampling(
    tree: TreeLike, logits: torch.Tensor, params: SamplingParams, key: int, position: int = 0
) -> Acceptance:
    """Single-request form of `verify_batch` (logits [S, V], S >= N + 1)."""
    return verify_batch([VerifyRow(tree, RowControls(params), key, position)], logits[None])[0]


# ---------------------------------------------------------------------------- logprobs


@dataclass(frozen=True)
class TokenLogprobs:
    """Log-probabilities of the tokens one request committed in one round, and the top-k
    alternatives at each of those positions (ids and log-probabilities, most likely first)."""

    chosen: np.ndarray  # float64 [n]
    top_ids: np.ndarray  # int64 [n, k]
    top_logprobs: np.ndarray  # float64 [n, k]


def sampling_log_probs(row_logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities [R, V] that a request reports for its tokens: those of the distribution
    it samples from (penalties, temperature, min-p, top-k and top-p applied; -inf where a filter
    removed a token); for a greedy request, whose sampling distribution is a point mass, those of
    the penalised logits at temperature 1 (what a greedy token's confidence is usually read as)."""
    if params.is_greedy:
        return row_logits.float().log_softmax(dim=-1)
    return warp_logits_to_probs(row_logits, params).log()


def committed_logprobs(rows: Sequence[VerifyRow], logits: torch.Tensor,
                       acceptances: Sequence[Acceptance]) -> list[TokenLogprobs | None]:
    """Per request with `params.logprobs` > 0, the logprobs of the tokens it committed this round
    (`Acceptance.tokens`), read from the rows of the verify forward that decided them (the root's
    and the accepted nodes': `Acceptance.committed_rows`) - no extra forward. Each row is changed
    by the request's logits processors by its own path, as verification saw it (a grammar's
    forbidden tokens have log-probability -inf). One transfer for the batch."""
    device = logits.device
    parts, shapes = [], []
    for b, (row, acc) in enumerate(zip(rows, acceptances, strict=True)):
        p = row.params
        if not p.logprobs:
            shapes.append(None)
            continue
        committed = to_device(acc.committed_rows, device)
        nodes = np.concatenate([[-1], acc.accepted]).astype(np.int64)
        row_logits = controlled_logits(logits[b, committed], [(row.tree, row.controls, nodes)])
        logp = sampling_log_probs(row_logits, p)
        chosen = logp.gather(-1, to_device(acc.tokens, device)[:, None])
        k = min(p.logprobs, logp.shape[-1])
        top = logp.topk(k, dim=-1)
        parts.append(torch.cat([chosen.double(), top.indices.double(), top.values.double()], dim=-1).reshape(-1))
        shapes.append((logp.shape[0], k))
    (host,) = to_host(torch.cat(parts)) if parts else (np.zeros(0),)
    out: list[TokenLogprobs | None] = []
    offset = 0
    for shape in shapes:
        if shape is None:
            out.append(None)
            continue
        n, k = shape
        block = host[offset : offset + n * (2 * k + 1)].reshape(n, 2 * k + 1)
        offset += n * (2 * k + 1)
        out.append(TokenLogprobs(block[:, 0], block[:, 1 : k + 1].astype(np.int64), block[:, k + 1 :]))
    return out


# Prompt rows projected to the vocabulary at a time (`prompt_logprobs`): [rows, V] float32 logits of
# a 262k vocabulary are 1 MB a row, so a long prompt is never projected whole.
_PROMPT_CHUNK = 64


def prompt_logprobs(logits_at: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                    prompt: Sequence[int], k: int) -> TokenLogprobs:
    """Log-probabilities of a prompt's tokens after the first (each under the target's raw
    distribution after the tokens before it, log-softmax at temperature 1, as vLLM's prompt_logprobs
    reports them: no request setting applies to text the request did not sample) and the `k` most
    likely tokens at each of those positions. `hidden`: the prompt's final hidden states [S, hidden]
    (row i predicts token i + 1); `logits_at` projects rows of them to the vocabulary, a chunk at a
    time. One transfer per chunk."""
    n = len(prompt) - 1
    if n <= 0:
        return TokenLogprobs(np.zeros(0), np.zeros((0, k), np.int64), np.zeros((0, k)))
    chosen, ids, values = [], [], []
    for start in range(0, n, _PROMPT_CHUNK):
        rows = range(start, min(n, start + _PROMPT_CHUNK))
        logp = logits_at(hidden[rows.start : rows.stop]).float().log_softmax(dim=-1)
        nxt = to_device(np.asarray(prompt[rows.start + 1 : rows.stop + 1], dtype=np.int64), logp.device)
        top = logp.topk(min(k, logp.shape[-1]), dim=-1)
        (host,) = to_host(torch.cat([logp.gather(-1, nxt[:, None]).double(), top.indices.double(),
                                     top.values.double()], dim=-1))
        width = top.indices.shape[-1]
        chosen.append(host[:, 0])
        ids.append(host[:, 1 : width + 1].astype(np.int64))
        values.append(host[:, width + 1 :])
    return TokenLogprobs(np.concatenate(chosen), np.concatenate(ids), np.concatenate(values))
