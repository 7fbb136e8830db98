// Context index for prompt-lookup / suffix-match drafting: one per request, over its prompt
// and committed tokens, answering "which earlier occurrences end like the current suffix, and
// what followed them?" as a small candidate tree (SuffixDecoding / prompt lookup decoding).
//
// Design: hash chains of n-grams, one chain per n-gram length k in [min_match, max_match].
// When token number e arrives (the sequence now has e tokens), for every k <= e the k-gram
// ending at e is hashed (one backward pass extends the hash from k to k + 1, so O(max_match)
// per token), `prev[e][k]` stores the latest earlier end of the same hash and the table maps
// the hash to e. A query walks the chains of the current suffix, longest k first, verifying
// each candidate's tokens (a 64-bit hash collision can never produce a wrong match): the
// first k with a verified earlier occurrence is the longest match, and its chain yields the
// occurrences most recent first, so "prefer recent occurrences" is free and a query touches
// only the occurrences it uses. Chosen over a suffix automaton because it also needs the
// occurrence positions (end-pos sets are awkward in an automaton, and it would need O(V)
// transition maps), and over a suffix array because it is incremental. Memory:
// (max_match - min_match + 1) int32 per token plus one open-addressing table slot per
// distinct n-gram; `max_tokens` bounds it (a full index stops learning, it still answers).
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

class ContextIndex {
 public:
  ContextIndex(int32_t min_match, int32_t max_match, int64_t max_tokens);

  // Tokens must be >= 0 (checked by the caller). Throws std::length_error past max_tokens.
  void append(const int32_t* tokens, size_t count);

  size_t size() const { return tokens_.size(); }
  const std::vector<int32_t>& tokens() const { return tokens_; }
  int32_t min_match() const { return min_match_; }
  int32_t max_match() const { return max_match_; }
  int64_t max_tokens() const { return max_tokens_; }

  // Longest L in [min_match, max_match] such that the last L tokens also end at an earlier
  // position e < size() (so a continuation tokens[e] exists); 0 if none. `ends` receives up to
  // `max_occurrences` such e, most recent first.
  int32_t match(int64_t max_occurrences, std::vector<int32_t>& ends) const;

 private:
  int32_t levels() const { return max_match_ - min_match_ + 1; }
  int32_t& prev_at(size_t end, int32_t k) { return prev_[end * levels() + (k - min_match_)]; }
  int32_t prev_at(size_t end, int32_t k) const { return prev_[end * levels() + (k - min_match_)]; }
  bool same_gram(size_t end_a, size_t end_b, int32_t k) const;
  int32_t exchange_latest(uint64_t key, int32_t end);  // table[key] = end, returns old or -1

  int32_t min_match_;
  int32_t max_match_;
  int64_t max_tokens_;
  std::vector<int32_t> tokens_;
  std::vector<int32_t> prev_;       // [(size + 1) * levels]: previous end of the same k-gram
  std::vector<uint64_t> keys_;      // open addressing, linear probing, power-of-2 capacity
  std::vector<int32_t> latest_;     // -1 = empty slot
  size_t used_ = 0;
};

// Scratch reused across the trees of one call (no allocation per tree once warm).
struct LookupScratch {
  std::vector<int32_t> ends;
  std::vector<int32_t> node_token, node_parent, node_depth, node_count, node_first;
  std::vector<int32_t> order, new_index;
  std::vector<trees::RawNode> raw;
  trees::CanonicalScratch canonical;
};

// The candidate tree of one index: a trie of the continuations (up to `depth_cap` tokens, cut
// at the end of the sequence and after an EOS token) of its longest match's occurrences.
// A node's score is ln(count / occurrences), where count = occurrences whose continuation
// passes through it; the tree keeps the best `budget` nodes by (count desc, depth asc, most
// recent occurrence through the node first), which is prefix-closed since counts never grow
// along a path. Appends the tree, in canonical order, to `out`.
void build_lookup_tree(const ContextIndex& index, int64_t depth_cap, const LookupParams& params,
                       const trees::EosSet& eos, LookupScratch& scratch, trees::TreeBatch& out);

}  // namespace context
