"""Lossless verification of a draft tree against the target's distributions.

The target's verify forward runs over rows [root, node_0, ..., node_{N-1}]: row 0 holds the
distribution of the token after the root (the last committed token), row i + 1 the
distribution after node i's path. Verification walks down the tree from the root, commits the
accepted nodes' tokens and one more token (the bonus), which becomes the next round's root.

Greedy (temperature 0): at each row move to the child whose token is the row's argmax; stop
when there is none; the bonus is the argmax of the last row reached. The committed tokens are
exactly what plain argmax decoding would produce, one forward per token.

Sampling: recursive rejection over siblings with deterministic proposals. At the current row,
with warped target distribution p and children x_1..x_k tried in sibling (proposal) order:

    residual r = p
    for x in x_1..x_k:
        accept x with probability r(x)                 -> commit x, move to x's row
        otherwise r(x) = 0 and renormalise r           (reject x)
    none accepted (or no children): bonus ~ r, stop

Why the committed tokens are distributed exactly as the target's. Claim: the token committed
at a row (an accepted child or the bonus) is distributed as r, for any residual r and any
list of children. By induction on k. k = 0: the bonus is drawn from r. k >= 1: x_1 is
committed with probability r(x_1). With probability 1 - r(x_1) we continue with
r' = r with x_1 zeroed, renormalised = r(y) / (1 - r(x_1)) for y != x_1, and by induction commit
y with probability r'(y), so in total P(y) = (1 - r(x_1)) * r(y) / (1 - r(x_1)) = r(y) for
y != x_1, and x_1 (r'(x_1) = 0) is only committed directly, with probability r(x_1). Starting
from r = p, the committed token at every row is distributed as p(. | prefix). Committing child
x moves to x's row, whose distribution is the target's p(. | prefix, x), and every step uses
fresh uniforms, so the committed sequence factorises exactly as the target's chain rule.
(This is standard speculative sampling with a point-mass proposal q = delta_x: accept with
min(1, p(x) / q(x)) = p(x), residual norm(max(p - q, 0)) = p with x removed.) Repeated sibling
tokens are harmless: after rejection their residual probability is 0.

Device use per batch of sampling requests:
1. Rows with children (the only ones the walk reads q from) are warped, requests sharing a
   warp (temperature, top-k, top-p) together, in memory-bounded chunks; one gather per chunk
   picks q = p_row(parent)(token) for every node. The q values, those rows' sums (a
   finiteness check) and each request's uniforms (N + 1 from its own generator: one per node,
   one for the bonus) cross to the host in ONE transfer.
2. The walks run on the host: a few dozen scalar comparisons.
3. Only the bonus rows are warped again (so no [B, S, V] float32 copy stays alive across the
   walk; alone or in a chunk a row warps to the same support and, up to float32 rounding,
   the same probabilities - a test checks), the rejected tokens are zeroed, and one batched
   inverse-CDF draw (what torch.multinomial does for one sample, for all requests at once,
   each with its own uniform) picks every bonus token; they cross in a second transfer.
Greedy requests need one argmax and one transfer. Or, where the logits were deferred
(`verify_greedy_by_rows`), one small vocabulary projection per tree level of the walk.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from dart_worker.sampling import SamplingParams, warp_logits_to_probs
from dart_worker.tree_batch import TreeLike, check_tree
from ngram_native.trees import SOURCE_COPIED, children

# Row sums of warped probabilities must be 1 up to float32 rounding over the vocabulary;
# anything further off means non-finite or otherwise broken logits.
_ROW_SUM_TOLERANCE = 1e-3
# Most float32 probabilities materialised by one warp call (256 MiB).
_WARP_BUDGET = 1 << 26
# Tokens per block of the two-level inverse-CDF draw (`_inverse_cdf_sample`).
_CDF_BLOCK = 1024


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
        argmax = row_logits(index, rows).max(dim=-1).indices.cpu().numpy().tolist()
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


@dataclass(frozen=True)
class _Walk:
    """Host-side result of the rejection walk for one request."""

    path: list[int]
    bonus_row: int
    rejected_tokens: list[int]  # tokens zeroed from the bonus row's residual


def _acceptance_probability(q: float, residual_mass: float) -> float:
    """r(x) = p(x) / (mass left after the rejected siblings), guarded against rounding.

    Exact arithmetic keeps q <= residual_mass; rounding can break that by an ulp, and the
    residual can reach 0 when everything left is x itself: then x is certain (if possible).
    """
    if residual_mass <= 0.0:
        return 1.0 if q > 0.0 else 0.0
    return min(1.0, q / residual_mass)


def _rejection_walk(tree: TreeLike, q: np.ndarray, uniforms: np.ndarray) -> _Walk:
    """Recursive rejection over siblings (see module doc). q[i] = p_row(parent(i))(token_i);
    uniforms[i] decides node i; each node is tried at most once, so every decision is fresh."""
    tokens, q_list, u_list = np.asarray(tree.tokens).tolist(), q.tolist(), uniforms.tolist()
    children: dict[int, list[int]] = {}
    for i, parent in enumerate(np.asarray(tree.parents).tolist()):
        children.setdefault(parent, []).append(i)  # index order = sibling (proposal) order
    path: list[int] = []
    node = -1
    while True:
        removed = 0.0
        rejected: list[int] = []
        accepted = None
        for child in children.get(node, ()):
            token = tokens[child]
            if token in rejected:  # a repeated sibling token: its residual probability is 0
                continue
            if u_list[child] < _acceptance_probability(q_list[child], 1.0 - removed):
                accepted = child
                break
            rejected.append(token)
            removed += q_list[child]
        if accepted is None:
            return _Walk(path, node + 1, rejected)
        path.append(accepted)
        node = accepted


def _inverse_cdf_sample(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One draw per row of `weights` [R, V] (unnormalised, >= 0, positive sum) from uniforms [R].

    What torch.multinomial does for one sample, but for every request at once with each
    request's own uniform: the first token whose cumulative weight exceeds u * total (see below
    for the rounding).
    Tokens of weight 0 own an empty interval, so they are never drawn; should rounding push
    u * total to the very end, the last token of positive weight is taken.

    In two levels, so the whole row is read once (block sums) instead of being copied to float64
    and scanned several times (over a 262k vocabulary that was most of a sampled round's
    non-model time on a CPU): pick the block of `_CDF_BLOCK` tokens whose cumulative mass
    crosses u * total, then the token inside it.
    """
    rows, vocab = weights.shape
    device = weights.device
    full = vocab - vocab % _CDF_BLOCK
    # Block sums in the weights' dtype (a float64 reduction over [16, 262k] cost 20 ms on a CPU,
    # the float32 one 0.5 ms), accumulated in float64: a block's sum is off by float32 rounding
    # of its own mass at most, which moves the odds of a draw by as little as the float32
    # probabilities themselves are exact.
    sums = [weights[:, :full].reshape(rows, -1, _CDF_BLOCK).sum(dim=-1)] if full else []
    if full < vocab:
        sums.append(weights[:, full:].sum(dim=-1, keepdim=True))
    block_cdf = torch.cat(sums, dim=-1).double().cumsum(dim=-1)
    total = block_cdf[:, -1:].contiguous()
    target = uniforms[:, None] * total
    # The crossing block, or the last block of positive mass (the first to reach the total).
    # (The clamps only matter for non-finite weights, which the caller reports after the draw.)
    block = torch.minimum(torch.searchsorted(block_cdf, target, right=True),
                          torch.searchsorted(block_cdf, total, right=False)).clamp(max=block_cdf.shape[-1] - 1)
    before = torch.where(block > 0, block_cdf.gather(1, (block - 1).clamp(min=0)), 0.0)
    columns = block * _CDF_BLOCK + torch.arange(_CDF_BLOCK, device=device)
    inside = torch.where(columns < vocab, weights.gather(1, columns.clamp(max=vocab - 1)), 0.0)
    cdf = before + inside.double().cumsum(dim=-1)
    # Rounding between the two levels can leave u * total past the block's own cumulative end:
    # then the block's last token of positive weight, as at the end of the row.
    offset = torch.minimum(torch.searchsorted(cdf, target, right=True),
                           torch.searchsorted(cdf, cdf[:, -1:].contiguous(), right=False)).clamp(max=_CDF_BLOCK - 1)
    return (columns.gather(1, offset))[:, 0]


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


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


