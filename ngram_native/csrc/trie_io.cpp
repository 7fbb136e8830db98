// Mappings, temporary files and the trie file writer (see trie_io.h).
#include "trie_io.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace ngram {
namespace {

constexpr size_t kIoBufferBytes = size_t{1} << 20;

std::string default_tmp_dir() {
  const char* env = std::getenv("TMPDIR");
  return (env != nullptr && env[0] != '\0') ? std::string(env) : std::string("/tmp");
}

std::string dirname_of(const std::string& path) {
  size_t slash = path.find_last_of('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

void write_all(int fd, const void* data, size_t len, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (len > 0) {
    ssize_t n = ::write(fd, p, len);
    if (n < 0) {
      if (errno == EINTR) continue;
      throw TrieIOError(errno, path, "cannot write");
    }
    p += n;
    len -= static_cast<size_t>(n);
  }
}

uint64_t align8(uint64_t x) { return (x + 7) & ~uint64_t{7}; }

// The output file: buffered writes that also feed the payload checksum.
class PayloadWriter {
 public:
  PayloadWriter(int fd, const std::string& path) : fd_(fd), path_(path) {
    buf_.reserve(kIoBufferBytes);
  }
  void write(const void* data, size_t len) {
    hash_.update(data, len);
    const unsigned char* p = static_cast<const unsigned char*>(data);
    if (buf_.size() + len > kIoBufferBytes) flush();
    if (len >= kIoBufferBytes) {
      write_all(fd_, p, len, path_);
    } else {
      buf_.insert(buf_.end(), p, p + len);
    }
    written_ += len;
  }
  void pad8() {
    static const unsigned char zeros[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t pad = static_cast<size_t>(align8(written_) - written_);
    if (pad > 0) write(zeros, pad);
  }
  // Writes `value` with `width` bytes (4 or 8); the caller has checked that it fits.
  void put_uint(uint64_t value, int width) {
    if (width == 4) {
      uint32_t v = static_cast<uint32_t>(value);
      write(&v, 4);
    } else {
      write(&value, 8);
    }
  }
  void flush() {
    if (!buf_.empty()) write_all(fd_, buf_.data(), buf_.size(), path_);
    buf_.clear();
  }
  uint64_t written() const { return written_; }
  uint64_t checksum() const { return hash_.digest(); }

 private:
  int fd_;
  std::string path_;
  std::vector<unsigned char> buf_;
  Xxh64 hash_{0};
  uint64_t written_ = 0;
};

// Copies a TempFile of u64 values into the output at `width` bytes each.
void copy_u64_stream(TempFile& src, uint64_t n, int width, PayloadWriter& out) {
  src.rewind();
  std::vector<uint64_t> block(1 << 16);
  std::vector<uint32_t> narrow(width == 4 ? block.size() : 0);
  while (n > 0) {
    size_t take = static_cast<size_t>(std::min<uint64_t>(n, block.size()));
    src.read_exact(block.data(), take * 8);
    if (width == 4) {
      for (size_t i = 0; i < take; ++i) narrow[i] = static_cast<uint32_t>(block[i]);
      out.write(narrow.data(), take * 4);
    } else {
      out.write(block.data(), take * 8);
    }
    n -= take;
  }
}

int bit_width(uint64_t v) {
  int bits = 0;
  for (; v > 0; v >>= 1) ++bits;
  return bits;
}

}  // namespace

int root_index_bits(uint32_t vocab_size, uint64_t level1_size) {
  const int id_bits = bit_width(vocab_size > 0 ? vocab_size - 1 : 0);
  return std::min(id_bits, bit_width(level1_size));
}

int root_index_shift(uint32_t vocab_size, uint64_t level1_size) {
  return bit_width(vocab_size > 0 ? vocab_size - 1 : 0) - root_index_bits(vocab_size, level1_size);
}

int open_readonly(const std::string& path) {
  int fd;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) throw TrieIOError(errno, path, "cannot open");
  return fd;
}

// ----- MappedFile -------------------------------------------------------------------------

MappedFile::MappedFile(const std::string& path) {
  int fd = open_readonly(path);
  struct stat st;
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw TrieIOError(err, path, "cannot stat");
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw TrieIOError(S_ISDIR(st.st_mode) ? EISDIR : EINVAL, path, "not a regular file");
  }
  size_ = static_cast<size_t>(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      int err = errno;
      ::close(fd);
      throw TrieIOError(err, path, "cannot mmap");
    }
    data_ = static_cast<const unsigned char*>(p);
  }
  ::close(fd);  // the mapping keeps the file open
}

MappedFile::~MappedFile() {
  if (data_ != nullptr) ::munmap(const_cast<unsigned char*>(data_), size_);
}

