// TrieBuilder: counts every k-gram (k <= n) of a corpus with bounded memory.
//
// How: each token position i of a document contributes one record, the "suffix gram"
// doc[i : min(i + n, len)] (shorter at the document's end). A k-gram's count is then the
// number of records that start with it, i.e. the sum of record counts in its subtree. So it
// is enough to sort and count records: the sorted stream of (record, multiplicity) is the
// trie in depth-first order, and one pass with a stack of open nodes emits every level.
//
// Records are packed into fixed-width keys (token id + 1 in ceil(log2(vocab + 1)) bits,
// first token in the high bits, 0 = past the document's end), so the lexicographic order of
// keys is the trie's order with a prefix before its extensions. A chunk of `chunk_tokens`
// keys is sorted in RAM; when more follow, it is run-length counted into a sorted run on
// disk, and the runs are k-way merged at the end (in passes of at most kMaxFanIn runs).
// Nothing depends on where the chunk boundaries fall, so the output bytes do not either.
#include <algorithm>
#include <array>
#include <cerrno>
#include <queue>

#include "trie.h"
#include "trie_io.h"

namespace ngram {
namespace {

constexpr size_t kMaxFanIn = 64;

int bit_width(uint64_t v) {
  int bits = 0;
  while (v > 0) {
    ++bits;
    v >>= 1;
  }
  return bits;
}

// Turns the sorted stream of suffix grams into trie levels, depth first.
class TrieAssembler {
 public:
  TrieAssembler(int order, uint64_t min_count, TrieFileWriter& writer)
      : order_(order), min_count_(min_count), writer_(writer) {}

  // `tokens[0..len)` must arrive in strictly increasing key order.
  void add(const uint32_t* tokens, int len, uint64_t count) {
    int common = 0;
    while (common < depth_ && common < len && open_[common + 1].token == tokens[common]) ++common;
    while (depth_ > common) close_deepest();
    for (int level = depth_ + 1; level <= len; ++level) {
      open_[level] = OpenNode{tokens[level - 1], 0, level < order_ ? writer_.level_size(level + 1) : 0};
    }
    depth_ = len;
    open_[len].count += count;
  }

  // Closes every open node; returns the root count (total tokens).
  uint64_t finish() {
    while (depth_ > 0) close_deepest();
    return open_[0].count;
  }

 private:
  struct OpenNode {
    uint32_t token;
    uint64_t count;        // terminal records in the subtree seen so far
    uint64_t child_start;  // size of the next level when this node was opened
  };

  // A closed node's count is final. Counts never grow with depth, so when a node falls
  // below min_count its whole subtree already did and was dropped: the result stays
  // prefix-closed without a second pass.
  void close_deepest() {
    OpenNode& node = open_[depth_];
    open_[depth_ - 1].count += node.count;
    if (node.count >= min_count_) writer_.add_node(depth_, node.token, node.count, node.child_start);
    --depth_;
  }

  int order_;
  uint64_t min_count_;
  TrieFileWriter& writer_;
  std::array<OpenNode, kMaxOrder + 1> open_{};  // open_[0] is the root
  int depth_ = 0;
};

}  // namespace

// Type-erased so TrieBuilder need not be a template; PackedKeyCounter<W> does the work.
class KeyCounter {
 public:
  virtual ~KeyCounter() = default;
  virtual void add(const int64_t* ids, size_t len) = 0;
  // Feeds every distinct suffix gram with its count, in key order, to `assembler`.
  virtual void drain(TrieAssembler& assembler) = 0;
  virtual uint64_t num_runs() const = 0;
};

namespace {

template <int W>
class PackedKeyCounter final : public KeyCounter {
 public:
  using Key = std::array<uint64_t, W>;

  PackedKeyCounter(int order, int bits, uint64_t chunk_tokens, std::string tmp_dir)
      : order_(order), bits_(bits), per_word_(64 / bits), chunk_tokens_(chunk_tokens),
        tmp_dir_(std::move(tmp_dir)) {}