def _verify_sampled(
    trees: Sequence[TreeLike],
    sizes: Sequence[int],
    logits: torch.Tensor,
    batch_index: Sequence[int],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
) -> list[Acceptance]:
    """Rejection verification for the sampling requests k, whose rows are logits[batch_index[k]]."""
    device = logits.device
    count = len(trees)
    vocab = int(logits.shape[-1])

    # 1. q = p_row(parent)(token) of every node. Only rows with children are warped here (the
    # others can only be bonus rows, warped in step 3), a chunk of same-warp requests at a time.
    # Request k's parent rows: the distinct parents (+1 = row); each node points into them.
    parent_nodes = [np.unique(t.parents).astype(np.int64) for t in trees]
    parent_slot = [np.searchsorted(u, t.parents).astype(np.int64) for u, t in zip(parent_nodes, trees, strict=True)]
    q_parts: list[torch.Tensor] = []
    sum_parts: list[torch.Tensor] = []
    q_offset = np.zeros(count, dtype=np.int64)  # request k's q values, in transfer order
    sum_offset = np.zeros(count, dtype=np.int64)  # request k's parent-row sums
    nodes_done = rows_done = 0
    for chunk in _warp_chunks(range(count), [u.shape[0] for u in parent_nodes], params, vocab):
        rows_per = np.array([parent_nodes[k].shape[0] for k in chunk], dtype=np.int64)
        nodes_per = np.array([sizes[k] for k in chunk], dtype=np.int64)
        row_start = np.cumsum(rows_per) - rows_per  # first row of each request within the chunk
        node_start = np.cumsum(nodes_per) - nodes_per
        num_rows, num_nodes = int(rows_per.sum()), int(nodes_per.sum())
        q_offset[chunk] = nodes_done + node_start
        sum_offset[chunk] = rows_done + row_start
        nodes_done += num_nodes
        rows_done += num_rows
        if num_rows == 0:  # only empty trees
            continue
        # Host-built indices, one host -> device copy: (sequence, row) of every warped row, then
        # (warped row of the parent, token) of every node.
        sequence = np.repeat(np.asarray([batch_index[k] for k in chunk], dtype=np.int64), rows_per)
        row = np.concatenate([parent_nodes[k] for k in chunk]) + 1
        parent_row = np.concatenate([parent_slot[k] for k in chunk]) + np.repeat(row_start, nodes_per)
        token = np.concatenate([trees[k].tokens for k in chunk]).astype(np.int64)
        index = torch.from_numpy(np.concatenate([sequence, row, parent_row, token])).to(device)
        sequence_d, row_d, parent_d, token_d = index.split([num_rows, num_rows, num_nodes, num_nodes])
        probs = warp_logits_to_probs(logits[sequence_d, row_d], params[chunk[0]])
        q_parts.append(probs[parent_d, token_d].double())
        sum_parts.append(probs.sum(dim=-1).double())
    # Uniforms come from each request's own generator, in request order: one per node for the
    # walk, then one for the bonus draw.
    uniforms = torch.cat(
        [torch.rand(sizes[k] + 1, generator=generators[k], device=device, dtype=torch.float64) for k in range(count)]
    )
    u_offset = np.cumsum([0] + [n + 1 for n in sizes])
    host = torch.cat([*q_parts, *sum_parts, uniforms]).cpu().numpy()  # THE device -> host transfer
    host_q, host_sums, host_u = np.split(host, [nodes_done, nodes_done + rows_done])

    # 2. The walks, on the host, after one vectorised check that every row is a distribution.
    bad = np.flatnonzero(~(np.abs(host_sums - 1.0) <= _ROW_SUM_TOLERANCE))
    if bad.size:
        where = int(bad[0])
        k = next(k for k in range(count) if sum_offset[k] <= where < sum_offset[k] + parent_nodes[k].shape[0])
        _raise_bad_row(batch_index[k], int(parent_nodes[k][where - sum_offset[k]]) + 1, host_sums[where])
    walks = [
        _rejection_walk(
            trees[k],
            host_q[q_offset[k] : q_offset[k] + sizes[k]],
            host_u[u_offset[k] : u_offset[k] + sizes[k]],
        )
        for k in range(count)
    ]

    # 3. Bonus tokens from the residuals: warp just the bonus rows (rather than keeping every
    # row's float32 probabilities alive across the host walk), zero the rejected tokens.
    picked = logits[
        torch.tensor(list(batch_index), device=device), torch.tensor([w.bonus_row for w in walks], device=device)
    ]
    chunks = _warp_chunks(range(count), [1] * count, params, vocab)
    if len(chunks) == 1:  # one warp for every request (the common case): no copy into place
        bonus_rows = warp_logits_to_probs(picked, params[0])
    else:
        bonus_rows = torch.empty(count, vocab, dtype=torch.float32, device=device)
        for chunk in chunks:
            chunk_dev = torch.tensor(chunk, device=device)
            bonus_rows[chunk_dev] = warp_logits_to_probs(picked[chunk_dev], params[chunk[0]])
    zero_req = [k for k, w in enumerate(walks) for _ in w.rejected_tokens]
    zero_tok = [t for w in walks for t in w.rejected_tokens]
    residual = bonus_rows
    if zero_tok:
        residual = bonus_rows.index_put(
            (torch.tensor(zero_req, device=device), torch.tensor(zero_tok, device=device)),
            torch.zeros((), device=device),
        )
        # Mass 0 is reachable only by rounding (a child with p(x) ~ 1 was rejected): fall back
        # to the unmodified row rather than fail; decided on the device, no sync.
        residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, bonus_rows)
    bonus_uniforms = uniforms[torch.from_numpy(u_offset[1:] - 1).to(device)]
    drawn = _inverse_cdf_sample(residual, bonus_uniforms).double()
    host = torch.cat([drawn, bonus_rows.sum(dim=-1).double()]).cpu().numpy()  # second transfer
    bonus_tokens, bonus_sums = host[:count].astype(np.int64), host[count:]
    bad = np.flatnonzero(~(np.abs(bonus_sums - 1.0) <= _ROW_SUM_TOLERANCE))
    if bad.size:  # a leaf row: not checked in step 2
        k = int(bad[0])
        _raise_bad_row(batch_index[k], walks[k].bonus_row, bonus_sums[k])
    return [_acceptance(t, w.path, int(tok)) for t, w, tok in zip(trees, walks, bonus_tokens, strict=True)]


