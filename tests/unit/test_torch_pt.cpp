// torch.save files as data (src/formats/torch_pt.*): every rank file of the real FSDP
// fixtures decoded and checked against the generator's layout.json and expected.safetensors,
// the special cases named in tests/fixtures/README.md, the hostile files, and hand-assembled
// pickles for what real files never contain.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <sstream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "formats/safetensors.hpp"
#include "formats/torch_pt.hpp"
#include "formats/zip.hpp"
#include "synth/synthetic_fsdp.hpp"
#include "shardmerge/error.hpp"
#include "test_support.hpp"
#include "util/file.hpp"

namespace shardmerge {
namespace {

// Ordered, so that layout.json's keys keep the state dict's order.
using json = nlohmann::ordered_json;
using test::fixtures_dir;
using namespace std::string_literals;

// ---- fixture helpers -----------------------------------------------------------------------

json load_json(const std::string& path) { return json::parse(test::read_file(path)); }

// Loaded once; returned by reference so range-for loops over its members do not dangle.
const json& manifest() {
  static const json loaded = load_json(fixtures_dir() + "/manifest.json");
  return loaded;
}

std::vector<json> fsdp_fixtures() {
  std::vector<json> out;
  for (const auto& f : manifest()["fixtures"])
    if (f["kind"] == "fsdp") out.push_back(f);
  return out;
}

json fixture(const std::string& name) {
  for (const auto& f : manifest()["fixtures"])
    if (f["name"] == name) return f;
  ADD_FAILURE() << "no fixture " << name << " in the manifest";
  return {};
}

std::string rank_file(const json& fx, const std::string& kind, int rank) {
  const int w = fx["world_size"].get<int>();
  return fixtures_dir() + "/" + fx["role_dir"].get<std::string>() + "/" + kind + "_world_size_" + std::to_string(w) +
         "_rank_" + std::to_string(rank) + ".pt";
}

const StateEntry& entry(const TorchFile& file, const std::string& name) {
  for (const auto& e : file.entries())
    if (e.name == name) return e;
  throw std::runtime_error("no entry " + name + " in " + file.path());
}

// torch.chunk: chunks of ceil(len / n); trailing chunks may be short or empty.
std::pair<int64_t, int64_t> chunk_range(int64_t len, int64_t n, int64_t index) {
  const int64_t chunk = (len + n - 1) / n;
  const int64_t begin = std::min(index * chunk, len);
  return {begin, std::min(begin + chunk, len)};
}

// A layout.json placement string: "Shard(dim=0)", "Replicate()", "_StridedShard(dim=0, sf=2)".
Placement parse_placement(const std::string& text) {
  Placement p;
  auto number_after = [&](const std::string& key) {
    const size_t at = text.find(key);
    EXPECT_NE(at, std::string::npos) << text;
    return std::stoll(text.substr(at + key.size()));
  };
  if (text.rfind("Shard(", 0) == 0) {
    p.kind = PlacementKind::Shard;
    p.dim = number_after("dim=");
  } else if (text.rfind("_StridedShard(", 0) == 0) {
    p.kind = PlacementKind::StridedShard;
    p.dim = number_after("dim=");
    p.split_factor = number_after("sf=");
  } else if (text == "Replicate()") {
    p.kind = PlacementKind::Replicate;
  } else {
    ADD_FAILURE() << "unexpected placement " << text;
  }
  return p;
}

struct Box {
  std::vector<int64_t> start, extent;
};

// The part of the global tensor that the rank at `coord` holds, computed from the placements
// alone: each Shard splits the current extent of its dim torch.chunk-wise, mesh dims left to
// right, except that a _StridedShard splits *after* the plain Shard of the same tensor dim on
// a later mesh dim (FSDP over TP: the TP split comes first, FSDP splits each TP piece).
Box expected_box(const std::vector<int64_t>& global, const std::vector<Placement>& placements,
                 const std::vector<int64_t>& mesh_shape, const std::vector<int64_t>& coord) {
  Box box{std::vector<int64_t>(global.size(), 0), global};
  std::vector<size_t> order;
  for (size_t i = 0; i < placements.size(); ++i)
    if (placements[i].kind != PlacementKind::StridedShard) order.push_back(i);
  for (size_t i = 0; i < placements.size(); ++i)
    if (placements[i].kind == PlacementKind::StridedShard) order.push_back(i);
  for (size_t i : order) {
    const Placement& p = placements[i];
    if (p.kind == PlacementKind::Replicate) continue;
    const auto [b, e] = chunk_range(box.extent[p.dim], mesh_shape[i], coord[i]);
    box.start[p.dim] += b;
    box.extent[p.dim] = e - b;
  }
  return box;
}

// Row-major coordinate of `rank` in a mesh (torch's DeviceMesh over arange(world)).
std::vector<int64_t> unravel(int64_t rank, const std::vector<int64_t>& shape) {
  std::vector<int64_t> coord(shape.size());
  for (size_t i = shape.size(); i-- > 0;) {
    coord[i] = rank % shape[i];
    rank /= shape[i];
  }
  return coord;
}

// Reads a strided view element by element: the storage's place in the file, the view's
// storage offset and strides, all in elements of the view's dtype.
std::string read_view(const TorchFile& tf, const TensorView& v) {
  const File file = File::open_read(tf.path());
  const uint64_t base = tf.storage_offset_in_file(v);
  const uint64_t es = dtype_size(v.dtype);
  std::string out;
  const uint64_t n = v.numel();
  std::vector<int64_t> index(v.size.size(), 0);
  for (uint64_t k = 0; k < n; ++k) {
    int64_t element = v.storage_offset;
    for (size_t d = 0; d < index.size(); ++d) element += index[d] * v.stride[d];
    out += file.read_string(base + static_cast<uint64_t>(element) * es, es);
    for (size_t d = index.size(); d-- > 0;) {
      if (++index[d] < v.size[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

// Reads a box of a row-major safetensors tensor.
std::string read_box(const std::string& path, const SafetensorsTensor& t, const Box& box) {
  const File file = File::open_read(path);
  const uint64_t es = dtype_size(t.dtype);
  std::vector<int64_t> row_stride(t.shape.size(), 1);
  for (size_t d = t.shape.size(); d-- > 1;) row_stride[d - 1] = row_stride[d] * t.shape[d];
  uint64_t n = 1;
  for (int64_t e : box.extent) n *= static_cast<uint64_t>(e);
  std::string out;
  std::vector<int64_t> index(box.extent.size(), 0);
  for (uint64_t k = 0; k < n; ++k) {
    int64_t element = 0;
    for (size_t d = 0; d < index.size(); ++d) element += (box.start[d] + index[d]) * row_stride[d];
    out += file.read_string(t.file_offset + static_cast<uint64_t>(element) * es, es);
    for (size_t d = index.size(); d-- > 0;) {
      if (++index[d] < box.extent[d]) break;
      index[d] = 0;
    }
  }
  return out;
}

std::vector<int64_t> ints(const json& j) { return j.get<std::vector<int64_t>>(); }

// ---- every rank file of every FSDP fixture ------------------------------------------------

// Checks one rank file against layout.json (the generator's record of what torch saved) and
// its data against the matching region of expected.safetensors.
void check_rank_file(const json& fx, int rank) {
  const std::string path = rank_file(fx, "model", rank);
  SCOPED_TRACE(path);
  const TorchFile tf = TorchFile::open(path);
  const json layout = load_json(fixtures_dir() + "/" + fx["layout"].get<std::string>());
  const std::string expected_path = fixtures_dir() + "/" + fx["expected"].get<std::string>();
  const SafetensorsFile expected = SafetensorsFile::open(expected_path);
  const int world = fx["world_size"].get<int>();

  std::vector<std::string> names, layout_names;
  for (const auto& e : tf.entries()) names.push_back(e.name);
  for (const auto& [name, info] : layout.items()) layout_names.push_back(name);
  EXPECT_EQ(names, layout_names) << "entries must be the state dict's, in its order";

  for (const StateEntry& e : tf.entries()) {
    SCOPED_TRACE(e.name);
    const json& info = layout.at(e.name);
    const SafetensorsTensor* want = expected.find(e.name);
    ASSERT_NE(want, nullptr);
    EXPECT_EQ(e.dtype(), want->dtype);
    EXPECT_EQ(e.global_shape(), want->shape);
    const std::vector<int64_t> local_shape = ints(info["local_shapes"][rank]);

    if (const auto* d = std::get_if<DTensorValue>(&e.value)) {
      ASSERT_TRUE(info.contains("placements")) << "layout.json says this is not a DTensor";
      EXPECT_EQ(d->global_size, ints(info["global_shape"]));
      std::vector<Placement> want_placements;
      for (const auto& p : info["placements"]) want_placements.push_back(parse_placement(p.get<std::string>()));
      ASSERT_EQ(d->placements.size(), want_placements.size());
      for (size_t i = 0; i < want_placements.size(); ++i) {
        EXPECT_EQ(d->placements[i].kind, want_placements[i].kind) << i;
        EXPECT_EQ(d->placements[i].dim, want_placements[i].dim) << i;
        EXPECT_EQ(d->placements[i].split_factor, want_placements[i].split_factor) << i;
      }
      EXPECT_EQ(d->mesh.shape, ints(info["mesh_shape"]));
      EXPECT_EQ(d->mesh.dim_names, info["mesh_dim_names"].get<std::vector<std::string>>());
      // The rank's coordinate on the root mesh (manifest), restricted to this DTensor's mesh
      // dims by name (TP fixtures put embeddings on the 1-D 'dp' sub-mesh).
      const auto root_names = fx["mesh_dim_names"].get<std::vector<std::string>>();
      const auto root_coord = unravel(rank, ints(fx["mesh_shape"]));
      std::vector<int64_t> coord;
      for (const auto& name : d->mesh.dim_names)
        coord.push_back(root_coord[std::find(root_names.begin(), root_names.end(), name) - root_names.begin()]);
      EXPECT_EQ(d->mesh.coordinate, coord);
      EXPECT_EQ(d->local.size, local_shape);

      const Box box = expected_box(d->global_size, want_placements, d->mesh.shape, coord);
      EXPECT_EQ(box.extent, local_shape) << "chunk arithmetic disagrees with what torch saved";
      EXPECT_EQ(read_view(tf, d->local), read_box(expected_path, *want, box)) << "local data";
    } else if (const auto* st = std::get_if<ShardedTensorValue>(&e.value)) {
      EXPECT_EQ(info["type"], "ShardedTensor");
      EXPECT_EQ(st->global_size, ints(info["global_shape"]));
      // FSDP1 shards dim 0 torch.chunk-wise over the world.
      ASSERT_EQ(st->all_shards.size(), static_cast<size_t>(world));
      for (int r = 0; r < world; ++r) {
        const auto [b, end] = chunk_range(st->global_size[0], world, r);
        std::vector<int64_t> offsets(st->global_size.size(), 0), sizes = st->global_size;
        offsets[0] = b;
        sizes[0] = end - b;
        EXPECT_EQ(st->all_shards[r].offsets, offsets) << "shard " << r;
        EXPECT_EQ(st->all_shards[r].sizes, sizes) << "shard " << r;
        EXPECT_EQ(st->all_shards[r].sizes, ints(info["local_shapes"][r])) << "shard " << r;
        EXPECT_EQ(st->all_shards[r].placement, "rank:" + std::to_string(r));
      }
      ASSERT_EQ(st->local_shards.size(), 1u);
      const auto& local = st->local_shards[0];
      EXPECT_EQ(local.offsets, st->all_shards[rank].offsets);
      EXPECT_EQ(local.view.size, local_shape);
      EXPECT_EQ(read_view(tf, local.view), read_box(expected_path, *want, Box{local.offsets, local.view.size}));
    } else {
      const auto& v = std::get<TensorView>(e.value);
      EXPECT_EQ(info["type"], "Tensor");
      EXPECT_EQ(v.size, local_shape);
      EXPECT_EQ(read_view(tf, v), read_box(expected_path, *want, Box{std::vector<int64_t>(v.size.size(), 0), v.size}));
    }
  }
}

TEST(TorchFixtures, EveryRankFileMatchesLayoutAndExpectedData) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const auto fixtures = fsdp_fixtures();
  ASSERT_GE(fixtures.size(), 10u);
  size_t files = 0;
  for (const auto& fx : fixtures) {
    for (int rank = 0; rank < fx["world_size"].get<int>(); ++rank) {
      check_rank_file(fx, rank);
      ++files;
    }
  }
  EXPECT_GE(files, 40u);
}

TEST(TorchFixtures, ValueTypesMatchTheManifest) {
  SHARDMERGE_REQUIRE_FIXTURES();
  for (const auto& fx : fsdp_fixtures()) {
    SCOPED_TRACE(fx["name"].get<std::string>());
    std::map<std::string, int> counts;
    const TorchFile tf = TorchFile::open(rank_file(fx, "model", 0));
    for (const auto& e : tf.entries())
      counts[e.is_plain() ? "Tensor" : std::holds_alternative<DTensorValue>(e.value) ? "DTensor" : "ShardedTensor"]++;
    EXPECT_EQ(counts, (fx["value_types"].get<std::map<std::string, int>>()));
  }
}

// ---- the special cases ---------------------------------------------------------------------

TEST(TorchFsdp2, StoragesArePaddedToTheFirstChunk) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const TorchFile tf = TorchFile::open(rank_file(fixture("qwen2_fsdp2_w2"), "model", 1));
  const auto& embed = std::get<DTensorValue>(entry(tf, "model.embed_tokens.weight").value);
  EXPECT_EQ(embed.local.size, (std::vector<int64_t>{125, 32}));
  EXPECT_EQ(embed.local.stride, (std::vector<int64_t>{32, 1}));
  EXPECT_EQ(embed.local.storage_offset, 0);
  EXPECT_EQ(embed.local.storage_nbytes, 126u * 32 * 4);  // padded to rank 0's 126 rows
  EXPECT_TRUE(embed.local.is_contiguous());
  EXPECT_EQ(embed.local.numel(), 125u * 32);
}

TEST(TorchFsdp2, EmptyLocalShardOfTheCriticScore) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const json fx = fixture("qwen2_critic_fsdp2_w2");
  const TorchFile rank1 = TorchFile::open(rank_file(fx, "model", 1));
  const auto& weight = std::get<DTensorValue>(entry(rank1, "score.weight").value);
  EXPECT_EQ(weight.global_size, (std::vector<int64_t>{1, 32}));
  EXPECT_EQ(weight.local.size, (std::vector<int64_t>{0, 32}));
  EXPECT_EQ(weight.local.numel(), 0u);
  EXPECT_EQ(weight.local.storage_nbytes, 32u * 4);  // the storage still holds one padded row
  const auto& bias = std::get<DTensorValue>(entry(rank1, "score.bias").value);
  EXPECT_EQ(bias.local.size, (std::vector<int64_t>{0}));
  EXPECT_EQ(bias.local.storage_nbytes, 4u);
  const TorchFile rank0 = TorchFile::open(rank_file(fx, "model", 0));
  EXPECT_EQ(std::get<DTensorValue>(entry(rank0, "score.weight").value).local.size, (std::vector<int64_t>{1, 32}));
}

TEST(TorchFsdp1, DTensorStoragesAreNotPadded) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const TorchFile tf = TorchFile::open(rank_file(fixture("qwen2_fsdp1_w2"), "model", 1));
  size_t checked = 0;
  for (const auto& e : tf.entries()) {
    const auto& d = std::get<DTensorValue>(e.value);
    EXPECT_EQ(d.local.storage_nbytes, d.local.numel() * 4) << e.name;
    ++checked;
  }
  EXPECT_EQ(checked, 27u);
  const auto& embed = std::get<DTensorValue>(entry(tf, "model.embed_tokens.weight").value);
  EXPECT_EQ(embed.local.storage_nbytes, 125u * 32 * 4);
}

TEST(TorchFsdp1, OneRankNoShardIsPlainTensorsFromRebuildFromType) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const TorchFile tf = TorchFile::open(rank_file(fixture("qwen2_fsdp1_w1"), "model", 0));
  ASSERT_EQ(tf.entries().size(), 27u);
  for (const auto& e : tf.entries()) EXPECT_TRUE(e.is_plain()) << e.name;
  const auto& embed = std::get<TensorView>(entry(tf, "model.embed_tokens.weight").value);
  EXPECT_EQ(embed.size, (std::vector<int64_t>{251, 32}));
  EXPECT_EQ(embed.dtype, DType::F32);
}

TEST(TorchShardedTensor, LocalShardAndAllShardMetadata) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const TorchFile tf = TorchFile::open(rank_file(fixture("qwen2_fsdp1_sharded_tensor_w2"), "model", 1));
  const auto& st = std::get<ShardedTensorValue>(entry(tf, "model.embed_tokens.weight").value);
  EXPECT_EQ(st.global_size, (std::vector<int64_t>{251, 32}));
  EXPECT_EQ(st.dtype, DType::F32);
  ASSERT_EQ(st.local_shards.size(), 1u);
  EXPECT_EQ(st.local_shards[0].offsets, (std::vector<int64_t>{126, 0}));
  EXPECT_EQ(st.local_shards[0].view.size, (std::vector<int64_t>{125, 32}));
  ASSERT_EQ(st.all_shards.size(), 2u);
  EXPECT_EQ(st.all_shards[0].offsets, (std::vector<int64_t>{0, 0}));
  EXPECT_EQ(st.all_shards[0].sizes, (std::vector<int64_t>{126, 32}));
  EXPECT_EQ(st.all_shards[1].offsets, (std::vector<int64_t>{126, 0}));
  EXPECT_EQ(st.all_shards[1].placement, "rank:1");
}

TEST(TorchHsdp, CoordinatesAndReplicatedDim) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const json fx = fixture("qwen2_hsdp_2x2");
  const TorchFile rank2 = TorchFile::open(rank_file(fx, "model", 2));
  const auto& d = std::get<DTensorValue>(entry(rank2, "model.embed_tokens.weight").value);
  EXPECT_EQ(d.mesh.shape, (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(d.mesh.dim_names, (std::vector<std::string>{"ddp", "fsdp"}));
  EXPECT_EQ(d.mesh.coordinate, (std::vector<int64_t>{1, 0}));
  ASSERT_EQ(d.placements.size(), 2u);
  EXPECT_EQ(d.placements[0].to_string(), "Replicate()");
  EXPECT_EQ(d.placements[1].to_string(), "Shard(0)");
  // shard_order: tensor dim 0 is sharded on mesh dim 1.
  ASSERT_EQ(d.shard_order.size(), 1u);
  EXPECT_EQ(d.shard_order[0].first, 0);
  EXPECT_EQ(d.shard_order[0].second, (std::vector<int64_t>{1}));
  // Rank 2 replicates rank 0 (same fsdp coordinate): the same rows, the same bytes.
  const TorchFile rank0 = TorchFile::open(rank_file(fx, "model", 0));
  const auto& d0 = std::get<DTensorValue>(entry(rank0, "model.embed_tokens.weight").value);
  EXPECT_EQ(read_view(rank2, d.local), read_view(rank0, d0.local));
}

TEST(TorchTensorParallel, StridedShardAndDpSubMesh) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const TorchFile tf = TorchFile::open(rank_file(fixture("qwen2_fsdp2_tp_2x2"), "model", 1));  // (dp 0, tp 1)
  const auto& q = std::get<DTensorValue>(entry(tf, "model.layers.0.self_attn.q_proj.weight").value);
  ASSERT_EQ(q.placements.size(), 2u);
  EXPECT_EQ(q.placements[0].kind, PlacementKind::StridedShard);
  EXPECT_EQ(q.placements[0].dim, 0);
  EXPECT_EQ(q.placements[0].split_factor, 2);
  EXPECT_EQ(q.placements[0].to_string(), "_StridedShard(0, sf=2)");
  EXPECT_EQ(q.placements[1].to_string(), "Shard(0)");
  EXPECT_TRUE(q.shard_order.empty());  // None when _StridedShard is present
  EXPECT_EQ(q.mesh.coordinate, (std::vector<int64_t>{0, 1}));

  const auto& o = std::get<DTensorValue>(entry(tf, "model.layers.0.self_attn.o_proj.weight").value);
  EXPECT_EQ(o.local.size, (std::vector<int64_t>{16, 16}));
  ASSERT_EQ(o.shard_order.size(), 2u);
  EXPECT_EQ(o.shard_order[1].first, 1);
  EXPECT_EQ(o.shard_order[1].second, (std::vector<int64_t>{1}));

  const auto& embed = std::get<DTensorValue>(entry(tf, "model.embed_tokens.weight").value);
  EXPECT_EQ(embed.mesh.dim_names, (std::vector<std::string>{"dp"}));
  EXPECT_EQ(embed.mesh.shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(embed.mesh.coordinate, (std::vector<int64_t>{0}));  // rank 1 holds rank 0's rows
}

TEST(TorchBuffers, PersistentBuffersArePlainAndFirst) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const json fx = fixture("qwen2_fsdp2_buffers_w2");
  const std::string expected_path = fixtures_dir() + "/" + fx["expected"].get<std::string>();
  const SafetensorsFile expected = SafetensorsFile::open(expected_path);
  std::string first_rank_counter;
  for (int rank = 0; rank < 2; ++rank) {
    const TorchFile tf = TorchFile::open(rank_file(fx, "model", rank));
    ASSERT_GE(tf.entries().size(), 2u);
    EXPECT_EQ(tf.entries()[0].name, "model.step_counter");
    EXPECT_EQ(tf.entries()[1].name, "model.layer_scalar");
    const auto& counter = std::get<TensorView>(tf.entries()[0].value);
    EXPECT_EQ(counter.dtype, DType::I64);
    EXPECT_TRUE(counter.size.empty());
    EXPECT_TRUE(counter.stride.empty());
    EXPECT_EQ(counter.numel(), 1u);
    const std::string bytes = read_view(tf, counter);
    EXPECT_EQ(bytes, read_box(expected_path, *expected.find("model.step_counter"), Box{}));
    if (rank == 0) first_rank_counter = bytes;
    EXPECT_EQ(bytes, first_rank_counter);  // identical on every rank
    const auto& scalar = std::get<TensorView>(tf.entries()[1].value);
    EXPECT_EQ(scalar.dtype, DType::F32);
    EXPECT_EQ(scalar.size, (std::vector<int64_t>{4}));
  }
}

TEST(TorchBf16, ParametersAreBFloat16) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const TorchFile tf = TorchFile::open(rank_file(fixture("qwen2_bf16_fsdp2_w2"), "model", 0));
  for (const auto& e : tf.entries()) {
    EXPECT_EQ(e.dtype(), DType::BF16) << e.name;
    EXPECT_EQ(std::get<DTensorValue>(e.value).local.storage_nbytes % 2, 0u) << e.name;
  }
  const auto& embed = std::get<DTensorValue>(entry(tf, "model.embed_tokens.weight").value);
  EXPECT_EQ(embed.local.storage_nbytes, 126u * 32 * 2);
}