  void add(const int64_t* ids, size_t len) override {
    for (size_t i = 0; i < len; ++i) {
      Key key{};
      const size_t m = std::min(static_cast<size_t>(order_), len - i);
      for (size_t j = 0; j < m; ++j) {
        const size_t word = j / per_word_;
        const int shift = 64 - bits_ * static_cast<int>(j % per_word_ + 1);
        key[word] |= static_cast<uint64_t>(ids[i + j] + 1) << shift;
      }
      if (keys_.size() == keys_.capacity()) {  // grow by doubling, never past the budget
        keys_.reserve(static_cast<size_t>(std::min<uint64_t>(chunk_tokens_, std::max<size_t>(1024, 2 * keys_.size()))));
      }
      keys_.push_back(key);
      if (keys_.size() >= chunk_tokens_) spill_chunk();
    }
  }

  void drain(TrieAssembler& assembler) override {
    if (runs_.empty()) {  // everything fit in one chunk: count straight from RAM
      if (!keys_.empty()) ++num_runs_;
      std::sort(keys_.begin(), keys_.end());
      for (size_t i = 0; i < keys_.size();) {
        size_t j = i + 1;
        while (j < keys_.size() && keys_[j] == keys_[i]) ++j;
        emit(assembler, keys_[i], j - i);
        i = j;
      }
      std::vector<Key>().swap(keys_);
      return;
    }
    if (!keys_.empty()) spill_chunk();
    std::vector<Key>().swap(keys_);
    while (runs_.size() > kMaxFanIn) {  // bound open files and merge buffers
      std::vector<std::unique_ptr<TempFile>> group;
      for (size_t i = 0; i < kMaxFanIn; ++i) group.push_back(std::move(runs_[i]));
      runs_.erase(runs_.begin(), runs_.begin() + kMaxFanIn);
      auto merged = std::make_unique<TempFile>(tmp_dir_);
      merge(group, [&](const Key& key, uint64_t count) { put_record(*merged, key, count); });
      runs_.push_back(std::move(merged));
    }
    merge(runs_, [&](const Key& key, uint64_t count) { emit(assembler, key, count); });
    runs_.clear();
  }

  uint64_t num_runs() const override { return num_runs_; }

 private:
  static void put_record(TempFile& f, const Key& key, uint64_t count) {
    f.write(key.data(), sizeof(Key));
    f.put(count);
  }

  void spill_chunk() {
    std::sort(keys_.begin(), keys_.end());
    auto run = std::make_unique<TempFile>(tmp_dir_);
    for (size_t i = 0; i < keys_.size();) {
      size_t j = i + 1;
      while (j < keys_.size() && keys_[j] == keys_[i]) ++j;
      put_record(*run, keys_[i], j - i);
      i = j;
    }
    keys_.clear();
    runs_.push_back(std::move(run));
    ++num_runs_;
  }

  void emit(TrieAssembler& assembler, const Key& key, uint64_t count) const {
    uint32_t tokens[kMaxOrder];
    int len = 0;
    const uint64_t mask = (uint64_t{1} << bits_) - 1;
    for (; len < order_; ++len) {
      const int shift = 64 - bits_ * static_cast<int>(len % per_word_ + 1);
      const uint64_t v = (key[len / per_word_] >> shift) & mask;
      if (v == 0) break;
      tokens[len] = static_cast<uint32_t>(v - 1);
    }
    assembler.add(tokens, len, count);
  }

  // K-way merge of sorted runs of distinct keys; equal keys of different runs are summed.
  template <typename Emit>
  static void merge(std::vector<std::unique_ptr<TempFile>>& runs, Emit&& out) {
    struct Head {
      Key key;
      uint64_t count;
    };
    std::vector<Head> heads(runs.size());
    auto advance = [&](size_t r) {
      Head& h = heads[r];
      size_t got = runs[r]->read(h.key.data(), sizeof(Key));
      if (got == 0) return false;
      if (got != sizeof(Key)) throw TrieIOError(EIO, "(temporary run file)", "sorted run ended mid-record in");
      runs[r]->read_exact(&h.count, 8);
      return true;
    };
    auto greater = [&](size_t a, size_t b) { return heads[b].key < heads[a].key; };
    std::priority_queue<size_t, std::vector<size_t>, decltype(greater)> queue(greater);
    for (size_t r = 0; r < runs.size(); ++r) {
      runs[r]->rewind();
      if (advance(r)) queue.push(r);
    }
    while (!queue.empty()) {
      size_t r = queue.top();
      queue.pop();
      Key key = heads[r].key;
      uint64_t count = heads[r].count;
      if (advance(r)) queue.push(r);
      while (!queue.empty() && heads[queue.top()].key == key) {
        size_t s = queue.top();
        queue.pop();
        count += heads[s].count;
        if (advance(s)) queue.push(s);
      }
      out(key, count);
    }
  }

