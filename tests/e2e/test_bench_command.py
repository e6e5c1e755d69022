"""`shardmerge bench`: a merge of a synthetic checkpoint beside the I/O floors of the same run.
Oracles: the files it generates and leaves (with --keep) measured here with os.stat, a merge of
the kept checkpoint run here, and the arithmetic of its own figures."""
import json
import os
import shutil
from pathlib import Path

import pytest

from e2e_util import error_lines


def bench(run, workdir, *args, check=True):
    return run("bench", "--model", "tiny", "--workdir", workdir, *args, check=check)


def test_bench_reports_floors_merge_and_ratios_and_leaves_nothing(run, tmp_path):
    work = tmp_path / "work"
    proc = bench(run, work, "--world-size", "4", "--rounds", "2", "--json")
    r = json.loads(proc.stdout)
    assert r["model"] == "tiny" and r["world_size"] == 4 and r["rounds"] == 2 and r["kept"] is None
    for k in ("read_floor_seconds", "write_floor_seconds", "merge_seconds"):
        assert r[k] > 0, k
    assert r["merge_over_max_floor"] == pytest.approx(r["merge_seconds"] / max(r["read_floor_seconds"],
                                                                               r["write_floor_seconds"]))
    assert r["merge_over_sum_floor"] == pytest.approx(r["merge_seconds"] / (r["read_floor_seconds"] +
                                                                             r["write_floor_seconds"]))
    assert r["merge_bytes_per_second"] == pytest.approx((r["bytes_in"] + r["bytes_out"]) / r["merge_seconds"])
    assert 0 < r["merge_peak_rss_bytes"] < 512 << 20
    # Reads in flight: some, and no more than every thread holding one piece (32 MiB at most).
    assert r["merge_threads"] >= 1
    assert 0 < r["merge_peak_read_bytes_in_flight"] <= r["merge_threads"] * (32 << 20)
    assert list(work.iterdir()) == [], "bench must remove what it generated"


def test_fused_experts_at_a_chosen_depth(run, tmp_path):
    """--fused-experts --layers 1 of tiny-moe: the merge writes the per-expert tensors of one layer
    (counted here from the shape: embeddings, 4 attention weights + q/k norms, the router, 4 experts x
    3, 2 layer norms, the final norm, lm_head) and its planning time is part of its time."""
    work = tmp_path / "work"
    r = json.loads(run("bench", "--model", "tiny-moe", "--layers", "1", "--fused-experts", "--world-size", "3",
                       "--workdir", work, "--json").stdout)
    assert r["fused_experts"] is True and r["layers"] == 1
    assert r["merge_tensors"] == 1 + 6 + 1 + 4 * 3 + 2 + 1 + 1
    assert 0 < r["merge_plan_seconds"] < r["merge_seconds"]
    assert list(work.iterdir()) == []


def test_kept_checkpoint_is_what_was_measured_and_is_reused(run, tmp_path):
    work = tmp_path / "work"
    first = json.loads(bench(run, work, "--world-size", "2", "--lora-rank", "4", "--keep", "--json").stdout)
    kept = Path(first["kept"])
    role = kept / "global_step_1" / "actor"
    rank_files = sorted(role.glob("model_world_size_2_rank_*.pt"))
    assert len(rank_files) == 2
    assert first["bytes_in"] == sum(f.stat().st_size for f in rank_files)
    # The output it measured is what a merge of that checkpoint writes.
    out = tmp_path / "merged"
    run("merge", "--local_dir", role, "--target_dir", out)
    assert first["bytes_out"] == sum(f.stat().st_size for f in out.rglob("*") if f.is_file())

    again = json.loads(bench(run, work, "--world-size", "2", "--lora-rank", "4", "--json").stdout)
    assert again["reused_checkpoint"] is True and again["bytes_in"] == first["bytes_in"]
    assert kept.exists(), "a reused checkpoint stays"

    # --local_dir times an existing checkpoint: the same files read, nothing written into it.
    before = {f: f.stat().st_mtime_ns for f in kept.rglob("*")}
    local = json.loads(run("bench", "--local_dir", role, "--workdir", tmp_path / "work2", "--json").stdout)
    assert local["local_dir"] == str(role) and local["kept"] is None
    assert local["bytes_in"] == first["bytes_in"] and local["bytes_out"] == first["bytes_out"]
    assert {f: f.stat().st_mtime_ns for f in kept.rglob("*")} == before
    assert list((tmp_path / "work2").iterdir()) == []
    shutil.rmtree(kept)


def test_table_names_each_figure(run, tmp_path):
    proc = bench(run, tmp_path / "work", "--world-size", "2")
    for line in ("read floor", "write floor", "merge --device cpu", "merge / max(read, write) floor",
                 "merge / (read + write) floor", "merge peak RSS"):
        assert line in proc.stdout, (line, proc.stdout)


def test_cold_adds_the_concurrent_floor_or_says_why_it_cannot(run, tmp_path):
    """--cold empties the page cache before each step (root only) and reports the concurrent floor;
    where the cache cannot be emptied it is an error naming /proc/sys/vm/drop_caches, and the
    generated checkpoint is removed all the same."""
    work = tmp_path / "work"
    proc = bench(run, work, "--world-size", "2", "--cold", "--json", check=False)
    if os.access("/proc/sys/vm/drop_caches", os.W_OK):
        assert proc.returncode == 0, proc.stderr
        r = json.loads(proc.stdout)
        assert r["cold"] is True and r["concurrent_floor_seconds"] > 0
        assert r["merge_over_concurrent_floor"] == pytest.approx(r["merge_seconds"] / r["concurrent_floor_seconds"])
    else:
        assert proc.returncode == 1, proc.stdout + proc.stderr
        (line,) = error_lines(proc.stderr)
        assert "/proc/sys/vm/drop_caches" in line and "--cold" in line, line
    assert list(work.iterdir()) == []


def test_refuses_to_start_without_the_space_it_needs(run, tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    free = shutil.disk_usage(work).free
    # The largest shape (listed last) at fp32 needs its parameters x 4 bytes in and x 2 out (72B: ~430 GB).
    names = [line.split()[0] for line in run("bench", "--list").stdout.splitlines()]
    if 72e9 * 6 < free:
        pytest.skip(f"{free / 1e9:.0f} GB free: even {names[-1]} fits here")
    proc = run("bench", "--model", names[-1], "--workdir", work, check=False)
    assert proc.returncode == 1, proc.stderr
    (line,) = error_lines(proc.stderr)
    assert str(work) in line and "free" in line, line
    assert list(work.iterdir()) == [], "nothing is generated when the space is short"


def test_bad_values_are_usage_errors(run, tmp_path):
    for args in (["--rounds", "0"], ["--world-size", "0"], ["--dtype", "float16"], ["--model", "no-such-model"]):
        proc = bench(run, tmp_path / "w", *args, check=False)
        assert proc.returncode == 2, (args, proc.stderr)
    assert not (tmp_path / "w").exists() or not os.listdir(tmp_path / "w")