TEST(TorchTied, LmHeadSharesTheEmbeddingStorageInFsdp2Only) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const TorchFile fsdp2 = TorchFile::open(rank_file(fixture("qwen2_fsdp2_w2"), "model", 0));
  const auto& embed = std::get<DTensorValue>(entry(fsdp2, "model.embed_tokens.weight").value);
  const auto& head = std::get<DTensorValue>(entry(fsdp2, "lm_head.weight").value);
  EXPECT_EQ(head.local.storage_key, embed.local.storage_key);
  EXPECT_EQ(fsdp2.storage_offset_in_file(head.local), fsdp2.storage_offset_in_file(embed.local));
  EXPECT_EQ(head.placements[0].to_string(), embed.placements[0].to_string());

  const TorchFile fsdp1 = TorchFile::open(rank_file(fixture("qwen2_fsdp1_w2"), "model", 0));
  const auto& embed1 = std::get<DTensorValue>(entry(fsdp1, "model.embed_tokens.weight").value);
  const auto& head1 = std::get<DTensorValue>(entry(fsdp1, "lm_head.weight").value);
  EXPECT_NE(head1.local.storage_key, embed1.local.storage_key);
  EXPECT_EQ(read_view(fsdp1, head1.local), read_view(fsdp1, embed1.local));  // same values, own copy
}