  int order_;
  int bits_;
  size_t per_word_;
  uint64_t chunk_tokens_;
  std::string tmp_dir_;
  std::vector<Key> keys_;
  std::vector<std::unique_ptr<TempFile>> runs_;
  uint64_t num_runs_ = 0;
};

std::unique_ptr<KeyCounter> make_counter(const BuildOptions& o) {
  const int bits = bit_width(o.vocab_size);  // encoded ids are 1..vocab_size
  const int per_word = 64 / bits;
  const int words = (o.order + per_word - 1) / per_word;
  switch (words) {
    case 1: return std::make_unique<PackedKeyCounter<1>>(o.order, bits, o.chunk_tokens, o.tmp_dir);
    case 2: return std::make_unique<PackedKeyCounter<2>>(o.order, bits, o.chunk_tokens, o.tmp_dir);
    case 3: return std::make_unique<PackedKeyCounter<3>>(o.order, bits, o.chunk_tokens, o.tmp_dir);
    case 4: return std::make_unique<PackedKeyCounter<4>>(o.order, bits, o.chunk_tokens, o.tmp_dir);
    default: throw std::logic_error("key width out of range");  // vocab <= 2^31, order <= 8
  }
}

}  // namespace

TrieBuilder::TrieBuilder(BuildOptions options) : options_(std::move(options)) {
  if (options_.order < 1 || options_.order > kMaxOrder) {
    throw std::invalid_argument("order must be in 1.." + std::to_string(kMaxOrder) + ", got " +
                                std::to_string(options_.order));
  }
  if (options_.vocab_size < 1 || options_.vocab_size > (uint32_t{1} << 31)) {
    throw std::invalid_argument("vocab_size must be in 1..2^31, got " + std::to_string(options_.vocab_size));
  }
  if (options_.chunk_tokens < 1) throw std::invalid_argument("chunk_tokens must be >= 1");
  if (options_.min_count < 1) throw std::invalid_argument("min_count must be >= 1");
  check_fingerprint(options_.tokenizer_fingerprint);
  counter_ = make_counter(options_);
}

TrieBuilder::~TrieBuilder() = default;

void TrieBuilder::add_document(const int64_t* ids, size_t len) {
  if (finished_) throw std::logic_error("TrieBuilder.finish() was already called");
  const int64_t vocab = options_.vocab_size;
  for (size_t i = 0; i < len; ++i) {
    if (ids[i] < 0 || ids[i] >= vocab) {
      throw std::invalid_argument("token id " + std::to_string(ids[i]) + " at position " + std::to_string(i) +
                                  " of document " + std::to_string(num_documents_) +
                                  " is outside the vocabulary [0, " + std::to_string(vocab) + ")");
    }
  }
  counter_->add(ids, len);
  ++num_documents_;
  num_tokens_ += len;
}

BuildStats TrieBuilder::finish(const std::string& path) {
  if (finished_) throw std::logic_error("TrieBuilder.finish() was already called");
  finished_ = true;
  TrieFileWriter writer(options_.order, options_.tmp_dir);
  TrieAssembler assembler(options_.order, options_.min_count, writer);
  counter_->drain(assembler);
  const uint64_t root_count = assembler.finish();
  BuildStats stats;
  stats.num_documents = num_documents_;
  stats.num_tokens = num_tokens_;
  stats.num_runs = counter_->num_runs();
  counter_.reset();
  stats.file_size = writer.write(path, root_count, options_.vocab_size, options_.tokenizer_fingerprint,
                                 options_.min_count, num_documents_);
  stats.level_sizes.push_back(1);
  for (int k = 1; k <= options_.order; ++k) stats.level_sizes.push_back(writer.level_size(k));
  return stats;
}

}  // namespace ngram
