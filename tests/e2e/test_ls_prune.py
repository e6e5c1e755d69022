"""`shardmerge ls` and `shardmerge prune` on run roots built from the real fixtures: extra steps
are copies of the fixture's step dir under other global_step_N names, then broken on purpose
(a rank file or .distcp removed, a temp dir left, a tracker naming a missing step, a symlinked
step pointing outside the run, the trash of an interrupted prune). The oracle is the file tree
itself, walked here with os.walk."""
import json
import os
import shutil
from pathlib import Path

import pytest


def tree(root):
    """{relative path: size or '->target'} of everything under root, symlinks not followed."""
    out = {}
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(d) / name
            rel = str(p.relative_to(root))
            out[rel] = "->" + os.readlink(p) if p.is_symlink() else (p.stat().st_size if p.is_file() else "dir")
    return out


def du(step_dir):
    return sum(os.lstat(Path(d) / f).st_size for d, _, files in os.walk(step_dir) for f in files
               if os.path.isfile(Path(d) / f) and not os.path.islink(Path(d) / f))


def ls_json(run, root):
    j = json.loads(run("ls", root, "--json").stdout)
    return j, {s["name"]: s for s in j["steps"]}


@pytest.fixture
def fsdp_run(fixtures, tmp_path):
    """qwen2_fsdp2_w4 (tracker: step 3) plus step 1 (complete), step 2 (rank 3's model file
    removed), step 4 (newer than the tracker) and step 6 (a temp dir left by a killed writer)."""
    root = tmp_path / "run"
    shutil.copytree(fixtures / "qwen2_fsdp2_w4", root)
    for extra in ("verl_ref", "expected.safetensors", "layout.json"):
        p = root / extra
        shutil.rmtree(p) if p.is_dir() else p.unlink()
    for n in (1, 2, 4, 6):
        shutil.copytree(root / "global_step_3", root / f"global_step_{n}")
    (root / "global_step_2/actor/model_world_size_4_rank_3.pt").unlink()
    (root / "global_step_6/actor/huggingface.tmp-123-0").mkdir()
    (root / "global_step_6/actor/huggingface.tmp-123-0/config.json").write_text("{}")
    assert (root / "latest_checkpointed_iteration.txt").read_text().strip() == "3"
    return root


def test_ls_fsdp(run, fsdp_run):
    j, steps = ls_json(run, fsdp_run)
    assert j["tracker_step"] == 3 and j["tracker_problem"] == ""
    assert sorted(steps) == [f"global_step_{n}" for n in (1, 2, 3, 4, 6)]
    assert [s["step"] for s in j["steps"]] == [1, 2, 3, 4, 6]
    for name, s in steps.items():
        assert s["bytes"] == du(fsdp_run / name), name
        assert [(r["name"], r["kind"]) for r in s["roles"]] == [("actor", "fsdp")]
        assert s["tracker"] == (name == "global_step_3")
    assert {n for n, s in steps.items() if s["complete"]} == {"global_step_1", "global_step_3", "global_step_4"}
    assert steps["global_step_2"]["problems"] == ["actor: missing model rank files for ranks 3"]
    assert any("huggingface.tmp-123-0" in p for p in steps["global_step_6"]["problems"])
    human = run("ls", fsdp_run).stdout
    assert "tracker: step 3" in human
    assert "missing model rank files for ranks 3" in human


def test_prune_dry_run_changes_nothing(run, fsdp_run):
    before = tree(fsdp_run)
    p = run("prune", fsdp_run, "--keep", "1")
    assert tree(fsdp_run) == before
    assert "nothing removed" in p.stderr
    lines = {l.split()[1]: l.split()[0] for l in p.stdout.splitlines()}
    assert lines == {"global_step_1": "remove", "global_step_2": "remove", "global_step_3": "keep",
                     "global_step_4": "keep", "global_step_6": "keep"}


def test_prune_keeps_newest_complete_and_tracker(run, fsdp_run):
    before = tree(fsdp_run)
    # keep 2: steps 3 and 1 are the newest complete ones at or below the tracker; the incomplete
    # step 2 lies between them and stays; 4 and 6 are newer than the tracker.
    p = json.loads(run("prune", fsdp_run, "--keep", "2", "--yes", "--json").stdout)
    assert [s["action"] for s in p["steps"]] == ["keep"] * 5
    assert tree(fsdp_run) == before
    run("prune", fsdp_run, "--keep", "1", "--yes")
    after = tree(fsdp_run)
    gone = {k for k in before if k.split("/")[0] in ("global_step_1", "global_step_2")}
    assert set(after) == set(before) - gone
    assert all(after[k] == before[k] for k in after)
    assert not (fsdp_run / ".shardmerge-trash").exists()
    assert not (fsdp_run / ".shardmerge-prune.lock").exists()


