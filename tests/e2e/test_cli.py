"""The CLI contract: inspect, run-root resolution, hostile inputs, missing ranks, target safety,
read-only source, verify/test, diff, --json, --profile and plan --json."""
import json
import os
import re
import shutil
from pathlib import Path

import pytest

from e2e_util import (error_lines, hf_tensor_names, hf_weight_files, leftovers, st_header, tensor_nbytes,
                      tree_digest)

ST_DTYPE = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "I64": "int64", "I32": "int32"}


def entry(manifest, name):
    fx = next((f for f in manifest["fixtures"] if f["name"] == name), None)
    if fx is None:
        pytest.skip(f"{name} not in the manifest")
    return fx


def assert_one_error_line(proc, *must_contain, code=1):
    assert proc.returncode == code, f"exit {proc.returncode} (want {code})\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, f"want exactly one stderr line, got {len(lines)}:\n{proc.stderr}"
    assert lines[0].startswith("shardmerge: error: "), lines[0]
    for s in must_contain:
        assert s.lower() in lines[0].lower(), f"{s!r} not in: {lines[0]}"
    return lines[0]


def need_torch():
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    return torch


def copy_role(fixtures, fx, dst):
    shutil.copytree(fixtures / fx["role_dir"], dst)
    return dst


# ---------------------------------------------------------------------------------------------
# inspect

INSPECT_CASES = {
    # case: (path from fixture entry, expected kind)
    "run_root": (lambda fx: fx["run_root"], "verl run root"),
    "step_root": (lambda fx: str(Path(fx["role_dir"]).parent), "verl step root"),
    "role_dir": (lambda fx: fx["role_dir"], "verl FSDP role directory"),
    "rank_file": (lambda fx: f"{fx['role_dir']}/model_world_size_{fx['world_size']}_rank_0.pt", "torch.save file"),
    "safetensors_file": (lambda fx: fx["expected"], "safetensors file"),
}


@pytest.mark.parametrize("case", sorted(INSPECT_CASES))
def test_inspect_checkpoint_paths(case, fsdp_fx, fixtures, run):
    rel, kind = INSPECT_CASES[case]
    path = fixtures / rel(fsdp_fx)
    j = json.loads(run("inspect", path, "--json").stdout)
    assert j["kind"] == kind, j
    assert j["path"] == str(path)
    human = run("inspect", path)
    assert human.stdout.splitlines()[0] == f"{path}: {kind}"
    assert human.stderr == ""
    if case == "run_root":
        assert j["tracker_step"] == fsdp_fx["latest_step"] and j["tracker_ok"] is True
        assert [s["step"] for s in j["steps"]] == fsdp_fx["steps"]
        if fsdp_fx["role"] == "actor":
            assert Path(j["resolves_to"]) == fixtures / fsdp_fx["role_dir"]
    elif case == "step_root":
        assert j["roles"] == [fsdp_fx["role"]]
        assert j["step"] == fsdp_fx["latest_step"]
    elif case == "role_dir":
        w = fsdp_fx["world_size"]
        assert j["world_size"] == w and j["ranks_present"] == list(range(w)) and j["ranks_missing"] == []
        assert j["fsdp_version"] == fsdp_fx["fsdp_version"]
        header, _, _ = st_header(fixtures / fsdp_fx["expected"])
        assert j["tensors"] == len(header)
        assert j["source_tensor_bytes"] == sum(tensor_nbytes(e) for e in header.values())
        assert j.get("mergeable", True) is True
        assert any(n.startswith("shardmerge merge") for n in j["next"]), j["next"]
        if fsdp_fx.get("lora"):
            assert "lora" in j, "LoRA checkpoint not reported as such"


@pytest.mark.parametrize("what", ["hf_dir", "adapter_dir"])
def test_inspect_hf_and_adapter(what, manifest, fixtures, run):
    fx = next(f for f in manifest["fixtures"] if f["kind"] == "peft_adapter")
    path = fixtures / (fx["base_dir"] if what == "hf_dir" else fx["adapter_dir"])
    j = json.loads(run("inspect", path, "--json", "--tensors").stdout)
    if what == "hf_dir":
        assert j["kind"] == "HuggingFace model directory"
        assert j["huggingface"]["weights"] == "model.safetensors" and j["huggingface"]["weights_complete"] is True
        header, _, _ = st_header(path / "model.safetensors")
        assert sorted(t["name"] for t in j["tensor_list"]) == sorted(header)
        for t in j["tensor_list"]:
            e = header[t["name"]]
            assert t["shape"] == e["shape"] and t["dtype"] == ST_DTYPE[e["dtype"]] and t["bytes"] == tensor_nbytes(e)
            assert t["file"] == "model.safetensors"
    else:
        assert j["kind"] == "PEFT adapter directory"
        assert j["adapter_config"] == json.loads((path / "adapter_config.json").read_text())
        assert any("fold-lora" in n for n in j["next"])


def test_inspect_tensors_role_dir(fsdp_fx, fixtures, run):
    role = fixtures / fsdp_fx["role_dir"]
    j = json.loads(run("inspect", role, "--json", "--tensors").stdout)
    header, _, _ = st_header(fixtures / fsdp_fx["expected"])
    got = {t["name"]: t for t in j["tensor_list"]}
    assert sorted(got) == sorted(header), f"missing {sorted(set(header) - set(got))}, extra {sorted(set(got) - set(header))}"
    for name, e in header.items():
        t = got[name]
        assert t["shape"] == e["shape"], (name, t["shape"], e["shape"])
        assert t["dtype"] == ST_DTYPE[e["dtype"]], (name, t["dtype"], e["dtype"])
        assert t["bytes"] == tensor_nbytes(e), name
        assert t["placement"], name
    plain = {p.split(" ")[0] for p in fsdp_fx.get("persistent_buffers") or []}
    for name in plain:
        assert "plain" in got[name]["placement"].lower(), got[name]
    human = run("inspect", role, "--tensors").stdout
    for name in header:
        assert re.search(rf"^\s+{re.escape(name)}\s", human, re.M), f"{name} not listed by inspect --tensors"


def test_inspect_tensors_rank_file(manifest, fixtures, run):
    fx = entry(manifest, "qwen2_fsdp2_w4")
    layout = json.loads((fixtures / fx["run_root"] / "layout.json").read_text())
    path = fixtures / fx["role_dir"] / "model_world_size_4_rank_3.pt"
    j = json.loads(run("inspect", path, "--json", "--tensors").stdout)
    header, _, _ = st_header(fixtures / fx["expected"])
    got = {t["name"]: t for t in j["tensor_list"]}
    assert sorted(got) == sorted(header)
    emb = got["model.embed_tokens.weight"]
    assert emb["shape"] == [251, 32], emb            # global shape
    assert "Shard(0)" in emb["placement"] and "local [62, 32]" in emb["placement"], emb  # 63,63,63,62
    assert emb["bytes"] == 251 * 32 * 4
    assert layout  # layout.json exists for this fixture


def test_inspect_missing_path_exit_2(run, tmp_path):
    missing = tmp_path / "does-not-exist"
    assert_one_error_line(run("inspect", missing, check=False), str(missing), code=2)
    assert_one_error_line(run("merge", "--local_dir", missing, "--target_dir", tmp_path / "o", check=False),
                          str(missing), code=2)
    assert not (tmp_path / "o").exists()


def test_inspect_unknown_dir(run, tmp_path):
    (tmp_path / "x").mkdir()
    proc = run("inspect", tmp_path / "x", "--json", check=False)
    assert proc.returncode == 1
    assert json.loads(proc.stdout)["kind"] == "unknown"


# ---------------------------------------------------------------------------------------------
# run-root resolution


