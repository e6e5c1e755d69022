"""The target of a merge under interruption, races and faults: SIGINT/SIGTERM/SIGHUP leave no
temp dir, no target and no parent dirs the run created; a temp dir left by a killed run is
removed (with a note) by the next run into that target; a second concurrent merge into one
target fails at once; a target filled during the run is not replaced without --force; a
symlinked target is never replaced or removed; a full filesystem fails before writing.

Checkpoints come from shardmerge-gen: a 2 GB one (qwen2.5-0.5b, fp32, 2 ranks) that takes a
few seconds to merge on one thread, so a signal or a race lands mid-merge, and a tiny one."""
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from e2e_util import tree_digest

SIGNALS = {"SIGINT": signal.SIGINT, "SIGTERM": signal.SIGTERM, "SIGHUP": signal.SIGHUP}


def generate(gen_bin, out, model, world_size):
    proc = subprocess.run([gen_bin, "--model", model, "--world-size", str(world_size), "--out", str(out)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"shardmerge-gen exited {proc.returncode}: {proc.stdout}{proc.stderr}"
    return Path(re.search(r"^wrote (\S+):", proc.stdout, re.M).group(1))


@pytest.fixture(scope="module")
def big(shardmerge_gen_bin, tmp_path_factory):
    root = tmp_path_factory.mktemp("big")
    yield generate(shardmerge_gen_bin, root / "ckpt", "qwen2.5-0.5b", 2)
    shutil.rmtree(root, ignore_errors=True)  # 2 GB: not kept among pytest's last runs


@pytest.fixture(scope="module")
def tiny(shardmerge_gen_bin, tmp_path_factory):
    return generate(shardmerge_gen_bin, tmp_path_factory.mktemp("tiny") / "ckpt", "tiny", 2)


def start_merge(shardmerge_bin, source, target, *extra):
    """A merge on one thread (a few seconds for `big`), as a running process."""
    return subprocess.Popen([shardmerge_bin, "merge", "--local_dir", str(source), "--target_dir", str(target),
                             "--threads", "1", *map(str, extra)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def temp_dirs(target):
    target = Path(target)
    return sorted(target.parent.glob(target.name + ".tmp-*")) if target.parent.exists() else []


def wait_for_temp(proc, target, timeout=60):
    """Waits until the merge has created its temp dir (it is then writing), returns it."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = temp_dirs(target)
        if found:
            return found[0]
        assert proc.poll() is None, f"merge ended before its temp dir was seen: {proc.communicate()}"
        time.sleep(0.005)
    raise AssertionError("no temp dir appeared")


def lock_file(target):
    target = Path(target)
    return target.parent / f".{target.name}.shardmerge.lock"


def beside(target):
    """Everything beside the target that the run could have left: the target, temps, lock."""
    target = Path(target)
    if not target.parent.exists():
        return []
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith((target.name, f".{target.name}")))


@pytest.mark.parametrize("name", sorted(SIGNALS))
def test_signal_mid_merge_leaves_nothing(name, big, shardmerge_bin, tmp_path):
    target = tmp_path / "made" / "by_run" / "out"  # two parent dirs the run creates
    proc = start_merge(shardmerge_bin, big, target)
    wait_for_temp(proc, target)
    proc.send_signal(SIGNALS[name])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + SIGNALS[name], f"exit {proc.returncode}\n{out}\n{err}"
    assert f"interrupted by {name}" in err and "removed the unfinished output" in err, err
    assert not (tmp_path / "made").exists(), f"left behind: {list(tmp_path.rglob('*'))}"


def test_stale_temp_of_killed_run_is_removed_by_next_run(big, tiny, shardmerge_bin, run, tmp_path):
    target = tmp_path / "out"
    proc = start_merge(shardmerge_bin, big, target)
    stale = wait_for_temp(proc, target)
    proc.kill()
    proc.communicate()
    assert stale.exists() and lock_file(target).exists(), "SIGKILL should leave the temp dir and lock file"
    # A temp dir whose pid is alive and older than it (this test's own process) is not stale.
    live = tmp_path / f"out.tmp-{os.getpid()}-7"
    live.mkdir()
    second = run("merge", "--local_dir", tiny, "--target_dir", target)
    notes = [line for line in second.stderr.splitlines() if "note: removed" in line]
    assert len(notes) == 1 and str(stale) in notes[0] and "interrupted run" in notes[0], second.stderr
    assert not stale.exists() and live.exists()
    assert (target / "model.safetensors").exists()
    assert beside(target) == ["out", live.name], beside(target)


def test_target_moved_aside_by_killed_force_run_is_put_back(tiny, run, tmp_path):
    """A --force swap killed between its two renames (filesystems without RENAME_EXCHANGE)
    leaves the old target at `.old`: the next run puts it back, then refuses to replace it."""
    target = tmp_path / "out"
    dead = subprocess.Popen(["true"])
    dead.wait()
    moved = tmp_path / f"out.tmp-{dead.pid}-0.old"
    moved.mkdir()
    (moved / "keep.txt").write_text("precious")
    proc = run("merge", "--local_dir", tiny, "--target_dir", target, check=False)
    assert proc.returncode == 2 and "--force" in proc.stderr, proc.stderr
    assert "put back" in proc.stderr, proc.stderr
    assert (target / "keep.txt").read_text() == "precious"
    assert beside(target) == ["out"], beside(target)


def test_concurrent_merge_into_one_target_fails_at_once(big, tiny, shardmerge_bin, run, tmp_path):
    target = tmp_path / "out"
    first = start_merge(shardmerge_bin, big, target)
    wait_for_temp(first, target)
    t0 = time.monotonic()
    second = run("merge", "--local_dir", tiny, "--target_dir", target, check=False)
    took = time.monotonic() - t0
    assert first.poll() is None, "the first merge ended before the second was tried: make it slower"
    assert second.returncode == 1 and "another shardmerge run is writing" in second.stderr, second.stderr
    assert took < 10, f"the second merge took {took:.1f} s to fail"
    out, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert (target / "model.safetensors").exists()
    assert beside(target) == ["out"], beside(target)


@pytest.mark.parametrize("force", [False, True])
def test_target_filled_during_the_run(force, big, shardmerge_bin, tmp_path):
    target = tmp_path / "out"
    proc = start_merge(shardmerge_bin, big, target, *(["--force"] if force else []))
    wait_for_temp(proc, target)
    target.mkdir()
    (target / "keep.txt").write_text("precious")
    out, err = proc.communicate(timeout=120)
    if force:
        assert proc.returncode == 0, err
        assert not (target / "keep.txt").exists() and (target / "model.safetensors").exists()
    else:
        assert proc.returncode == 1 and "filled by something else" in err, f"exit {proc.returncode}: {err}"
        assert sorted(p.name for p in target.iterdir()) == ["keep.txt"]
    assert beside(target) == ["out"], beside(target)


def test_symlinked_target_is_written_through_never_replaced(tiny, run, tmp_path):
    real = tmp_path / "elsewhere" / "real"
    real.mkdir(parents=True)
    link = tmp_path / "link"
    link.symlink_to(real)
    run("merge", "--local_dir", tiny, "--target_dir", link)
    assert link.is_symlink() and os.readlink(link) == str(real)
    assert (real / "model.safetensors").exists()
    assert beside(link) == ["link"] and sorted(p.name for p in real.parent.iterdir()) == ["real"]

    # non-empty without --force: refused, nothing touched
    before = tree_digest(real)
    proc = run("merge", "--local_dir", tiny, "--target_dir", link, check=False)
    assert proc.returncode == 2 and "--force" in proc.stderr, proc.stderr
    assert link.is_symlink() and tree_digest(real) == before

    # --force, and the merge fails after its temp dir exists: link and tree untouched, no temp
    proc = run("merge", "--local_dir", tiny, "--target_dir", link, "--force", "--memory-limit", "1MiB", check=False)
    assert proc.returncode != 0
    assert link.is_symlink() and os.readlink(link) == str(real) and tree_digest(real) == before
    assert beside(link) == ["link"] and sorted(p.name for p in real.parent.iterdir()) == ["real"]


def test_dangling_symlink_target(tiny, run, tmp_path):
    """A symlink to a missing dir: the output goes where it points; a failed run removes the
    parents it created there and leaves the link."""
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "new" / "dir")
    proc = run("merge", "--local_dir", tiny, "--target_dir", link, "--memory-limit", "1MiB", check=False)
    assert proc.returncode != 0
    assert link.is_symlink() and not (tmp_path / "new").exists()
    run("merge", "--local_dir", tiny, "--target_dir", link)
    assert link.is_symlink() and (tmp_path / "new" / "dir" / "model.safetensors").exists()


def test_failed_merge_removes_the_parent_dirs_it_created(tiny, run, tmp_path):
    (tmp_path / "a").mkdir()
    target = tmp_path / "a" / "b" / "c" / "out"
    proc = run("merge", "--local_dir", tiny, "--target_dir", target, "--memory-limit", "1MiB", check=False)
    assert proc.returncode != 0
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [], "created parents left behind"


@pytest.fixture
def small_filesystem(tmp_path):
    """A 1 MiB tmpfs (root only), unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (the unit test FreeSpace covers the check)")
    mnt = tmp_path / "small"
    mnt.mkdir()
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=False)


def test_disk_full_fails_before_writing(big, run, small_filesystem):
    target = small_filesystem / "new" / "out"
    proc = run("merge", "--local_dir", big, "--target_dir", target, check=False)
    assert proc.returncode == 1 and "not enough free space" in proc.stderr, proc.stderr
    assert list(small_filesystem.iterdir()) == [], "temp dir or created parent left behind"
