"""Plan files: `shardmerge plan --out FILE` then `shardmerge merge --plan FILE` writes the same
tree, byte for byte, as a direct merge, on every FSDP and Megatron fixture; a plan whose
sources changed since it was made, or of an unknown version, is refused before anything is
written; planning options cannot be given with --plan."""
import json
import os
import shutil
import subprocess

import pytest
from e2e_util import leftovers, megatron_merge_args, tree_digest
from test_multiprocess import free_port


def planning_args(fixtures, fx):
    if fx["kind"] == "megatron":
        return megatron_merge_args(fixtures, fx)
    return ["--backend", "fsdp"]


def test_plan_file_merge_equals_direct_merge(merge_fx, fixtures, run, tmp_path):
    role = fixtures / merge_fx["role_dir"]
    args = planning_args(fixtures, merge_fx)
    plan = tmp_path / "plan.json"
    run("plan", "--local_dir", role, *args, "--out", plan)
    assert json.loads(plan.read_text())["shardmerge_plan"] == 1
    run("merge", "--plan", plan, "--target_dir", tmp_path / "from_plan")
    run("merge", "--local_dir", role, *args, "--target_dir", tmp_path / "direct")
    assert tree_digest(tmp_path / "from_plan") == tree_digest(tmp_path / "direct")


def copied_role(fixtures, manifest, name, dest):
    fx = next(f for f in manifest["fixtures"] if f["name"] == name)
    shutil.copytree(fixtures / fx["run_root"], dest / fx["run_root"], symlinks=True)
    return dest / fx["role_dir"]


@pytest.fixture
def planned(fixtures, manifest, run, tmp_path):
    """A copy of qwen2_fsdp2_w2 and a plan file made over it."""
    role = copied_role(fixtures, manifest, "qwen2_fsdp2_w2", tmp_path / "src")
    plan = tmp_path / "plan.json"
    run("plan", "--local_dir", role, "--out", plan)
    return role, plan


def assert_refused(proc, target, *says):
    assert proc.returncode == 1, proc.stdout + proc.stderr
    for s in says:
        assert s in proc.stderr, proc.stderr
    assert leftovers(target) == [], "nothing may be written when a plan is refused"


def test_a_source_touched_after_planning_is_refused(planned, run, tmp_path):
    role, plan = planned
    rank1 = role / "model_world_size_2_rank_1.pt"
    st = rank1.stat()
    os.utime(rank1, ns=(st.st_atime_ns, st.st_mtime_ns + 5_000_000_000))
    target = tmp_path / "out"
    assert_refused(run("merge", "--plan", plan, "--target_dir", target, check=False), target, str(rank1),
                   "changed since the plan", "mtime")


def test_a_source_truncated_after_planning_is_refused(planned, run, tmp_path):
    role, plan = planned
    rank0 = role / "model_world_size_2_rank_0.pt"
    st = rank0.stat()
    with open(rank0, "r+b") as f:
        f.truncate(st.st_size - 100)
    os.utime(rank0, ns=(st.st_atime_ns, st.st_mtime_ns))  # even with its mtime put back
    target = tmp_path / "out"
    assert_refused(run("merge", "--plan", plan, "--target_dir", target, check=False), target, str(rank0),
                   f"size {st.st_size} -> {st.st_size - 100} bytes")


def test_a_source_missing_after_planning_is_refused(planned, run, tmp_path):
    role, plan = planned
    rank1 = role / "model_world_size_2_rank_1.pt"
    rank1.unlink()
    target = tmp_path / "out"
    assert_refused(run("merge", "--plan", plan, "--target_dir", target, check=False), target, str(rank1))


def test_a_copied_tree_with_the_same_sizes_and_mtimes_is_accepted(planned, run, tmp_path):
    """Another machine sees the same files with other inodes, devices and ctimes: only size and
    mtime are compared."""
    role, plan = planned
    run("merge", "--plan", plan, "--target_dir", tmp_path / "before")
    src = tmp_path / "src"
    shutil.move(src, tmp_path / "moved")
    shutil.copytree(tmp_path / "moved", src, copy_function=shutil.copy2)  # copy2 keeps mtimes
    run("merge", "--plan", plan, "--target_dir", tmp_path / "after")
    assert tree_digest(tmp_path / "after") == tree_digest(tmp_path / "before")


def edited(plan, tmp_path, edit):
    j = json.loads(plan.read_text())
    edit(j)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(j))
    return out


@pytest.mark.parametrize("version", [2, 0, "1", None])
def test_an_unknown_or_missing_version_is_refused(planned, run, tmp_path, version):
    _, plan = planned

    def set_version(j):
        if version is None:
            del j["shardmerge_plan"]
        else:
            j["shardmerge_plan"] = version

    bad = edited(plan, tmp_path, set_version)
    target = tmp_path / "out"
    says = "no 'shardmerge_plan' version field" if version is None else "reads plan files of version 1 only"
    assert_refused(run("merge", "--plan", bad, "--target_dir", target, check=False), target, str(bad), says)