def test_merge_run_root_uses_tracker_step(manifest, fixtures, run, tmp_path):
    torch = need_torch()
    from e2e_util import assert_tensors_bitwise, expected_base, load_hf, load_st

    fx = entry(manifest, "qwen2_fsdp2_w2")  # steps 1 and 3, tracker says 3
    assert fx["steps"] == [1, 3]
    out = tmp_path / "out"
    proc = run("merge", "--local_dir", fixtures / fx["run_root"], "--target_dir", out)
    assert "latest_checkpointed_iteration.txt" in proc.stdout and "step 3" in proc.stdout, proc.stdout
    assert str(fixtures / fx["role_dir"]) in proc.stdout
    assert_tensors_bitwise(load_hf(out), expected_base(fixtures, fx, "bf16"), "run root merge (step 3)")
    # the older step (no fsdp_config.json: world size from the file names) merges to its own weights
    step1 = fixtures / fx["run_root"] / "global_step_1"
    assert not (step1 / "actor" / "fsdp_config.json").exists()
    out1 = tmp_path / "out1"
    p1 = run("merge", "--local_dir", step1, "--target_dir", out1)
    assert "actor" in p1.stdout
    exp1 = {k: v.to(torch.bfloat16) for k, v in load_st(fixtures / fx["expected_by_step"]["1"]).items()
            if k != "lm_head.weight"}
    assert_tensors_bitwise(load_hf(out1), exp1, "global_step_1 merge")


def test_merge_run_root_with_role(manifest, fixtures, run, tmp_path):
    fx = entry(manifest, "qwen2_critic_fsdp2_w2")
    # No actor/ here: the default role is refused, and the error names the roles there are.
    proc = run("merge", "--local_dir", fixtures / fx["run_root"], "--target_dir", tmp_path / "a", check=False)
    assert_one_error_line(proc, "has no 'actor' checkpoint", "(roles here: critic)", code=1)
    assert not (tmp_path / "a").exists()
    run("merge", "--local_dir", fixtures / fx["run_root"], "--role", "critic", "--target_dir", tmp_path / "b")
    assert sorted(hf_tensor_names(tmp_path / "b")) == sorted(st_header(fixtures / fx["expected"])[0])


@pytest.mark.parametrize("tracker", ["7", "abc", None], ids=["missing_step", "garbage", "no_tracker"])
def test_tracker_problems_are_reported(tracker, manifest, fixtures, run, tmp_path):
    fx = entry(manifest, "qwen2_fsdp2_w2")
    root = tmp_path / "run"
    shutil.copytree(fixtures / fx["run_root"], root, ignore=shutil.ignore_patterns("optim_*", "extra_state_*"))
    if tracker is None:
        (root / "latest_checkpointed_iteration.txt").unlink()
    else:
        (root / "latest_checkpointed_iteration.txt").write_text(tracker)
    j = json.loads(run("inspect", root, "--json").stdout)
    if tracker is not None:
        assert j["tracker_ok"] is False, j
        assert any(tracker in w for w in j["warnings"]), j["warnings"]
    # A tracker that cannot be followed is a note, not a failure: the highest step is merged, and
    # the note says why and which.
    proc = run("merge", "--local_dir", root, "--target_dir", tmp_path / "out")
    why = {"7": "latest_checkpointed_iteration.txt points to step 7, which has no global_step_7 directory",
           "abc": "latest_checkpointed_iteration.txt does not hold a step number ('abc')",
           None: "no latest_checkpointed_iteration.txt"}[tracker]
    assert f"note: run root: {why}" in proc.stdout, proc.stdout
    assert f"using the highest step, {root / 'global_step_3'}" in proc.stdout, proc.stdout
    need_torch()
    from e2e_util import assert_tensors_bitwise, expected_base, load_hf
    assert_tensors_bitwise(load_hf(tmp_path / "out"), expected_base(fixtures, fx, "bf16"), f"tracker {tracker!r}")


# ---------------------------------------------------------------------------------------------
# hostile files


def make_role(tmp_path, pt_file):
    role = tmp_path / "actor"
    role.mkdir()
    shutil.copyfile(pt_file, role / "model_world_size_1_rank_0.pt")
    (role / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 1}, indent=4))
    return role


def test_hostile_rank_file(hostile_pt_fx, fixtures, manifest, run, tmp_path):
    fx = hostile_pt_fx
    role = make_role(tmp_path, fixtures / fx["file"])
    before = tree_digest(role)
    subs = [fx["expect_error_contains"]]
    out = tmp_path / "out"
    line = assert_one_error_line(run("merge", "--local_dir", role, "--target_dir", out, check=False),
                                 "model_world_size_1_rank_0.pt", *subs)
    assert leftovers(out) == [], f"left behind after '{line}': {leftovers(out)}"
    assert_one_error_line(run("plan", "--local_dir", role, "--json", check=False), "model_world_size_1_rank_0.pt", *subs)
    hf = fixtures / manifest["hf_base"]["qwen2"]
    assert_one_error_line(run("verify", "--local_dir", role, "--test_hf_dir", hf, check=False),
                          "model_world_size_1_rank_0.pt", *subs)
    # inspect of the file itself: an error; of the directory: a report that says it cannot be merged
    assert_one_error_line(run("inspect", role / "model_world_size_1_rank_0.pt", check=False),
                          "model_world_size_1_rank_0.pt", *subs)
    proc = run("inspect", role, "--json", check=False)
    assert proc.returncode == 0, proc.stderr  # a report on a checkpoint that cannot be merged is still a report
    j = json.loads(proc.stdout)
    assert j.get("mergeable") is False, j
    assert any(subs[0].lower() in w.lower() for w in j["warnings"]), j["warnings"]
    assert tree_digest(role) == before, "the source was modified"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["actor"]


def test_hostile_safetensors(hostile_st_fx, fixtures, manifest, run, tmp_path):
    fx = hostile_st_fx
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copyfile(fixtures / fx["file"], hf / "model.safetensors")
    shutil.copyfile(fixtures / manifest["hf_base"]["qwen2"] / "config.json", hf / "config.json")
    sub = fx["expect_error_contains"]
    base = fixtures / manifest["hf_base"]["qwen2"]
    assert_one_error_line(run("diff", hf, base, check=False), "model.safetensors", sub)
    assert_one_error_line(run("diff", base, hf, check=False), "model.safetensors", sub)
    adapter = next(f for f in manifest["fixtures"] if f["kind"] == "peft_adapter" and f["model"] == "qwen2")
    out = tmp_path / "out"
    assert_one_error_line(run("fold-lora", "--base", hf, "--adapter", fixtures / adapter["adapter_dir"],
                              "--target_dir", out, check=False), "model.safetensors", sub)
    assert leftovers(out) == [], leftovers(out)
    w2 = entry(manifest, "qwen2_fsdp2_w2")
    assert_one_error_line(run("verify", "--local_dir", fixtures / w2["role_dir"], "--test_hf_dir", hf, check=False),
                          "model.safetensors", sub)
    assert_one_error_line(run("inspect", hf / "model.safetensors", check=False), "model.safetensors", sub)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_hostile_controls_load(manifest, fixtures, run, tmp_path):
    need_torch()
    from e2e_util import assert_tensors_bitwise, expected_base, load_hf

    controls = {c["name"]: c for c in manifest.get("hostile_controls", [])}
    if "control_rewritten.pt" not in controls:
        pytest.skip("no control_rewritten.pt")
    c = controls["control_rewritten.pt"]
    src_fx = next(f for f in manifest["fixtures"] if c["derived_from"].startswith(f["role_dir"]))
    role = copy_role(fixtures, src_fx, tmp_path / "actor")
    shutil.copyfile(fixtures / c["file"], role / Path(c["derived_from"]).name)
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "out")
    assert_tensors_bitwise(load_hf(tmp_path / "out"), expected_base(fixtures, src_fx, "bf16"), "control_rewritten")
    if "st_control.safetensors" in controls:
        hf = tmp_path / "hf"
        hf.mkdir()
        shutil.copyfile(fixtures / controls["st_control.safetensors"]["file"], hf / "model.safetensors")
        proc = run("diff", hf, hf)
        assert "equal" in proc.stdout
        j = json.loads(run("inspect", hf / "model.safetensors", "--json").stdout)
        assert j["tensors"] >= 1


