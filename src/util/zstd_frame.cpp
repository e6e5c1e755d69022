#include "util/zstd_frame.hpp"

#include <algorithm>

namespace shardmerge {

ZstdFrameReader::ZstdFrameReader(const File& in, uint64_t offset, uint64_t length)
    : in_(in), offset_(offset), length_(length), ctx_(ZSTD_createDCtx(), ZSTD_freeDCtx), inbuf_(ZSTD_DStreamInSize(), '\0') {
  if (!ctx_) throw fail("out of memory creating a zstd decoder");
  refill();
  const auto* b = reinterpret_cast<const uint8_t*>(inbuf_.data());
  const uint32_t magic = src_.size >= 4 ? uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24 : 0;
  if (magic != ZSTD_MAGICNUMBER) throw fail("does not start with the zstd frame magic 28 b5 2f fd");
  const unsigned long long declared = ZSTD_getFrameContentSize(inbuf_.data(), src_.size);
  if (declared == ZSTD_CONTENTSIZE_ERROR) throw fail("corrupt frame header");
  if (declared != ZSTD_CONTENTSIZE_UNKNOWN) declared_ = declared;
}

Error ZstdFrameReader::fail(const std::string& what) const { return Error("zstd item: " + what).file(in_.path()).offset(offset_); }

void ZstdFrameReader::refill() {
  const size_t n = static_cast<size_t>(std::min<uint64_t>(inbuf_.size(), length_ - consumed_));
  in_.read_exact(offset_ + consumed_, inbuf_.data(), n);
  consumed_ += n;
  src_ = {inbuf_.data(), n, 0};
}

size_t ZstdFrameReader::read(char* buf, size_t n) {
  while (true) {
    if (last_ == 0) {
      if (const uint64_t after = length_ - consumed_ + (src_.size - src_.pos))
        throw fail(std::to_string(after) + " bytes follow the end of its zstd frame");
      return 0;
    }
    if (src_.pos == src_.size && consumed_ < length_) refill();
    const size_t before = src_.pos;
    ZSTD_outBuffer dst{buf, n, 0};
    last_ = ZSTD_decompressStream(ctx_.get(), &dst, &src_);
    if (ZSTD_isError(last_)) throw fail(std::string("corrupt: ") + ZSTD_getErrorName(last_));
    decoded_ += dst.pos;
    if (dst.pos > 0) return dst.pos;
    // No output and no input used with none left: the frame stops short.
    if (last_ != 0 && src_.pos == before && src_.pos == src_.size && consumed_ == length_)
      throw fail("truncated: the frame ends after " + std::to_string(decoded_) + " decoded bytes");
  }
}

void decode_zstd_frame(const File& in, uint64_t offset, uint64_t length, uint64_t decoded_size, const File& out) {
  ZstdFrameReader frame(in, offset, length);
  uint64_t most = 0;
  if (__builtin_add_overflow(decoded_size, kMaxDiscardedTail, &most)) throw frame.fail("the plan needs more than 2^64 decoded bytes");
  const std::string expected = " (the plan needs " + std::to_string(decoded_size) + ", and at most " +
                               std::to_string(kMaxDiscardedTail) + " more after them)";
  if (const auto declared = frame.declared_size(); declared && (*declared < decoded_size || *declared > most))
    throw frame.fail("its frame declares " + std::to_string(*declared) + " bytes" + expected);
  std::string buf(ZSTD_DStreamOutSize(), '\0');
  while (const size_t n = frame.read(buf.data(), buf.size())) {
    if (frame.decoded() > most) throw frame.fail("decodes to more than " + std::to_string(most) + " bytes" + expected);
    const uint64_t at = frame.decoded() - n;
    if (at < decoded_size) out.write_exact(at, buf.data(), static_cast<size_t>(std::min<uint64_t>(n, decoded_size - at)));
  }
  if (frame.decoded() < decoded_size) throw frame.fail("decodes to " + std::to_string(frame.decoded()) + " bytes" + expected);
}

}  // namespace shardmerge