const unsigned char* MappedFile::release() {
  const unsigned char* p = data_;
  data_ = nullptr;
  return p;
}

// ----- TempFile ---------------------------------------------------------------------------

TempFile::TempFile(const std::string& dir) : dir_(dir.empty() ? default_tmp_dir() : dir) {
  std::string tmpl = dir_ + "/ngram_trie_tmp.XXXXXX";
  std::vector<char> name(tmpl.begin(), tmpl.end());
  name.push_back('\0');
  fd_ = ::mkostemp(name.data(), O_CLOEXEC);
  if (fd_ < 0) throw TrieIOError(errno, dir_, "cannot create a temporary file in");
  ::unlink(name.data());
  buf_.resize(kIoBufferBytes);
}

TempFile::~TempFile() {
  if (fd_ >= 0) ::close(fd_);
}

void TempFile::flush() {
  if (buf_pos_ > 0) write_all(fd_, buf_.data(), buf_pos_, dir_ + " (temporary file)");
  buf_pos_ = 0;
}

void TempFile::write(const void* data, size_t len) {
  written_ += len;
  if (buf_pos_ + len > buf_.size()) flush();
  if (len >= buf_.size()) {
    write_all(fd_, data, len, dir_ + " (temporary file)");
    return;
  }
  std::memcpy(buf_.data() + buf_pos_, data, len);
  buf_pos_ += len;
}

void TempFile::rewind() {
  flush();
  if (::lseek(fd_, 0, SEEK_SET) != 0) throw TrieIOError(errno, dir_, "cannot seek a temporary file in");
  buf_pos_ = 0;
  buf_end_ = 0;
}

size_t TempFile::read(void* data, size_t len) {
  unsigned char* out = static_cast<unsigned char*>(data);
  size_t done = 0;
  while (done < len) {
    if (buf_pos_ == buf_end_) {
      ssize_t n = ::read(fd_, buf_.data(), buf_.size());
      if (n < 0) {
        if (errno == EINTR) continue;
        throw TrieIOError(errno, dir_, "cannot read a temporary file in");
      }
      if (n == 0) break;
      buf_pos_ = 0;
      buf_end_ = static_cast<size_t>(n);
    }
    size_t take = std::min(len - done, buf_end_ - buf_pos_);
    std::memcpy(out + done, buf_.data() + buf_pos_, take);
    buf_pos_ += take;
    done += take;
  }
  return done;
}

void TempFile::read_exact(void* data, size_t len) {
  if (read(data, len) != len) {
    throw TrieIOError(EIO, dir_, "temporary file ended early (disk full or removed?) in");
  }
}

// ----- TrieFileWriter ---------------------------------------------------------------------

TrieFileWriter::TrieFileWriter(int order, const std::string& tmp_dir)
    : order_(order), levels_(static_cast<size_t>(order) + 1) {
  for (int k = 1; k <= order; ++k) {
    levels_[k].tokens = std::make_unique<TempFile>(tmp_dir);
    levels_[k].counts = std::make_unique<TempFile>(tmp_dir);
    if (k < order) levels_[k].child_starts = std::make_unique<TempFile>(tmp_dir);
  }
}

void TrieFileWriter::add_node(int level, uint32_t token, uint64_t count, uint64_t child_start) {
  LevelStreams& l = levels_[level];
  l.tokens->put(token);
  l.counts->put(count);
  if (level < order_) l.child_starts->put(child_start);
  l.max_count = std::max(l.max_count, count);
  ++l.size;
}