# ---------------------------------------------------------------------------------------------
# missing ranks


@pytest.mark.parametrize("name", ["qwen2_fsdp2_w4", "llama_fsdp2_w4", "llama_fsdp2_shard1_w4"])
def test_missing_rank_is_named(name, manifest, fixtures, run, tmp_path):
    fx = entry(manifest, name)
    role = copy_role(fixtures, fx, tmp_path / "actor")
    (role / "model_world_size_4_rank_2.pt").unlink()
    j = json.loads(run("inspect", role, "--json").stdout)
    assert j["ranks_missing"] == [2] and j["ranks_present"] == [0, 1, 3], j
    assert any("model_world_size_4_rank_2.pt" in w for w in j["warnings"]), j["warnings"]
    out = tmp_path / "out"
    assert_one_error_line(run("merge", "--local_dir", role, "--target_dir", out, check=False),
                          "model_world_size_4_rank_2.pt")
    assert leftovers(out) == []


def test_world_size_sources(manifest, fixtures, run, tmp_path):
    """fsdp_config.json decides the world size; stale rank files of another world size are
    ignored (and said so); without fsdp_config.json, two world sizes are ambiguous and the error
    must say what it found, not that there are no rank files."""
    need_torch()
    from e2e_util import assert_tensors_bitwise, expected_base, load_hf

    fx2, fx4 = entry(manifest, "qwen2_fsdp2_w2"), entry(manifest, "qwen2_fsdp2_w4")
    role = copy_role(fixtures, fx2, tmp_path / "actor")
    for f in (fixtures / fx4["role_dir"]).glob("model_world_size_4_rank_*.pt"):
        shutil.copyfile(f, role / f.name)
    proc = run("merge", "--local_dir", role, "--target_dir", tmp_path / "out")
    assert "world size 4" in proc.stdout, proc.stdout
    assert_tensors_bitwise(load_hf(tmp_path / "out"), expected_base(fixtures, fx2, "bf16"), "W=2 beside stale W=4")
    (role / "fsdp_config.json").unlink()
    proc = run("merge", "--local_dir", role, "--target_dir", tmp_path / "out2", check=False)
    if proc.returncode == 0:
        pytest.fail(f"two world sizes and no fsdp_config.json: merged without complaint:\n{proc.stdout}")
    line = assert_one_error_line(proc, code=proc.returncode)
    assert "no rank files" not in line, f"misleading error with 6 rank files present: {line}"
    assert leftovers(tmp_path / "out2") == []


@pytest.mark.parametrize("ranks", [[2], [3], [1], [0], [2, 3], [0, 1]], ids=lambda r: "del" + "_".join(map(str, r)))
def test_hsdp_missing_replica_still_merges(ranks, manifest, fixtures, run, tmp_path):
    """HSDP (ddp=2, fsdp=2): ranks 2,3 replicate ranks 0,1. Any set of missing ranks that leaves
    one copy of every fsdp shard must merge to the same weights (docs/fsdp.md: missing ranks are only
    an error when their data has no replica)."""
    need_torch()
    from e2e_util import assert_tensors_bitwise, expected_base, load_hf

    fx = entry(manifest, "qwen2_hsdp_2x2")
    role = copy_role(fixtures, fx, tmp_path / "actor")
    for r in ranks:
        (role / f"model_world_size_4_rank_{r}.pt").unlink()
    out = tmp_path / "out"
    proc = run("merge", "--local_dir", role, "--target_dir", out, check=False)
    assert proc.returncode == 0, f"deleting replica rank(s) {ranks}: {proc.stderr}"
    for r in ranks:
        assert f"model_world_size_4_rank_{r}.pt" in proc.stdout, "the missing rank file is not mentioned"
    assert_tensors_bitwise(load_hf(out), expected_base(fixtures, fx, "bf16"), f"HSDP without ranks {ranks}")


@pytest.mark.parametrize("ranks", [[0, 2], [1, 3]])
def test_hsdp_missing_both_replicas_fails(ranks, manifest, fixtures, run, tmp_path):
    fx = entry(manifest, "qwen2_hsdp_2x2")
    role = copy_role(fixtures, fx, tmp_path / "actor")
    for r in ranks:
        (role / f"model_world_size_4_rank_{r}.pt").unlink()
    out = tmp_path / "out"
    line = assert_one_error_line(run("merge", "--local_dir", role, "--target_dir", out, check=False))
    assert any(f"model_world_size_4_rank_{r}.pt" in line for r in ranks), line
    assert leftovers(out) == []


# ---------------------------------------------------------------------------------------------
# target safety


def test_existing_target_needs_force(manifest, fixtures, run, tmp_path):
    fx = entry(manifest, "qwen2_fsdp2_w2")
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    proc = run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out, check=False)
    line = assert_one_error_line(proc, "--force", code=proc.returncode)
    assert proc.returncode in (1, 2), line
    assert sorted(p.name for p in out.iterdir()) == ["keep.txt"] and (out / "keep.txt").read_text() == "precious"
    assert [p.name for p in tmp_path.iterdir()] == ["out"], "temp dir left behind"
    run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out, "--force")
    assert not (out / "keep.txt").exists(), "--force did not replace the target"
    assert (out / "model.safetensors").exists() and (out / "config.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["out"], f"left behind: {list(tmp_path.iterdir())}"
    # an existing empty directory is fine without --force
    empty = tmp_path / "empty"
    empty.mkdir()
    run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", empty)
    assert (empty / "model.safetensors").exists()


@pytest.mark.parametrize("spelling", ["trailing_slash_new", "trailing_slash_existing_empty", "space_and_unicode"])
def test_target_spellings(spelling, manifest, fixtures, run, tmp_path):
    """`--target_dir OUT/` (shell completion adds the slash) and odd names must work like OUT."""
    fx = entry(manifest, "qwen2_fsdp2_w2")
    out = tmp_path / ("rün dir" if spelling == "space_and_unicode" else "out")
    if spelling == "trailing_slash_existing_empty":
        out.mkdir()
    arg = str(out) + ("/" if spelling.startswith("trailing_slash") else "")
    proc = run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", arg, check=False)
    assert proc.returncode == 0, f"--target_dir {arg!r}: exit {proc.returncode}: {proc.stderr}"
    assert (out / "model.safetensors").exists() and (out / "config.json").exists(), sorted(out.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == [out.name], sorted(p.name for p in tmp_path.iterdir())
    assert [p.name for p in out.iterdir() if ".tmp-" in p.name] == []


def test_wrong_backend_or_source_kind(manifest, fixtures, run, tmp_path):
    fx = entry(manifest, "qwen2_fsdp2_w2")
    out = tmp_path / "out"
    assert_one_error_line(run("merge", "--backend", "megatron", "--local_dir", fixtures / fx["role_dir"],
                              "--target_dir", out, check=False), "megatron", "FSDP")
    hf = fixtures / manifest["hf_base"]["qwen2"]
    assert_one_error_line(run("merge", "--local_dir", hf, "--target_dir", out, check=False), str(hf))
    proc = run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out, "--max-shard-size", "abc",
               check=False)
    assert proc.returncode == 2 and "abc" in proc.stderr, proc.stderr
    proc = run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out, "--dtype", "int8", check=False)
    assert proc.returncode == 2, proc.stderr
    assert leftovers(out) == []
    run("merge", "--backend", "auto", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out)


@pytest.mark.parametrize("via", ["role_dir", "run_root", "symlink", "target_contains_source_force"])
def test_target_inside_source_refused(via, manifest, fixtures, run, tmp_path):
    fx = entry(manifest, "qwen2_fsdp2_w2")
    root = tmp_path / "run"
    shutil.copytree(fixtures / fx["run_root"], root)
    role = root / Path(fx["role_dir"]).relative_to(fx["run_root"])
    before = tree_digest(root)
    if via == "role_dir":
        src, target = role, role / "merged"
    elif via == "run_root":
        src, target = root, role / "huggingface" / "merged"
    elif via == "symlink":
        link = tmp_path / "link"
        link.symlink_to(role)
        src, target = role, link / "merged"
    else:
        src, target = role, root
    force = ["--force"] if via == "target_contains_source_force" else []
    proc = run("merge", "--local_dir", src, "--target_dir", target, *force, check=False)
    assert_one_error_line(proc, "contains" if force else "inside", code=proc.returncode)
    assert proc.returncode != 0
    assert tree_digest(root) == before, "something was written into the source"