// ---- optimizer and extra-state files -------------------------------------------------------

TEST(TorchTrainingState, OptimizerTensorsAreFoundInNestedDicts) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const json fx = fixture("qwen2_fsdp2_w2");
  const TorchFile optim = TorchFile::open(rank_file(fx, "optim", 1));
  // 26 parameters (lm_head is tied to the embedding) x (step, exp_avg, exp_avg_sq);
  // param_groups hold no tensors.
  EXPECT_EQ(optim.entries().size(), 78u);
  const auto& step = std::get<TensorView>(entry(optim, "state.0.step").value);
  EXPECT_TRUE(step.size.empty());
  EXPECT_EQ(step.dtype, DType::F32);
  const auto& exp_avg = std::get<DTensorValue>(entry(optim, "state.0.exp_avg").value);
  EXPECT_EQ(exp_avg.global_size, (std::vector<int64_t>{251, 32}));
  EXPECT_EQ(exp_avg.local.size, (std::vector<int64_t>{125, 32}));
  EXPECT_NO_THROW(entry(optim, "state.25.exp_avg_sq"));
  for (const auto& e : optim.entries()) EXPECT_EQ(e.name.rfind("param_groups", 0), std::string::npos) << e.name;

  // FSDP1: flat-parameter shards as plain 1-D tensors.
  const TorchFile flat = TorchFile::open(rank_file(fixture("qwen2_fsdp1_w2"), "optim", 1));
  const auto& flat_avg = std::get<TensorView>(entry(flat, "state.0.exp_avg").value);
  EXPECT_EQ(flat_avg.size.size(), 1u);
}