def test_prune_refuses_tracker_naming_missing_step(run, fsdp_run):
    (fsdp_run / "latest_checkpointed_iteration.txt").write_text("9")
    j, _ = ls_json(run, fsdp_run)
    assert j["tracker_step"] == 9 and "no global_step_9" in j["tracker_problem"]
    before = tree(fsdp_run)
    for args in (("--keep", "1", "--yes"), ("--keep", "1")):
        p = run("prune", fsdp_run, *args, check=False)
        assert p.returncode == 1, p.stderr
        assert "refusing to prune" in p.stderr and "global_step_9" in p.stderr
    (fsdp_run / "latest_checkpointed_iteration.txt").unlink()
    p = run("prune", fsdp_run, "--keep", "1", "--yes", check=False)
    assert p.returncode == 1 and "no latest_checkpointed_iteration.txt" in p.stderr
    assert tree(fsdp_run) == {k: v for k, v in before.items() if k != "latest_checkpointed_iteration.txt"}


def test_symlinked_step_is_never_followed(run, fsdp_run, tmp_path):
    outside = tmp_path / "outside" / "global_step_0"
    shutil.copytree(fsdp_run / "global_step_1", outside)
    outside_before = tree(outside)
    (fsdp_run / "global_step_0").symlink_to(outside)
    _, steps = ls_json(run, fsdp_run)
    assert steps["global_step_0"]["symlink_target"] == str(outside)
    assert not steps["global_step_0"]["complete"] and steps["global_step_0"]["bytes"] == 0
    p = json.loads(run("prune", fsdp_run, "--keep", "1", "--yes", "--json").stdout)
    actions = {s["name"]: s["action"] for s in p["steps"]}
    assert actions["global_step_0"] == "keep"
    assert (fsdp_run / "global_step_0").is_symlink()
    assert tree(outside) == outside_before


def test_prune_finishes_interrupted_prune(run, fsdp_run):
    trash = fsdp_run / ".shardmerge-trash"
    shutil.copytree(fsdp_run / "global_step_1", trash / "global_step_1")  # moved, not yet removed
    _, steps = ls_json(run, fsdp_run)
    assert "global_step_1" in steps  # the trash is not a step
    assert json.loads(run("ls", fsdp_run, "--json").stdout)["interrupted_prune"] is True
    before = tree(fsdp_run)
    p = run("prune", fsdp_run, "--keep", "5")
    assert tree(fsdp_run) == before and "interrupted prune" in p.stderr
    p = run("prune", fsdp_run, "--keep", "5", "--yes")
    assert "removing" in p.stderr and "interrupted prune" in p.stderr
    assert not trash.exists()
    assert tree(fsdp_run) == {k: v for k, v in before.items() if not k.startswith(".shardmerge-trash")}


def test_stray_entries_are_not_steps(run, fsdp_run):
    (fsdp_run / "global_step_9.tmp-55-0").mkdir()
    (fsdp_run / "global_step_8").write_text("not a dir")
    (fsdp_run / "notes").mkdir()
    j, steps = ls_json(run, fsdp_run)
    assert "global_step_8" not in steps and j["stray_temps"] == ["global_step_9.tmp-55-0"]
    run("prune", fsdp_run, "--keep", "1", "--yes")
    assert (fsdp_run / "global_step_9.tmp-55-0").is_dir()
    assert (fsdp_run / "global_step_8").is_file() and (fsdp_run / "notes").is_dir()


def test_megatron_run(run, fixtures, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(fixtures / "qwen2_megatron_tp2_pp2", root)
    shutil.rmtree(root / "expected")
    for n in (2, 3, 4):
        shutil.copytree(root / "global_step_1", root / f"global_step_{n}")
    (root / "latest_checkpointed_iteration.txt").write_text("4")
    (root / "global_step_2/actor/model/dist_ckpt/__1_0.distcp").unlink()
    (root / "global_step_4/actor/model/dist_ckpt.tmp-123-0").mkdir()
    _, steps = ls_json(run, root)
    assert steps["global_step_1"]["complete"]
    assert steps["global_step_2"]["problems"] == [
        "actor: model/dist_ckpt: files named by .metadata missing: __1_0.distcp"]
    assert steps["global_step_3"]["complete"] and not steps["global_step_4"]["complete"]
    assert [(r["name"], r["kind"]) for r in steps["global_step_1"]["roles"]] == [("actor", "megatron")]
    # The tracker's step is incomplete: it stays, and so does the newest complete step below it
    # (3); the complete step 1 and the incomplete step 2 are older than that and go.
    run("prune", root, "--keep", "1", "--yes")
    assert sorted(p.name for p in root.glob("global_step_*")) == ["global_step_3", "global_step_4"]


def test_megatron_legacy_missing_rank(run, fixtures, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(fixtures / "qwen2_megatron_tp2_pp2_legacy", root)
    (root / "global_step_1/actor/model/mp_rank_01_001/model.pt").unlink()
    _, steps = ls_json(run, root)
    assert steps["global_step_1"]["problems"] == ["actor: model/mp_rank_01_001/model.pt missing"]


def test_usage_errors(run, fsdp_run, tmp_path):
    assert run("prune", fsdp_run, check=False).returncode == 2  # --keep is required
    assert run("prune", fsdp_run, "--keep", "0", check=False).returncode == 2
    assert run("prune", fsdp_run, "--keep", "x", check=False).returncode == 2
    assert run("prune", tmp_path / "nope", "--keep", "1", check=False).returncode == 2
    assert run("ls", tmp_path / "nope", check=False).returncode == 2