@pytest.mark.parametrize("where", ["inside_base", "inside_adapter", "base_itself_force", "adapter_itself_force"])
def test_fold_lora_never_writes_into_its_sources(where, manifest, fixtures, run, tmp_path):
    """fold-lora reads two sources, the base model and the adapter: neither may receive the
    output or be replaced by it (merge refuses both for its checkpoint)."""
    fx = next((f for f in manifest["fixtures"] if f["kind"] == "peft_adapter" and f["model"] == "qwen2"), None)
    if fx is None:
        pytest.skip("no qwen2 PEFT adapter fixture")
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    shutil.copytree(fixtures / fx["base_dir"], base)
    shutil.copytree(fixtures / fx["adapter_dir"], adapter)
    before = (tree_digest(base), tree_digest(adapter))
    target, extra = {"inside_base": (base / "folded", []), "inside_adapter": (adapter / "folded", []),
                     "base_itself_force": (base, ["--force"]),
                     "adapter_itself_force": (adapter, ["--force"])}[where]
    proc = run("fold-lora", "--base", base, "--adapter", adapter, "--target_dir", target, *extra, check=False)
    assert proc.returncode != 0, f"fold-lora --target_dir {target.relative_to(tmp_path)} {extra} was accepted"
    assert_one_error_line(proc, code=proc.returncode)
    assert (tree_digest(base), tree_digest(adapter)) == before, "a fold-lora source was modified"


def test_source_is_never_modified(manifest, fixtures, run, tmp_path):
    """merge / verify / test / inspect / plan / diff / merge --verify leave every source byte alone."""
    names = ["qwen2_fsdp2_w2", "qwen2_lora_fsdp2_w2", "qwen2_fsdp1_sharded_tensor_w2"]
    for name in names:
        fx = entry(manifest, name)
        root = fixtures / fx["run_root"]
        before = tree_digest(root)
        mtimes = {p: p.stat().st_mtime_ns for p in root.rglob("*")}
        out = tmp_path / name
        run("merge", "--local_dir", root, "--target_dir", out, "--verify")
        run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out, "--force", "--lora", "adapter")
        run("verify", "--local_dir", root, "--test_hf_dir", out, "--lora", "adapter")
        run("test", "--local_dir", fixtures / fx["role_dir"], "--test_hf_dir", out, "--lora", "adapter")
        run("inspect", root)
        run("inspect", fixtures / fx["role_dir"], "--tensors", "--json")
        run("inspect", fixtures / fx["role_dir"] / f"model_world_size_{fx['world_size']}_rank_0.pt", "--tensors")
        run("plan", "--local_dir", root, "--json")
        run("diff", out, out)
        assert tree_digest(root) == before, f"{name}: source tree changed"
        assert {p: p.stat().st_mtime_ns for p in root.rglob("*")} == mtimes, f"{name}: mtimes changed"


# ---------------------------------------------------------------------------------------------
# verify / test / diff