TEST(TorchTrainingState, ExtraStateWithNumpyAndOpaqueObjectsParses) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const TorchFile extra = TorchFile::open(rank_file(fixture("qwen2_fsdp2_w2"), "extra_state", 0));
  // The CPU RNG state is a ByteStorage tensor; numpy's and Python's RNG states are opaque objects.
  ASSERT_EQ(extra.entries().size(), 1u);
  EXPECT_EQ(extra.entries()[0].name, "rng.cpu");
  EXPECT_EQ(extra.entries()[0].dtype(), DType::U8);
  const TorchFile data = TorchFile::open(fixtures_dir() + "/qwen2_fsdp2_w2/global_step_3/data.pt");
  EXPECT_TRUE(data.entries().empty());
}

// ---- hostile files -------------------------------------------------------------------------

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return s;
}

TEST(TorchHostile, EveryHostileTorchFileFailsNamingTheProblemAndTheFile) {
  SHARDMERGE_REQUIRE_FIXTURES();
  size_t checked = 0;
  for (const auto& h : manifest()["hostile"]) {
    const std::string file = h["file"].get<std::string>();
    if (file.size() < 3 || file.substr(file.size() - 3) != ".pt") continue;
    SCOPED_TRACE(file);
    const std::string path = fixtures_dir() + "/" + file;
    try {
      TorchFile::open(path);
      ADD_FAILURE() << "loaded without an error";
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(path), std::string::npos) << what;
      bool matched = false;
      for (const auto& alt : h["expect_error_contains_any"])
        matched = matched || lower(what).find(lower(alt.get<std::string>())) != std::string::npos;
      EXPECT_TRUE(matched) << what << "\nexpected one of " << h["expect_error_contains_any"].dump();
    }
    ++checked;
  }
  EXPECT_EQ(checked, 9u);
}