uint64_t TrieFileWriter::write(const std::string& path, uint64_t root_count, uint32_t vocab_size,
                               const std::string& fingerprint, uint64_t min_count,
                               uint64_t num_documents) {
  constexpr uint64_t kU32Max = std::numeric_limits<uint32_t>::max();
  FileHeader h;
  std::memset(&h, 0, sizeof(h));
  std::memcpy(h.magic, kTrieMagic, sizeof(h.magic));
  h.format_version = kTrieFormatVersion;
  h.byte_order_mark = kByteOrderMark;
  h.order = static_cast<uint32_t>(order_);
  h.vocab_size = vocab_size;
  h.header_size = kHeaderSize;
  h.min_count = min_count;
  h.num_documents = num_documents;
  std::memcpy(h.tokenizer_fingerprint, fingerprint.data(), fingerprint.size());

  // Layout: sizes and widths are all known now, so every offset is fixed up front.
  uint64_t cursor = kHeaderSize;
  for (int k = 0; k <= order_; ++k) {
    LevelEntry& e = h.levels[k];
    e.node_count = k == 0 ? 1 : levels_[k].size;
    uint64_t max_count = k == 0 ? root_count : levels_[k].max_count;
    e.count_width = max_count <= kU32Max ? 4 : 8;
    if (k > 0) {
      e.tokens_offset = cursor;
      cursor += align8(4 * e.node_count);
    }
    e.counts_offset = cursor;
    cursor += align8(e.count_width * e.node_count);
    if (k < order_) {
      e.child_offset_width = levels_[k + 1].size <= kU32Max ? 4 : 8;
      e.child_offsets_offset = cursor;
      cursor += align8(e.child_offset_width * (e.node_count + 1));
    }
  }
  const uint64_t level1_size = levels_[1].size;
  h.root_index_bits = static_cast<uint8_t>(root_index_bits(vocab_size, level1_size));
  const int root_shift = root_index_shift(vocab_size, level1_size);
  const uint64_t buckets = uint64_t{1} << h.root_index_bits;
  h.root_index_offset = cursor;
  cursor += align8(4 * (buckets + 1));
  h.file_size = cursor;
  // root_index[b + 1] counts level-1 tokens in bucket b, filled while copying level 1;
  // the prefix sum at the end turns it into the index.
  std::vector<uint32_t> root_index(static_cast<size_t>(buckets) + 1, 0);

  std::string tmpl = path + ".tmp.XXXXXX";
  std::vector<char> tmp_name(tmpl.begin(), tmpl.end());
  tmp_name.push_back('\0');
  int fd = ::mkostemp(tmp_name.data(), O_CLOEXEC);
  if (fd < 0) throw TrieIOError(errno, path, "cannot create a temporary file next to");
  std::string tmp_path(tmp_name.data());
  try {
    PayloadWriter out(fd, tmp_path);
    std::vector<unsigned char> zeros(kHeaderSize, 0);
    write_all(fd, zeros.data(), zeros.size(), tmp_path);  // header placeholder, not hashed
    for (int k = 0; k <= order_; ++k) {
      const LevelEntry& e = h.levels[k];
      if (k == 0) {
        out.put_uint(root_count, e.count_width);
        out.pad8();
        out.put_uint(0, e.child_offset_width);
        out.put_uint(levels_[1].size, e.child_offset_width);
        out.pad8();
        continue;
      }
      LevelStreams& l = levels_[k];
      l.tokens->rewind();
      std::vector<uint32_t> block(1 << 16);
      for (uint64_t left = l.size; left > 0;) {
        size_t take = static_cast<size_t>(std::min<uint64_t>(left, block.size()));
        l.tokens->read_exact(block.data(), take * 4);
        out.write(block.data(), take * 4);
        if (k == 1) {
          for (size_t i = 0; i < take; ++i) ++root_index[(block[i] >> root_shift) + 1];
        }
        left -= take;
      }
      out.pad8();
      copy_u64_stream(*l.counts, l.size, e.count_width, out);
      out.pad8();
      if (k < order_) {
        copy_u64_stream(*l.child_starts, l.size, e.child_offset_width, out);
        out.put_uint(levels_[k + 1].size, e.child_offset_width);
        out.pad8();
      }
    }
    for (size_t b = 1; b < root_index.size(); ++b) root_index[b] += root_index[b - 1];
    out.write(root_index.data(), root_index.size() * 4);
    out.pad8();
    out.flush();
    if (kHeaderSize + out.written() != h.file_size) {
      throw std::logic_error("trie writer: payload size does not match the computed layout");
    }
    h.payload_checksum = out.checksum();
    h.header_checksum = 0;
    h.header_checksum = xxh64(&h, sizeof(h));
    const ssize_t n = ::pwrite(fd, &h, sizeof(h), 0);
    if (n != static_cast<ssize_t>(sizeof(h))) {
      throw TrieIOError(n < 0 ? errno : EIO, tmp_path, "cannot write the header of");
    }
    if (::fchmod(fd, 0644) != 0) throw TrieIOError(errno, tmp_path, "cannot chmod");
    if (::fsync(fd) != 0) throw TrieIOError(errno, tmp_path, "cannot fsync");
    if (::close(fd) != 0) {
      fd = -1;
      throw TrieIOError(errno, tmp_path, "cannot close");
    }
    fd = -1;
    if (::rename(tmp_path.c_str(), path.c_str()) != 0) {
      throw TrieIOError(errno, path, "cannot rename " + tmp_path + " to");
    }
  } catch (...) {
    if (fd >= 0) ::close(fd);
    ::unlink(tmp_path.c_str());
    throw;
  }
  // Make the rename itself durable; failure here does not invalidate the file.
  int dir_fd = ::open(dirname_of(path).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dir_fd >= 0) {
    (void)::fsync(dir_fd);
    ::close(dir_fd);
  }
  return h.file_size;
}

}  // namespace ngram
