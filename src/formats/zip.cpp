#include "formats/zip.hpp"

#include <algorithm>
#include <cstdio>

#include "shardmerge/error.hpp"
#include "util/bytes.hpp"
#include "util/crc32.hpp"

namespace shardmerge {
namespace {

constexpr uint32_t kCentralSig = 0x02014b50;
constexpr uint32_t kEocdSig = 0x06054b50;
constexpr uint32_t kZip64LocatorSig = 0x07064b50;
constexpr uint32_t kZip64EocdSig = 0x06064b50;
constexpr size_t kEocdSize = 22;
constexpr size_t kZip64LocatorSize = 20;
constexpr size_t kZip64EocdSize = 56;
constexpr size_t kMaxComment = 0xFFFF;
// A central directory describes records, it never holds data; anything this large is hostile.
constexpr uint64_t kMaxCentralDirectory = 256ull << 20;

struct Directory {
  uint64_t entries = 0;
  uint64_t size = 0;
  uint64_t offset = 0;    // relative to the archive base
  uint64_t end = 0;       // where the directory must end: the (ZIP64) EOCD position
};

Directory find_directory(const File& file, uint64_t base, uint64_t length) {
  if (length < kEocdSize) throw Error("not a zip archive: only " + std::to_string(length) + " bytes");
  const uint64_t tail_len = std::min<uint64_t>(length, kEocdSize + kMaxComment);
  const std::string tail = file.read_string(base + length - tail_len, tail_len);

  // Scan backwards for an EOCD whose comment runs exactly to the end of the archive.
  std::optional<uint64_t> eocd_in_tail;
  for (uint64_t i = tail_len - kEocdSize + 1; i-- > 0;) {
    if (load_le<uint32_t>(tail.data() + i) != kEocdSig) continue;
    uint16_t comment_len = load_le<uint16_t>(tail.data() + i + 20);
    if (i + kEocdSize + comment_len == tail_len) {
      eocd_in_tail = i;
      break;
    }
  }
  if (!eocd_in_tail)
    throw Error("not a zip archive or truncated: no end-of-central-directory record at the end of the file");
  const char* e = tail.data() + *eocd_in_tail;
  const uint64_t eocd_pos = length - tail_len + *eocd_in_tail;

  Directory dir;
  if (load_le<uint16_t>(e + 4) != 0 || load_le<uint16_t>(e + 6) != 0)
    throw Error("multi-disk zip archives are not supported");
  dir.entries = load_le<uint16_t>(e + 10);
  dir.size = load_le<uint32_t>(e + 12);
  dir.offset = load_le<uint32_t>(e + 16);
  dir.end = eocd_pos;

  // torch always writes ZIP64 end records (miniz's WRITE_ZIP64 flag), even for tiny files.
  if (eocd_pos >= kZip64LocatorSize) {
    std::string loc = file.read_string(base + eocd_pos - kZip64LocatorSize, kZip64LocatorSize);
    if (load_le<uint32_t>(loc.data()) == kZip64LocatorSig) {
      uint64_t z64_pos = load_le<uint64_t>(loc.data() + 8);
      if (z64_pos > eocd_pos - kZip64LocatorSize || eocd_pos - kZip64LocatorSize - z64_pos < kZip64EocdSize)
        throw Error("corrupt zip: ZIP64 end record offset " + std::to_string(z64_pos) + " is out of bounds");
      std::string z = file.read_string(base + z64_pos, kZip64EocdSize);
      if (load_le<uint32_t>(z.data()) != kZip64EocdSig)
        throw Error("corrupt zip: no ZIP64 end-of-central-directory record at byte " + std::to_string(z64_pos));
      dir.entries = load_le<uint64_t>(z.data() + 32);
      dir.size = load_le<uint64_t>(z.data() + 40);
      dir.offset = load_le<uint64_t>(z.data() + 48);
      dir.end = z64_pos;
    }
  }
  if (dir.offset > dir.end || dir.size > dir.end - dir.offset)
    throw Error("corrupt or truncated zip: central directory [" + std::to_string(dir.offset) + ", +" +
                std::to_string(dir.size) + ") does not fit before its end record at " + std::to_string(dir.end));
  if (dir.size > kMaxCentralDirectory)
    throw Error("central directory of " + std::to_string(dir.size) + " bytes is implausibly large");
  return dir;
}

std::string hex32(uint32_t v) {
  char buf[11];
  std::snprintf(buf, sizeof buf, "0x%08x", v);
  return buf;
}

// What the central directory says about one entry.
struct CentralEntry {
  std::string name;
  uint16_t flags = 0;
  uint16_t method = 0;
  uint32_t crc = 0;
  uint64_t size = 0;
  uint64_t lho = 0;
};

// The local header repeats the central directory's name, flags, method, CRC and sizes (or,
// with flag bit 3, leaves CRC and sizes to a data descriptor after the data): a reader that
// only skipped over it would read data another reader sees under another name or size.
// Returns the data offset relative to the archive base; everything must end before `limit`
// (the central directory).
uint64_t check_local_header(const File& file, uint64_t base, const CentralEntry& c, uint64_t limit) {
  const std::string& name = c.name;
  if (limit < 30 || c.lho > limit - 30)  // (lho + 30 could wrap: lho comes from a ZIP64 field)
    throw Error("corrupt zip: entry '" + name + "' local header at " + std::to_string(c.lho) +
                " is outside the data area");
  const std::string local = file.read_string(base + c.lho, 30);
  if (load_le<uint32_t>(local.data()) != kLocalHeaderSig)
    throw Error("corrupt zip: no local header for entry '" + name + "' at byte " + std::to_string(c.lho));
  const uint16_t flags = load_le<uint16_t>(local.data() + 6);
  const uint16_t method = load_le<uint16_t>(local.data() + 8);
  const uint32_t crc = load_le<uint32_t>(local.data() + 14);
  uint64_t csize = load_le<uint32_t>(local.data() + 18);
  uint64_t usize = load_le<uint32_t>(local.data() + 22);
  const uint16_t name_len = load_le<uint16_t>(local.data() + 26);
  const uint16_t extra_len = load_le<uint16_t>(local.data() + 28);
  const std::string where = "corrupt zip: entry '" + name + "': its local header at " + std::to_string(c.lho);
  if (flags != c.flags)
    throw Error(where + " has flags " + hex32(flags) + ", the central directory " + hex32(c.flags));
  if (method != c.method)
    throw Error(where + " has method " + std::to_string(method) + ", the central directory " + std::to_string(c.method));
  if (30 + uint64_t{name_len} + extra_len > limit - c.lho)
    throw Error(where + " runs into the central directory");
  const std::string rest = file.read_string(base + c.lho + 30, name_len + size_t{extra_len});
  if (std::string_view(rest).substr(0, name_len) != name)
    throw Error(where + " names it '" + rest.substr(0, name_len) + "'");
  const std::string_view extra = std::string_view(rest).substr(name_len);
  // The data follows the *local* name and extra fields, which differ from the central ones.
  const uint64_t data = c.lho + 30 + name_len + extra_len;
  if (data > limit || c.size > limit - data)
    throw Error("corrupt or truncated zip: entry '" + name + "' data [" + std::to_string(data) + ", +" +
                std::to_string(c.size) + ") runs past the data area, which ends at " + std::to_string(limit));
  const std::optional<std::string_view> zip64 = extra_field(extra, 0x0001);

  if (!(flags & kDataDescriptorFlag)) {
    uint64_t unused_lho = 0;
    apply_zip64_extra(extra, usize, csize, unused_lho, name);
    if (crc != c.crc || usize != c.size || csize != c.size)
      throw Error(where + " says CRC-32 " + hex32(crc) + ", " + std::to_string(usize) + " bytes (" +
                  std::to_string(csize) + " stored); the central directory " + hex32(c.crc) + ", " + std::to_string(c.size));
    return data;
  }
  // CRC and sizes follow the data; the local fields are zero (torch's miniz) or repeat them.
  if ((crc != 0 && crc != c.crc) || (usize != 0 && usize != c.size && usize != 0xFFFFFFFFu))
    throw Error(where + " says CRC-32 " + hex32(crc) + ", " + std::to_string(usize) + " bytes; the central directory " +
                hex32(c.crc) + ", " + std::to_string(c.size));
  // Sizes in the descriptor are 8 bytes each when the local header has a ZIP64 field.
  const uint64_t field = zip64 ? 8 : 4;
  const uint64_t at = data + c.size, avail = limit - at;
  const std::string d = file.read_string(base + at, static_cast<size_t>(std::min<uint64_t>(avail, 4 + 4 + 2 * field)));
  const size_t sig = d.size() >= 4 && load_le<uint32_t>(d.data()) == kDataDescriptorSig ? 4 : 0;  // optional
  if (d.size() < sig + 4 + 2 * field)
    throw Error("corrupt zip: entry '" + name + "' has no room for its data descriptor at " + std::to_string(at));
  const uint32_t dcrc = load_le<uint32_t>(d.data() + sig);
  const uint64_t dcsize = field == 8 ? load_le<uint64_t>(d.data() + sig + 4) : load_le<uint32_t>(d.data() + sig + 4);
  const uint64_t dusize = field == 8 ? load_le<uint64_t>(d.data() + sig + 4 + 8) : load_le<uint32_t>(d.data() + sig + 8);
  if (dcrc != c.crc || dcsize != c.size || dusize != c.size)
    throw Error("corrupt zip: entry '" + name + "': its data descriptor at " + std::to_string(at) + " says CRC-32 " +
                hex32(dcrc) + ", " + std::to_string(dusize) + " bytes (" + std::to_string(dcsize) +
                " stored); the central directory " + hex32(c.crc) + ", " + std::to_string(c.size));
  return data;
}

}  // namespace

void apply_zip64_extra(std::string_view extra, uint64_t& usize, uint64_t& csize, uint64_t& lho,
                       const std::string& name) {
  size_t pos = 0;
  while (pos + 4 <= extra.size()) {
    uint16_t id = load_le<uint16_t>(extra.data() + pos);
    uint16_t len = load_le<uint16_t>(extra.data() + pos + 2);
    if (pos + 4 + len > extra.size()) throw Error("corrupt zip: extra field overruns entry '" + name + "'");
    if (id == 0x0001) {
      const char* f = extra.data() + pos + 4;
      size_t avail = len;
      auto take = [&](uint64_t& field) {
        if (field != 0xFFFFFFFFu) return;
        if (avail < 8) throw Error("corrupt zip: short ZIP64 field in entry '" + name + "'");
        field = load_le<uint64_t>(f);
        f += 8;
        avail -= 8;
      };
      take(usize);
      take(csize);
      take(lho);
      return;
    }
    pos += 4 + len;
  }
}

std::optional<std::string_view> extra_field(std::string_view extra, uint16_t id) {
  size_t pos = 0;
  while (pos + 4 <= extra.size()) {
    const uint16_t len = load_le<uint16_t>(extra.data() + pos + 2);
    if (pos + 4 + len > extra.size()) return std::nullopt;
    if (load_le<uint16_t>(extra.data() + pos) == id) return extra.substr(pos + 4, len);
    pos += 4 + len;
  }
  return std::nullopt;
}

std::string read_record_checked(const File& file, const ZipEntry& entry) {
  std::string data = file.read_string(entry.data_offset, static_cast<size_t>(entry.size));
  if (const uint32_t crc = crc32_update(0, data.data(), data.size()); crc != entry.crc32)
    throw Error("CRC-32 mismatch: record " + entry.name + " has " + hex32(crc) + ", the zip directory says " +
                hex32(entry.crc32))
        .file(file.path())
        .offset(entry.data_offset);
  return data;
}

ZipArchive ZipArchive::read(const File& file, uint64_t base, std::optional<uint64_t> length) {
  try {
    return read_directory(file, base, length);
  } catch (Error& e) {
    e.file(file.path());  // every problem with an archive is a problem with this file
    throw;
  }
}

ZipArchive ZipArchive::read_directory(const File& file, uint64_t base, std::optional<uint64_t> length) {
  const uint64_t file_size = file.size();
  if (base > file_size) throw Error("zip archive offset " + std::to_string(base) + " is past the end of the file");
  const uint64_t len = length.value_or(file_size - base);
  if (len > file_size - base)
    throw Error("file is truncated: the zip archive at byte " + std::to_string(base) + " needs " +
                std::to_string(len) + " bytes");

  const Directory dir = find_directory(file, base, len);
  const std::string cd = file.read_string(base + dir.offset, static_cast<size_t>(dir.size));

  ZipArchive zip;
  size_t pos = 0;
  for (uint64_t i = 0; i < dir.entries; ++i) {
    if (pos + 46 > cd.size()) throw Error("corrupt zip: central directory ends after " + std::to_string(i) + " of " +
                                          std::to_string(dir.entries) + " entries");
    const char* h = cd.data() + pos;
    if (load_le<uint32_t>(h) != kCentralSig) throw Error("corrupt zip: bad central directory entry " + std::to_string(i));
    const uint16_t flags = load_le<uint16_t>(h + 8);
    const uint16_t method = load_le<uint16_t>(h + 10);
    const uint32_t crc = load_le<uint32_t>(h + 16);
    uint64_t csize = load_le<uint32_t>(h + 20);
    uint64_t usize = load_le<uint32_t>(h + 24);
    const uint16_t name_len = load_le<uint16_t>(h + 28);
    const uint16_t extra_len = load_le<uint16_t>(h + 30);
    const uint16_t comment_len = load_le<uint16_t>(h + 32);
    uint64_t lho = load_le<uint32_t>(h + 42);
    if (pos + 46 + name_len + extra_len + comment_len > cd.size())
      throw Error("corrupt zip: central directory entry " + std::to_string(i) + " overruns the directory");
    ZipEntry entry;
    entry.name.assign(h + 46, name_len);
    apply_zip64_extra(std::string_view(h + 46 + name_len, extra_len), usize, csize, lho, entry.name);
    pos += 46 + name_len + extra_len + comment_len;

    if (method != 0)
      throw Error("zip entry '" + entry.name + "' is compressed (method " + std::to_string(method) +
                  "); torch.save writes only stored entries, re-save the file without compression");
    if (csize != usize)
      throw Error("corrupt zip: stored entry '" + entry.name + "' has compressed size " + std::to_string(csize) +
                  " != size " + std::to_string(usize));
    const uint64_t data = check_local_header(file, base, {entry.name, flags, method, crc, usize, lho}, dir.offset);
    entry.data_offset = base + data;
    entry.size = usize;
    entry.crc32 = crc;
    if (!zip.by_name_.emplace(entry.name, zip.entries_.size()).second)
      throw Error("corrupt zip: duplicate entry '" + entry.name + "'");
    zip.entries_.push_back(std::move(entry));
  }

  // Records must not share bytes: overlapping records are a crafted file, not a torch one.
  std::vector<const ZipEntry*> by_offset;
  for (const auto& e : zip.entries_) by_offset.push_back(&e);
  std::sort(by_offset.begin(), by_offset.end(),
            [](const ZipEntry* a, const ZipEntry* b) { return a->data_offset < b->data_offset; });
  for (size_t i = 1; i < by_offset.size(); ++i) {
    const ZipEntry& prev = *by_offset[i - 1];
    if (prev.size > 0 && prev.data_offset + prev.size > by_offset[i]->data_offset)
      throw Error("corrupt zip: entries '" + prev.name + "' and '" + by_offset[i]->name + "' overlap");
  }
  return zip;
}

const ZipEntry* ZipArchive::find(std::string_view name) const {
  auto it = by_name_.find(std::string(name));
  return it == by_name_.end() ? nullptr : &entries_[it->second];
}

TorchArchive TorchArchive::read(const File& file, uint64_t base, std::optional<uint64_t> length) {
  if (file.size() >= 8 && base <= file.size() - 8) {
    std::string magic = file.read_string(base, 8);
    if (magic == "PYTORCH1")
      throw Error("TorchScript/legacy 'PYTORCH1' archives are not supported").file(file.path());
    if (load_le<uint32_t>(magic.data()) != kLocalHeaderSig)
      throw Error("not a torch.save zip archive (wrong magic bytes; files saved with "
                  "_use_new_zipfile_serialization=False are not supported)")
          .file(file.path());
  }
  TorchArchive archive;
  archive.path_ = file.path();
  archive.zip_ = ZipArchive::read(file, base, length);
  const auto& entries = archive.zip_.entries();
  if (entries.empty()) throw Error("empty zip archive, expected a torch.save file").file(file.path());
  // As torch's reader: the archive name is the first entry's text before '/', shared by all.
  const auto slash = entries.front().name.find('/');
  if (slash == std::string::npos || slash == 0)
    throw Error("not a torch.save archive: first entry '" + entries.front().name + "' has no '<archive>/' prefix")
        .file(file.path());
  archive.prefix_ = entries.front().name.substr(0, slash);
  for (const auto& e : entries)
    if (e.name.compare(0, slash + 1, archive.prefix_ + "/") != 0)
      throw Error("not a torch.save archive: entry '" + e.name + "' is outside '" + archive.prefix_ + "/'")
          .file(file.path());
  if (!archive.find_record("data.pkl")) throw Error("torch.save archive has no data.pkl record").file(file.path());
  if (const ZipEntry* bo = archive.find_record("byteorder")) {
    if (bo->size > 16) throw Error("byteorder record is implausibly large").file(file.path());
    if (read_record_checked(file, *bo) != "little")
      throw Error("archive was saved on a big-endian machine; only little-endian data is supported").file(file.path());
  }
  return archive;
}

const ZipEntry* TorchArchive::find_record(std::string_view record) const {
  std::string full = prefix_ + "/";
  full.append(record);
  return zip_.find(full);
}

const ZipEntry& TorchArchive::record(std::string_view record) const {
  if (const ZipEntry* e = find_record(record)) return *e;
  throw Error("torch.save archive has no record '" + prefix_ + "/" + std::string(record) + "'").file(path_);
}

}  // namespace shardmerge
