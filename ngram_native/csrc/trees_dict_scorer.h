// TEST SUPPORT ONLY: an NgramScorer over an explicit n-gram -> count table.
//
// Lets the tree builders be tested (and compared with pure-Python references) without the
// trie. It follows the NgramScorer contract exactly but is neither compact nor fast: one
// hash lookup per (suffix, candidate) and a small allocation per call.
#pragma once

#include <cstddef>
#include <cstdint>
#include <unordered_map>
#include <utility>
#include <vector>

#include "ngram_scorer.h"

namespace trees {

class DictScorer : public ngram::NgramScorer {
 public:
  // `counts`: every n-gram of length 1..order that occurs, with its count.
  DictScorer(int order, std::vector<std::pair<std::vector<int32_t>, uint64_t>> counts);

  int order() const override { return order_; }
  void score(const int32_t* ctx, size_t ctx_len, const int32_t* candidates, size_t n_candidates,
             float* out_probs) const override;

 private:
  struct KeyHash {
    size_t operator()(const std::vector<int32_t>& key) const;
  };
  uint64_t count(const std::vector<int32_t>& key) const;

  int order_;
  std::unordered_map<std::vector<int32_t>, uint64_t, KeyHash> counts_;
};

}  // namespace trees