def flip_byte(hf_dir, tensor, element=10, mask=0x01):
    """Flip bits of one element of `tensor` (low byte: keeps it finite) in its safetensors file."""
    for f in hf_weight_files(hf_dir):
        header, _, start = st_header(f)
        if tensor in header:
            e = header[tensor]
            pos = start + e["data_offsets"][0] + element * (tensor_nbytes(e) // max(1, _numel(e["shape"])))
            with open(f, "r+b") as fh:
                fh.seek(pos)
                b = fh.read(1)
                fh.seek(pos)
                fh.write(bytes([b[0] ^ mask]))
            return
    raise KeyError(tensor)


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


@pytest.mark.parametrize("cmd", ["verify", "test"])
@pytest.mark.parametrize("sharded", [False, True], ids=["single", "sharded"])
def test_verify_and_tamper(cmd, sharded, manifest, fixtures, run, merged, tmp_path):
    fx = entry(manifest, "qwen2_fsdp2_w4")
    opts = ["--max-shard-size", "20KB"] if sharded else []
    good = merged(fx, *opts)
    ok = run(cmd, "--local_dir", fixtures / fx["role_dir"], "--test_hf_dir", good, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "equal" in ok.stdout
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    victim = "model.layers.1.mlp.up_proj.weight"
    flip_byte(bad, victim)
    proc = run(cmd, "--local_dir", fixtures / fx["role_dir"], "--test_hf_dir", bad, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    diff_lines = [line for line in proc.stdout.splitlines() if victim in line]
    assert diff_lines and "1 of" in diff_lines[0], proc.stdout
    others = [line for line in proc.stdout.splitlines() if "differ" in line and victim not in line]
    assert not others, others
    j = json.loads(run(cmd, "--local_dir", fixtures / fx["role_dir"], "--test_hf_dir", bad, "--json",
                       check=False).stdout)
    assert j["equal"] is False and j["tensors"][victim]["mismatched"] == 1
    assert [k for k, v in j["tensors"].items() if v["mismatched"]] == [victim]
    # a NaN written over a weight is a difference too
    nan = tmp_path / "nan"
    shutil.copytree(good, nan)
    flip_byte(nan, victim, element=3, mask=0)  # no-op, then write a NaN pattern
    for f in hf_weight_files(nan):
        header, _, start = st_header(f)
        if victim in header:
            with open(f, "r+b") as fh:
                fh.seek(start + header[victim]["data_offsets"][0] + 6)
                fh.write(bytes([0xC0, 0x7F]))
    proc = run(cmd, "--local_dir", fixtures / fx["role_dir"], "--test_hf_dir", nan, check=False)
    assert proc.returncode == 1 and victim in proc.stdout, proc.stdout


def test_verify_missing_and_extra_tensor(manifest, fixtures, run, merged, tmp_path):
    need_torch()
    from safetensors.torch import save_file

    from e2e_util import load_hf

    fx = entry(manifest, "qwen2_fsdp2_w2")
    good = merged(fx)
    t = load_hf(good)
    victim = "model.norm.weight"
    t2 = dict(t)
    t2.pop(victim)
    t2["extra.tensor"] = t[victim].clone()
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file(t2, str(bad / "model.safetensors"), metadata={"format": "pt"})
    proc = run("verify", "--local_dir", fixtures / fx["role_dir"], "--test_hf_dir", bad, check=False)
    assert proc.returncode == 1
    assert re.search(rf"^missing: {re.escape(victim)}$", proc.stdout, re.M), proc.stdout
    assert re.search(r"^unexpected: extra\.tensor$", proc.stdout, re.M), proc.stdout


def test_diff_reports_missing_unexpected_mismatched(manifest, fixtures, run, merged, tmp_path):
    torch = need_torch()
    from safetensors.torch import save_file

    from e2e_util import load_hf

    fx = entry(manifest, "qwen2_fsdp2_w2")
    a = merged(fx)
    t = load_hf(a)
    b_t = dict(t)
    b_t.pop("model.norm.weight")                                             # missing in B
    b_t["model.extra"] = torch.zeros(3, dtype=torch.bfloat16)                 # unexpected in B
    k_val = "model.layers.0.self_attn.q_proj.weight"
    b_t[k_val] = t[k_val].clone()
    b_t[k_val][0, :4] += 1.0                                                  # 4 values differ
    k_dtype = "model.layers.0.self_attn.q_proj.bias"
    b_t[k_dtype] = t[k_dtype].float()                                         # dtype differs
    k_shape = "model.layers.0.input_layernorm.weight"
    b_t[k_shape] = t[k_shape][:16].clone()                                    # shape differs
    b = tmp_path / "b"
    b.mkdir()
    save_file(b_t, str(b / "model.safetensors"), metadata={"format": "pt"})
    proc = run("diff", a, b, check=False)
    assert proc.returncode == 1, proc.stdout
    out = proc.stdout
    assert re.search(r"^missing: model\.norm\.weight$", out, re.M), out
    assert re.search(r"^unexpected: model\.extra$", out, re.M), out
    assert re.search(rf"^values differ: {re.escape(k_val)}: 4 of 1024 elements", out, re.M), out
    assert re.search(rf"^differs: {re.escape(k_dtype)}: bfloat16 \[32\] vs float32 \[32\]", out, re.M), out
    assert re.search(rf"^differs: {re.escape(k_shape)}: ", out, re.M), out
    assert "DIFFERENT" in out
    j = json.loads(run("diff", a, b, "--json", check=False).stdout)
    assert j["equal"] is False
    assert j["missing"] == ["model.norm.weight"] and j["unexpected"] == ["model.extra"]
    assert sorted(m.split(":")[0] for m in j["metadata_mismatch"]) == sorted([k_dtype, k_shape])
    assert j["tensors"][k_val]["mismatched"] == 4 and j["tensors"][k_val]["elements"] == 1024
    assert j["tensors"][k_val]["max_abs_error"] > 0.5
    mismatched = sorted(k for k, v in j["tensors"].items() if v["mismatched"])
    assert mismatched == [k_val], mismatched
    # reversed: missing and unexpected swap
    j2 = json.loads(run("diff", b, a, "--json", check=False).stdout)
    assert j2["missing"] == ["model.extra"] and j2["unexpected"] == ["model.norm.weight"]
    # --atol accepts small value differences but not missing/unexpected tensors
    j3 = json.loads(run("diff", a, b, "--json", "--atol", "10", check=False).stdout)
    assert j3["tensors"][k_val]["mismatched"] == 0 and j3["equal"] is False
    # identical trees
    same = run("diff", a, a)
    assert same.returncode == 0 and "equal" in same.stdout


def test_diff_is_bitwise_by_default(manifest, fixtures, run, tmp_path):
    """`diff` says its default is bitwise: -0.0 vs +0.0 differ in their bytes."""
    torch = need_torch()
    from safetensors.torch import save_file

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    save_file({"w": torch.tensor([0.0, 1.0], dtype=torch.bfloat16)}, str(a / "model.safetensors"))
    save_file({"w": torch.tensor([-0.0, 1.0], dtype=torch.bfloat16)}, str(b / "model.safetensors"))
    proc = run("diff", a, b, check=False)
    assert proc.returncode == 1, f"diff (default: bitwise) calls +0.0 and -0.0 equal:\n{proc.stdout}"


# ---------------------------------------------------------------------------------------------
# --json summary, --profile, plan --json


@pytest.mark.parametrize("name,opts", [("qwen2_fsdp2_w4", []), ("qwen2_lora_fsdp2_w2", ["--lora", "fold"]),
                                       ("qwen2_fsdp2_buffers_w2", ["--max-shard-size", "20KB"])])
def test_merge_json_summary(name, opts, manifest, fixtures, run, tmp_path):
    fx = entry(manifest, name)
    out = tmp_path / "out"
    proc = run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out, "--json", "--verify", *opts)
    j = json.loads(proc.stdout)  # stdout is exactly one JSON document
    for key in ("source", "target", "layout", "tensors", "files", "bytes_read", "bytes_written", "seconds",
                "gb_per_s", "peak_rss_bytes", "lora_folds", "notes", "verified"):
        assert key in j, f"--json lacks {key}: {sorted(j)}"
    assert Path(j["source"]) == fixtures / fx["role_dir"] and Path(j["target"]) == out
    names = hf_tensor_names(out)
    files = hf_weight_files(out)
    assert j["tensors"] == len(names)
    assert j["files"] == len(files)
    assert j["bytes_written"] == sum(f.stat().st_size for f in files)
    assert j["verified"] is True
    assert 0 < j["peak_rss_bytes"] < 512 << 20
    assert j["seconds"] > 0
    header, _, _ = st_header(fixtures / fx["expected"])
    src_bytes = {k: tensor_nbytes(e) for k, e in header.items()}
    if fx.get("lora"):
        assert j["lora_folds"] == sum(1 for k in header if ".lora_A." in k)
        want_read = sum(src_bytes.values()) - src_bytes.get("base_model.model.lm_head.weight", 0)
    else:
        assert j["lora_folds"] == 0
        want_read = sum(v for k, v in src_bytes.items() if k in names)
    assert j["bytes_read"] == want_read, f"bytes_read {j['bytes_read']} != {want_read} (each source byte once)"
    assert isinstance(j["notes"], list) and all(isinstance(n, str) for n in j["notes"])


def test_profile_trace(manifest, fixtures, run, tmp_path):
    fx = entry(manifest, "qwen2_fsdp2_w4")
    trace = tmp_path / "trace.json"
    j = json.loads(run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", tmp_path / "out",
                       "--profile", trace, "--json").stdout)
    t = json.loads(trace.read_text())
    events = t["traceEvents"] if isinstance(t, dict) else t
    names = {e["name"] for e in events}
    for phase in ("plan", "read", "cast", "write", "fsync"):
        assert phase in names, f"no '{phase}' event in {sorted(names)}"
    for e in events:
        assert e["ph"] in ("X", "B", "E", "i", "M", "C"), e
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0, e
    read_bytes = sum(e.get("args", {}).get("bytes", 0) for e in events if e["name"] == "read")
    assert read_bytes == j["bytes_read"], f"read events cover {read_bytes} bytes, summary says {j['bytes_read']}"
    assert [p.name for p in tmp_path.iterdir() if p.name != "trace.json"] == ["out"]


@pytest.mark.parametrize("name,opts", [("qwen2_fsdp2_w4", []), ("llama_fsdp2_shard1_w4", []),
                                       ("qwen2_fsdp2_tp_2x2", []), ("qwen2_fsdp1_sharded_tensor_w2", []),
                                       ("qwen2_hsdp_2x2", []), ("qwen2_fsdp2_buffers_w2", []),
                                       ("qwen2_lora_fsdp2_w2", ["--lora", "fold"])])
def test_plan_json(name, opts, manifest, fixtures, run):
    """plan --json: every output tensor, its copies (file, offset, length, dst_start) that tile it
    exactly once and hold the expected values, and a cast op for fp32 -> bf16."""
    torch = need_torch()
    from e2e_util import expected_base, load_st, verl_name

    fx = entry(manifest, name)
    plan = json.loads(run("plan", "--local_dir", fixtures / fx["role_dir"], "--json", *opts).stdout)
    exp = expected_base(fixtures, fx, "keep")
    assert sorted(t["name"] for t in plan["tensors"]) == sorted(exp)
    esize = {"float32": 4, "bfloat16": 2, "int64": 8, "float16": 2}
    total_read = 0
    for t in plan["tensors"]:
        want = exp[t["name"]]
        assert t["shape"] == list(want.shape)
        casts = [op for op in t["ops"] if op["op"] == "cast"]
        if want.is_floating_point() and want.dtype != torch.bfloat16:
            assert casts and casts[0]["from"] == str(want.dtype).replace("torch.", "") and casts[0]["to"] == "bfloat16", t
        elif not want.is_floating_point():
            assert not casts and t["dtype"] == str(want.dtype).replace("torch.", ""), t
        cover = torch.zeros(want.shape, dtype=torch.int32) if want.dim() else torch.zeros((), dtype=torch.int32)
        for c in t["copies"]:
            for key in ("file", "offset", "length", "dst_start"):
                assert key in c, c
            es = esize[c["dtype"]]
            ext, strides = c["dst_extent"], c["strides"]
            numel = _numel(ext)
            assert c["length"] == numel * es, c
            total_read += c["length"]
            span = (sum((e - 1) * s for e, s in zip(ext, strides)) + 1) * es if numel else 0
            assert c["offset"] + span <= os.path.getsize(c["file"]), c
            with open(c["file"], "rb") as fh:
                fh.seek(c["offset"])
                raw = bytearray(fh.read(span))
            src_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}[c["dtype"]]
            buf = torch.frombuffer(raw, dtype=src_dtype) if numel else torch.empty(0, dtype=src_dtype)
            piece = buf.as_strided(ext, strides) if numel else buf
            idx = tuple(slice(s, s + e) for s, e in zip(c["dst_start"], ext))
            if want.dim():
                assert torch.equal(piece, want[idx]), f"{t['name']}: copy from {c['file']}@{c['offset']} holds other values"
                cover[idx] += 1
            else:
                assert torch.equal(piece.reshape(()), want), t["name"]
                cover += 1
        assert bool((cover == 1).all()), f"{t['name']}: copies do not tile the tensor exactly once"
        folds = [op for op in t["ops"] if op["op"] == "lora_fold"]
        if folds:
            raw_exp = load_st(fixtures / fx["expected"])
            mod = next(k for k in raw_exp if ".lora_A." in k and verl_name(k.split(".lora_A.")[0] + ".base_layer.weight") == t["name"])
            assert folds[0]["rank"] == raw_exp[mod].shape[0] and folds[0]["scale"] == fx["lora"]["scaling"]
            for part in ("a", "b"):
                total_read += sum(s["length"] for s in folds[0][part])
    assert plan["bytes_read"] == total_read