TEST(TorchHostile, ControlsLoad) {
  SHARDMERGE_REQUIRE_FIXTURES();
  const TorchFile control = TorchFile::open(fixtures_dir() + "/hostile/control_rewritten.pt");
  const TorchFile original = TorchFile::open(rank_file(fixture("qwen2_fsdp2_w2"), "model", 1));
  ASSERT_EQ(control.entries().size(), original.entries().size());
  const auto& a = std::get<DTensorValue>(entry(control, "model.embed_tokens.weight").value);
  const auto& b = std::get<DTensorValue>(entry(original, "model.embed_tokens.weight").value);
  EXPECT_EQ(read_view(control, a.local), read_view(original, b.local));
}

// ---- hand-assembled pickles: what real files never hold ------------------------------------
// Pickle is a stack machine, so nested calls are plain concatenation: callable, arguments, R.

namespace pk {
std::string global(const std::string& module, const std::string& name) { return "c" + module + "\n" + name + "\n"; }
std::string str(const std::string& s) {
  std::string len(4, '\0');
  for (int i = 0; i < 4; ++i) len[i] = static_cast<char>(s.size() >> (8 * i));
  return "X" + len + s;
}
std::string integer(int64_t v) {
  std::string bytes(8, '\0');
  for (int i = 0; i < 8; ++i) bytes[i] = static_cast<char>(static_cast<uint64_t>(v) >> (8 * i));
  return "\x8a\x08"s + bytes;  // LONG1, 8 bytes: any int64
}
std::string tuple(const std::vector<std::string>& items) {
  std::string out = "(";
  for (const auto& i : items) out += i;
  return out + "t";
}
std::string ints(const std::vector<int64_t>& v) {
  std::vector<std::string> items;
  for (int64_t x : v) items.push_back(integer(x));
  return tuple(items);
}
std::string dict(const std::vector<std::pair<std::string, std::string>>& kv) {
  std::string out = "}(";
  for (const auto& [k, v] : kv) out += str(k) + v;
  return out + "u";
}
std::string call(const std::string& callable, const std::vector<std::string>& args) {
  return callable + tuple(args) + "R";
}
// cls.__new__(cls) then BUILD with `state`, as for DeviceMesh, DTensorSpec, placements.
std::string object(const std::string& module, const std::string& name, const std::string& state) {
  return global(module, name) + ")\x81" + state + "b";
}
std::string storage(const std::string& key, int64_t numel, const std::string& cls = "FloatStorage") {
  return tuple({str("storage"), global("torch", cls), str(key), str("cpu"), integer(numel)}) + "Q";
}
std::string tensor(const std::string& storage_pid, int64_t offset, const std::vector<int64_t>& size,
                   const std::vector<int64_t>& stride) {
  return call(global("torch._utils", "_rebuild_tensor_v2"),
              {storage_pid, integer(offset), ints(size), ints(stride), "\x89", call(global("collections", "OrderedDict"), {})});
}
std::string shard(int64_t dim) {
  return object("torch.distributed.tensor.placement_types", "Shard", dict({{"dim", integer(dim)}}));
}
std::string mesh(const std::vector<int64_t>& shape, const std::vector<int64_t>& coordinate) {
  std::vector<std::string> axes, names;
  for (int64_t n : shape) {
    axes.push_back(object("torch.distributed._mesh_layout", "_FlatLayout",
                          dict({{"shape", ints({n})}, {"stride", ints({1})}})));
    std::string name = "d";  // (not "d" + to_string(): GCC 12 warns falsely about that, -Wrestrict)
    name += std::to_string(axes.size());
    names.push_back(str(name));
  }
  return object("torch.distributed.device_mesh", "DeviceMesh",
                dict({{"_layout", object("torch.distributed._mesh_layout", "_MeshLayout", dict({{"axes", tuple(axes)}}))},
                      {"_mesh_dim_names", tuple(names)},
                      {"_coordinate_on_dim", ints(coordinate)}}));
}
std::string dtensor(const std::vector<int64_t>& global_size, const std::string& local, const std::string& device_mesh,
                    const std::vector<std::string>& placements, const std::string& dtype = "float32") {
  const std::string cls = global("torch.distributed.tensor", "DTensor");
  std::vector<int64_t> stride(global_size.size(), 1);
  const std::string wrapper_args =
      tuple({cls, global("torch", dtype), ints(global_size), ints(stride), integer(0), str("torch.strided"), str("cpu"), "\x89"});
  const std::string spec = object("torch.distributed.tensor._dtensor_spec", "DTensorSpec",
                                  dict({{"mesh", device_mesh}, {"placements", tuple(placements)}}));
  return call(global("torch._tensor", "_rebuild_from_type_v2"),
              {global("torch._utils", "_rebuild_wrapper_subclass"), cls, wrapper_args,
               tuple({"N", dict({{"_local_tensor", local}, {"_spec", spec}})})});
}
// {name: value, ...} + STOP, as torch.save of a dict.
std::string state_dict(const std::vector<std::pair<std::string, std::string>>& entries) {
  return "\x80\x02" + dict(entries) + ".";
}
}  // namespace pk

