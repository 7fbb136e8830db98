// TEST SUPPORT ONLY: see trees_dict_scorer.h.
#include "trees_dict_scorer.h"

#include <algorithm>
#include <stdexcept>

namespace trees {

DictScorer::DictScorer(int order, std::vector<std::pair<std::vector<int32_t>, uint64_t>> counts)
    : order_(order) {
  if (order < 1) throw std::invalid_argument("n-gram order must be >= 1");
  for (auto& [key, value] : counts) {
    if (key.empty() || static_cast<int>(key.size()) > order) {
      throw std::invalid_argument("n-gram keys must hold 1..order tokens");
    }
    counts_[std::move(key)] += value;
  }
}

size_t DictScorer::KeyHash::operator()(const std::vector<int32_t>& key) const {
  uint64_t h = 1469598103934665603ull;  // FNV-1a over the token ids
  for (int32_t t : key) {
    h ^= static_cast<uint32_t>(t);
    h *= 1099511628211ull;
  }
  return static_cast<size_t>(h);
}

uint64_t DictScorer::count(const std::vector<int32_t>& key) const {
  auto it = counts_.find(key);
  return it == counts_.end() ? 0 : it->second;
}

void DictScorer::score(const int32_t* ctx, size_t ctx_len, const int32_t* candidates,
                       size_t n_candidates, float* out_probs) const {
  std::fill(out_probs, out_probs + n_candidates, 0.0f);
  const size_t longest = std::min(ctx_len, static_cast<size_t>(order_ - 1));
  std::vector<int32_t> key;
  for (size_t len = longest; len >= 1; --len) {
    key.assign(ctx + ctx_len - len, ctx + ctx_len);
    const uint64_t context_count = count(key);
    if (context_count == 0) continue;
    key.push_back(0);
    for (size_t i = 0; i < n_candidates; ++i) {
      if (out_probs[i] != 0.0f) continue;  // already scored at a longer suffix
      key.back() = candidates[i];
      const uint64_t c = count(key);
      if (c > 0) {
        out_probs[i] = static_cast<float>(static_cast<double>(c) / static_cast<double>(context_count));
      }
    }
  }
}

}  // namespace trees
