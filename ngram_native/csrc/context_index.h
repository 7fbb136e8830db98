// Suffix-match drafting from earlier text: the shared hash-chain core (`NgramChains`), the
// per-request context index over one request's prompt and committed tokens (`ContextIndex`,
// prompt lookup / SuffixDecoding), and the continuation trees both it and the job-level cache
// (job_cache.h) propose: "which earlier occurrences end like the current suffix, and what
// followed them?".
//
// Design (`NgramChains`): hash chains of n-grams, one chain per n-gram length k in
// [min_match, max_match], over one token stream. When token number e arrives (the stream now has
// e tokens), for every k up to the tokens of its document so far the k-gram ending at e is hashed
// (one backward pass extends the hash from k to k + 1, so O(max_match) per token), `prev[e][k]`
// stores the latest earlier end of the same hash and the table maps the hash to e. A query walks
// the chains of a suffix, longest k first, verifying each candidate's tokens (a 64-bit hash
// collision can never produce a wrong match): the first k with a verified earlier occurrence is
// the longest match, and its chain yields the occurrences most recent first, so "prefer recent
// occurrences" is free and a query touches only the occurrences it uses. The suffix may be the
// stream's own (the context index: the chain starts at prev[n][k]) or another sequence's (the
// job cache: its k-gram hashes are computed the same way and the chain starts at the table's
// latest end). The stream may hold several documents separated by a -1 token: no n-gram spans a
// separator and a continuation stops at one. Dropping the oldest documents (`drop_before`) only
// moves the live start (chains stop there); the dead prefix is compacted away, positions rebased
// and the table rebuilt without stale keys once it is as large as the live part (amortised
// O(max_match) per token). Chosen over a suffix automaton because it also needs the occurrence
// positions (end-pos sets are awkward in an automaton, and it would need O(V) transition maps),
// and over a suffix array because it is incremental and drops a prefix cheaply. Memory:
// (max_match - min_match + 1) int32 per token plus one open-addressing table slot (12 B, load
// <= 1/2) per distinct n-gram.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "trees.h"

namespace context {

// Query parameters of the candidate tree (the index's n-gram range is fixed at construction).
struct LookupParams {
  int64_t budget = 60;            // nodes per tree, root excluded
  double depth_factor = 4.0;      // depth <= floor(depth_factor * match length) (SuffixDecoding)
  int64_t max_occurrences = 32;   // most recent occurrences of the match that vote
};

// Hash chains of n-grams over one stream of tokens (>= 0) and document separators (-1).
class NgramChains {
 public:
  static constexpr int32_t kSeparator = -1;

  NgramChains(int32_t min_match, int32_t max_match);

  // Appends `token` (>= 0), the `run`-th token of its document (1-based): the k-grams ending
  // here with k <= run are indexed. Or a separator (kSeparator, run ignored): none are.
  void push(int32_t token, int64_t run);

  // Forget everything before stream position `first` (a document start, >= live_start()):
  // no chain reaches an n-gram there any more. Compacts once the dead prefix outgrows the live
  // part, so memory follows the live tokens.
  void drop_before(size_t first);

  // Longest L in [min_match, max_match] such that the last L tokens of `query` (n tokens) occur
  // in the live stream ending at some e with a continuation (stream[e] is a token, not a
  // separator or the end); 0 if none. `ends` receives up to `max_occurrences` such e (stream
  // positions), most recent first. `self`: `query` is this stream (n == size()), whose own
  // suffix is then not an occurrence of itself.
  int32_t match(const int32_t* query, size_t n, bool self, int64_t max_occurrences,
                std::vector<int32_t>& ends) const;

  size_t size() const { return tokens_.size(); }  // stream positions, dead prefix included
  size_t live_start() const { return first_; }
  const std::vector<int32_t>& stream() const { return tokens_; }
  int32_t min_match() const { return min_match_; }
  int32_t max_match() const { return max_match_; }
  size_t memory_bytes() const;  // capacity of every buffer

 private:
  int32_t levels() const { return max_match_ - min_match_ + 1; }
  int32_t& prev_at(size_t end, int32_t k) { return prev_[end * levels() + (k - min_match_)]; }
  int32_t prev_at(size_t end, int32_t k) const { return prev_[end * levels() + (k - min_match_)]; }
  int32_t latest(uint64_t key) const;                  // table[key] or -1
  int32_t exchange_latest(uint64_t key, int32_t end);  // table[key] = end, returns old or -1
  void insert_slot(uint64_t key, int32_t end);         // into a table known to lack `key`
  void compact();

  int32_t min_match_;
  int32_t max_match_;
  std::vector<int32_t> tokens_;
  std::vector<int32_t> prev_;       // [(size + 1) * levels]: previous end of the same k-gram
  std::vector<uint64_t> keys_;      // open addressing, linear probing, power-of-2 capacity
  std::vector<int32_t> latest_;     // -1 = empty slot
  size_t used_ = 0;
  size_t first_ = 0;                // live start: ends <= first_ are dead
};

// One request's prompt and committed tokens (one document, never evicted).
class ContextIndex {
 public:
  ContextIndex(int32_t min_match, int32_t max_match, int64_t max_tokens);

  // Tokens must be >= 0 (checked by the caller). Throws std::length_error past max_tokens.
  void append(const int32_t* tokens, size_t count);

  size_t size() const { return chains_.size(); }
  const std::vector<int32_t>& tokens() const { return chains_.stream(); }
  int32_t min_match() const { return chains_.min_match(); }
  int32_t max_match() const { return chains_.max_match(); }
  int64_t max_tokens() const { return max_tokens_; }
  const NgramChains& chains() const { return chains_; }

  // Longest L in [min_match, max_match] such that the last L tokens also end at an earlier
  // position e < size() (so a continuation tokens[e] exists); 0 if none. `ends` receives up to
  // `max_occurrences` such e, most recent first.
  int32_t match(int64_t max_occurrences, std::vector<int32_t>& ends) const;

 private:
  NgramChains chains_;
  int64_t max_tokens_;
};

// Scratch reused across the trees of one call (no allocation per tree once warm).
struct LookupScratch {
  std::vector<int32_t> ends;
  std::vector<int32_t> node_token, node_parent, node_depth, node_count, node_first;
  std::vector<int32_t> order, new_index;
  std::vector<trees::RawNode> raw;
  trees::CanonicalScratch canonical;
};

// The continuation tree of a match of `match_len` tokens whose occurrences end at `ends`
// (positions of `stream`, most recent first): a trie of the continuations stream[e, e + depth),
// depth = min(depth_cap, floor(depth_factor * match_len)), each cut at a separator, at the end of
// the stream and after an EOS token. A node's score is ln(count / occurrences), where count =
// occurrences whose continuation passes through it; the tree keeps the best `budget` nodes by
// (count desc, depth asc, most recent occurrence through the node first), which is
// prefix-closed since counts never grow along a path. Appends the tree, in canonical order, to
// `out` (an empty tree when match_len is 0). Shared by the context index and the job cache.
void build_continuation_tree(const std::vector<int32_t>& stream, const std::vector<int32_t>& ends,
                             int32_t match_len, int64_t depth_cap, const LookupParams& params,
                             const trees::EosSet& eos, LookupScratch& scratch, trees::TreeBatch& out);

// The candidate tree of one index: `build_continuation_tree` of its longest match.
void build_lookup_tree(const ContextIndex& index, int64_t depth_cap, const LookupParams& params,
                       const trees::EosSet& eos, LookupScratch& scratch, trees::TreeBatch& out);

}  // namespace context