def test_a_malformed_field_is_refused_naming_it(planned, run, tmp_path):
    _, plan = planned
    bad = edited(plan, tmp_path, lambda j: j["tensors"][3]["copies"][0].__setitem__("offset", -8))
    target = tmp_path / "out"
    assert_refused(run("merge", "--plan", bad, "--target_dir", target, check=False), target,
                   f"{bad}: 'tensors[3].copies[0].offset' is -8, not a non-negative integer")


@pytest.mark.parametrize("option", [["--local_dir", "x"], ["--dtype", "fp32"], ["--lora", "drop"],
                                    ["--hf_model_path", "x"], ["--max-shard-size", "1GB"], ["--backend", "fsdp"],
                                    ["--is-value-model"]])
def test_planning_options_with_plan_are_a_usage_error(planned, run, tmp_path, option):
    _, plan = planned
    proc = run("merge", "--plan", plan, *option, "--target_dir", tmp_path / "out", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "cannot be given with --plan: the planning options were fixed when the plan was made" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_merge_needs_local_dir_or_plan(run, tmp_path):
    proc = run("merge", "--target_dir", tmp_path / "out", check=False)
    assert proc.returncode == 2
    assert "--local_dir is required" in proc.stderr


def test_plan_json_prints_the_plan_file(planned, run):
    role, plan = planned
    printed = run("plan", "--local_dir", role, "--json").stdout
    assert json.loads(printed) == json.loads(plan.read_text())


def test_target_inside_the_plans_source_dir_is_refused(planned, run):
    role, plan = planned
    proc = run("merge", "--plan", plan, "--target_dir", role / "out", check=False)
    assert proc.returncode == 2, proc.stderr
    assert "is inside the source" in proc.stderr
    assert not (role / "out").exists()


def test_execution_options_apply_to_a_plan_file(planned, run, tmp_path):
    role, plan = planned
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "direct")
    proc = run("merge", "--plan", plan, "--target_dir", tmp_path / "out", "--verify", "--no-crc", "--threads", "2",
               "--memory-limit", "256MiB", "--json", "--profile", tmp_path / "trace.json")
    summary = json.loads(proc.stdout)
    assert summary["verified"] is True and summary["crc_checked_records"] == 0
    assert (tmp_path / "trace.json").exists()
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "direct")
    (tmp_path / "out" / "config.json").write_text("{}")
    run("merge", "--plan", plan, "--target_dir", tmp_path / "out", "--force")
    assert tree_digest(tmp_path / "out") == tree_digest(tmp_path / "direct")


def test_processes_share_a_plan_file(planned, shardmerge_bin, run, tmp_path):
    role, plan = planned
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "direct")
    port = free_port()
    procs = [subprocess.Popen([shardmerge_bin, "merge", "--plan", str(plan), "--target_dir", str(tmp_path / "multi")],
                              env=dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r),
                                       MASTER_ADDR="127.0.0.1", SHARDMERGE_PORT=str(port)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    for p in procs:
        stdout, stderr = p.communicate(timeout=300)
        assert p.returncode == 0, stdout + stderr
    assert tree_digest(tmp_path / "multi") == tree_digest(tmp_path / "direct")


def test_a_megatron_save_of_hf_weights_and_an_adapter(manifest, fixtures, run, tmp_path):
    """Megatron's bridge saved complete HF weights and a PEFT adapter beside them: the plan's
    source_dir is still the role dir, so --verify reads the checkpoint and a target inside the
    role dir (outside the adapter) is refused."""
    fx = next(f for f in manifest["fixtures"] if f["kind"] == "peft_adapter")
    role = tmp_path / "global_step_1" / "actor"
    shutil.copytree(fixtures / fx["base_dir"], role / "model" / "huggingface")
    shutil.copytree(fixtures / fx["adapter_dir"], role / "model" / "huggingface" / "adapter")
    (role / "transformer_config.json").write_text("{}")  # what makes it a Megatron role
    plan = tmp_path / "plan.json"
    run("plan", "--local_dir", role, "--backend", "megatron", "--out", plan)
    assert json.loads(plan.read_text())["source_dir"] == str(role)
    run("merge", "--local_dir", role, "--backend", "megatron", "--target_dir", tmp_path / "direct")
    run("merge", "--plan", plan, "--target_dir", tmp_path / "from_plan", "--verify")
    assert tree_digest(tmp_path / "from_plan") == tree_digest(tmp_path / "direct")
    proc = run("merge", "--plan", plan, "--target_dir", role / "out", check=False)
    assert proc.returncode == 2 and "is inside the source" in proc.stderr, proc.stderr
    assert not (role / "out").exists()
