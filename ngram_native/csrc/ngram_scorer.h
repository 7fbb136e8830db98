// The one interface the draft-tree builders need from an N-gram model.
//
// Kept abstract so that the tree builders (trees.cpp) do not depend on the trie file
// layout (trie.cpp): the trie implements it, and tests may implement it too.
#pragma once

#include <cstddef>
#include <cstdint>

namespace ngram {

class NgramScorer {
 public:
  virtual ~NgramScorer() = default;

  // N-gram order n: contexts longer than n - 1 tokens are cut to their last n - 1.
  virtual int order() const = 0;

  // DART estimate for every candidate: from the longest matching suffix of `ctx`
  // (at most n - 1 tokens) down to length 1, P(t) = count(suffix + t) / count(suffix)
  // for each candidate not yet scored at a longer suffix; 0 when never seen.
  // Thread-safe and allocation-free on the hot path; called with the GIL released.
  virtual void score(const int32_t* ctx, size_t ctx_len, const int32_t* candidates,
                     size_t n_candidates, float* out_probs) const = 0;
};

}  // namespace ngram
