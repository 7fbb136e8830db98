// Merging two draft trees of the same root into one within a node budget (see trees.h).
//
// Runs once per sequence per round in the hybrid modes (dart_lookup, ddtree_lookup) and in the
// lookup drafters' job-cache graft, so it allocates nothing once its scratch is warm: the union
// trie lives in flat arrays, its (parent, token) -> node map is an open-addressing table, and
// the canonical flattening is the builders' own `append_canonical`.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>

#include "trees.h"

namespace trees {

namespace {

uint64_t slot_of(int32_t parent, int32_t token, uint64_t mask) {
  const uint64_t k = (static_cast<uint64_t>(static_cast<uint32_t>(parent + 1)) << 32) |
                     static_cast<uint32_t>(token);
  return ((k * 0x9E3779B97F4A7C15ULL) >> 17) & mask;
}

// Add one tree's nodes to the union trie of `s`.
void add_tree(const TreeView& tree, MergeScratch& s, uint64_t mask) {
  s.to_trie.resize(static_cast<size_t>(tree.size));
  for (int64_t i = 0; i < tree.size; ++i) {
    const int32_t p = tree.parents[i];
    if (p < -1 || p >= i) {
      throw std::invalid_argument("node " + std::to_string(i) + " has parent " + std::to_string(p) +
                                  "; need -1 <= parent < " + std::to_string(i));
    }
    const double score = tree.scores == nullptr ? 0.0 : tree.scores[i];
    if (std::isnan(score)) throw std::invalid_argument("node " + std::to_string(i) + " has a NaN score");
    const int32_t parent = p < 0 ? -1 : s.to_trie[p];
    const int32_t token = tree.tokens[i];
    uint64_t slot = slot_of(parent, token, mask);
    int32_t node;
    while (true) {
      node = s.table[slot];
      if (node < 0 || (s.parent[node] == parent && s.token[node] == token)) break;
      slot = (slot + 1) & mask;
    }
    if (node < 0) {  // a new path: parents come first, so its parent's depth and key are known
      node = static_cast<int32_t>(s.token.size());
      s.table[slot] = node;
      s.token.push_back(token);
      s.parent.push_back(parent);
      s.depth.push_back(parent < 0 ? 1 : s.depth[parent] + 1);
      s.best.push_back(-std::numeric_limits<double>::infinity());
      s.origin.push_back(0);
    }
    // As Python's max(best, score) and `|`: the first of equal scores stays (-0.0 vs 0.0).
    if (score > s.best[node]) s.best[node] = score;
    s.origin[node] |= tree.sources == nullptr ? 0 : tree.sources[i];
    s.to_trie[i] = node;
  }
}

}  // namespace

void merge_trees(const TreeView& first, const TreeView& second, int64_t budget,
                 MergeScratch& s) {
  if (budget < 0) throw std::invalid_argument("budget must be >= 0, got " + std::to_string(budget));
  for (auto* v : {&s.token, &s.parent, &s.depth, &s.order, &s.kept_index}) v->clear();
  s.best.clear();
  s.key.clear();
  s.origin.clear();
  s.kept.clear();
  s.sources.clear();
  s.out.tokens.clear();
  s.out.parents.clear();
  s.out.depths.clear();
  s.out.scores.clear();
  s.out.offsets.assign(1, 0);

  const int64_t total = first.size + second.size;
  uint64_t table_size = 16;
  while (table_size < 2 * static_cast<uint64_t>(total)) table_size <<= 1;
  s.table.assign(table_size, -1);
  add_tree(first, s, table_size - 1);
  add_tree(second, s, table_size - 1);
  const int32_t n = static_cast<int32_t>(s.token.size());

  // key = min(score, parent's key), parents first (creation order is topological). As Python's
  // min(score, parent_key): the parent's key only when strictly smaller.
  s.key.resize(n);
  for (int32_t i = 0; i < n; ++i) {
    const int32_t p = s.parent[i];
    s.key[i] = (p >= 0 && s.key[p] < s.best[i]) ? s.key[p] : s.best[i];
  }

  // The best `budget` nodes by (key desc, depth asc, path asc): prefix-closed, since a parent's
  // key is >= its child's and its depth smaller. Scores are never NaN and (parent, token) is
  // unique, so this order is total and the kept set well defined; only the set is needed here.
  const int32_t keep = static_cast<int32_t>(std::min<int64_t>(budget, n));
  s.kept_index.assign(n, keep < n ? -1 : 0);  // 0: kept (numbered below), -1: left out
  if (keep < n) {
    // Paths of one depth, lexicographically: climb both to the children of a common parent.
    auto path_less = [&](int32_t a, int32_t b) {
      while (s.parent[a] != s.parent[b]) {
        a = s.parent[a];
        b = s.parent[b];
      }
      return s.token[a] < s.token[b];
    };
    auto better = [&](int32_t a, int32_t b) {
      if (s.key[a] != s.key[b]) return s.key[a] > s.key[b];
      if (s.depth[a] != s.depth[b]) return s.depth[a] < s.depth[b];
      return path_less(a, b);
    };
    s.order.resize(n);
    for (int32_t i = 0; i < n; ++i) s.order[i] = i;
    std::nth_element(s.order.begin(), s.order.begin() + keep, s.order.end(), better);
    for (int32_t j = 0; j < keep; ++j) s.kept_index[s.order[j]] = 0;
  }
  // The kept nodes in creation order (topological), numbered for their children.
  s.order.clear();
  s.kept.reserve(keep);
  for (int32_t i = 0; i < n; ++i) {
    if (s.kept_index[i] < 0) continue;
    const int32_t p = s.parent[i];
    const int32_t kept_parent = p < 0 ? -1 : s.kept_index[p];
    if (p >= 0 && kept_parent < 0) throw std::logic_error("merge_trees: kept a node without its parent");
    s.kept_index[i] = static_cast<int32_t>(s.kept.size());
    s.order.push_back(i);
    s.kept.push_back(RawNode{s.token[i], kept_parent, s.depth[i], s.key[i]});
  }
  // Canonical order: by depth, then parent's new index, then key desc, then token asc.
  append_canonical(s.kept, s.out, s.canonical);
  s.sources.resize(keep);
  for (int32_t j = 0; j < keep; ++j) s.sources[s.canonical.out_index[j]] = s.origin[s.order[j]];
}

}  // namespace trees
