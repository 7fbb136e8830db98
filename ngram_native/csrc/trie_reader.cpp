// NgramTrie: open (validate header and bounds), verify, and the DART estimate queries.
#include <sys/mman.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <sstream>

#include "trie.h"
#include "trie_io.h"

namespace ngram {
namespace {

// `path` names the file in the message; an empty one leaves the naming to the caller.
[[noreturn]] void format_error(const std::string& path, const std::string& what) {
  throw TrieFormatError(path.empty() ? what : "trie file '" + path + "': " + what);
}

std::string hex64(uint64_t v) {
  char buf[19];
  std::snprintf(buf, sizeof(buf), "0x%016llx", static_cast<unsigned long long>(v));
  return buf;
}

// Shows bytes as a C-escaped string, so a wrong magic is readable in the error.
std::string escape_bytes(const unsigned char* p, size_t n) {
  std::string out;
  for (size_t i = 0; i < n; ++i) {
    if (p[i] >= 0x20 && p[i] < 0x7f && p[i] != '\\' && p[i] != '\'') {
      out += static_cast<char>(p[i]);
    } else {
      char buf[5];
      std::snprintf(buf, sizeof(buf), "\\x%02x", p[i]);
      out += buf;
    }
  }
  return out;
}

uint32_t read_u32(const unsigned char* p) {
  uint32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

inline uint64_t load_uint(const unsigned char* base, uint64_t i, bool is_u64) {
  if (is_u64) {
    uint64_t v;
    std::memcpy(&v, base + 8 * i, 8);
    return v;
  }
  uint32_t v;
  std::memcpy(&v, base + 4 * i, 4);
  return v;
}

bool all_zero(const void* p, size_t n) {
  const unsigned char* b = static_cast<const unsigned char*>(p);
  return std::all_of(b, b + n, [](unsigned char c) { return c == 0; });
}

}  // namespace

std::string stored_fingerprint(const FileHeader& h) {
  size_t len = 0;
  while (len < kFingerprintSize && h.tokenizer_fingerprint[len] != '\0') ++len;
  return std::string(h.tokenizer_fingerprint, len);
}

FileHeader read_header(const unsigned char* data, size_t data_len, uint64_t size, const std::string& path) {
  const size_t avail = static_cast<size_t>(std::min<uint64_t>({data_len, size, kHeaderSize}));
  if (avail < std::min<uint64_t>(size, kHeaderSize)) {
    throw std::invalid_argument("read_header needs the first " + std::to_string(std::min<uint64_t>(size, kHeaderSize)) +
                                " bytes of the file, got " + std::to_string(data_len));
  }
  if (size == 0) format_error(path, "file is empty (0 bytes), not a trie");
  if (avail < sizeof(kTrieMagic) || std::memcmp(data, kTrieMagic, sizeof(kTrieMagic)) != 0) {
    size_t n = std::min(avail, sizeof(kTrieMagic));
    format_error(path, "not a DART trie file: magic is '" + escape_bytes(data, n) +
                           "', expected '" + std::string(kTrieMagic, sizeof(kTrieMagic)) + "'");
  }
  if (avail >= 12) {
    uint32_t version = read_u32(data + offsetof(FileHeader, format_version));
    if (version != kTrieFormatVersion) {
      format_error(path, "unsupported format version " + std::to_string(version) +
                             " (this build reads version " + std::to_string(kTrieFormatVersion) +
                             "); rebuild or re-import the trie");
    }
  }
  if (avail >= 16) {
    uint32_t bom = read_u32(data + offsetof(FileHeader, byte_order_mark));
    if (bom != kByteOrderMark) {
      format_error(path, "byte-order mark is " + hex64(bom) + ", expected " + hex64(kByteOrderMark) +
                             (bom == 0x04030201u ? " (file written big-endian)" : " (corrupt header)"));
    }
  }
  if (size < kHeaderSize) {
    format_error(path, "truncated: " + std::to_string(size) + " bytes, shorter than the " +
                           std::to_string(kHeaderSize) + "-byte header");
  }
  FileHeader h;
  std::memcpy(&h, data, sizeof(h));
  FileHeader zeroed = h;
  zeroed.header_checksum = 0;
  uint64_t computed = xxh64(&zeroed, sizeof(zeroed));
  if (computed != h.header_checksum) {
    format_error(path, "header checksum mismatch: stored " + hex64(h.header_checksum) + ", computed " +
                           hex64(computed) + " (header altered or corrupted)");
  }
  if (h.file_size != size) {
    format_error(path, size < h.file_size
                           ? "truncated: header says " + std::to_string(h.file_size) +
                                 " bytes, file has " + std::to_string(size)
                           : "file has " + std::to_string(size) + " bytes but its header says " +
                                 std::to_string(h.file_size) + " (trailing data appended?)");
  }
  if (h.header_size != kHeaderSize) {
    format_error(path, "header_size is " + std::to_string(h.header_size) + ", expected " +
                           std::to_string(kHeaderSize));
  }
  if (h.order < 1 || h.order > static_cast<uint32_t>(kMaxOrder)) {
    format_error(path, "order " + std::to_string(h.order) + " outside 1.." + std::to_string(kMaxOrder));
  }
  if (h.vocab_size == 0) format_error(path, "vocab_size is 0");
  if (h.reserved0 != 0 || !all_zero(h.reserved1, sizeof(h.reserved1))) {
    format_error(path, "reserved header fields are not zero");
  }
  std::string fp = stored_fingerprint(h);
  for (char c : fp) {
    if (c < 0x20 || c > 0x7e) format_error(path, "tokenizer fingerprint is not printable ASCII");
  }
  if (!all_zero(h.tokenizer_fingerprint + fp.size(), kFingerprintSize - fp.size())) {
    format_error(path, "tokenizer fingerprint has bytes after its NUL terminator");
  }

  // Recompute the canonical layout from node counts and widths; every offset must match it
  // and the last section must end exactly at file_size, so every section is in bounds.
  const uint64_t order = h.order;
  uint64_t cursor = kHeaderSize;
  auto section = [&](uint64_t offset, uint64_t count, uint64_t width, const std::string& name, uint64_t k) {
    std::string where = name + " of level " + std::to_string(k);
    if (offset != cursor) {
      format_error(path, where + " is at offset " + std::to_string(offset) + ", expected " +
                             std::to_string(cursor));
    }
    if (count > (size - cursor) / width) {  // overflow-safe bound check
      format_error(path, where + " (" + std::to_string(count) + " x " + std::to_string(width) +
                             " bytes at offset " + std::to_string(offset) + ") runs past the end of the " +
                             std::to_string(size) + "-byte file");
    }
    cursor += (count * width + 7) & ~uint64_t{7};
  };
  for (uint64_t k = 0; k <= static_cast<uint64_t>(kMaxOrder); ++k) {
    const LevelEntry& e = h.levels[k];
    if (k > order) {
      if (!all_zero(&e, sizeof(e))) format_error(path, "level " + std::to_string(k) + " beyond order is set");
      continue;
    }
    if (!all_zero(e.reserved, sizeof(e.reserved))) format_error(path, "reserved level fields are not zero");
    if (k == 0 && e.node_count != 1) {
      format_error(path, "level 0 (root) has " + std::to_string(e.node_count) + " nodes, expected 1");
    }
    if (e.count_width != 4 && e.count_width != 8) {
      format_error(path, "count width of level " + std::to_string(k) + " is " +
                             std::to_string(e.count_width) + ", expected 4 or 8");
    }
    bool has_children = k < order;
    if (has_children ? (e.child_offset_width != 4 && e.child_offset_width != 8) : e.child_offset_width != 0) {
      format_error(path, "child offset width of level " + std::to_string(k) + " is " +
                             std::to_string(e.child_offset_width));
    }
    if (k == 0) {
      if (e.tokens_offset != 0) format_error(path, "level 0 has a tokens section");
    } else {
      section(e.tokens_offset, e.node_count, 4, "tokens", k);
    }
    section(e.counts_offset, e.node_count, e.count_width, "counts", k);
    if (has_children) {
      if (e.node_count == UINT64_MAX) format_error(path, "level " + std::to_string(k) + " is too large");
      section(e.child_offsets_offset, e.node_count + 1, e.child_offset_width, "child offsets", k);
    } else if (e.child_offsets_offset != 0) {
      format_error(path, "last level has a child offsets section");
    }
  }
  const uint64_t level1_size = h.levels[1].node_count;
  const int expected_bits = root_index_bits(h.vocab_size, level1_size);
  if (h.root_index_bits != expected_bits) {
    format_error(path, "root index has " + std::to_string(h.root_index_bits) + " bits, expected " +
                           std::to_string(expected_bits));
  }
  section(h.root_index_offset, (uint64_t{1} << expected_bits) + 1, 4, "root index", 0);
  if (cursor != h.file_size) {
    format_error(path, "sections end at byte " + std::to_string(cursor) + " but the file has " +
                           std::to_string(h.file_size) + " bytes");
  }
  return h;
}

void check_fingerprint(const std::string& fp) {
  if (fp.size() > kFingerprintSize) {
    throw std::invalid_argument("tokenizer fingerprint has " + std::to_string(fp.size()) +
                                " characters; at most " + std::to_string(kFingerprintSize) + " fit");
  }
  for (char c : fp) {
    if (c < 0x20 || c > 0x7e) {
      throw std::invalid_argument("tokenizer fingerprint must be printable ASCII (e.g. a hex digest)");
    }
  }
}

NgramTrie::NgramTrie(const std::string& path, bool verify_payload, const std::string& expected_fingerprint)
    : path_(path) {
  MappedFile file(path);
  header_ = read_header(file.data(), file.size(), file.size(), path);
  std::string found = stored_fingerprint(header_);
  if (!expected_fingerprint.empty() && expected_fingerprint != found) {
    throw TokenizerMismatchError("trie file '" + path + "' was built for tokenizer fingerprint '" + found +
                                 "', expected '" + expected_fingerprint + "'");
  }
  base_ = file.data();
  mapped_size_ = file.size();
  for (uint32_t k = 0; k <= header_.order; ++k) {
    const LevelEntry& e = header_.levels[k];
    Level& l = levels_[k];
    l.size = e.node_count;
    l.tokens = k == 0 ? nullptr : reinterpret_cast<const uint32_t*>(base_ + e.tokens_offset);
    l.counts = base_ + e.counts_offset;
    l.counts_u64 = e.count_width == 8;
    l.child_offsets = k < header_.order ? base_ + e.child_offsets_offset : nullptr;
    l.offsets_u64 = e.child_offset_width == 8;
  }
  root_index_ = reinterpret_cast<const uint32_t*>(base_ + header_.root_index_offset);
  root_index_shift_ = root_index_shift(header_.vocab_size, levels_[1].size);
  const uint64_t buckets = uint64_t{1} << header_.root_index_bits;
  if (root_index_[0] != 0 || root_index_[buckets] != levels_[1].size) {
    format_error(path, "root index spans " + std::to_string(root_index_[0]) + ".." +
                           std::to_string(root_index_[buckets]) + ", expected 0.." + std::to_string(levels_[1].size));
  }
  // O(1) structural check: each level's child offsets span exactly the next level.
  for (uint32_t k = 0; k < header_.order; ++k) {
    const Level& l = levels_[k];
    uint64_t first = load_uint(l.child_offsets, 0, l.offsets_u64);
    uint64_t last = load_uint(l.child_offsets, l.size, l.offsets_u64);
    if (first != 0 || last != levels_[k + 1].size) {
      format_error(path, "child offsets of level " + std::to_string(k) + " span " + std::to_string(first) +
                             ".." + std::to_string(last) + ", expected 0.." + std::to_string(levels_[k + 1].size));
    }
  }
  if (verify_payload) verify();  // on failure `file` unmaps: base_ is not owned yet
  file.release();
}

NgramTrie::~NgramTrie() { close(); }

void NgramTrie::close() {
  std::unique_lock<std::shared_mutex> lock(mutex_);
  if (base_ != nullptr) ::munmap(const_cast<unsigned char*>(base_), mapped_size_);
  base_ = nullptr;
  root_index_ = nullptr;
  for (Level& l : levels_) l = Level{};
}

bool NgramTrie::closed() const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  return base_ == nullptr;
}

void NgramTrie::check_open() const {
  if (base_ == nullptr) throw TrieClosedError("trie '" + path_ + "' is closed");
}

std::string NgramTrie::tokenizer_fingerprint() const { return stored_fingerprint(header_); }

std::vector<uint64_t> stored_level_sizes(const FileHeader& h) {
  std::vector<uint64_t> sizes;
  for (uint32_t k = 0; k <= h.order; ++k) sizes.push_back(h.levels[k].node_count);
  return sizes;
}

std::vector<uint64_t> NgramTrie::level_sizes() const { return stored_level_sizes(header_); }

inline uint64_t NgramTrie::count_at(int level, uint64_t i) const {
  const Level& l = levels_[level];
  return load_uint(l.counts, i, l.counts_u64);
}

inline void NgramTrie::child_range(int level, uint64_t i, uint64_t* lo, uint64_t* hi) const {
  const Level& l = levels_[level];
  const uint64_t limit = levels_[level + 1].size;
  // Clamped so that even an altered payload (quick open) cannot send a search out of bounds.
  *hi = std::min(load_uint(l.child_offsets, i + 1, l.offsets_u64), limit);
  *lo = std::min(load_uint(l.child_offsets, i, l.offsets_u64), *hi);
}

namespace {

// Position of the first element >= t in the sorted run [base, base + n), n >= 1, except
// that it returns the last element when all are < t. Branch-free: a binary search over
// cached data is bound by mispredicted branches, this one by load latency only.
inline const uint32_t* search_sorted(const uint32_t* base, uint64_t n, uint32_t t) {
  while (n > 1) {
    const uint64_t half = n / 2;
    base += static_cast<uint64_t>(base[half - 1] < t) * half;
    n -= half;
  }
  return base;
}

}  // namespace

inline bool NgramTrie::find_child(int child_level, uint64_t lo, uint64_t hi, int64_t token,
                                  uint64_t* out) const {
  if (lo >= hi || token < 0 || token >= static_cast<int64_t>(header_.vocab_size)) return false;
  const uint32_t* tokens = levels_[child_level].tokens;
  const uint32_t* it = search_sorted(tokens + lo, hi - lo, static_cast<uint32_t>(token));
  if (*it != static_cast<uint32_t>(token)) return false;
  *out = static_cast<uint64_t>(it - tokens);
  return true;
}

size_t NgramTrie::score_children(int child_level, uint64_t lo, uint64_t hi, uint64_t ctx_count,
                                 const int32_t* candidates, size_t n_candidates, float* out_probs) const {
  const uint32_t* tokens = levels_[child_level].tokens;
  const int64_t vocab = header_.vocab_size;
  size_t scored = 0;
  constexpr size_t kBatch = 32;  // on the stack: no allocation
  for (size_t start = 0; start < n_candidates; start += kBatch) {
    uint32_t index[kBatch];
    uint32_t want[kBatch];
    const uint32_t* pos[kBatch];
    size_t m = 0;
    const size_t end = std::min(n_candidates, start + kBatch);
    for (size_t i = start; i < end; ++i) {
      if (out_probs[i] >= 0.0f || candidates[i] < 0 || candidates[i] >= vocab) continue;
      index[m] = static_cast<uint32_t>(i);
      want[m] = static_cast<uint32_t>(candidates[i]);
      pos[m] = tokens + lo;
      ++m;
    }
    // The searches share one range, hence the same halving steps: running them in lockstep
    // lets their loads overlap instead of waiting for each other (search_sorted, unrolled).
    for (uint64_t n = hi - lo; n > 1;) {
      const uint64_t half = n / 2;
      for (size_t j = 0; j < m; ++j) pos[j] += static_cast<uint64_t>(pos[j][half - 1] < want[j]) * half;
      n -= half;
    }
    for (size_t j = 0; j < m; ++j) {
      if (*pos[j] != want[j]) continue;
      const uint64_t child = static_cast<uint64_t>(pos[j] - tokens);
      // Divided in double, then rounded once: exactly float32(count / ctx_count).
      out_probs[index[j]] = static_cast<float>(static_cast<double>(count_at(child_level, child)) /
                                               static_cast<double>(ctx_count));
      ++scored;
    }
  }
  return scored;
}

inline void NgramTrie::root_bucket(uint32_t t, uint64_t* lo, uint64_t* hi) const {
  const uint32_t b = t >> root_index_shift_;
  // Clamped like child_range: a damaged index cannot send a search out of bounds.
  *hi = std::min<uint64_t>(root_index_[b + 1], levels_[1].size);
  *lo = std::min<uint64_t>(root_index_[b], *hi);
}

template <typename Id>
inline bool NgramTrie::find_node(const Id* ngram, size_t len, uint64_t* node) const {
  uint64_t cur = 0;
  for (size_t j = 0; j < len; ++j) {
    const int64_t t = ngram[j];
    if (t < 0 || t >= static_cast<int64_t>(header_.vocab_size)) return false;
    uint64_t lo, hi;
    if (j == 0) {
      root_bucket(static_cast<uint32_t>(t), &lo, &hi);
    } else {
      child_range(static_cast<int>(j), cur, &lo, &hi);
    }
    if (!find_child(static_cast<int>(j) + 1, lo, hi, t, &cur)) return false;
  }
  *node = cur;
  return true;
}

void NgramTrie::score(const int32_t* ctx, size_t ctx_len, const int32_t* candidates, size_t n_candidates,
                      float* out_probs) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  check_open();
  // A negative value marks "not scored yet": no allocation on this hot path.
  for (size_t i = 0; i < n_candidates; ++i) out_probs[i] = -1.0f;
  size_t unscored = n_candidates;
  const size_t longest = std::min(ctx_len, static_cast<size_t>(header_.order) - 1);
  for (size_t len = longest; len >= 1 && unscored > 0; --len) {
    uint64_t node;
    if (!find_node(ctx + ctx_len - len, len, &node)) continue;
    const uint64_t ctx_count = count_at(static_cast<int>(len), node);
    uint64_t lo, hi;
    child_range(static_cast<int>(len), node, &lo, &hi);
    if (ctx_count == 0 || lo == hi) continue;
    unscored -= score_children(static_cast<int>(len) + 1, lo, hi, ctx_count, candidates, n_candidates, out_probs);
  }
  for (size_t i = 0; i < n_candidates; ++i) {
    if (out_probs[i] < 0.0f) out_probs[i] = 0.0f;
  }
}