def _raise_bad_row(request: int, row: int, total: float) -> None:
    raise ValueError(f"request {request}: warped probabilities of row {row} sum to {total} (non-finite logits?)")


# ---------------------------------------------------------------------------- batched


def verify_batch(
    trees: Sequence[TreeLike],
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[Acceptance]:
    """Verify B trees against the target logits of one verify forward.

    The trees must be well-formed (`check_tree`); the engine checks them once, when it builds
    the verify block from them (`TreeBatch.from_trees`), and they are not checked again here.

    logits: [B, S, V] (S >= 1 + N_b, padded; any float dtype, computed in float32), row 0 = root.
    params[b] / generators[b]: request b's sampling parameters and its own generator (None is
    allowed for greedy requests). Returns one Acceptance per tree, in order.
    """
    batch = len(trees)
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, rows, vocab], got shape {tuple(logits.shape)}")
    if logits.shape[0] != batch or len(params) != batch or len(generators) != batch:
        raise ValueError(
            f"batch sizes differ: {batch} trees, logits batch {logits.shape[0]}, "
            f"{len(params)} params, {len(generators)} generators"
        )
    width = int(logits.shape[1])
    sizes = [int(np.shape(t.tokens)[0]) for t in trees]  # trees were checked where they entered
    for b, n in enumerate(sizes):
        if n + 1 > width:
            raise ValueError(f"trees[{b}] has {n} nodes but logits have only {width} rows (need N + 1)")
    results: list[Acceptance | None] = [None] * batch

    greedy = [b for b in range(batch) if params[b].is_greedy]
    if greedy:
        # max().indices is argmax with the same tie rule (first maximum) and about twice as fast
        # on CPU over a 262k vocabulary, where this is the largest cost of a round after verify.
        argmax = torch.cat([logits[b, : sizes[b] + 1].max(dim=-1).indices for b in greedy]).cpu().numpy()
        offset = 0
        for b in greedy:
            results[b] = _greedy_walk(trees[b], argmax[offset : offset + sizes[b] + 1])
            offset += sizes[b] + 1

    sampled = [b for b in range(batch) if not params[b].is_greedy]
    if sampled:
        for b in sampled:
            gen = generators[b]
            if gen is None:
                raise ValueError(f"request {b} samples (temperature {params[b].temperature}) but has no generator")
            if not _same_device(gen.device, logits.device):
                raise ValueError(f"request {b}: generator is on {gen.device}, logits on {logits.device}")
        accepted = _verify_sampled(
            [trees[b] for b in sampled],
            [sizes[b] for b in sampled],
            logits,
            sampled,
            [params[b] for b in sampled],
            [generators[b] for b in sampled],  # type: ignore[misc]
        )
        for b, acceptance in zip(sampled, accepted, strict=True):
            results[b] = acceptance
    return results  # type: ignore[return-value]


def verify_sampling(
    tree: TreeLike, logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> Acceptance:
    """Single-request form of `verify_batch` (logits [S, V], S >= N + 1)."""
    return verify_batch([tree], logits[None], [params], [generator])[0]
