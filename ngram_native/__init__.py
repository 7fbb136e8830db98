"""N-gram trie files and draft-tree builders for DART speculative decoding (C++ core).

Depends on numpy only. The trie (`NgramTrie`, `TrieBuilder`, `build_trie`, and
`read_trie_header` to check a file from its first bytes) is a flat, checksummed,
memory-mapped file shared by every process on a node; the tree builders
(`build_dart_trees`, `build_ddtree_trees`, `build_chain_trees`, in `builders`) return
`DraftTree`s in one canonical flattened form, and everything done to a tree - validation,
masks, positions, walks, cuts, merges - is in `trees`;
`ContextIndex` + `build_lookup_trees` draft from a request's own text (prompt lookup), `JobCache` +
`build_job_cache_trees` from the finished outputs of a job's earlier rows; `JobNgram` counts those
outputs' n-grams as a second N-gram scorer for DART's beam, mixed into the trie's estimate.
"""

from ngram_native.builders import (
    DEFAULT_BUDGET,
    InvalidTreeParams,
    NgramScorer,
    TreeParams,
    build_chain_trees,
    build_dart_trees,
    build_ddtree_trees,
)
from ngram_native.context import ContextIndex, JobCache, build_job_cache_trees, build_lookup_trees
from ngram_native.job_ngram import JobNgram
from ngram_native.trees import (
    DraftTree,
    ancestor_mask,
    ancestor_masks,
    check_tree,
    children,
    graft,
    merge_trees,
    position_offsets,
    subtree,
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
    "check_tree",
    "children",
    "graft",
    "import_upstream_trie",
    "merge_trees",
    "position_offsets",
    "read_trie_header",
    "subtree",
]
