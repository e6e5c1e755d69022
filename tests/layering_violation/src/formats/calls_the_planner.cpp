// A planted violation for tests/check_link_layering.sh: a formats/ object that calls into plan/
// through a declaration written here, which no #include line shows.
namespace shardmerge {
enum class LegacyTpSplit;
const char* to_string(LegacyTpSplit split);
}  // namespace shardmerge

const char* planted_upward_call() { return shardmerge::to_string(shardmerge::LegacyTpSplit{}); }
