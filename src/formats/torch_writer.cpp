#include "formats/torch_writer.hpp"

#include <algorithm>
#include <memory>

#include "util/bytes.hpp"
#include "util/crc32.hpp"

namespace shardmerge {
namespace {

constexpr uint64_t kZip64Limit = 0xFFFFFFFFull;
constexpr uint64_t kAlignment = 64;

}  // namespace

TorchArchiveWriter::TorchArchiveWriter(const std::string& path, std::string archive_name)
    : file_(File::create(path)), prefix_(std::move(archive_name) + "/") {}

uint64_t TorchArchiveWriter::begin_record(const std::string& full, uint64_t size) {
  const uint64_t header = cursor_;
  const bool z64_size = size >= kZip64Limit, z64_offset = header >= kZip64Limit;
  std::string extra;
  if (z64_size || z64_offset) {  // miniz: sizes (when large), then the header offset (when large)
    append_le<uint16_t>(extra, 0x0001);
    append_le<uint16_t>(extra, static_cast<uint16_t>((z64_size ? 16 : 0) + (z64_offset ? 8 : 0)));
    if (z64_size) {
      append_le<uint64_t>(extra, size);
      append_le<uint64_t>(extra, 0);
    }
    if (z64_offset) append_le<uint64_t>(extra, header);
  }
  // The "FB" field pads the data start to a multiple of 64; it is present even when empty.
  const uint64_t start = header + 30 + full.size() + extra.size() + 4;
  const uint64_t pad = (kAlignment - start % kAlignment) % kAlignment;
  append_le<uint16_t>(extra, 0x4246);
  append_le<uint16_t>(extra, static_cast<uint16_t>(pad));
  extra.append(pad, 'Z');

  std::string h;
  append_le<uint32_t>(h, 0x04034b50);
  append_le<uint16_t>(h, 0);                          // version needed
  append_le<uint16_t>(h, size ? 0x0808 : 0x0800);     // descriptor follows (non-empty), UTF-8 name
  append_le<uint16_t>(h, 0);                          // stored
  append_le<uint32_t>(h, 0);                          // time, date
  append_le<uint32_t>(h, 0);                          // crc (in the descriptor)
  append_le<uint32_t>(h, 0);                          // sizes (in the descriptor)
  append_le<uint32_t>(h, 0);
  append_le<uint16_t>(h, static_cast<uint16_t>(full.size()));
  append_le<uint16_t>(h, static_cast<uint16_t>(extra.size()));
  h += full;
  h += extra;
  file_.write_exact(cursor_, h.data(), h.size());
  cursor_ += h.size();
  return header;
}

void TorchArchiveWriter::end_record(uint64_t header, const std::string& full, uint64_t size, uint32_t crc) {
  if (size > 0) {
    std::string d;
    append_le<uint32_t>(d, 0x08074b50);
    append_le<uint32_t>(d, crc);
    if (size >= kZip64Limit || header >= kZip64Limit) {
      append_le<uint64_t>(d, size);
      append_le<uint64_t>(d, size);
    } else {
      append_le<uint32_t>(d, static_cast<uint32_t>(size));
      append_le<uint32_t>(d, static_cast<uint32_t>(size));
    }
    file_.write_exact(cursor_, d.data(), d.size());
    cursor_ += d.size();
  }
  entries_.push_back({full, header, size, crc});
}

void TorchArchiveWriter::add_record(const std::string& name, const std::string& data) {
  const std::string full = prefix_ + name;
  const uint64_t header = begin_record(full, data.size());
  file_.write_exact(cursor_, data.data(), data.size());
  cursor_ += data.size();
  end_record(header, full, data.size(), crc32_update(0, data.data(), data.size()));
}

void TorchArchiveWriter::add_record(const std::string& name, uint64_t size,
                                    const std::function<void(char*, size_t)>& fill) {
  const std::string full = prefix_ + name;
  const uint64_t header = begin_record(full, size);
  constexpr size_t kChunk = 8u << 20;
  std::unique_ptr<char[]> buf(new char[std::min<uint64_t>(kChunk, std::max<uint64_t>(size, 1))]);
  uint32_t crc = 0;
  for (uint64_t done = 0; done < size;) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(kChunk, size - done));
    fill(buf.get(), n);
    crc = crc32_update(crc, buf.get(), n);
    file_.write_exact(cursor_, buf.get(), n);
    cursor_ += n;
    done += n;
  }
  end_record(header, full, size, crc);
}

