// Import of upstream DART's C++ `.trie` files into our format.
//
// Upstream format (little-endian, packed, no padding):
//   u64 order, u64 node_count, then node_count nodes, node 0 being the root:
//     i32 token, u64 parent, i32 freq, u64 n_children,
//     n_children x { i32 child_token, u64 child_index }
//   freq is the number of occurrences of the node's path (its n-gram).
// Nodes may appear in any order and children in any order; we walk the tree breadth first
// from the root, sorting each node's children by token, which yields our levels in their
// final order directly. Everything is validated: every index in range, every child's parent
// and token match its parent's entry, each node reached exactly once, depth <= order, ids in
// the vocabulary, counts >= 1 and >= the sum of the children's counts. The root's freq is
// not trusted (upstream builders may leave it 0): our root count is the larger of it and the
// sum of the level-1 counts.
#include <algorithm>
#include <cstring>

#include "trie.h"
#include "trie_io.h"

namespace ngram {
namespace {

constexpr uint64_t kUpstreamHeader = 16;
constexpr uint64_t kNodeFixed = 24;   // i32 token, u64 parent, i32 freq, u64 n_children
constexpr uint64_t kChildEntry = 12;  // i32 token, u64 index

[[noreturn]] void bad(const std::string& path, const std::string& what) {
  throw TrieFormatError("upstream trie file '" + path + "': " + what);
}

template <typename T>
T load(const unsigned char* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

struct NodeView {
  int32_t token;
  uint64_t parent;
  int32_t freq;
  uint64_t n_children;
  const unsigned char* children;
};

NodeView node_at(const unsigned char* base, uint64_t offset) {
  const unsigned char* p = base + offset;
  return NodeView{load<int32_t>(p), load<uint64_t>(p + 4), load<int32_t>(p + 12), load<uint64_t>(p + 16),
                  p + kNodeFixed};
}

}  // namespace

BuildStats import_upstream_trie(const std::string& src_path, const std::string& dst_path, uint32_t vocab_size,
                                const std::string& tokenizer_fingerprint, const std::string& tmp_dir) {
  check_fingerprint(tokenizer_fingerprint);
  if (vocab_size < 1 || vocab_size > (uint32_t{1} << 31)) {
    throw std::invalid_argument("vocab_size must be in 1..2^31, got " + std::to_string(vocab_size));
  }
  MappedFile file(src_path);
  const unsigned char* data = file.data();
  const uint64_t size = file.size();
  if (size < kUpstreamHeader) {
    bad(src_path, "truncated: " + std::to_string(size) + " bytes, shorter than the 16-byte header");
  }
  const uint64_t order = load<uint64_t>(data);
  const uint64_t node_count = load<uint64_t>(data + 8);
  if (order < 1 || order > static_cast<uint64_t>(kMaxOrder)) {
    bad(src_path, "order " + std::to_string(order) + " outside 1.." + std::to_string(kMaxOrder));
  }
  if (node_count < 1) bad(src_path, "node_count is 0 (no root)");
  if (node_count > (size - kUpstreamHeader) / kNodeFixed) {
    bad(src_path, "declares " + std::to_string(node_count) + " nodes but its " + std::to_string(size) +
                      " bytes hold at most " + std::to_string((size - kUpstreamHeader) / kNodeFixed));
  }

  // Pass 1: where each node starts (records have variable length).
  std::vector<uint64_t> offsets(node_count);
  uint64_t pos = kUpstreamHeader;
  for (uint64_t i = 0; i < node_count; ++i) {
    if (size - pos < kNodeFixed) {
      bad(src_path, "truncated in node " + std::to_string(i) + " (at byte " + std::to_string(pos) + ")");
    }
    offsets[i] = pos;
    const uint64_t n_children = load<uint64_t>(data + pos + 16);
    pos += kNodeFixed;
    if (n_children > (size - pos) / kChildEntry) {
      bad(src_path, "truncated in the " + std::to_string(n_children) + " children of node " + std::to_string(i) +
                        " (at byte " + std::to_string(pos) + ")");
    }
    pos += n_children * kChildEntry;
  }
  if (pos != size) {
    bad(src_path, std::to_string(size - pos) + " trailing bytes after the last node (at byte " +
                      std::to_string(pos) + ")");
  }

  // Pass 2: breadth first from the root; level d + 1 in order = children of level d in
  // order, each sorted by token.
  const int n = static_cast<int>(order);
  TrieFileWriter writer(n, tmp_dir);
  std::vector<uint8_t> visited(node_count, 0);
  visited[0] = 1;
  uint64_t reached = 1;
  std::vector<uint64_t> level{0};
  std::vector<uint64_t> next;
  std::vector<std::pair<uint32_t, uint64_t>> kids;
  uint64_t root_count = 0;
  for (int d = 0; d <= n; ++d) {
    next.clear();
    for (uint64_t p : level) {
      const NodeView node = node_at(data, offsets[p]);
      const std::string where = "node " + std::to_string(p) + " (depth " + std::to_string(d) + ")";
      if (d == n && node.n_children > 0) {
        bad(src_path, where + " has children, deeper than the order " + std::to_string(order));
      }
      kids.clear();
      uint64_t child_sum = 0;
      for (uint64_t c = 0; c < node.n_children; ++c) {
        const unsigned char* entry = node.children + c * kChildEntry;
        const int32_t token = load<int32_t>(entry);
        const uint64_t idx = load<uint64_t>(entry + 4);
        const std::string child = "child " + std::to_string(c) + " of " + where;
        if (idx == 0 || idx >= node_count) {
          bad(src_path, child + " has index " + std::to_string(idx) + ", outside 1.." + std::to_string(node_count - 1));
        }
        if (token < 0 || static_cast<uint64_t>(token) >= vocab_size) {
          bad(src_path, child + " has token " + std::to_string(token) + ", outside the vocabulary [0, " +
                            std::to_string(vocab_size) + ")");
        }
        const NodeView kid = node_at(data, offsets[idx]);
        if (kid.parent != p) {
          bad(src_path, child + " is node " + std::to_string(idx) + ", whose parent field says " +
                            std::to_string(kid.parent));
        }
        if (kid.token != token) {
          bad(src_path, child + " is listed with token " + std::to_string(token) + " but node " +
                            std::to_string(idx) + " has token " + std::to_string(kid.token));
        }
        if (kid.freq < 1) bad(src_path, "node " + std::to_string(idx) + " has freq " + std::to_string(kid.freq));
        if (visited[idx]) bad(src_path, "node " + std::to_string(idx) + " is reached twice (again as " + child + ")");
        visited[idx] = 1;
        ++reached;
        child_sum += static_cast<uint64_t>(kid.freq);
        kids.emplace_back(static_cast<uint32_t>(token), idx);
      }
      std::sort(kids.begin(), kids.end());
      for (size_t c = 1; c < kids.size(); ++c) {
        if (kids[c].first == kids[c - 1].first) {
          bad(src_path, where + " has two children with token " + std::to_string(kids[c].first));
        }
      }
      if (d == 0) {
        root_count = std::max(static_cast<uint64_t>(std::max(node.freq, 0)), child_sum);
      } else {
        if (child_sum > static_cast<uint64_t>(node.freq)) {
          bad(src_path, where + " has freq " + std::to_string(node.freq) + ", less than the sum " +
                            std::to_string(child_sum) + " of its children's");
        }
        writer.add_node(d, static_cast<uint32_t>(node.token), static_cast<uint64_t>(node.freq), next.size());
      }
      for (const auto& kid : kids) next.push_back(kid.second);
    }
    level.swap(next);
  }
  if (reached != node_count) {
    uint64_t first = 0;
    while (visited[first]) ++first;
    bad(src_path, std::to_string(node_count - reached) + " of " + std::to_string(node_count) +
                      " nodes are unreachable from the root (first: node " + std::to_string(first) + ")");
  }
  BuildStats stats;
  stats.num_tokens = root_count;
  stats.file_size = writer.write(dst_path, root_count, vocab_size, tokenizer_fingerprint, 0, 0);
  stats.level_sizes.push_back(1);
  for (int k = 1; k <= n; ++k) stats.level_sizes.push_back(writer.level_size(k));
  return stats;
}

}  // namespace ngram
