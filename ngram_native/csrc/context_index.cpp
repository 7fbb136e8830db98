// Hash chains of n-grams, the context index and continuation trees; design in context_index.h.
#include "context_index.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace context {

namespace {

uint64_t mix(uint64_t h, uint64_t v) {  // splitmix64 finaliser over (h, v)
  h ^= v + 0x9e3779b97f4a7c15ULL + (h << 6) + (h >> 2);
  h ^= h >> 30;
  h *= 0xbf58476d1ce4e5b9ULL;
  h ^= h >> 27;
  h *= 0x94d049bb133111ebULL;
  return h ^ (h >> 31);
}

constexpr uint64_t kHashSeed = 0x2545f4914f6cdd1dULL;
constexpr size_t kMinTable = 64;

}  // namespace

// ------------------------------------------------------------------------- NgramChains

NgramChains::NgramChains(int32_t min_match, int32_t max_match)
    : min_match_(min_match), max_match_(max_match) {
  if (min_match < 1 || max_match < min_match || max_match > 1024) {
    throw std::invalid_argument("need 1 <= min_match <= max_match <= 1024, got min_match " +
                                std::to_string(min_match) + ", max_match " +
                                std::to_string(max_match));
  }
  prev_.assign(static_cast<size_t>(levels()), -1);  // end 0: no gram ends before any token
  keys_.assign(kMinTable, 0);
  latest_.assign(kMinTable, -1);
}

void NgramChains::insert_slot(uint64_t key, int32_t end) {
  const size_t mask = keys_.size() - 1;
  size_t slot = key & mask;
  while (latest_[slot] >= 0) slot = (slot + 1) & mask;
  keys_[slot] = key;
  latest_[slot] = end;
}

int32_t NgramChains::latest(uint64_t key) const {
  const size_t mask = keys_.size() - 1;
  for (size_t slot = key & mask; latest_[slot] >= 0; slot = (slot + 1) & mask) {
    if (keys_[slot] == key) return latest_[slot];
  }
  return -1;
}

int32_t NgramChains::exchange_latest(uint64_t key, int32_t end) {
  if (2 * (used_ + 1) > keys_.size()) {  // grow at half load: probes stay short
    std::vector<uint64_t> old_keys(2 * keys_.size(), 0);
    std::vector<int32_t> old_latest(2 * keys_.size(), -1);
    old_keys.swap(keys_);
    old_latest.swap(latest_);
    for (size_t i = 0; i < old_keys.size(); ++i) {
      if (old_latest[i] >= 0) insert_slot(old_keys[i], old_latest[i]);
    }
  }
  const size_t mask = keys_.size() - 1;
  size_t slot = key & mask;
  while (latest_[slot] >= 0 && keys_[slot] != key) slot = (slot + 1) & mask;
  const int32_t old = latest_[slot];
  if (old < 0) ++used_;
  keys_[slot] = key;
  latest_[slot] = end;
  return old;
}

void NgramChains::push(int32_t token, int64_t run) {
  tokens_.push_back(token);
  const size_t end = tokens_.size();
  prev_.resize((end + 1) * static_cast<size_t>(levels()), -1);
  if (token < 0) return;  // a separator: no gram ends here
  const int32_t longest = static_cast<int32_t>(std::min<int64_t>(max_match_, run));
  uint64_t h = kHashSeed;
  for (int32_t k = 1; k <= longest; ++k) {  // the k-gram tokens[end - k, end), grown leftwards
    h = mix(h, static_cast<uint64_t>(static_cast<uint32_t>(tokens_[end - k])));
    if (k >= min_match_) {
      prev_at(end, k) = exchange_latest(mix(h, static_cast<uint64_t>(k)), static_cast<int32_t>(end));
    }
  }
}

void NgramChains::drop_before(size_t first) {
  if (first < first_ || first > tokens_.size()) {
    throw std::invalid_argument("drop_before: position " + std::to_string(first) +
                                " outside the live stream [" + std::to_string(first_) + ", " +
                                std::to_string(tokens_.size()) + "]");
  }
  first_ = first;
  if (first_ > 0 && first_ >= tokens_.size() - first_) compact();
}

