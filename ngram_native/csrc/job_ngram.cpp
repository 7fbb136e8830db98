// Job n-gram scorer: see job_ngram.h.
#include "job_ngram.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace ngram {
namespace {

uint64_t mix(uint64_t h, uint64_t v) {  // splitmix64 finaliser over (h, v)
  uint64_t z = h ^ (v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2));
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

uint64_t hash_ngram(const int32_t* tokens, size_t len) {
  uint64_t h = len;
  for (size_t i = 0; i < len; ++i) h = mix(h, static_cast<uint32_t>(tokens[i]));
  return h;
}

size_t next_pow2(size_t x) {
  size_t p = 16;
  while (p < x) p <<= 1;
  return p;
}

}  // namespace

JobNgram::JobNgram(int order, int64_t max_tokens, const NgramScorer* base, double prior)
    : order_(order), base_order_(base ? base->order() : 0), max_tokens_(max_tokens), base_(base),
      prior_(prior) {
  if (order < 1 || order > kMaxOrder) {
    throw std::invalid_argument("job n-gram order must be in [1, " + std::to_string(kMaxOrder) + "], got " +
                                std::to_string(order));
  }
  if (max_tokens < 1) throw std::invalid_argument("job n-gram max_tokens must be >= 1");
  if (!(prior >= 0.0)) throw std::invalid_argument("job n-gram prior must be >= 0");
  table_.resize(16);
}

size_t JobNgram::find(const int32_t* tokens, size_t len) const {
  const size_t mask = table_.size() - 1;
  for (size_t i = hash_ngram(tokens, len) & mask;; i = (i + 1) & mask) {
    const Slot& s = table_[i];
    if (s.len == 0) return table_.size();
    if (s.len == len && std::equal(tokens, tokens + len, s.tokens.begin())) return i;
  }
}

void JobNgram::rehash(size_t min_capacity) {
  std::vector<Slot> old;
  old.swap(table_);
  table_.assign(next_pow2(min_capacity), Slot{});
  const size_t mask = table_.size() - 1;
  used_slots_ = 0;
  for (const Slot& s : old) {
    if (s.len == 0 || s.count == 0) continue;  // dead slots are dropped here
    size_t i = hash_ngram(s.tokens.data(), s.len) & mask;
    while (table_[i].len != 0) i = (i + 1) & mask;
    table_[i] = s;
    ++used_slots_;
  }
}

void JobNgram::bump(const int32_t* tokens, size_t len, int delta) {
  size_t i = find(tokens, len);
  if (i == table_.size()) {
    if (delta < 0) throw std::logic_error("job n-gram: evicting an n-gram that was never counted");
    if ((used_slots_ + 1) * 2 > table_.size()) {
      rehash(3 * (live_slots_ + 1));
    }
    const size_t mask = table_.size() - 1;
    i = hash_ngram(tokens, len) & mask;
    while (table_[i].len != 0) i = (i + 1) & mask;
    Slot& s = table_[i];
    s.tokens.fill(-1);
    std::copy(tokens, tokens + len, s.tokens.begin());
    s.len = static_cast<uint32_t>(len);
    s.count = 0;
    ++used_slots_;
  }
  Slot& s = table_[i];
  if (delta > 0) {
    if (s.count == 0) ++live_slots_;  // a new or a dead slot comes alive
    ++s.count;
  } else {
    if (s.count == 0) throw std::logic_error("job n-gram: count below zero");
    if (--s.count == 0) --live_slots_;
  }
}

void JobNgram::count_document(const std::vector<int32_t>& doc, int delta) {
  const size_t n = doc.size();
  for (size_t i = 0; i < n; ++i) {
    const size_t longest = std::min(static_cast<size_t>(order_), n - i);
    for (size_t len = 1; len <= longest; ++len) bump(doc.data() + i, len, delta);
  }
}

void JobNgram::add(const int32_t* tokens, size_t count) {
  if (count == 0) return;
  const size_t keep = std::min(count, static_cast<size_t>(max_tokens_));
  docs_.emplace_back(tokens + (count - keep), tokens + count);
  count_document(docs_.back(), +1);
  live_tokens_ += keep;
  while (live_tokens_ > static_cast<size_t>(max_tokens_)) {
    count_document(docs_.front(), -1);
    live_tokens_ -= docs_.front().size();
    docs_.pop_front();
    ++evicted_;
  }
  // Dead slots only lengthen probes: rehash once they are most of the table's occupants.
  if (used_slots_ > 2 * live_slots_ + 1024) rehash(3 * (live_slots_ + 1));
}

uint64_t JobNgram::count(const int32_t* tokens, size_t len) const {
  if (len == 0 || len > static_cast<size_t>(order_)) return 0;
  const size_t i = find(tokens, len);
  return i == table_.size() ? 0 : table_[i].count;
}

uint64_t JobNgram::score_job(const int32_t* ctx, size_t ctx_len, const int32_t* candidates,
                             size_t n_candidates, float* out_probs) const {
  std::fill(out_probs, out_probs + n_candidates, 0.0f);
  const size_t longest = std::min(ctx_len, static_cast<size_t>(order_ - 1));
  std::array<int32_t, kMaxOrder> key{};
  uint64_t longest_count = 0;
  for (size_t len = longest; len >= 1; --len) {
    std::copy(ctx + ctx_len - len, ctx + ctx_len, key.begin());
    const uint64_t context_count = count(key.data(), len);
    if (context_count == 0) continue;
    if (longest_count == 0) longest_count = context_count;
    for (size_t i = 0; i < n_candidates; ++i) {
      if (out_probs[i] != 0.0f) continue;  // already scored at a longer suffix
      key[len] = candidates[i];
      const uint64_t c = count(key.data(), len + 1);
      if (c > 0) out_probs[i] = static_cast<float>(static_cast<double>(c) / static_cast<double>(context_count));
    }
  }
  return longest_count;
}

void JobNgram::score(const int32_t* ctx, size_t ctx_len, const int32_t* candidates, size_t n_candidates,
                     float* out_probs) const {
  if (base_ == nullptr) {
    score_job(ctx, ctx_len, candidates, n_candidates, out_probs);
    return;
  }
  base_->score(ctx, ctx_len, candidates, n_candidates, out_probs);
  if (live_tokens_ == 0) return;
  thread_local std::vector<float> own;
  own.resize(n_candidates);
  const uint64_t c = score_job(ctx, ctx_len, candidates, n_candidates, own.data());
  if (c == 0) return;
  const double lambda = static_cast<double>(c) / (static_cast<double>(c) + prior_);
  for (size_t i = 0; i < n_candidates; ++i) {
    const double q = (1.0 - lambda) * out_probs[i] + lambda * own[i];
    out_probs[i] = static_cast<float>(std::min(1.0, q));
  }
}

size_t JobNgram::memory_bytes() const {
  size_t bytes = table_.capacity() * sizeof(Slot);
  for (const auto& d : docs_) bytes += d.capacity() * sizeof(int32_t) + sizeof(d);
  return bytes;
}

}  // namespace ngram