uint64_t NgramTrie::count(const int64_t* ngram, size_t len) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  check_open();
  if (len > header_.order) return 0;
  uint64_t node;
  if (!find_node(ngram, len, &node)) return 0;
  return count_at(static_cast<int>(len), node);
}

void NgramTrie::verify() const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  check_open();
  uint64_t computed = xxh64(base_ + kHeaderSize, mapped_size_ - kHeaderSize);
  if (computed != header_.payload_checksum) {
    format_error(path_, "payload checksum mismatch: header says " + hex64(header_.payload_checksum) +
                            ", data hashes to " + hex64(computed) + " (file altered or corrupted)");
  }
  verify_structure();
}

void NgramTrie::verify_structure() const {
  const int order = static_cast<int>(header_.order);

  for (int k = 0; k < order; ++k) {
    const Level& l = levels_[k];
    const Level& next = levels_[k + 1];
    uint64_t prev_hi = 0;
    for (uint64_t i = 0; i < l.size; ++i) {
      uint64_t lo = load_uint(l.child_offsets, i, l.offsets_u64);
      uint64_t hi = load_uint(l.child_offsets, i + 1, l.offsets_u64);
      auto where = [&] { return "node " + std::to_string(i) + " of level " + std::to_string(k); };
      if (lo != prev_hi || hi < lo || hi > next.size) {
        format_error(path_, where() + " has child range " + std::to_string(lo) + ".." + std::to_string(hi) +
                                " (not contiguous within 0.." + std::to_string(next.size) + ")");
      }
      prev_hi = hi;
      const uint64_t parent_count = count_at(k, i);
      if (k > 0 && parent_count == 0) format_error(path_, where() + " has count 0");
      unsigned __int128 child_sum = 0;
      for (uint64_t c = lo; c < hi; ++c) {
        uint32_t t = next.tokens[c];
        if (t >= header_.vocab_size) {
          format_error(path_, "token " + std::to_string(t) + " of node " + std::to_string(c) + " of level " +
                                  std::to_string(k + 1) + " is >= vocab_size " +
                                  std::to_string(header_.vocab_size));
        }
        if (c > lo && next.tokens[c - 1] >= t) {
          format_error(path_, "children of " + where() + " are not strictly sorted by token");
        }
        child_sum += count_at(k + 1, c);
      }
      if (child_sum > parent_count) {
        format_error(path_, where() + " has count " + std::to_string(parent_count) +
                                ", less than the sum of its children's counts");
      }
    }
  }
  // Leaves (last level) were range-checked above as children; they also need count >= 1.
  for (uint64_t i = 0; i < levels_[order].size; ++i) {
    if (count_at(order, i) == 0) {
      format_error(path_, "node " + std::to_string(i) + " of level " + std::to_string(order) + " has count 0");
    }
  }
  // The root index must send every level-1 token to the bucket holding it (tokens are known
  // to be < vocab_size and sorted by now).
  const uint64_t buckets = uint64_t{1} << header_.root_index_bits;
  for (uint64_t b = 0; b < buckets; ++b) {
    if (root_index_[b] > root_index_[b + 1]) {
      format_error(path_, "root index decreases at bucket " + std::to_string(b));
    }
  }
  for (uint64_t i = 0; i < levels_[1].size; ++i) {
    const uint32_t b = levels_[1].tokens[i] >> root_index_shift_;
    if (i < root_index_[b] || i >= root_index_[b + 1]) {
      format_error(path_, "root index does not cover node " + std::to_string(i) + " of level 1 (token " +
                              std::to_string(levels_[1].tokens[i]) + ")");
    }
  }
}

NgramTrie::LevelCopy NgramTrie::copy_level(int level) const {
  std::shared_lock<std::shared_mutex> lock(mutex_);
  check_open();
  if (level < 0 || level > static_cast<int>(header_.order)) {
    throw std::out_of_range("level " + std::to_string(level) + " outside 0.." + std::to_string(header_.order));
  }
  const Level& l = levels_[level];
  LevelCopy out;
  if (level > 0) out.tokens.assign(l.tokens, l.tokens + l.size);
  out.counts.resize(l.size);
  for (uint64_t i = 0; i < l.size; ++i) out.counts[i] = count_at(level, i);
  if (level < static_cast<int>(header_.order)) {
    out.child_offsets.resize(l.size + 1);
    for (uint64_t i = 0; i <= l.size; ++i) out.child_offsets[i] = load_uint(l.child_offsets, i, l.offsets_u64);
  }
  return out;
}

}  // namespace ngram
