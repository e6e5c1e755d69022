// `shardmerge inspect PATH [--json] [--tensors]`: the report of api/inspect.hpp, as JSON or as
// indented lines.
#include <algorithm>
#include <cstdio>
#include <iostream>

#include "api/inspect.hpp"
#include "cli/commands.hpp"
#include "layouts/layout.hpp"
#include "util/units.hpp"

using json = nlohmann::ordered_json;

namespace shardmerge::cli {
namespace {

// A report value as text: scalars as they read, lists comma-separated; objects are nested
// lines (see print_entry), never JSON.
std::string scalar_text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_boolean()) return v.get<bool>() ? "yes" : "no";
  if (v.is_null()) return "-";
  return v.dump();
}

bool is_flat_list(const json& v) {
  if (!v.is_array()) return false;
  for (const auto& e : v)
    if (e.is_structured()) return false;
  return true;
}

void print_entry(const std::string& key, const json& value, int indent) {
  const std::string label = key + ":";
  if (!value.empty() && (value.is_object() || (value.is_array() && !is_flat_list(value)))) {
    std::printf("%*s%s\n", indent, "", label.c_str());
    size_t i = 0;
    for (const auto& [k, v] : value.items())
      if (!v.is_null()) print_entry(value.is_array() ? std::to_string(i++) : k, v, indent + 2);
    return;
  }
  std::string text;
  if (value.is_structured()) {  // a flat list, or an empty object
    for (const auto& e : value) text += (text.empty() ? "" : ", ") + scalar_text(e);
    if (text.empty()) text = "none";
  } else {
    text = scalar_text(value);
  }
  std::printf("%*s%-*s %s\n", indent, "", std::max(0, 21 - indent), label.c_str(), text.c_str());
}

void print_human(const json& j) {
  std::printf("%s: %s\n", j["path"].get<std::string>().c_str(), j["kind"].get<std::string>().c_str());
  for (const auto& [key, value] : j.items()) {
    if (key == "path" || key == "kind" || key == "warnings" || key == "next" || key == "tensor_list" || key == "tensors")
      continue;
    if (key == "lora") {
      for (const auto& l : value) print_entry("lora", l, 2);
      continue;
    }
    if (key == "saved_names") {
      const std::string how = value["conversion"].is_string() ? value["conversion"].get<std::string>()
                              : value["refused"].get<bool>() ? std::string("refused (--keep-runtime-names)")
                                                             : std::string("as at run time");
      print_entry("saved names", how + " [" + value["class"].get<std::string>() + "]", 2);
      continue;
    }
    if (key == "steps") {
      std::string s;
      for (const auto& st : value) s += (s.empty() ? "" : ", ") + std::to_string(st["step"].get<int64_t>());
      print_entry("steps", s, 2);
      continue;
    }
    if (key == "adapter_config") {  // what decides the fold; --json has the whole file
      json shown = json::object();
      for (const char* k : {"peft_type", "r", "lora_alpha", "use_rslora", "target_modules", "rank_pattern", "alpha_pattern",
                            "fan_in_fan_out", "modules_to_save", "base_model_name_or_path"})
        if (value.contains(k) && !value[k].is_null()) shown[k] = value[k];
      print_entry(key, shown, 2);
      continue;
    }
    if (key == "source_tensor_bytes") {
      print_entry("tensor bytes", format_bytes(value.get<uint64_t>()), 2);
      continue;
    }
    print_entry(key, value, 2);
  }
  // The count and, with --tensors, the list under one "tensors:" line.
  if (j.contains("tensors") || j.contains("tensor_list"))
    print_entry("tensors", j.contains("tensors") ? j["tensors"] : json(j["tensor_list"].size()), 2);
  if (j.contains("tensor_list")) {
    for (const auto& t : j["tensor_list"]) {
      std::string shape;
      for (const auto& d : t["shape"]) shape += (shape.empty() ? "" : ",") + d.dump();
      std::printf("    %-60s %-9s %-18s %10s  %s\n", t["name"].get<std::string>().c_str(),
                  t["dtype"].get<std::string>().c_str(), ("[" + shape + "]").c_str(),
                  format_bytes(t["bytes"].get<uint64_t>()).c_str(),
                  t.contains("placement") ? t["placement"].get<std::string>().c_str()
                                          : t.value("file", std::string()).c_str());
    }
  }
  for (const auto& w : j["warnings"]) std::printf("  warning: %s\n", w.get<std::string>().c_str());
  for (const auto& n : j["next"]) std::printf("  next: %s\n", n.get<std::string>().c_str());
}

}  // namespace

void add_inspect(CLI::App& app, Runner& run) {
  auto* cmd = app.add_subcommand("inspect", "Say what a checkpoint path holds and how to merge it (reads no tensor data)");
  auto path = std::make_shared<std::string>();
  auto as_json = std::make_shared<bool>(false);
  auto tensors = std::make_shared<bool>(false);
  cmd->add_option("path", *path, "Run root, step root, role directory, HF model or PEFT adapter")->required();
  cmd->add_flag("--json", *as_json, "Print the report as JSON");
  cmd->add_flag("--tensors", *tensors, "List every tensor: name, dtype, global shape, placement, bytes");
  cmd->callback([&run, path, as_json, tensors] {
    run = [path, as_json, tensors] {
      const json j = api::inspect(*path, *tensors);
      if (*as_json) std::cout << j.dump(2) << "\n";
      else print_human(j);
      return j["kind"] == layouts::kind_name(layouts::Kind::Unknown) ? 1 : 0;
    };
  });
}

}  // namespace shardmerge::cli
