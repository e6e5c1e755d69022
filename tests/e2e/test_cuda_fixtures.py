"""The CUDA executor writes what the CPU executor writes, on every real fixture (FSDP and
Megatron): the same files, byte for byte, except that a LoRA fold may differ by one unit in the
last place of the output dtype (cuBLAS and OpenBLAS sum in different orders). The oracle is the
CPU executor's tree, read back with the safetensors package. Skips, saying why, without a GPU
or without a CUDA build. SHARDMERGE_GPU_WRAPPER (e.g. "compute-sanitizer --tool memcheck
--error-exitcode 86") runs every GPU merge under that command; bench/gpu_check.sh sets it."""
import os
import shlex
import subprocess

import pytest

pytest.importorskip("torch")
pytest.importorskip("safetensors")

from e2e_util import hf_weight_files, load_hf, megatron_merge_args, tree_digest, ulp_distance  # noqa: E402

NO_GPU_MARKERS = ("no CUDA device is usable", "has no CUDA executor")
# The CUDA context and cuBLAS count against --memory-limit (estimated 256 + 224 MiB).
GPU_OPTIONS = ("--device", "cuda", "--memory-limit", "2GiB", "--verify")


def merge_options(fixtures, fx):
    return megatron_merge_args(fixtures, fx) if fx["kind"] == "megatron" else ["--backend", "fsdp"]


@pytest.fixture(scope="module")
def run_on_gpu(shardmerge_bin, fixtures, manifest, tmp_path_factory):
    """run_on_gpu(*args) -> CompletedProcess of shardmerge under SHARDMERGE_GPU_WRAPPER; skips the
    module when the first GPU merge says there is no GPU or no CUDA build."""
    wrapper = shlex.split(os.environ.get("SHARDMERGE_GPU_WRAPPER", ""))

    def _run(*args):
        return subprocess.run([*wrapper, shardmerge_bin, *map(str, args)], capture_output=True, text=True)

    probe = next(f for f in manifest["fixtures"] if f["kind"] == "fsdp" and f.get("status", "ok") == "ok")
    target = tmp_path_factory.mktemp("probe") / "out"
    proc = _run("merge", "--local_dir", fixtures / probe["role_dir"], "--target_dir", target,
                *merge_options(fixtures, probe), *GPU_OPTIONS)
    if proc.returncode != 0 and any(m in proc.stderr for m in NO_GPU_MARKERS):
        pytest.skip("no GPU merge here: " + proc.stderr.strip().splitlines()[-1])
    return _run


def test_cuda_executor_writes_what_the_cpu_executor_writes(merge_fx, fixtures, run, run_on_gpu, tmp_path):
    src = fixtures / merge_fx["role_dir"]
    options = merge_options(fixtures, merge_fx)
    cpu, gpu = tmp_path / "cpu", tmp_path / "cuda"
    run("merge", "--local_dir", src, "--target_dir", cpu, *options, "--device", "cpu")
    proc = run_on_gpu("merge", "--local_dir", src, "--target_dir", gpu, *options, *GPU_OPTIONS)
    assert proc.returncode == 0, f"GPU merge exited {proc.returncode}\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    if "compute-sanitizer" in os.environ.get("SHARDMERGE_GPU_WRAPPER", ""):  # it ran, and found nothing
        assert "ERROR SUMMARY: 0 errors" in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-2000:]

    cpu_files, gpu_files = tree_digest(cpu), tree_digest(gpu)
    assert sorted(cpu_files) == sorted(gpu_files)
    weights = {str(f.relative_to(cpu)) for f in hf_weight_files(cpu)}
    if not merge_fx.get("lora"):
        assert cpu_files == gpu_files, "a merge without a fold must be byte-identical on the GPU"
        return
    for name in cpu_files:
        if name not in weights:
            assert cpu_files[name] == gpu_files[name], name
    want, got = load_hf(cpu), load_hf(gpu)
    assert sorted(want) == sorted(got)
    for name, t in want.items():
        assert (t.dtype, t.shape) == (got[name].dtype, got[name].shape), name
        assert ulp_distance(t, got[name]) <= 1, f"{name}: GPU fold differs from the CPU fold by more than 1 ulp"