std::vector<StateEntry> collect(const std::string& pickle_bytes) {
  const pickle::Document doc = parse_torch_pickle(pickle_bytes);
  return collect_tensors(doc.root());
}

std::string collect_error(const std::string& pickle_bytes) {
  try {
    collect(pickle_bytes);
  } catch (const Error& e) {
    return e.what();
  }
  ADD_FAILURE() << "no error";
  return "";
}

// What a reader derives from an entry, as text: two decodings agree when these agree.
std::string entry_text(const StateEntry& e) {
  std::ostringstream out;
  out << e.name << ' ' << dtype_name(e.dtype()) << " [";
  for (int64_t d : e.global_shape()) out << d << ',';
  out << "] kind " << e.value.index();
  auto view = [&out](const TensorView& v) {
    out << " storage " << v.storage_key << '@' << v.storage_offset << " size";
    for (int64_t d : v.size) out << ' ' << d;
  };
  if (const auto* v = std::get_if<TensorView>(&e.value)) view(*v);
  if (const auto* d = std::get_if<DTensorValue>(&e.value)) {
    view(d->local);
    for (const Placement& p : d->placements) out << ' ' << p.to_string();
    for (int64_t c : d->mesh.coordinate) out << " @" << c;
  }
  if (const auto* t = std::get_if<ShardedTensorValue>(&e.value))
    for (const auto& l : t->local_shards) view(l.view);
  return out.str();
}

std::vector<std::string> entry_texts(const std::vector<StateEntry>& entries) {
  std::vector<std::string> out;
  for (const StateEntry& e : entries) out.push_back(entry_text(e));
  return out;
}

std::string data_pkl(const std::string& path) {
  const File file = File::open_read(path);
  return read_record_checked(file, TorchArchive::read(file).record("data.pkl"));
}

TEST(TorchStreaming, EqualsTheWholeParseOnEveryFixtureFile) {
  // Rank files, optimizer and extra-state files of every producer the fixtures hold.
  SHARDMERGE_REQUIRE_FIXTURES();
  size_t files = 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(fixtures_dir())) {
    if (e.path().extension() != ".pt" || e.path().string().find("hostile") != std::string::npos) continue;
    const std::string pickle_bytes = data_pkl(e.path().string());
    EXPECT_EQ(entry_texts(read_state_entries(pickle_bytes)), entry_texts(collect(pickle_bytes))) << e.path();
    ++files;
  }
  EXPECT_GE(files, 100u);
}

TEST(TorchStreaming, ManyBatchesOfDTensorsDecodeAsTheWholeParse) {
  // 3,000+ DTensors in batches of 1000 that share one memoized mesh and dtype: the streamed
  // parse frees each batch's values, and gives the same entries.
  const std::filesystem::path dir = std::filesystem::temp_directory_path() / ("sm-stream-" + std::to_string(::getpid()));
  synth::SyntheticOptions o;
  o.out_dir = dir.string();
  o.model = "moe-101k-tensors";
  o.layers = 2;
  o.world_size = 2;
  o.dtype = "bfloat16";
  const std::string role = synth::write_synthetic_fsdp(o).role_dir;
  const std::string pickle_bytes = data_pkl(role + "/model_world_size_2_rank_1.pt");
  std::filesystem::remove_all(dir);
  const auto streamed = read_state_entries(pickle_bytes);
  ASSERT_GT(streamed.size(), 3000u);
  EXPECT_EQ(entry_texts(streamed), entry_texts(collect(pickle_bytes)));
}

TEST(TorchStreaming, ATensorSharedAcrossBatchesOutlivesTheCollections) {
  // A DTensor memoized in the first batch and referenced again five batches later (one
  // Parameter under two names, as a tied lm_head is pickled): what its wrapper points to must
  // survive every collection in between. Fillers in between, half of them nested dicts.
  auto memo_index = [](uint32_t i) { return std::string(reinterpret_cast<const char*>(&i), 4); };
  const std::string local = pk::tensor(pk::storage("w", 8), 0, {2, 4}, {4, 1});
  std::string p = "\x80\x02}(";
  p += pk::str("w");
  p += pk::dtensor({4, 4}, local, pk::mesh({2}, {1}), {pk::shard(0)});
  p += "r";
  p += memo_index(900000);
  int filler = 0;
  for (int batch = 0; batch < 6; ++batch) {
    for (int i = 0; i < 999; ++i, ++filler) {
      std::string name = "f";
      name += std::to_string(filler);
      p += pk::str(name);
      // Every other one a nested dict {"w": tensor}: containers the collector has walked are
      // freed too, and their addresses come back as new ones.
      if (filler % 2) p += "}(" + pk::str("w");
      p += pk::tensor(pk::storage(std::to_string(filler), 4), 0, {4}, {1});
      if (filler % 2) p += "u";
    }
    p += "u(";
  }
  p += pk::str("tied");
  p += "j";
  p += memo_index(900000);
  p += "u.";
  const auto streamed = read_state_entries(p);
  ASSERT_EQ(streamed.size(), 5996u);
  EXPECT_EQ(entry_texts(streamed), entry_texts(collect(p)));
  EXPECT_EQ(entry_text(streamed.back()).substr(4), entry_text(streamed.front()).substr(1));
}

TEST(TorchStreaming, ContainersWhoseSlotsComeBackAreWalkedAgain) {
  // Every value a container ({"w": tensor}, as an optimizer state's per-parameter dicts), enough
  // of them for several collections: the collector walks each container once, and the VM frees
  // a batch's containers and reuses their slots in later batches. A new container at a freed one's address is another object, and its
  // tensor must be collected.
  std::string p = "\x80\x02}(";
  for (int i = 0; i < 20000; ++i) {
    std::string name = "p";
    name += std::to_string(i);
    p += pk::str(name);
    p += "}(" + pk::str("w");
    p += pk::tensor(pk::storage(std::to_string(i), 4), 0, {4}, {1});
    p += "u";
    if (i % 1000 == 999) p += "u(";
  }
  p += "u.";
  const auto streamed = read_state_entries(p);
  ASSERT_EQ(streamed.size(), 20000u);
  EXPECT_EQ(entry_texts(streamed), entry_texts(collect(p)));
}