void NgramChains::compact() {
  const size_t shift = first_;
  const int32_t s = static_cast<int32_t>(shift);
  const size_t width = static_cast<size_t>(levels());
  std::vector<int32_t> tokens(tokens_.begin() + static_cast<std::ptrdiff_t>(shift), tokens_.end());
  std::vector<int32_t> prev(prev_.begin() + static_cast<std::ptrdiff_t>(shift * width), prev_.end());
  for (int32_t& v : prev) v = v > s ? v - s : -1;  // ends <= first_ are dead
  tokens_.swap(tokens);
  prev_.swap(prev);
  size_t live = 0;
  for (int32_t e : latest_) live += e > s;
  size_t capacity = kMinTable;
  while (2 * (live + 1) > capacity) capacity *= 2;
  std::vector<uint64_t> old_keys(capacity, 0);
  std::vector<int32_t> old_latest(capacity, -1);
  old_keys.swap(keys_);
  old_latest.swap(latest_);
  for (size_t i = 0; i < old_keys.size(); ++i) {
    if (old_latest[i] > s) insert_slot(old_keys[i], old_latest[i] - s);
  }
  used_ = live;
  first_ = 0;
}

size_t NgramChains::memory_bytes() const {
  return tokens_.capacity() * sizeof(int32_t) + prev_.capacity() * sizeof(int32_t) +
         keys_.capacity() * sizeof(uint64_t) + latest_.capacity() * sizeof(int32_t);
}

int32_t NgramChains::match(const int32_t* query, size_t n, bool self, int64_t max_occurrences,
                           std::vector<int32_t>& ends) const {
  ends.clear();
  if (max_occurrences < 1 || n < (self ? 2u : 1u)) return 0;
  // Self: an occurrence must end at e <= n - 1 (a continuation exists), so k <= n - 1.
  const int32_t longest = static_cast<int32_t>(std::min<size_t>(max_match_, self ? n - 1 : n));
  if (longest < min_match_) return 0;
  uint64_t keys[1024];  // the query suffix's k-gram keys (another stream's query only)
  if (!self) {
    uint64_t h = kHashSeed;
    for (int32_t k = 1; k <= longest; ++k) {
      h = mix(h, static_cast<uint64_t>(static_cast<uint32_t>(query[n - k])));
      keys[k - 1] = mix(h, static_cast<uint64_t>(k));
    }
  }
  const size_t size = tokens_.size();
  for (int32_t k = longest; k >= min_match_; --k) {
    int32_t e = self ? prev_at(n, k) : latest(keys[k - 1]);
    for (; e > static_cast<int32_t>(first_); e = prev_at(static_cast<size_t>(e), k)) {
      const size_t end = static_cast<size_t>(e);
      if (end >= size || tokens_[end] < 0) continue;  // no continuation (end of a document)
      if (!std::equal(tokens_.begin() + static_cast<std::ptrdiff_t>(end - k),
                      tokens_.begin() + static_cast<std::ptrdiff_t>(end), query + (n - k))) {
        continue;  // a hash collision
      }
      ends.push_back(e);
      if (static_cast<int64_t>(ends.size()) == max_occurrences) break;
    }
    if (!ends.empty()) return k;
  }
  return 0;
}

// ------------------------------------------------------------------------ ContextIndex

ContextIndex::ContextIndex(int32_t min_match, int32_t max_match, int64_t max_tokens)
    : chains_(min_match, max_match), max_tokens_(max_tokens) {
  if (max_tokens < 1 || max_tokens >= (int64_t{1} << 31)) {
    throw std::invalid_argument("max_tokens must be in [1, 2^31), got " + std::to_string(max_tokens));
  }
}

void ContextIndex::append(const int32_t* tokens, size_t count) {
  if (static_cast<int64_t>(size() + count) > max_tokens_) {
    throw std::length_error("context index is full: " + std::to_string(size()) + " + " +
                            std::to_string(count) + " tokens > max_tokens " +
                            std::to_string(max_tokens_));
  }
  for (size_t i = 0; i < count; ++i) {
    chains_.push(tokens[i], static_cast<int64_t>(size()) + 1);
  }
}