# ---------------------------------------------------------------------------------------------
# --dtype: the default never casts between the 16-bit types; an explicit cast that does warns


def warning_lines(stderr):
    return [line for line in error_lines(stderr) if line.startswith("shardmerge: warning:")]


def test_fp16_checkpoint_keeps_fp16_by_default(manifest, fixtures, run, tmp_path):
    torch = need_torch()
    from e2e_util import assert_tensors_bitwise, expected_base, load_hf

    fx = entry(manifest, "qwen2_fp16_fsdp2_w2")
    role = fixtures / fx["role_dir"]
    proc = run("merge", "--local_dir", role, "--target_dir", tmp_path / "default")
    assert not warning_lines(proc.stderr), proc.stderr
    got = load_hf(tmp_path / "default")
    assert_tensors_bitwise(got, expected_base(fixtures, fx, "keep"), "fp16 checkpoint, default --dtype")
    assert {t.dtype for t in got.values() if t.is_floating_point()} == {torch.float16}
    assert json.loads((tmp_path / "default" / "config.json").read_text())["dtype"] == "float16"
    # asked for bf16: written, with one warning line on stderr saying what is lost
    proc = run("merge", "--local_dir", role, "--target_dir", tmp_path / "bf16", "--dtype", "bf16")
    warnings = warning_lines(proc.stderr)
    assert len(warnings) == 1, proc.stderr
    assert "float16" in warnings[0] and "bfloat16" in warnings[0] and "--dtype default" in warnings[0], warnings[0]
    assert_tensors_bitwise(load_hf(tmp_path / "bf16"), expected_base(fixtures, fx, "bf16"), "fp16 checkpoint, --dtype bf16")
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    assert not warning_lines(run("merge", "--local_dir", role, "--target_dir", tmp_path / "fp16", "--dtype", "fp16").stderr)


@pytest.mark.parametrize("opts,warned", [([], False), (["--dtype", "bf16"], False), (["--dtype", "fp16"], True),
                                         (["--dtype", "fp32"], False)])
def test_bf16_checkpoint_dtype_warnings(opts, warned, manifest, fixtures, run, tmp_path):
    fx = entry(manifest, "qwen2_bf16_fsdp2_w2")
    proc = run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", tmp_path / "out", *opts, "--json")
    warnings = warning_lines(proc.stderr)
    assert len(warnings) == (1 if warned else 0), proc.stderr
    assert json.loads(proc.stdout)["warnings"] == [w[len("shardmerge: warning: "):] for w in warnings]
    written = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[opts[1] if opts else "bf16"]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == written


# ---------------------------------------------------------------------------------------------
# --hf_model_path: its config must describe the weights


@pytest.mark.parametrize("field,delta", [("vocab_size", 5), ("hidden_size", 32), ("num_hidden_layers", 1),
                                         ("num_key_value_heads", -1)])
def test_hf_model_path_config_must_match_the_weights(field, delta, manifest, fixtures, run, tmp_path):
    fx = entry(manifest, "qwen2_fsdp2_w2")
    role = fixtures / fx["role_dir"]
    given = tmp_path / "given"
    shutil.copytree(role / "huggingface", given)
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "ok", "--hf_model_path", given)  # as it is: fine
    cfg = json.loads((given / "config.json").read_text())
    right = cfg[field]
    cfg[field] = right + delta
    (given / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "out"
    proc = run("merge", "--local_dir", role, "--target_dir", out, "--hf_model_path", given, check=False)
    assert_one_error_line(proc, str(given / "config.json"), f"{field}={right + delta}", f"{field}={right}", str(role))
    assert leftovers(out) == [], f"left behind: {leftovers(out)}"


def test_hf_model_path_config_must_match_megatron_weights(manifest, fixtures, run, tmp_path):
    fx = next((f for f in manifest["fixtures"] if f["kind"] == "megatron" and f.get("status") == "ok"
               and f.get("hf_config_dir_fallback") and not f.get("lora")), None)
    if fx is None:
        pytest.skip("no Megatron fixture with a fallback HF config")
    given = tmp_path / "given"
    shutil.copytree(fixtures / fx["hf_config_dir_fallback"], given, ignore=shutil.ignore_patterns("*.safetensors*"))
    cfg = json.loads((given / "config.json").read_text())
    cfg["num_hidden_layers"] += 1
    (given / "config.json").write_text(json.dumps(cfg))
    proc = run("merge", "--backend", "megatron", "--local_dir", fixtures / fx["role_dir"], "--target_dir",
               tmp_path / "out", "--hf_model_path", given, check=False)
    assert_one_error_line(proc, str(given / "config.json"), str(cfg["num_hidden_layers"]), "layers")


# ---------------------------------------------------------------------------------------------
# What a new user hit (issue 11, item 10): --help defaults, the default target, --profile, -v,
# diff across dtypes and of adapters, messages, inspect's text, progress, summary, exit codes.

SUBCOMMANDS = ["inspect", "plan", "merge", "verify", "test", "diff", "fold-lora"]


def help_entries(text):
    """{first option name: whole help entry} of CLI11's --help (an entry may wrap onto lines
    indented by 30 spaces)."""
    entries, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (\S+)(.*)$", line)
        if m and not line.startswith("   "):
            current = m.group(1).split(",")[0]
            entries[current] = line.strip()
        elif current and line.startswith(" " * 30):
            entries[current] += " " + line.strip()
        else:
            current = None
    return entries


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_help_shows_every_default(sub, run):
    entries = help_entries(run(sub, "--help").stdout)
    assert entries, "no options parsed from --help"
    for name, text in entries.items():
        words = text.split()
        takes_value = len(words) > 1 and re.match(r"^(TEXT|UINT|INT|FLOAT)\b", words[1])
        if not takes_value or "REQUIRED" in text:
            continue
        shown = "=" in words[1] or "default: " in text.lower()
        assert shown, f"{sub} --help: {name} shows no default: {text}"
    if sub == "merge":
        for name, value in {"--target_dir": "tmp", "--memory-limit": "512MiB", "--max-shard-size": "5GB",
                            "--device": "cpu", "--role": "actor", "--backend": "auto"}.items():
            assert re.search(rf"=({re.escape(value)})\b", entries[name]), entries[name]


def test_merge_without_target_dir_says_where(manifest, fixtures, run, tmp_path):
    """verl writes to ./tmp when --target_dir is not given; shardmerge does too, saying so on stderr."""
    fx = entry(manifest, "qwen2_fsdp2_w2")
    for opts, workdir in (([], tmp_path / "a"), (["--json"], tmp_path / "b")):
        workdir.mkdir()
        proc = run("merge", "--local_dir", fixtures / fx["role_dir"], *opts, cwd=workdir)
        said = [line for line in error_lines(proc.stderr) if "--target_dir" in line]
        assert len(said) == 1, proc.stderr
        assert str(workdir / "tmp") in said[0], said[0]
        assert (workdir / "tmp" / "model.safetensors").exists()
        if opts:
            assert json.loads(proc.stdout)["target"] == "tmp"
    proc = run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", tmp_path / "c")
    assert "--target_dir" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("where", ["missing_dir", "a_directory"])
def test_profile_to_unwritable_path_fails_first(where, manifest, fixtures, run, tmp_path):
    fx = entry(manifest, "qwen2_fsdp2_w2")
    profile = tmp_path / "no-such-dir" / "trace.json" if where == "missing_dir" else tmp_path
    out = tmp_path / "out"
    proc = run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out, "--profile", profile,
               check=False)
    assert_one_error_line(proc, "--profile", str(profile), code=2)
    assert proc.stdout == "", f"work started before the --profile check:\n{proc.stdout}"
    assert leftovers(out) == []
    assert not (tmp_path / "no-such-dir").exists()