TEST(TorchStreaming, RepeatedOrWrappedStateDictsFallBackToTheWholeParse) {
  const std::string a = pk::tensor(pk::storage("0", 4), 0, {4}, {1}), b = pk::tensor(pk::storage("1", 2), 0, {2}, {1});
  // "w" again in a second SETITEMS batch: the later tensor, at the first position (Python's dict).
  std::string repeated = "\x80\x02}(";
  for (const std::string& piece : {pk::str("w"), a, pk::str("x"), a, std::string("u("), pk::str("w"), b, std::string("u.")})
    repeated += piece;
  ASSERT_EQ(collect(repeated).size(), 2u);
  EXPECT_EQ(entry_texts(read_state_entries(repeated)), entry_texts(collect(repeated)));
  EXPECT_EQ(std::get<TensorView>(read_state_entries(repeated)[0].value).storage_key, "1");
  // The state dict inside a tuple: its tensors are named "0.w".
  std::string wrapped = "\x80\x02}(";
  for (const std::string& piece : {pk::str("w"), a, pk::str("x"), b, std::string("u\x85.")}) wrapped += piece;
  EXPECT_EQ(entry_texts(read_state_entries(wrapped)), entry_texts(collect(wrapped)));
  EXPECT_EQ(read_state_entries(wrapped)[0].name, "0.w");
  // A bad tensor in a streamed dict that is not the result: a whole parse never decodes it.
  const std::string bad = pk::tensor(pk::storage("2", 2), 0, {8}, {1});  // 8 elements in a storage of 2
  std::string unused = "\x80\x02}(";
  for (const std::string& piece : {pk::str("w"), bad, std::string("uK\x01.")}) unused += piece;
  EXPECT_TRUE(collect(unused).empty());
  EXPECT_TRUE(read_state_entries(unused).empty());
  std::string used = "\x80\x02}(";
  for (const std::string& piece : {pk::str("w"), bad, std::string("u.")}) used += piece;
  EXPECT_THROW(read_state_entries(used), Error);
}

TEST(TorchPickle, HandAssembledDTensorDecodes) {
  const std::string local = pk::tensor(pk::storage("0", 8), 0, {2, 4}, {4, 1});
  const auto entries = collect(pk::state_dict({{"w", pk::dtensor({4, 4}, local, pk::mesh({2}, {1}), {pk::shard(0)})}}));
  ASSERT_EQ(entries.size(), 1u);
  const auto& d = std::get<DTensorValue>(entries[0].value);
  EXPECT_EQ(d.global_size, (std::vector<int64_t>{4, 4}));
  EXPECT_EQ(d.local.size, (std::vector<int64_t>{2, 4}));
  EXPECT_EQ(d.mesh.shape, (std::vector<int64_t>{2}));
  EXPECT_EQ(d.mesh.coordinate, (std::vector<int64_t>{1}));
  EXPECT_EQ(d.mesh.dim_names, (std::vector<std::string>{"d1"}));
  EXPECT_EQ(d.local.storage_nbytes, 32u);
}

TEST(TorchPickle, InconsistentDTensorsAreRefused) {
  const std::string local = pk::tensor(pk::storage("0", 8), 0, {2, 4}, {4, 1});
  struct Case {
    std::string what;
    std::string pickle;
    std::string error;
  };
  const Case cases[] = {
      {"mesh with an empty dim", pk::dtensor({4, 4}, local, pk::mesh({0}, {0}), {pk::shard(0)}), "empty dim"},
      {"coordinate outside the mesh", pk::dtensor({4, 4}, local, pk::mesh({2}, {2}), {pk::shard(0)}), "outside the mesh"},
      {"negative coordinate", pk::dtensor({4, 4}, local, pk::mesh({2}, {-1}), {pk::shard(0)}), "outside the mesh"},
      {"mesh axis product overflow",
       pk::dtensor({4, 4}, local,
                   pk::object("torch.distributed.device_mesh", "DeviceMesh",
                              pk::dict({{"_layout", pk::object("torch.distributed._mesh_layout", "_MeshLayout",
                                                               pk::dict({{"axes", pk::tuple({pk::object(
                                                                                      "torch.distributed._mesh_layout",
                                                                                      "_FlatLayout",
                                                                                      pk::dict({{"shape", pk::ints({1ll << 40, 1ll << 40})},
                                                                                                {"stride", pk::ints({1, 1})}}))})}}))}})),
                   {pk::shard(0)}),
       "more than 2^63"},
      {"local larger than global", pk::dtensor({1, 4}, local, pk::mesh({2}, {0}), {pk::shard(0)}), "exceeds its global shape"},
      {"negative global dim", pk::dtensor({-4, 4}, local, pk::mesh({2}, {0}), {pk::shard(0)}), "negative dimension"},
      {"global numel overflow", pk::dtensor({1ll << 40, 1ll << 40}, local, pk::mesh({2}, {0}), {pk::shard(0)}), "more than 2^63"},
      {"placement count", pk::dtensor({4, 4}, local, pk::mesh({2}, {0}), {pk::shard(0), pk::shard(1)}), "2 placements for a 1-dim mesh"},
      {"placement dim out of range", pk::dtensor({4, 4}, local, pk::mesh({2}, {0}), {pk::shard(2)}), "Shard(2) on a 2-dim tensor"},
      {"dtype differs from the storage", pk::dtensor({4, 4}, local, pk::mesh({2}, {0}), {pk::shard(0)}, "bfloat16"),
       "DTensor is bfloat16 but its local tensor is float32"},
  };
  for (const auto& c : cases) {
    const std::string what = collect_error(pk::state_dict({{"w", c.pickle}}));
    EXPECT_NE(what.find(c.error), std::string::npos) << c.what << ": " << what;
    EXPECT_NE(what.find("tensor 'w'"), std::string::npos) << c.what << ": " << what;
  }
}

TEST(TorchPickle, OneTensorUnderTwoNamesIsCollectedUnderBoth) {
  // torch.save({'a': t, 'b': t}) memoizes t and writes 'b' as a BINGET of it.
  const std::string t = pk::tensor(pk::storage("0", 4), 0, {4}, {1});
  const std::string p = "\x80\x02}(" + pk::str("a") + t + "q\x07" + pk::str("b") + "h\x07" "u.";
  const auto entries = collect(p);
  ASSERT_EQ(entries.size(), 2u);
  EXPECT_EQ(entries[0].name, "a");
  EXPECT_EQ(entries[1].name, "b");
  EXPECT_EQ(std::get<TensorView>(entries[1].value).storage_key, "0");
}