int32_t ContextIndex::match(int64_t max_occurrences, std::vector<int32_t>& ends) const {
  return chains_.match(tokens().data(), size(), /*self=*/true, max_occurrences, ends);
}

// ------------------------------------------------------------------ continuation trees

void build_continuation_tree(const std::vector<int32_t>& tokens, const std::vector<int32_t>& ends,
                             int32_t match_len, int64_t depth_cap, const LookupParams& params,
                             const trees::EosSet& eos, LookupScratch& s, trees::TreeBatch& out) {
  const double by_match = std::floor(params.depth_factor * match_len);
  const int64_t depth = static_cast<int64_t>(std::min(static_cast<double>(depth_cap), by_match));
  s.raw.clear();
  if (match_len == 0 || ends.empty() || depth <= 0 || params.budget <= 0) {
    trees::append_canonical(s.raw, out, s.canonical);
    return;
  }
  // Trie of the continuations; a node's children are found by a scan of the nodes created
  // from the same parent (trees hold at most max_occurrences * depth nodes, usually far fewer).
  for (auto* v : {&s.node_token, &s.node_parent, &s.node_depth, &s.node_count, &s.node_first}) v->clear();
  const int64_t n = static_cast<int64_t>(tokens.size());
  for (size_t o = 0; o < ends.size(); ++o) {
    int32_t parent = -1;
    const int64_t stop = std::min<int64_t>(n, ends[o] + depth);
    for (int64_t pos = ends[o]; pos < stop; ++pos) {
      const int32_t token = tokens[pos];
      if (token < 0) break;  // a document separator
      int32_t node = -1;
      for (int32_t c = parent + 1; c < static_cast<int32_t>(s.node_token.size()); ++c) {
        if (s.node_parent[c] == parent && s.node_token[c] == token) {
          node = c;
          break;
        }
      }
      if (node < 0) {
        node = static_cast<int32_t>(s.node_token.size());
        s.node_token.push_back(token);
        s.node_parent.push_back(parent);
        s.node_depth.push_back(parent < 0 ? 1 : s.node_depth[parent] + 1);
        s.node_count.push_back(0);
        s.node_first.push_back(static_cast<int32_t>(o));
      }
      ++s.node_count[node];
      parent = node;
      if (eos.contains(token)) break;
    }
  }
  // Keep the best `budget`: a parent ranks before its children (count >=, depth <), so the kept
  // set is prefix-closed and, in rank order, topological.
  const int32_t total = static_cast<int32_t>(s.node_token.size());
  s.order.resize(total);
  for (int32_t i = 0; i < total; ++i) s.order[i] = i;
  std::sort(s.order.begin(), s.order.end(), [&](int32_t a, int32_t b) {
    if (s.node_count[a] != s.node_count[b]) return s.node_count[a] > s.node_count[b];
    if (s.node_depth[a] != s.node_depth[b]) return s.node_depth[a] < s.node_depth[b];
    return s.node_first[a] < s.node_first[b];
  });
  const int32_t kept = static_cast<int32_t>(std::min<int64_t>(total, params.budget));
  s.new_index.assign(total, -1);
  const double occurrences = static_cast<double>(ends.size());
  for (int32_t r = 0; r < kept; ++r) {
    const int32_t i = s.order[r];
    s.new_index[i] = r;
    const int32_t parent = s.node_parent[i] < 0 ? -1 : s.new_index[s.node_parent[i]];
    s.raw.push_back({s.node_token[i], parent, s.node_depth[i], std::log(s.node_count[i] / occurrences)});
  }
  trees::append_canonical(s.raw, out, s.canonical);
}

void build_lookup_tree(const ContextIndex& index, int64_t depth_cap, const LookupParams& params,
                       const trees::EosSet& eos, LookupScratch& s, trees::TreeBatch& out) {
  const int32_t match_len = index.match(params.max_occurrences, s.ends);
  build_continuation_tree(index.tokens(), s.ends, match_len, depth_cap, params, eos, s, out);
}

}  // namespace context