def test_verbose_merge_and_verify(manifest, fixtures, run, tmp_path):
    fx = entry(manifest, "qwen2_fsdp2_w2")
    role = fixtures / fx["role_dir"]
    out = tmp_path / "out"
    quiet = run("merge", "--local_dir", role, "--target_dir", out).stdout
    names = hf_tensor_names(out)
    loud = run("merge", "--local_dir", role, "--target_dir", out, "--force", "-v", "--verify").stdout
    phases = [line for line in loud.splitlines() if "phases:" in line]
    assert len(phases) == 1, loud
    for phase in ("plan", "write", "fsync", "verify"):
        assert re.search(rf"\b{phase}\S* [\d.]+ s", phases[0]), phases[0]
    for name in names:
        assert re.search(rf"^\s+{re.escape(name)}\s", loud, re.M), f"merge -v does not list {name}"
        assert not re.search(rf"^\s+{re.escape(name)}\s", quiet, re.M), f"merge without -v lists {name}"
    for cmd in (["verify", "--local_dir", role, "--test_hf_dir", out], ["diff", out, out]):
        v = run(*cmd, "-v").stdout
        for name in names:
            assert re.search(rf"^\s+{re.escape(name)}: \d+ elements equal$", v, re.M), f"{cmd[0]} -v: {name}\n{v}"
        assert names[0] not in run(*cmd).stdout


def test_diff_across_dtypes_with_atol(manifest, fixtures, run, merged):
    """diff --atol compares values as fp32, also between tensors of different float dtypes; the
    per-tensor counts and errors match torch's."""
    torch = need_torch()
    from e2e_util import load_hf

    fx = entry(manifest, "qwen2_fsdp2_w2")
    fp32, bf16 = merged(fx, "--dtype", "fp32"), merged(fx, "--dtype", "bf16")
    ta, tb = load_hf(fp32), load_hf(bf16)
    proc = run("diff", fp32, bf16, check=False)
    assert proc.returncode == 1 and "float32" in proc.stdout and "--atol" in proc.stdout, proc.stdout
    j = json.loads(run("diff", fp32, bf16, "--atol", "1e-12", "--json", check=False).stdout)
    assert j["metadata_mismatch"] == [] and j["missing"] == [] and j["unexpected"] == []
    assert len(j["compared_as_fp32"]) == sum(1 for k in ta if ta[k].dtype != tb[k].dtype), j["compared_as_fp32"]
    for name, a in ta.items():
        b = tb[name].float()
        got = j["tensors"][name]
        assert got["elements"] == a.numel(), name
        err = (a.float() - b).abs()
        assert got["mismatched"] == int((err > 1e-12).sum()), name
        assert got["max_abs_error"] == pytest.approx(float(err.max()) if a.numel() else 0.0, rel=1e-6), name
    worst = max(float((a.float() - tb[k].float()).abs().max()) for k, a in ta.items())
    assert worst > 0
    ok = run("diff", fp32, bf16, "--atol", repr(worst))
    assert "equal" in ok.stdout
    assert run("diff", fp32, bf16, "--atol", repr(worst / 2), check=False).returncode == 1


def test_diff_adapter_dirs(manifest, fixtures, run, tmp_path):
    fx = next((f for f in manifest["fixtures"] if f["kind"] == "peft_adapter"), None)
    if fx is None:
        pytest.skip("no PEFT adapter fixture")
    a, b = tmp_path / "a", tmp_path / "b"
    shutil.copytree(fixtures / fx["adapter_dir"], a)
    shutil.copytree(fixtures / fx["adapter_dir"], b)
    same = run("diff", a, b)
    names = list(st_header(a / "adapter_model.safetensors")[0])
    assert f"({len(names)} tensors compared)" in same.stdout, same.stdout
    assert "equal" in run("diff", a / "adapter_model.safetensors", b / "adapter_model.safetensors").stdout
    # one value of one tensor
    header, _, start = st_header(b / "adapter_model.safetensors")
    victim = sorted(header)[0]
    with open(b / "adapter_model.safetensors", "r+b") as fh:
        fh.seek(start + header[victim]["data_offsets"][0])
        byte = fh.read(1)
        fh.seek(start + header[victim]["data_offsets"][0])
        fh.write(bytes([byte[0] ^ 0x01]))
    proc = run("diff", a, b, check=False)
    assert proc.returncode == 1 and re.search(rf"^values differ: {re.escape(victim)}: 1 of", proc.stdout, re.M), proc.stdout
    # the same tensors with another alpha are another adapter
    shutil.copyfile(a / "adapter_model.safetensors", b / "adapter_model.safetensors")
    cfg = json.loads((b / "adapter_config.json").read_text())
    cfg["lora_alpha"] = cfg["lora_alpha"] * 2
    (b / "adapter_config.json").write_text(json.dumps(cfg))
    proc = run("diff", a, b, check=False)
    assert proc.returncode == 1 and "adapter_config.json" in proc.stdout and "lora_alpha" in proc.stdout, proc.stdout


@pytest.mark.parametrize("what", ["empty_dir", "hf_dir"])
def test_cannot_merge_message_reads(what, manifest, fixtures, run, tmp_path):
    src = tmp_path / "empty" if what == "empty_dir" else fixtures / manifest["hf_base"]["qwen2"]
    src.mkdir(exist_ok=True)
    line = assert_one_error_line(run("merge", "--local_dir", src, "--target_dir", tmp_path / "out", check=False),
                                 f"cannot merge {src}: it is ")
    assert " a unknown" not in line
    assert ("not a checkpoint shardmerge recognises" if what == "empty_dir" else "HuggingFace model directory") in line


def inspect_paths(manifest, fixtures):
    peft = next(f for f in manifest["fixtures"] if f["kind"] == "peft_adapter")
    megatron = next((f for f in manifest["fixtures"] if f["kind"] == "megatron" and f.get("status") == "ok"), None)
    lora = entry(manifest, "qwen2_lora_fsdp2_w2")
    paths = {"run_root": fixtures / lora["run_root"], "role_dir": fixtures / lora["role_dir"],
             "hf_dir": fixtures / manifest["hf_base"]["qwen2"], "adapter_dir": fixtures / peft["adapter_dir"],
             "rank_file": fixtures / lora["role_dir"] / f"model_world_size_{lora['world_size']}_rank_0.pt"}
    if megatron:
        paths["megatron_role"] = fixtures / megatron["role_dir"]
    return paths


