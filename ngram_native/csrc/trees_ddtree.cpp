// DDTree best-first tree (arXiv 2604.12989) and the single-chain baseline.
//
// Both rank paths by the sum of per-position draft log-probabilities. Best-first search
// over "next sibling / first child" successors visits nodes in exactly the order
// (score desc, depth asc, candidate ranks along the path lexicographically asc): that
// order is monotone (a child never precedes its parent, sibling j + 1 never precedes
// sibling j), so the frontier always holds the next node and the first `budget` pops are
// the top-`budget` prefixes.
#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "trees.h"

namespace trees {
namespace {

// Largest positive "log-prob" accepted as rounding noise (clamped to 0).
constexpr double kLogProbSlack = 1e-4;

// Per-position log-probabilities of the selected candidates: [positions * k].
void compute_log_probs(const DraftScores& in, int64_t b, const CandidateRows& rows,
                       bool values_are_logprobs, std::vector<double>& lp) {
  lp.resize(rows.positions * rows.k);
  const bool given_logprobs = values_are_logprobs && in.ids != nullptr;
  for (int64_t d = 0; d < rows.positions; ++d) {
    for (int64_t j = 0; j < rows.k; ++j) {
      const double v = rows.values[d * rows.k + j];
      if (!given_logprobs) {
        lp[d * rows.k + j] = v - rows.log_norm[d];
      } else if (v <= 0.0) {
        lp[d * rows.k + j] = v;
      } else if (v <= kLogProbSlack) {
        lp[d * rows.k + j] = 0.0;
      } else {
        throw std::invalid_argument("topk_values[" + std::to_string(b) + ", " +
                                    std::to_string(d) + "] holds " + std::to_string(v) +
                                    " > 0: log-probabilities must be <= 0 (pass values=\"logits\" for logits)");
      }
    }
  }
}

struct Frontier {
  double score;
  int32_t depth;
  int32_t parent;  // index into the popped nodes, -1 = root
  int32_t rank;    // candidate rank at position depth - 1
};

struct BestFirstWorkspace {
  CandidateRows rows;
  std::vector<double> lp;
  std::vector<Frontier> heap;
  std::vector<int32_t> paths;  // [popped node * positions]: candidate ranks root -> node
  std::vector<RawNode> nodes;
  CanonicalScratch canonical;
};

void ddtree_one(const DraftScores& in, int64_t b, int64_t k, const BestFirstParams& p,
                const EosSet& eos, BestFirstWorkspace& ws, TreeBatch& out) {
  const bool need_log_norm = !(p.values_are_logprobs && in.ids != nullptr);
  select_candidates(in, b, k, need_log_norm, ws.rows);
  compute_log_probs(in, b, ws.rows, p.values_are_logprobs, ws.lp);
  k = ws.rows.k;
  const int64_t positions = ws.rows.positions;

  // True when frontier entry a precedes b in the total order.
  auto precedes = [&](const Frontier& a, const Frontier& c) {
    if (a.score != c.score) return a.score > c.score;
    if (a.depth != c.depth) return a.depth < c.depth;
    if (a.parent != c.parent) {  // same depth: compare the parents' paths
      const int32_t* pa = &ws.paths[a.parent * positions];
      const int32_t* pc = &ws.paths[c.parent * positions];
      for (int32_t i = 0; i < a.depth - 1; ++i) {
        if (pa[i] != pc[i]) return pa[i] < pc[i];
      }
    }
    return a.rank < c.rank;
  };
  auto heap_less = [&](const Frontier& a, const Frontier& c) { return precedes(c, a); };

  ws.heap.clear();
  ws.nodes.clear();
  ws.paths.clear();
  if (p.budget > 0 && positions > 0) ws.heap.push_back(Frontier{ws.lp[0], 1, -1, 0});
  while (!ws.heap.empty() && static_cast<int64_t>(ws.nodes.size()) < p.budget) {
    std::pop_heap(ws.heap.begin(), ws.heap.end(), heap_less);
    const Frontier f = ws.heap.back();
    ws.heap.pop_back();
    const int32_t row = f.depth - 1;
    const int32_t token = ws.rows.ids[row * k + f.rank];
    const int32_t index = static_cast<int32_t>(ws.nodes.size());
    ws.nodes.push_back(RawNode{token, f.parent, f.depth, f.score});
    ws.paths.resize(ws.paths.size() + positions, 0);
    int32_t* path = &ws.paths[index * positions];
    if (f.parent >= 0) std::copy_n(&ws.paths[f.parent * positions], row, path);
    path[row] = f.rank;

    const double parent_score = f.parent < 0 ? 0.0 : ws.nodes[f.parent].score;
    if (f.rank + 1 < k) {  // next sibling
      ws.heap.push_back(
          Frontier{parent_score + ws.lp[row * k + f.rank + 1], f.depth, f.parent, f.rank + 1});
      std::push_heap(ws.heap.begin(), ws.heap.end(), heap_less);
    }
    if (f.depth < positions && !eos.contains(token)) {  // first child
      ws.heap.push_back(Frontier{f.score + ws.lp[f.depth * k], f.depth + 1, index, 0});
      std::push_heap(ws.heap.begin(), ws.heap.end(), heap_less);
    }
  }
  append_canonical(ws.nodes, out, ws.canonical);
}

void chain_one(const DraftScores& in, int64_t b, const BestFirstParams& p, const EosSet& eos,
               BestFirstWorkspace& ws, TreeBatch& out) {
  // Dense rows need only the best candidate (plus the full log-sum-exp for its score);
  // pre-selected logits are normalised over every given candidate.
  const int64_t k = in.ids == nullptr ? 1 : in.width;
  const bool need_log_norm = !(p.values_are_logprobs && in.ids != nullptr);
  select_candidates(in, b, k, need_log_norm, ws.rows);
  compute_log_probs(in, b, ws.rows, p.values_are_logprobs, ws.lp);
  ws.nodes.clear();
  double score = 0.0;
  const int64_t depth = std::min(ws.rows.positions, p.budget);
  for (int64_t d = 0; d < depth; ++d) {
    const int32_t token = ws.rows.ids[d * ws.rows.k];
    score += ws.lp[d * ws.rows.k];
    ws.nodes.push_back(RawNode{token, static_cast<int32_t>(d) - 1, static_cast<int32_t>(d + 1), score});
    if (eos.contains(token)) break;
  }
  append_canonical(ws.nodes, out, ws.canonical);
}

void check_budget(const BestFirstParams& params) {
  if (params.budget < 0) throw std::invalid_argument("budget must be >= 0");
  if (params.top_k < 0) throw std::invalid_argument("top_k must be >= 1 (or 0 = automatic)");
}

}  // namespace

void build_ddtree(const DraftScores& in, const BestFirstParams& params, const EosSet& eos,
                  TreeBatch& out) {
  check_budget(params);
  int64_t k = params.top_k;
  if (k == 0) k = in.ids == nullptr ? std::max<int64_t>(1, std::min(params.budget, in.width)) : in.width;
  thread_local BestFirstWorkspace ws;  // reused across calls: no allocation once warm
  for (int64_t b = 0; b < in.batch; ++b) ddtree_one(in, b, k, params, eos, ws, out);
}

void build_chain(const DraftScores& in, const BestFirstParams& params, const EosSet& eos,
                 TreeBatch& out) {
  check_budget(params);
  thread_local BestFirstWorkspace ws;
  for (int64_t b = 0; b < in.batch; ++b) chain_one(in, b, params, eos, ws, out);
}

}  // namespace trees
