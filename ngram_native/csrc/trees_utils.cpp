// Canonical flattening shared by every tree builder.
#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "trees.h"

namespace trees {

void append_canonical(const std::vector<RawNode>& nodes, TreeBatch& out,
                      CanonicalScratch& scratch) {
  const int32_t n = static_cast<int32_t>(nodes.size());
  auto& order = scratch.order;
  auto& out_index = scratch.out_index;
  order.resize(n);
  out_index.assign(n, -1);
  for (int32_t i = 0; i < n; ++i) order[i] = i;
  // Depth groups first; a group's parents sit in earlier groups and are numbered already.
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return nodes[a].depth < nodes[b].depth; });
  const int64_t base = static_cast<int64_t>(out.tokens.size());
  int32_t group_begin = 0;
  while (group_begin < n) {
    const int32_t depth = nodes[order[group_begin]].depth;
    int32_t group_end = group_begin;
    while (group_end < n && nodes[order[group_end]].depth == depth) ++group_end;
    auto parent_of = [&](int32_t i) {
      return nodes[i].parent < 0 ? -1 : out_index[nodes[i].parent];
    };
    std::sort(order.begin() + group_begin, order.begin() + group_end, [&](int32_t a, int32_t b) {
      const int32_t pa = parent_of(a), pb = parent_of(b);
      if (pa != pb) return pa < pb;
      if (nodes[a].score != nodes[b].score) return nodes[a].score > nodes[b].score;
      return nodes[a].token < nodes[b].token;
    });
    for (int32_t g = group_begin; g < group_end; ++g) {
      const int32_t i = order[g];
      out_index[i] = g;
      out.tokens.push_back(nodes[i].token);
      out.parents.push_back(parent_of(i));
      out.depths.push_back(nodes[i].depth);
      out.scores.push_back(nodes[i].score);
    }
    group_begin = group_end;
  }
  out.offsets.push_back(base + n);
}

}  // namespace trees
