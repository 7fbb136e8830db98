// File plumbing shared by the trie builder, the upstream importer and the reader:
// read-only mappings, anonymous buffered temporary files, and the writer that turns
// per-level node streams into one trie file. Internal to ngram_native.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "trie.h"

namespace ngram {

// A whole file mapped read-only (MAP_SHARED). Empty files are not mapped (data() == nullptr).
class MappedFile {
 public:
  explicit MappedFile(const std::string& path);
  ~MappedFile();
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const unsigned char* data() const { return data_; }
  size_t size() const { return size_; }
  // Hands the mapping over to the caller, who must munmap(data, size).
  const unsigned char* release();

 private:
  const unsigned char* data_ = nullptr;
  size_t size_ = 0;
};

// An unnamed temporary file (created in `dir`, unlinked at once, so nothing is left behind
// even if the process dies) with its own write and read buffers. Write everything, call
// rewind(), then read it back sequentially.
class TempFile {
 public:
  explicit TempFile(const std::string& dir);
  ~TempFile();
  TempFile(const TempFile&) = delete;
  TempFile& operator=(const TempFile&) = delete;

  void write(const void* data, size_t len);
  template <typename T>
  void put(const T& value) { write(&value, sizeof(T)); }
  // Flushes pending writes and moves to the start for reading.
  void rewind();
  // Reads up to len bytes; returns how many (0 at the end).
  size_t read(void* data, size_t len);
  // Reads exactly len bytes or throws.
  void read_exact(void* data, size_t len);
  uint64_t bytes_written() const { return written_; }

 private:
  void flush();
  int fd_ = -1;
  std::string dir_;
  std::vector<unsigned char> buf_;
  size_t buf_pos_ = 0;   // write: bytes pending; read: next byte to hand out
  size_t buf_end_ = 0;   // read: valid bytes in buf_
  uint64_t written_ = 0;
};

// Collects the nodes of a trie level by level (each level in its final order, levels
// freely interleaved) into temporary files, then writes the trie file atomically.
class TrieFileWriter {
 public:
  TrieFileWriter(int order, const std::string& tmp_dir);

  // Appends node (token, count) to `level` (1..order). For level < order, `child_start`
  // is the number of level + 1 nodes added before this node's first child.
  void add_node(int level, uint32_t token, uint64_t count, uint64_t child_start);
  uint64_t level_size(int level) const { return levels_[level].size; }

  // Writes header + payload to a temporary name next to `path`, fsyncs, renames.
  // Returns the file size.
  uint64_t write(const std::string& path, uint64_t root_count, uint32_t vocab_size,
                 const std::string& fingerprint, uint64_t min_count, uint64_t num_documents);

 private:
  struct LevelStreams {
    std::unique_ptr<TempFile> tokens;        // u32
    std::unique_ptr<TempFile> counts;        // u64
    std::unique_ptr<TempFile> child_starts;  // u64
    uint64_t size = 0;
    uint64_t max_count = 0;
  };
  int order_;
  std::vector<LevelStreams> levels_;  // index 1..order used
};

// Opens `path` for reading; throws TrieIOError.
int open_readonly(const std::string& path);

}  // namespace ngram
