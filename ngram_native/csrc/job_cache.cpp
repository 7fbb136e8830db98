// Job-level cache of finished outputs; design and memory bound in job_cache.h.
#include "job_cache.h"

#include <stdexcept>
#include <string>

namespace context {

JobCache::JobCache(int32_t min_match, int32_t max_match, int64_t max_tokens)
    : chains_(min_match, max_match), max_tokens_(max_tokens) {
  if (max_tokens < 1 || max_tokens > (int64_t{1} << 28)) {  // stream positions stay int32
    throw std::invalid_argument("max_tokens must be in [1, 2^28], got " + std::to_string(max_tokens));
  }
}

void JobCache::add(const int32_t* tokens, size_t count) {
  if (count == 0) return;
  if (static_cast<int64_t>(count) > max_tokens_) {  // keep the document's last max_tokens
    tokens += count - static_cast<size_t>(max_tokens_);
    count = static_cast<size_t>(max_tokens_);
  }
  size_t first = chains_.live_start();
  while (!docs_.empty() && static_cast<int64_t>(live_tokens_ + count) > max_tokens_) {
    const int64_t oldest = docs_.front();
    docs_.pop_front();
    first += static_cast<size_t>(oldest) + 1;  // the document and its separator
    live_tokens_ -= static_cast<size_t>(oldest);
    ++evicted_;
  }
  chains_.drop_before(first);
  for (size_t i = 0; i < count; ++i) chains_.push(tokens[i], static_cast<int64_t>(i) + 1);
  chains_.push(NgramChains::kSeparator, 0);
  docs_.push_back(static_cast<int64_t>(count));
  live_tokens_ += count;
}

std::vector<int32_t> JobCache::live_stream() const {
  const std::vector<int32_t>& stream = chains_.stream();
  return std::vector<int32_t>(stream.begin() + static_cast<std::ptrdiff_t>(chains_.live_start()), stream.end());
}

void build_job_cache_tree(const JobCache& cache, const ContextIndex& query, int64_t depth_cap,
                          const LookupParams& params, const trees::EosSet& eos, LookupScratch& s,
                          trees::TreeBatch& out) {
  const int32_t match_len = cache.match(query.tokens().data(), query.size(), params.max_occurrences, s.ends);
  build_continuation_tree(cache.chains().stream(), s.ends, match_len, depth_cap, params, eos, s, out);
}

}  // namespace context
