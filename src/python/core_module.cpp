// shardmerge._core: the operations of src/api as a Python extension module (nanobind). The
// package's shardmerge/_api.py wraps them into shardmerge.inspect/plan/merge/verify; results
// cross as the JSON text the CLI's --json prints, which _api.py loads.
//
// A merge runs on its own thread (MergeJob); the calling Python thread waits on it in short
// slices with the GIL released, so between slices Python runs its signal handlers (Ctrl-C
// raises KeyboardInterrupt there) and the progress callback. Either one raising cancels the job:
// the executor stops at its next task, the output's temp directory is removed as the merge
// unwinds, and the Python exception is raised once the thread has ended.
#include <nanobind/nanobind.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <exception>
#include <functional>
#include <mutex>
#include <new>
#include <optional>
#include <thread>

#include "api/inspect.hpp"
#include "api/merge.hpp"
#include "api/plan.hpp"
#include "api/verify.hpp"
#include "shardmerge/error.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace shardmerge {
namespace {

PyObject* error_type = nullptr;  // shardmerge.Error: created at import, never freed

// shardmerge::Error becomes shardmerge.Error with its context as attributes, or ValueError for a
// usage error (a bad option); any other std::exception but bad_alloc becomes shardmerge.Error too.
void translate_error(const std::exception_ptr& p, void*) {
  std::string line, message, file, tensor;
  nb::object offset = nb::none();
  try {
    std::rethrow_exception(p);
  } catch (const Error& e) {
    if (e.exit_code() == ExitCode::usage) {
      PyErr_SetString(PyExc_ValueError, e.what());
      return;
    }
    line = e.what();
    message = e.message();
    file = e.file();
    tensor = e.tensor();
    if (e.offset()) offset = nb::int_(*e.offset());
  } catch (const std::bad_alloc&) {
    throw;  // nanobind's MemoryError
  } catch (const std::exception& e) {
    line = message = e.what();
  }
  auto text = [](const std::string& s) { return s.empty() ? nb::none() : nb::object(nb::str(s.c_str())); };
  nb::object err = nb::borrow(error_type)(nb::str(line.c_str()));
  err.attr("message") = nb::str(message.c_str());
  err.attr("file") = text(file);
  err.attr("tensor") = text(tensor);
  err.attr("offset") = offset;
  PyErr_SetObject(error_type, err.ptr());
}

// One merge (or fold-lora, or plan file run) on its own thread, planning included.
// Members the thread uses are declared before thread_, which starts it.
class MergeJob {
 public:
  MergeJob(api::MergeSource source, api::WriteOptions write)
      : source_(std::move(source)), write_(std::move(write)), thread_([this] { body(); }) {}
  MergeJob(const MergeJob&) = delete;
  MergeJob& operator=(const MergeJob&) = delete;
  // _api.py always joins; this is for a job dropped without (the merge is abandoned, not finished).
  ~MergeJob() {
    cancel_ = true;
    if (thread_.joinable()) {
      nb::gil_scoped_release unlocked;
      thread_.join();
    }
  }

  // Whether the merge has ended (succeeded or failed), waiting up to `seconds` for it.
  bool wait(double seconds) {
    nb::gil_scoped_release unlocked;
    std::unique_lock<std::mutex> lock(mutex_);
    return ended_cv_.wait_for(lock, std::chrono::duration<double>(seconds), [this] { return ended_; });
  }
  // (tensor bytes written, tensor bytes to write); (0, 0) until the plan is made.
  std::pair<uint64_t, uint64_t> progress() const { return {done_.load(), total_.load()}; }
  void cancel() { cancel_ = true; }
  // Waits for the end; the summary as JSON text, or the merge's error.
  std::string result() {
    if (thread_.joinable()) {
      nb::gil_scoped_release unlocked;
      thread_.join();
    }
    if (error_) std::rethrow_exception(error_);
    return summary_;
  }

 private:
  void body() {
    api::MergeHooks hooks;
    hooks.cancel = &cancel_;
    hooks.on_start = [this](const PlannedMerge&, const std::string&, uint64_t total) { total_ = total; };
    hooks.on_written = [this](uint64_t n) { done_.fetch_add(n, std::memory_order_relaxed); };
    try {
      const api::MergeOutcome out = api::merge(source_, write_, hooks);
      summary_ = out.summary ? out.summary->to_json().dump() : "null";
    } catch (...) {
      error_ = std::current_exception();
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ended_ = true;
    }
    ended_cv_.notify_all();
  }

  const api::MergeSource source_;
  const api::WriteOptions write_;
  std::atomic<bool> cancel_{false};
  std::atomic<uint64_t> done_{0}, total_{0};
  std::mutex mutex_;
  std::condition_variable ended_cv_;
  bool ended_ = false;
  std::string summary_;
  std::exception_ptr error_;
  std::thread thread_;
};

}  // namespace
}  // namespace shardmerge

