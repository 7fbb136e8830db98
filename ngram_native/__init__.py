"""N-gram trie files and draft-tree builders for DART speculative decoding (C++ core).

Depends on numpy only. The trie (`NgramTrie`, `TrieBuilder`, `build_trie`, and
`read_trie_header` to check a file from its first bytes) is a flat, checksummed,
memory-mapped file shared by every process on a node; the tree builders
(`build_dart_trees`, `build_ddtree_trees`, `build_chain_trees`) return `DraftTree`s in one
canonical flattened form that masks, positions and verification walks derive from;
`ContextIndex` + `build_lookup_trees` draft from a request's own text (prompt lookup), `JobCache` +
`build_job_cache_trees` from the finished outputs of a job's earlier rows; `JobNgram` counts those
outputs' n-grams as a second N-gram scorer for DART's beam, mixed into the trie's estimate.
"""

from ngram_native.context import ContextIndex, JobCache, build_job_cache_trees, build_lookup_trees
from ngram_native.job_ngram import JobNgram
from ngram_native.trees import (
    DEFAULT_BUDGET,
    DraftTree,
    InvalidTreeParams,
    NgramScorer,
    TreeParams,
    ancestor_mask,
    ancestor_masks,
    build_chain_trees,
    build_dart_trees,
    build_ddtree_trees,
    children,
    position_offsets,
)
from ngram_native.trie import (
    DEFAULT_ORDER,
    TRIE_HEADER_SIZE,
    NgramTrie,
    TokenizerMismatchError,
    TrieBuilder,
    TrieBuildStats,
    TrieClosedError,
    TrieFormatError,
    TrieHeader,
    build_trie,
    import_upstream_trie,
    read_trie_header,
)

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_ORDER",
    "TRIE_HEADER_SIZE",
    "ContextIndex",
    "DraftTree",
    "InvalidTreeParams",
    "JobCache",
    "JobNgram",
    "NgramScorer",
    "NgramTrie",
    "TokenizerMismatchError",
    "TreeParams",
    "TrieBuildStats",
    "TrieBuilder",
    "TrieClosedError",
    "TrieFormatError",
    "TrieHeader",
    "ancestor_mask",
    "ancestor_masks",
    "build_chain_trees",
    "build_dart_trees",
    "build_ddtree_trees",
    "build_job_cache_trees",
    "build_lookup_trees",
    "build_trie",
    "children",
    "import_upstream_trie",
    "position_offsets",
    "read_trie_header",
]
