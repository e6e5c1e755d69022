"""Multi-process merges on one machine (the CPU-only form of a multi-node run): torchrun-style
environment variables, a shared filesystem, output files split among the processes, one index,
and the same bytes as a single-process merge."""
import os
import socket
import subprocess
from pathlib import Path

import pytest


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(shardmerge_bin, world, args_for_rank):
    """Starts `world` processes as torchrun would; returns their CompletedProcess-like results."""
    port = free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", SHARDMERGE_PORT=str(port))
        procs.append(subprocess.Popen([shardmerge_bin, *map(str, args_for_rank(rank))], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        out.append((p.returncode, stdout, stderr))
    return out


def role_of(fixtures, manifest, name):
    entry = next(f for f in manifest["fixtures"] if f["name"] == name)
    return fixtures / entry["role_dir"]


@pytest.mark.parametrize("world", [2, 3, 4])
def test_processes_split_the_files_and_match_one_process(shardmerge_bin, fixtures, manifest, run, tmp_path, world):
    role = role_of(fixtures, manifest, "qwen2_fsdp2_w4")
    single = tmp_path / "single"
    run("merge", "--local_dir", role, "--target_dir", single, "--max-shard-size", "12KB")
    multi = tmp_path / "multi"
    results = launch(shardmerge_bin, world,
                     lambda r: ["merge", "--local_dir", role, "--target_dir", multi, "--max-shard-size", "12KB"])
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}\n{stdout}\n{stderr}"
    assert f"{world} processes" in results[0][1]
    shards = sorted(p.name for p in multi.glob("model-*.safetensors"))
    assert len(shards) >= world, "the test needs at least one output file per process"
    assert shards == sorted(p.name for p in single.glob("model-*.safetensors"))
    for name in shards + ["model.safetensors.index.json", "config.json"]:
        assert (multi / name).read_bytes() == (single / name).read_bytes(), name
    assert not list(tmp_path.glob("multi.tmp-*"))


@pytest.mark.parametrize("differs, says", [
    ("local_dir", "was given a different --local_dir than rank 0"),  # another checkpoint
    ("shard_size", "planned a different merge than rank 0"),         # the same files, another plan
])
def test_a_failing_process_stops_all_and_leaves_nothing(shardmerge_bin, fixtures, manifest, tmp_path, differs, says):
    role = role_of(fixtures, manifest, "qwen2_fsdp2_w4")
    other = role_of(fixtures, manifest, "llama_fsdp2_w4")
    target = tmp_path / "out"

    def args(rank):
        local = other if rank == 1 and differs == "local_dir" else role
        size = "20KB" if rank == 1 and differs == "shard_size" else "12KB"
        return ["merge", "--local_dir", local, "--target_dir", target, "--max-shard-size", size]

    # Rank 1 is given something else than rank 0: every process must refuse.
    results = launch(shardmerge_bin, 2, args)
    for rank, (code, _, stderr) in enumerate(results):
        assert code == 1, f"rank {rank} exited {code}: {stderr}"
        assert stderr.startswith("shardmerge: error:"), stderr
        assert says in stderr, stderr
    assert not target.exists()
    assert not list(tmp_path.glob("out.tmp-*"))


def test_the_summary_of_several_processes_is_the_summary_of_one_and_theirs(shardmerge_bin, fixtures, manifest, run,
                                                                          tmp_path):
    """One summary type: a 2-process merge reports everything a 1-process merge does (same counts:
    each source byte read once, each record CRC-checked once), plus how the processes shared it."""
    import json
    role = role_of(fixtures, manifest, "qwen2_fsdp2_w4")
    one = json.loads(run("merge", "--local_dir", role, "--target_dir", tmp_path / "one", "--max-shard-size", "12KB",
                         "--json").stdout)
    results = launch(shardmerge_bin, 2, lambda r: ["merge", "--local_dir", role, "--target_dir", tmp_path / "two",
                                                   "--max-shard-size", "12KB", "--json"])
    for rank, (code, stdout, stderr) in enumerate(results):
        assert code == 0, f"rank {rank} exited {code}\n{stdout}\n{stderr}"
    assert results[1][1] == "", "only rank 0 prints the summary"
    two = json.loads(results[0][1])
    assert set(two) == set(one) | {"processes", "transport", "data_plane", "node_local_sources", "writers",
                                   "target_seen_by_all", "bytes_sent_between_processes"}, sorted(two)
    for key in ("source", "layout", "executor", "tensors", "files", "bytes_read", "bytes_written", "lora_folds",
                "crc_checked_records", "notes", "warnings"):
        assert two[key] == one[key], (key, two[key], one[key])
    assert two["processes"] == 2 and two["writers"] == 2 and two["target_seen_by_all"] is True, two
