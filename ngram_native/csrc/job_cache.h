// Job-level cache for suffix-match drafting: one per worker (engine), over the finished outputs
// of the job's earlier rows (optionally their prompts too), so that row 10,000 of a templated job
// drafts from rows 1..9,999 (SuffixDecoding's global tree, as a bounded index).
//
// Data structure: the documents (one per finished row) are concatenated into one stream with a
// separator (-1) after each and indexed by the same hash chains as the per-request context index
// (`context::NgramChains`, context_index.h): O(max_match) per added token. A query hashes the
// last max_match tokens of a live sequence (its `ContextIndex`) once, O(max_match), and walks the
// chain of the longest k-gram that occurs, most recent occurrence first, verifying tokens; it
// touches only the occurrences it uses (at most max_occurrences per level tried). The candidate
// tree is `context::build_continuation_tree` - the same count-based trie as the context index's,
// with continuations cut at document ends.
//
// Memory is bounded by a token budget: adding a document first evicts the oldest documents until
// the live documents hold at most `max_tokens` tokens (a single document longer than the budget
// keeps its last `max_tokens`). Eviction moves the chains' live start; the dead prefix is
// compacted away (positions rebased, the hash table rebuilt without stale keys) once it is as
// long as the live part, so the stream holds at most 2 x (live tokens + separators) positions:
// per live token at most 2 x (4 + 4 L) bytes of stream and chains (L = max_match - min_match + 1
// levels) plus hash-table slots (12 B each, load factor <= 1/2) for the distinct n-grams of
// the stream - L per token in the worst case (no repeats), far fewer on templated text.
// `memory_bytes` reports the buffers' capacities.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <vector>

#include "context_index.h"

namespace context {

class JobCache {
 public:
  JobCache(int32_t min_match, int32_t max_match, int64_t max_tokens);

  // One finished document (tokens >= 0, checked by the caller; count >= 1).
  void add(const int32_t* tokens, size_t count);

  size_t size() const { return live_tokens_; }  // tokens of the live documents
  size_t num_documents() const { return docs_.size(); }
  int64_t evicted_documents() const { return evicted_; }
  int64_t max_tokens() const { return max_tokens_; }
  int32_t min_match() const { return chains_.min_match(); }
  int32_t max_match() const { return chains_.max_match(); }
  size_t memory_bytes() const { return chains_.memory_bytes(); }
  const NgramChains& chains() const { return chains_; }

  // The live stream: documents, each followed by a separator (-1).
  std::vector<int32_t> live_stream() const;

  // Longest match of the last tokens of `query` (n tokens) in the live documents, as
  // `NgramChains::match`; `ends` are stream positions (live_stream() index + chains().live_start()).
  int32_t match(const int32_t* query, size_t n, int64_t max_occurrences, std::vector<int32_t>& ends) const {
    return chains_.match(query, n, /*self=*/false, max_occurrences, ends);
  }

 private:
  NgramChains chains_;
  int64_t max_tokens_;
  std::deque<int64_t> docs_;  // token counts of the live documents, oldest first
  size_t live_tokens_ = 0;
  int64_t evicted_ = 0;
};

// The candidate tree of the live sequence `query` from the cache: `build_continuation_tree` of
// the longest match of its suffix among the cached documents.
void build_job_cache_tree(const JobCache& cache, const ContextIndex& query, int64_t depth_cap,
                          const LookupParams& params, const trees::EosSet& eos, LookupScratch& scratch,
                          trees::TreeBatch& out);

}  // namespace context