def test_inspect_text_has_no_json(manifest, fixtures, run):
    for case, path in inspect_paths(manifest, fixtures).items():
        for opts in ([], ["--tensors"]):
            out = run("inspect", path, *opts).stdout
            raw = [line for line in out.splitlines() if "{" in line or '"' in line or re.search(r"\[\d+,\d", line)
                   and not re.match(r"^    \S", line)]
            assert not raw, f"inspect {case} {opts}: JSON in the text report: {raw}"
            heads = [line for line in out.splitlines() if re.match(r"^\s*tensors:", line)]
            assert len(heads) <= 1, f"inspect {case} {opts}: 'tensors:' {len(heads)} times:\n{out}"
            if opts and case != "run_root":
                assert len(heads) == 1, out
    hf = inspect_paths(manifest, fixtures)["hf_dir"]
    nexts = [line.split("next: ", 1)[1] for line in run("inspect", hf).stdout.splitlines() if "next: " in line]
    assert any(n.startswith("shardmerge verify ") and str(hf) in n for n in nexts), nexts
    assert any(n.startswith("shardmerge verify ") for n in json.loads(run("inspect", hf, "--json").stdout)["next"])


def test_inspect_next_command_works_twice(manifest, fixtures, shardmerge_bin, run, tmp_path):
    """The `next:` command inspect prints must still work after it has been run once."""
    import shlex
    import subprocess

    fx = entry(manifest, "qwen2_fsdp2_w2")
    root = tmp_path / "run"
    shutil.copytree(fixtures / fx["run_root"], root, ignore=shutil.ignore_patterns("optim_*", "extra_state_*", "verl_ref"))
    targets = []
    for attempt in range(2):
        j = json.loads(run("inspect", root, "--json").stdout)
        merges = [n for n in j["next"] if n.startswith("shardmerge merge ")]
        assert len(merges) == 1, j["next"]
        human = run("inspect", root).stdout
        assert f"next: {merges[0]}" in human, human
        argv = shlex.split(merges[0])
        proc = subprocess.run([shardmerge_bin, *argv[1:]], capture_output=True, text=True)
        assert proc.returncode == 0, f"run {attempt + 1} of `{merges[0]}`: {proc.stderr}"
        targets.append(Path(argv[argv.index("--target_dir") + 1]))
    assert targets[0] != targets[1] and all((t / "model.safetensors").exists() for t in targets), targets
    assert all(not t.is_relative_to(root / "global_step_3" / "actor") for t in targets), targets


def test_progress_bar_ends_at_100_percent(manifest, fixtures, shardmerge_bin, tmp_path):
    """On a terminal the bar's last state is 100 %, done bytes equal to the total."""
    import pty
    import subprocess

    for name, opts in (("qwen2_fsdp2_w4", []), ("qwen2_lora_fsdp2_w2", ["--lora", "both"])):
        fx = entry(manifest, name)
        master, slave = pty.openpty()
        proc = subprocess.Popen([shardmerge_bin, "merge", "--local_dir", fixtures / fx["role_dir"],
                                 "--target_dir", tmp_path / name, *opts], stdout=subprocess.DEVNULL, stderr=slave)
        os.close(slave)
        said = b""
        while True:
            try:
                chunk = os.read(master, 65536)
            except OSError:  # EIO: the child closed the terminal
                break
            if not chunk:
                break
            said += chunk
        os.close(master)
        assert proc.wait(timeout=120) == 0
        draws = [d for d in said.decode().replace("\n", "\r").split("\r") if d.startswith("merging")]
        assert draws, said
        last = draws[-1]
        m = re.search(r"(\d+)% (\S+ \S+) / (\S+ \S+)", last)
        assert m and m.group(1) == "100" and m.group(2) == m.group(3), f"{name}: the bar ends at: {last!r}"


def _bytes_of(text):
    number, unit = text.split()
    return float(number) * {"B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12}[unit]


def test_summary_says_what_the_rate_counts(manifest, fixtures, run, tmp_path):
    fx = entry(manifest, "qwen2_fsdp2_w4")
    out = tmp_path / "out"
    line = next(line for line in run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out).stdout
                .splitlines() if " merged " in line)
    m = re.search(r": (\S+ \S*B) read \+ (\S+ \S*B) written in ([\d.]+) s \((\S+ \S*B)/s read\+written\)", line)
    assert m, line
    written = sum(f.stat().st_size for f in hf_weight_files(out))
    assert _bytes_of(m.group(2)) == pytest.approx(written, rel=0.01), line
    header, _, _ = st_header(fixtures / fx["expected"])
    assert _bytes_of(m.group(1)) == pytest.approx(sum(tensor_nbytes(e) for k, e in header.items() if k != "lm_head.weight"),
                                                  rel=0.01), line


BAD_FLAG_VALUES = [("--dtype", "foo"), ("--memory-limit", "12XB"), ("--threads", "-1"), ("--max-shard-size", "abc"),
                   ("--max-shard-size", "0"), ("--gpu-memory", "3QB"), ("--lora", "twice"), ("--lora-alpha", "x"),
                   ("--backend", "deepspeed"), ("--device", "tpu")]


@pytest.mark.parametrize("flag,value", BAD_FLAG_VALUES, ids=[f"{f}={v}" for f, v in BAD_FLAG_VALUES])
def test_bad_flag_value_exits_2(flag, value, manifest, fixtures, run, tmp_path):
    fx = entry(manifest, "qwen2_fsdp2_w2")
    out = tmp_path / "out"
    proc = run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out, flag, value, check=False)
    assert_one_error_line(proc, flag, code=2)
    assert leftovers(out) == []


@pytest.mark.parametrize("args", [["diff", "--atol", "-1"], ["diff", "--atol", "abc"], ["fold-lora", "--max-shard-size", "1ZB"]],
                         ids=["diff_atol_negative", "diff_atol_text", "fold_lora_size"])
def test_bad_flag_value_exits_2_other_commands(args, manifest, fixtures, run, tmp_path):
    hf = fixtures / manifest["hf_base"]["qwen2"]
    peft = next(f for f in manifest["fixtures"] if f["kind"] == "peft_adapter")
    rest = [hf, hf] if args[0] == "diff" else ["--base", hf, "--adapter", fixtures / peft["adapter_dir"],
                                                "--target_dir", tmp_path / "out"]
    assert_one_error_line(run(*args, *rest, check=False), args[1], code=2)
    assert not (tmp_path / "out").exists()


def test_missing_path_exits_2_everywhere(manifest, fixtures, run, tmp_path):
    """docs/usage.md: 2 for usage errors such as a missing path, in every subcommand."""
    missing = tmp_path / "does-not-exist"
    hf = fixtures / manifest["hf_base"]["qwen2"]
    role = fixtures / entry(manifest, "qwen2_fsdp2_w2")["role_dir"]
    peft = fixtures / next(f for f in manifest["fixtures"] if f["kind"] == "peft_adapter")["adapter_dir"]
    out = tmp_path / "out"
    for args in (["diff", missing, hf], ["diff", hf, missing], ["verify", "--local_dir", role, "--test_hf_dir", missing],
                 ["verify", "--local_dir", missing, "--test_hf_dir", hf], ["plan", "--local_dir", missing],
                 ["inspect", missing], ["merge", "--local_dir", missing, "--target_dir", out],
                 ["merge", "--local_dir", role, "--hf_model_path", missing, "--target_dir", out],
                 ["fold-lora", "--base", missing, "--adapter", peft, "--target_dir", out],
                 ["fold-lora", "--base", hf, "--adapter", missing, "--target_dir", out]):
        assert_one_error_line(run(*args, check=False), str(missing), code=2)
    assert leftovers(out) == []


def test_demo_output_is_git_ignored():
    import subprocess

    repo = Path(__file__).resolve().parents[2]
    demo = (repo / "scripts" / "demo.sh").read_text()
    m = re.search(r"OUT=\$\{1:-([^}]+)\}", demo)
    assert m, "scripts/demo.sh: no default output dir found"
    if shutil.which("git") is None or subprocess.run(["git", "-C", repo, "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout")
    proc = subprocess.run(["git", "-C", repo, "check-ignore", "-q", f"{m.group(1)}/model.safetensors"])
    assert proc.returncode == 0, f"{m.group(1)}/ (written by scripts/demo.sh) is not git-ignored"