TEST(TorchPickle, ViewsMustStayInsideTheirStorage) {
  const int64_t big = (1ll << 62) + 1;
  // 16 dims of (2^62 + 1) with stride 2^62: the last index is 16 * 2^124 = 2^128, which wraps
  // to 0 in 128-bit arithmetic and passed for a 4-element storage; its element count is refused.
  const std::string wrapping = pk::tensor(pk::storage("0", 4), 0, std::vector<int64_t>(16, big),
                                          std::vector<int64_t>(16, 1ll << 62));
  EXPECT_NE(collect_error(pk::state_dict({{"w", wrapping}})).find("more than 2^63 elements"), std::string::npos);
  // Eight elements whose last index, 3 * (2^63 - 1), does not fit 64 bits: said so, not truncated.
  const int64_t huge_stride = std::numeric_limits<int64_t>::max();
  const std::string far = pk::tensor(pk::storage("0", 4), 0, {2, 2, 2}, {huge_stride, huge_stride, huge_stride});
  EXPECT_NE(collect_error(pk::state_dict({{"w", far}})).find("needs more than 2^64 bytes"), std::string::npos);
  // Zero strides make a view of 2^80 elements over one element: numel would wrap around.
  const std::string broadcast = pk::tensor(pk::storage("0", 1), 0, {1ll << 40, 1ll << 40}, {0, 0});
  EXPECT_NE(collect_error(pk::state_dict({{"w", broadcast}})).find("more than 2^63 elements"), std::string::npos);
  // A legitimate zero-stride view (torch.save of an expanded tensor) is fine.
  const auto ok = collect(pk::state_dict({{"w", pk::tensor(pk::storage("0", 1), 0, {3, 5}, {0, 0})}}));
  ASSERT_EQ(ok.size(), 1u);
  EXPECT_EQ(std::get<TensorView>(ok[0].value).numel(), 15u);
  EXPECT_FALSE(std::get<TensorView>(ok[0].value).is_contiguous());
  // Negative values and one element past the end.
  EXPECT_NE(collect_error(pk::state_dict({{"w", pk::tensor(pk::storage("0", 4), -1, {1}, {1})}})).find("negative storage offset"),
            std::string::npos);
  EXPECT_NE(collect_error(pk::state_dict({{"w", pk::tensor(pk::storage("0", 4), 0, {2}, {-1})}})).find("negative stride"),
            std::string::npos);
  EXPECT_NE(collect_error(pk::state_dict({{"w", pk::tensor(pk::storage("0", 4), 1, {4}, {1})}})).find("needs 20 bytes"),
            std::string::npos);
}

TEST(TorchPickle, LazyNegationAndConjugationBitsAreRefused) {
  // torch.save(x.neg()) of a lazily negated view writes the un-negated bytes and a 7th
  // argument {'neg': True}; copying those bytes would write -x as x. Same for conj.
  auto with_metadata = [](const std::string& metadata) {
    return pk::call(pk::global("torch._utils", "_rebuild_tensor_v2"),
                    {pk::storage("0", 4), pk::integer(0), pk::ints({4}), pk::ints({1}), "\x89",
                     pk::call(pk::global("collections", "OrderedDict"), {}), metadata});
  };
  const std::string neg = collect_error(pk::state_dict({{"w", with_metadata(pk::dict({{"neg", "\x88"}}))}}));
  EXPECT_NE(neg.find("negation bit"), std::string::npos) << neg;
  EXPECT_NE(neg.find("tensor 'w'"), std::string::npos) << neg;
  const std::string conj = collect_error(pk::state_dict({{"w", with_metadata(pk::dict({{"conj", "\x88"}}))}}));
  EXPECT_NE(conj.find("conjugation bit"), std::string::npos) << conj;
  // The bits also reach a DTensor's local tensor.
  const std::string local = with_metadata(pk::dict({{"neg", "\x88"}}));
  const std::string dt = collect_error(pk::state_dict({{"w", pk::dtensor({4}, local, pk::mesh({1}, {0}), {pk::shard(0)})}}));
  EXPECT_NE(dt.find("negation bit"), std::string::npos) << dt;
  // False bits, as torch never writes them but a dict may hold them, are plain tensors.
  EXPECT_EQ(collect(pk::state_dict({{"w", with_metadata(pk::dict({{"neg", "\x89"}, {"conj", "\x89"}}))}})).size(), 1u);
}

TEST(TorchPickle, DeeplyNestedSubclassRebuildsAreRefused) {
  // _rebuild_from_type_v2(_rebuild_from_type_v2, None, (_rebuild_from_type_v2, None, (...))),
  // nested far past anything torch writes: the function is memo 0, the growing tuple memo 1,
  // so each level costs 10 bytes.
  std::string p = "\x80\x02" + pk::global("torch._tensor", "_rebuild_from_type_v2") + "q\x00" "0)q\x01" "0"s;
  for (int i = 0; i < 100000; ++i) p += "(h\x00" "Nh\x01" "tq\x01" "0"s;
  p += "h\x00" "h\x01" "R."s;
  try {
    parse_torch_pickle(p);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("nested more than"), std::string::npos) << e.what();
  }
}

TEST(TorchPickle, ShardedTensorShardsMustLieInsideTheGlobalShape) {
  auto sharded = [](std::vector<int64_t> offsets) {
    const std::string meta_mod = "torch.distributed._shard.metadata";
    const std::string shard_meta = pk::object(meta_mod, "ShardMetadata",
                                              pk::tuple({"N", pk::dict({{"shard_offsets", pk::ints(offsets)},
                                                                        {"shard_sizes", pk::ints({2, 4})}})}));
    const std::string local_shard = pk::object(
        "torch.distributed._shard.sharded_tensor.shard", "Shard",
        pk::tuple({"N", pk::dict({{"tensor", pk::tensor(pk::storage("0", 8), 0, {2, 4}, {4, 1})}, {"metadata", shard_meta}})}));
    const std::string st_meta = pk::object("torch.distributed._shard.sharded_tensor.metadata", "ShardedTensorMetadata",
                                           pk::dict({{"shards_metadata", "]" + shard_meta + "a"}}));
    const std::string cls = pk::global("torch.distributed._shard.sharded_tensor.api", "ShardedTensor");
    return pk::state_dict(
        {{"w", pk::call(pk::global("torch._tensor", "_rebuild_from_type_v2"),
                        {pk::global("torch._utils", "_rebuild_wrapper_subclass"), cls,
                         pk::tuple({cls, pk::global("torch", "float32"), pk::ints({4, 4}), pk::ints({4, 1})}),
                         pk::tuple({"]" + local_shard + "a", st_meta, "N", "N", "\x89"})})}});
  };
  const auto ok = collect(sharded({2, 0}));
  ASSERT_EQ(ok.size(), 1u);
  EXPECT_EQ(std::get<ShardedTensorValue>(ok[0].value).local_shards[0].offsets, (std::vector<int64_t>{2, 0}));
  EXPECT_NE(collect_error(sharded({3, 0})).find("outside the global shape"), std::string::npos);
  EXPECT_NE(collect_error(sharded({-1, 0})).find("outside the global shape"), std::string::npos);
}

}  // namespace
}  // namespace shardmerge
