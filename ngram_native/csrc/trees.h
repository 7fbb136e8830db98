// Draft-tree builders for tree speculative decoding (DART n-gram beam, DDTree best-first, chain).
//
// Every builder returns the same flattened tree per sequence, in one canonical order:
// by depth, then by parent index, then siblings by score descending (ties: token id
// ascending). So the array is topological, each node's children are contiguous, and
// siblings appear in proposal order (the order a sampler tries them in). The root (the
// last committed token) is not a node: children of the root have parent -1, depth 1.
//
// Nothing here touches Python: bind_trees.cpp validates and converts arrays, releases the
// GIL and calls these functions. Bad data values (NaN, ids out of range, duplicates) are
// reported by throwing std::invalid_argument, which the bindings turn into ValueError.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "ngram_scorer.h"

namespace trees {

// Per-position draft scores of a batch, C-contiguous, owned by the caller.
// Dense: ids == nullptr, values = logits [batch, positions, width = V].
// Pre-selected: ids [batch, positions, width = K] and values [batch, positions, K].
struct DraftScores {
  const float* values = nullptr;
  const int32_t* ids = nullptr;
  int64_t batch = 0;
  int64_t positions = 0;  // D: the tree is at most this deep
  int64_t width = 0;      // V (dense) or K (pre-selected)
  int64_t vocab_size = -1;  // upper bound for ids (exclusive); -1 = unchecked (pre-selected)
  const int64_t* max_depths = nullptr;  // optional [batch]: per-sequence depth limit

  // Draft positions sequence b may use: its tree is at most this deep.
  int64_t positions_of(int64_t b) const {
    return max_depths == nullptr ? positions : std::min(positions, std::max<int64_t>(0, max_depths[b]));
  }
};

// The best `k` candidates of every usable draft position of one sequence, sorted by value
// descending (ties: id ascending), so the result does not depend on the input order.
struct CandidateRows {
  int64_t positions = 0;
  int64_t k = 0;
  std::vector<int32_t> ids;     // [positions * k]
  std::vector<float> values;    // [positions * k], as given (logits or log-probs)
  std::vector<double> log_norm;  // [positions]: log-sum-exp of the full row (dense input)
                                 // or of the k kept values (pre-selected input)
  std::vector<std::pair<float, int32_t>> work;  // scratch of select_candidates
  std::vector<int32_t> work_ids;                 // scratch of select_candidates
};

// Fill `rows` for sequence b with the top-k candidates of each of its in.positions_of(b)
// positions (k is clamped to the width; rows past a sequence's depth limit are not read). Dense rows are scanned once with a small heap (O(V) with few heap updates);
// `need_log_norm` adds a second O(V) exp pass for the full-vocabulary log-sum-exp.
// Throws std::invalid_argument on NaN / +inf values, ids out of range, duplicate ids.
void select_candidates(const DraftScores& in, int64_t b, int64_t k, bool need_log_norm,
                       CandidateRows& rows);

// Trees of a whole batch, concatenated: sequence b owns [offsets[b], offsets[b + 1]).
// Parents are indices local to their own tree (-1 = root).
struct TreeBatch {
  std::vector<int32_t> tokens;
  std::vector<int32_t> parents;
  std::vector<int32_t> depths;
  std::vector<double> scores;
  std::vector<int64_t> offsets{0};
};

// A node of a tree under construction; `parent` indexes the same array (-1 = root) and
// must precede the node (topological input).
struct RawNode {
  int32_t token;
  int32_t parent;
  int32_t depth;
  double score;
};

// Reusable buffers of `append_canonical` (no allocation per tree once warm).
struct CanonicalScratch {
  std::vector<int32_t> order;
  std::vector<int32_t> out_index;
};

// Append `nodes` (topological) to `out` in canonical order and close the sequence.
void append_canonical(const std::vector<RawNode>& nodes, TreeBatch& out,
                      CanonicalScratch& scratch);

// Small set of end-of-sequence ids: nodes carrying one are never expanded.
class EosSet {
 public:
  explicit EosSet(std::vector<int32_t> ids) : ids_(std::move(ids)) {}
  bool contains(int32_t token) const {
    for (int32_t id : ids_) {
      if (id == token) return true;
    }
    return false;
  }
  bool empty() const { return ids_.empty(); }