void TorchArchiveWriter::finish() {
  add_record("version", "3\n");
  const uint64_t cd_offset = cursor_;
  std::string cd;
  for (const Entry& e : entries_) {
    const bool z64_size = e.size >= kZip64Limit, z64_offset = e.header_offset >= kZip64Limit;
    std::string extra;
    if (z64_size || z64_offset) {
      append_le<uint16_t>(extra, 0x0001);
      append_le<uint16_t>(extra, static_cast<uint16_t>((z64_size ? 16 : 0) + (z64_offset ? 8 : 0)));
      if (z64_size) {
        append_le<uint64_t>(extra, e.size);
        append_le<uint64_t>(extra, e.size);
      }
      if (z64_offset) append_le<uint64_t>(extra, e.header_offset);
    }
    append_le<uint32_t>(cd, 0x02014b50);
    append_le<uint16_t>(cd, 0);  // made by
    append_le<uint16_t>(cd, 0);  // needed
    append_le<uint16_t>(cd, e.size ? 0x0808 : 0x0800);
    append_le<uint16_t>(cd, 0);  // stored
    append_le<uint32_t>(cd, 0);  // time, date
    append_le<uint32_t>(cd, e.crc);
    const auto small = static_cast<uint32_t>(z64_size ? kZip64Limit : e.size);
    append_le<uint32_t>(cd, small);
    append_le<uint32_t>(cd, small);
    append_le<uint16_t>(cd, static_cast<uint16_t>(e.name.size()));
    append_le<uint16_t>(cd, static_cast<uint16_t>(extra.size()));
    append_le<uint16_t>(cd, 0);  // comment
    append_le<uint16_t>(cd, 0);  // disk
    append_le<uint16_t>(cd, 0);  // internal attributes
    append_le<uint32_t>(cd, 0);  // external attributes
    append_le<uint32_t>(cd, static_cast<uint32_t>(z64_offset ? kZip64Limit : e.header_offset));
    cd += e.name;
    cd += extra;
  }
  const uint64_t n = entries_.size();
  const uint64_t z64_eocd = cd_offset + cd.size();
  append_le<uint32_t>(cd, 0x06064b50);  // ZIP64 end of central directory, always (miniz's WRITE_ZIP64)
  append_le<uint64_t>(cd, 44);
  append_le<uint16_t>(cd, 0x031E);
  append_le<uint16_t>(cd, 0x002D);
  append_le<uint32_t>(cd, 0);
  append_le<uint32_t>(cd, 0);
  append_le<uint64_t>(cd, n);
  append_le<uint64_t>(cd, n);
  append_le<uint64_t>(cd, z64_eocd - cd_offset);
  append_le<uint64_t>(cd, cd_offset);
  append_le<uint32_t>(cd, 0x07064b50);  // locator
  append_le<uint32_t>(cd, 0);
  append_le<uint64_t>(cd, z64_eocd);
  append_le<uint32_t>(cd, 1);
  append_le<uint32_t>(cd, 0x06054b50);  // end of central directory
  append_le<uint16_t>(cd, 0);
  append_le<uint16_t>(cd, 0);
  append_le<uint16_t>(cd, static_cast<uint16_t>(std::min<uint64_t>(n, 0xFFFF)));
  append_le<uint16_t>(cd, static_cast<uint16_t>(std::min<uint64_t>(n, 0xFFFF)));
  append_le<uint32_t>(cd, static_cast<uint32_t>(std::min<uint64_t>(z64_eocd - cd_offset, kZip64Limit)));
  append_le<uint32_t>(cd, static_cast<uint32_t>(std::min<uint64_t>(cd_offset, kZip64Limit)));
  append_le<uint16_t>(cd, 0);
  file_.write_exact(cursor_, cd.data(), cd.size());
  cursor_ += cd.size();
  file_.sync();
  file_.close();
}

}  // namespace shardmerge