NB_MODULE(_core, m) {
  using namespace shardmerge;
  error_type = PyErr_NewExceptionWithDoc(
      "shardmerge.Error",
      "A checkpoint, plan or output that shardmerge cannot handle. .file, .tensor and .offset (or None) say where; "
      ".message is the text without them.",
      PyExc_RuntimeError, nullptr);
  m.attr("Error") = nb::borrow(error_type);
  nb::register_exception_translator(translate_error);

  nb::class_<api::MergeOptions>(m, "MergeOptions")
      .def(nb::init<>())
      .def_rw("local_dir", &api::MergeOptions::local_dir)
      .def_rw("backend", &api::MergeOptions::backend)
      .def_rw("dtype", &api::MergeOptions::dtype)
      .def_rw("max_shard_size", &api::MergeOptions::max_shard_size)
      .def_rw("lora", &api::MergeOptions::lora)
      .def_rw("lora_alpha", &api::MergeOptions::lora_alpha)
      .def_rw("force_lora_alpha", &api::MergeOptions::force_lora_alpha)
      .def_rw("tie_word_embedding", &api::MergeOptions::tie_word_embedding)
      .def_rw("is_value_model", &api::MergeOptions::is_value_model)
      .def_rw("role", &api::MergeOptions::role)
      .def_rw("hf_model_path", &api::MergeOptions::hf_model_path)
      .def_rw("runtime_names", &api::MergeOptions::runtime_names);

  nb::class_<api::WriteOptions>(m, "WriteOptions")
      .def(nb::init<>())
      .def_rw("target", &api::WriteOptions::target)
      .def_rw("threads", &api::WriteOptions::threads)
      .def_rw("memory_limit", &api::WriteOptions::memory_limit)
      .def_rw("device", &api::WriteOptions::device)
      .def_rw("gpu_memory", &api::WriteOptions::gpu_memory)
      .def_rw("profile", &api::WriteOptions::profile)
      .def_rw("verify", &api::WriteOptions::verify)
      .def_rw("force", &api::WriteOptions::force)
      .def_rw("no_crc", &api::WriteOptions::no_crc)
      .def_rw("multi_process", &api::WriteOptions::multi_process)
      .def_rw("transport", &api::WriteOptions::transport)
      .def_rw("peer_timeout", &api::WriteOptions::peer_timeout);

  nb::class_<api::FoldLoraOptions>(m, "FoldLoraOptions")
      .def(nb::init<>())
      .def_rw("base", &api::FoldLoraOptions::base)
      .def_rw("adapter", &api::FoldLoraOptions::adapter)
      .def_rw("dtype", &api::FoldLoraOptions::dtype)
      .def_rw("max_shard_size", &api::FoldLoraOptions::max_shard_size)
      .def_rw("lora_alpha", &api::FoldLoraOptions::lora_alpha)
      .def_rw("force_lora_alpha", &api::FoldLoraOptions::force_lora_alpha);

  // Options are checked here (a bad one raises at once); the job plans and merges on its own
  // thread, and its errors come from result().
  nb::class_<MergeJob>(m, "MergeJob")
      .def_static(
          "merge", [](const api::MergeOptions& o, const api::WriteOptions& w) {
            return new MergeJob(api::to_request(o), w);
          },
          "merge"_a, "write"_a, nb::rv_policy::take_ownership)
      .def_static(
          "fold_lora", [](const api::FoldLoraOptions& o, const api::WriteOptions& w) {
            return new MergeJob(api::to_request(o), w);
          },
          "fold"_a, "write"_a, nb::rv_policy::take_ownership)
      .def_static(
          "plan_file", [](const std::string& path, const api::WriteOptions& w) {
            return new MergeJob(api::PlanFile{path}, w);
          },
          "path"_a, "write"_a, nb::rv_policy::take_ownership)
      .def("wait", &MergeJob::wait, "seconds"_a)
      .def("progress", &MergeJob::progress)
      .def("cancel", &MergeJob::cancel)
      .def("result", &MergeJob::result);

  m.def(
      "inspect",
      [](const std::string& path, bool tensors) {
        nb::gil_scoped_release unlocked;
        return api::inspect(path, tensors).dump();
      },
      "path"_a, "tensors"_a);
  m.def(
      "plan",
      [](const api::MergeOptions& o, const std::string& out) {
        nb::gil_scoped_release unlocked;
        return api::plan_json(api::plan(o, out), o).dump();
      },
      "options"_a, "out"_a);
  m.def(
      "verify",
      [](const api::MergeOptions& o, const std::string& test_hf_dir, double atol) {
        nb::gil_scoped_release unlocked;
        return api::verify(api::VerifyOptions{o, test_hf_dir, atol}).summary.dump();
      },
      "options"_a, "test_hf_dir"_a, "atol"_a);
}