 private:
  std::vector<int32_t> ids_;
};

// N-gram contexts of a batch: sequence b's committed tokens (already cut to at most
// n - 1 of the most recent) are ctx_tokens[ctx_offsets[b] .. ctx_offsets[b + 1]).
struct Contexts {
  const int32_t* tokens = nullptr;
  const int64_t* offsets = nullptr;  // [batch + 1], or nullptr = every context empty
};

// ---- DART n-gram beam search (defaults = the DART reference implementation) ----
//
// Level l (0-based, node depth l + 1) scores a child t of a beam node as
//   score = parent_score + w_l * (a_l * ln(p_l(t) + 1e-10) + g * ln(q(t | ctx) + 1e-10))
// with w_l = (l + 1)^-depth_decay, a_l = draft_decay^l, g = ngram_weight, p_l the
// softmax over the k candidate values of position l, and q the scorer's estimate for the
// context = last n-1 tokens of (committed + path to the parent). At level 0, or without a
// scorer, the n-gram term is dropped. (The reference's level weight exponent -0.7 is
// `depth_decay` = 0.7 here: w_l = (l + 1)^-depth_decay.) Each level's children are cut to `beam_width`
// (non-EOS first, then score descending, then creation order); EOS children are never
// expanded. The tree is the best `budget` nodes of the pool (every scored child if
// keep_pruned, as in the reference; else only beam-kept ones) ranked by
// key = min(score, parent's key), then creation order: keys never increase along a path
// and parents are created first, so every top-`budget` set is prefix-closed.
struct DartParams {
  int64_t top_k = 25;
  int64_t beam_width = 20;
  int64_t budget = 60;
  double depth_decay = 0.7;
  double draft_decay = 0.9;
  double ngram_weight = 0.5;
  bool keep_pruned = true;
  // Score level 0 with the N-gram model too (the reference does not: NO_NGRAM_ON_FIRST_TOKEN).
  bool ngram_first_level = false;
  // Skip children that provably cannot enter the tree: never creates them, nor scores
  // them with the N-gram model. The result is identical (tested against prune = false);
  // it saves most scorer calls at deep levels, whose nodes rarely make the budget.
  bool prune = true;
};

void build_dart(const DraftScores& in, const Contexts& contexts,
                const ngram::NgramScorer* scorer, const DartParams& params, const EosSet& eos,
                TreeBatch& out);

// ---- DDTree best-first (arXiv 2604.12989) and the chain ----
//
// Scores are path sums of per-position log-probabilities: log-softmax over V for dense
// logits, over the k values for pre-selected logits, or the values themselves when they
// are log-probs (tiny positive rounding noise is clamped to 0). The best-first search
// keeps a heap of frontier nodes ordered by (score desc, depth asc, path of candidate
// ranks lexicographically asc); popping a node pushes its next sibling and its first
// child, so the result equals the top-`budget` prefixes under that order.
struct BestFirstParams {
  int64_t top_k = 0;  // 0 = min(budget, width) for dense input, all K for pre-selected
  int64_t budget = 60;
  bool values_are_logprobs = false;  // pre-selected input only
};

void build_ddtree(const DraftScores& in, const BestFirstParams& params, const EosSet& eos,
                  TreeBatch& out);

// Top-1 per position, stopping after an EOS token; depth <= min(positions, budget).
void build_chain(const DraftScores& in, const BestFirstParams& params, const EosSet& eos,
                 TreeBatch& out);

// ---- Merging two trees of the same root (hybrid drafting: ngram_native.trees.merge_trees) ----
//
// The trees are merged as tries: a path both hold becomes one node, whose score is the larger
// of the two (a missing score counts 0) and whose source bits are OR-ed (missing: 0). Ranked by
// key = min(score, parent's key) descending, then depth ascending, then the path's tokens
// lexicographically, the best `budget` nodes form a prefix-closed tree (keys never grow along
// a path and a parent is shallower than its child), output in canonical order with its keys
// as scores.

// One input tree: arrays of `size` entries owned by the caller; parents[i] is -1 or < i.
// scores and sources may be null (every node 0).
struct TreeView {
  const int32_t* tokens = nullptr;
  const int32_t* parents = nullptr;
  const double* scores = nullptr;
  const uint8_t* sources = nullptr;
  int64_t size = 0;
};

// The merged tree (canonical order) and the reusable buffers of `merge_trees`: no allocation
// per call once warm.
struct MergeScratch {
  TreeBatch out;                 // one sequence: tokens, parents, depths, scores (the keys)
  std::vector<uint8_t> sources;  // [out size], aligned with `out`
  // The union trie, in creation order (parents first).
  std::vector<int32_t> token, parent, depth;
  std::vector<double> best, key;
  std::vector<uint8_t> origin;
  std::vector<int32_t> table;   // open addressing: (parent, token) -> trie node, -1 = empty
  std::vector<int32_t> to_trie;  // input node -> trie node, for the tree being read
  std::vector<int32_t> order, kept_index;  // scratch; kept node -> its index among the kept
  std::vector<RawNode> kept;
  CanonicalScratch canonical;
};

// Merge `first` and `second` into scratch.out / scratch.sources. Throws std::invalid_argument
// for a parent that is not -1 or an earlier index, a NaN score, or budget < 0.
void merge_trees(const TreeView& first, const TreeView& second, int64_t budget,
                 MergeScratch& scratch);

}  // namespace trees
