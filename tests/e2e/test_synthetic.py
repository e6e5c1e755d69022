"""shardmerge-gen's synthetic FSDP2 checkpoints: torch reads them as real DTensors, shardmerge
merges them to the concatenated local tensors, any world size gives the same model, and a
2 GB checkpoint merges within a 256 MiB memory limit."""
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from e2e_util import hf_weight_files, st_header, tensor_nbytes


def generate(gen_bin, out, model, world_size, *extra):
    proc = subprocess.run([gen_bin, "--model", model, "--world-size", str(world_size), "--out", str(out), *extra],
                          capture_output=True, text=True)
    assert proc.returncode == 0, f"shardmerge-gen exited {proc.returncode}: {proc.stdout}{proc.stderr}"
    m = re.search(r"^wrote (\S+):", proc.stdout, re.M)
    assert m, proc.stdout
    role = Path(m.group(1))
    assert role.is_dir() and str(role).startswith(str(out)), role
    return role


@pytest.fixture(scope="module")
def tiny(shardmerge_gen_bin, tmp_path_factory):
    """{world_size: role dir} of the tiny model."""
    root = tmp_path_factory.mktemp("synthetic")
    return {w: generate(shardmerge_gen_bin, root / f"tiny_w{w}", "tiny", w) for w in (1, 3, 8)}


def test_tiny_w3_is_real_dtensor_checkpoint(tiny, run, tmp_path):
    check_real_dtensor_checkpoint(tiny[3], run, tmp_path)


def test_moe_shape_is_a_real_dtensor_checkpoint_that_transformers_loads(shardmerge_gen_bin, run, tmp_path):
    """tiny-moe (Qwen3-MoE layout: per-expert gate/up/down, a router, q/k norms, head_dim that
    is not hidden / heads): torch reads the rank files as DTensors, the merge equals their
    concatenation, and transformers builds Qwen3MoeForCausalLM from the merged config and
    loads every weight, with none missing or left over."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Qwen3MoeForCausalLM"):
        pytest.skip("this transformers has no Qwen3MoeForCausalLM")
    role = generate(shardmerge_gen_bin, tmp_path / "moe", "tiny-moe", 3)
    out = check_real_dtensor_checkpoint(role, run, tmp_path)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3MoeForCausalLM"] and cfg["num_experts"] == 4, cfg
    _, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(kind), (kind, info[kind])


def test_list_names_the_moe_shape(shardmerge_gen_bin):
    proc = subprocess.run([shardmerge_gen_bin, "--list"], capture_output=True, text=True, check=True)
    line = next(l for l in proc.stdout.splitlines() if l.startswith("qwen3-30b-a3b "))
    assert "Qwen3MoeForCausalLM" in line and "experts=128x768 (top-8)" in line, line


def check_real_dtensor_checkpoint(role, run, tmp_path):
    """Loads every rank file of `role` (world size 3) with torch, checks the FSDP2 layout, merges it in fp32 and
    compares with torch.cat of the local tensors. Returns the merged directory."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("safetensors")
    from torch.distributed.tensor import DTensor, Shard

    from e2e_util import load_hf

    cfg = json.loads((role / "fsdp_config.json").read_text())
    assert cfg == {"FSDP_version": 2, "world_size": 3}
    files = sorted(role.glob("model_world_size_3_rank_*.pt"))
    assert [f.name for f in files] == [f"model_world_size_3_rank_{r}.pt" for r in range(3)]
    states = [torch.load(f, weights_only=False, map_location="cpu") for f in files]
    keys = list(states[0])
    assert keys and all(list(s) == keys for s in states), "ranks hold different keys"
    full = {}
    for k in keys:
        vals = [s[k] for s in states]
        if not isinstance(vals[0], DTensor):
            assert all(torch.equal(v, vals[0]) for v in vals), f"{k}: plain tensor differs between ranks"
            full[k] = vals[0]
            continue
        for r, v in enumerate(vals):
            assert isinstance(v, DTensor), f"{k} rank {r}: {type(v)}"
            assert len(v.placements) == 1 and isinstance(v.placements[0], Shard), (k, v.placements)
            mesh = v.device_mesh
            assert tuple(mesh.shape) == (3,) and mesh.mesh_dim_names == ("fsdp",), (k, mesh)
            chunk = -(-v.shape[v.placements[0].dim] // 3)
            want_rows = max(0, min(chunk, v.shape[v.placements[0].dim] - r * chunk))
            assert v._local_tensor.shape[v.placements[0].dim] == want_rows, (k, r, v._local_tensor.shape)
        dim = vals[0].placements[0].dim
        full[k] = torch.cat([v._local_tensor for v in vals], dim=dim)
        assert tuple(full[k].shape) == tuple(vals[0].shape), (k, full[k].shape, vals[0].shape)
    out = tmp_path / "out"
    run("merge", "--local_dir", role, "--target_dir", out, "--dtype", "fp32")
    got = load_hf(out)
    tied = json.loads((role / "huggingface" / "config.json").read_text()).get("tie_word_embeddings", False)
    want = {k: v for k, v in full.items() if not (tied and k == "lm_head.weight")}
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), f"{k}: merge != torch.cat(_local_tensor)"
    return out


def test_world_sizes_merge_identically(tiny, run, tmp_path):
    outs = {}
    for w, role in tiny.items():
        outs[w] = tmp_path / f"w{w}"
        run("merge", "--local_dir", role, "--target_dir", outs[w], "--dtype", "fp32")
    for w in (3, 8):
        proc = run("diff", outs[1], outs[w], check=False)
        assert proc.returncode == 0, f"world size 1 vs {w}: {proc.stdout}{proc.stderr}"
        assert "equal" in proc.stdout
    # and in the default bf16
    run("merge", "--local_dir", tiny[8], "--target_dir", tmp_path / "b8")
    run("merge", "--local_dir", tiny[1], "--target_dir", tmp_path / "b1")
    assert run("diff", tmp_path / "b1", tmp_path / "b8", check=False).returncode == 0


def test_memory_bound_merge(shardmerge_gen_bin, shardmerge_bin, tmp_path):
    """qwen2.5-0.5b shape, world size 8 (~2 GB of fp32 rank files): merge with --memory-limit
    256MiB and check the peak RSS (shardmerge's own report and the kernel's rusage)."""
    limit = 256 << 20
    free = shutil.disk_usage(tmp_path).free
    if free < 4 << 30:
        pytest.skip(f"needs ~3 GB of free disk, {free >> 20} MiB free")
    root = tmp_path / "big"
    try:
        role = generate(shardmerge_gen_bin, root, "qwen2.5-0.5b", 8)
        in_bytes = sum(f.stat().st_size for f in role.glob("model_world_size_8_rank_*.pt"))
        assert in_bytes > 7 * limit, f"input {in_bytes} bytes is not ~8x the {limit}-byte limit"
        out = tmp_path / "out"
        # A small wrapper process forks and execs shardmerge and reports its rusage: a child of
        # this (large, torch-loaded) pytest process would inherit our RSS high-water mark.
        wrapper = ("import os, sys\n"
                   "pid = os.fork()\n"
                   "if pid == 0:\n"
                   "    fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC); os.dup2(fd, 1)\n"
                   "    os.execv(sys.argv[2], sys.argv[2:])\n"
                   "_, status, ru = os.wait4(pid, 0)\n"
                   "print(os.waitstatus_to_exitcode(status), ru.ru_maxrss)\n")
        p = subprocess.run([sys.executable, "-S", "-c", wrapper, str(tmp_path / "summary.json"), shardmerge_bin,
                            "merge", "--local_dir", str(role), "--target_dir", str(out),
                            "--memory-limit", "256MiB", "--json"], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr
        code, maxrss_kib = map(int, p.stdout.split())
        assert code == 0, p.stderr
        j = json.loads((tmp_path / "summary.json").read_text())
        assert 0 < j["peak_rss_bytes"] < limit, f"peak RSS {j['peak_rss_bytes'] >> 20} MiB >= 256 MiB"
        kernel_peak = maxrss_kib * 1024  # Linux: KiB
        assert kernel_peak < limit, f"kernel ru_maxrss {kernel_peak >> 20} MiB >= 256 MiB"
        assert j["bytes_read"] > 7 * limit
        files = hf_weight_files(out)
        total = 0
        for f in files:
            h, _, _ = st_header(f)
            total += sum(tensor_nbytes(e) for e in h.values())
        assert total * 2 == pytest.approx(j["bytes_read"], rel=0.01), "bf16 output should be half the fp32 input"
        assert j["tensors"] > 200
    finally:
        shutil.rmtree(root, ignore_errors=True)
        shutil.rmtree(tmp_path / "out", ignore_errors=True)


@pytest.mark.parametrize("shape", ["tiny-moe", "tiny-deepseek-v3"])
def test_fused_experts_merge_per_expert_as_transformers_reads_them(shardmerge_gen_bin, run, tmp_path, shape):
    """--fused-experts (the run-time layout of transformers 5's Qwen3-MoE and DeepSeek-V3: one
    gate_up_proj and one down_proj per layer; DeepSeek-V3 with MLA, a dense first layer, shared
    experts and the router's e_score_correction_bias): the merge writes per-expert tensors, under
    the names transformers' own save_pretrained writes, and transformers, fusing them again as it
    loads, holds exactly the rank files' fused tensors (read by torch, concatenated)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    role = generate(shardmerge_gen_bin, tmp_path / "moe", shape, 3, "--fused-experts")
    states = [torch.load(f, weights_only=False, map_location="cpu")
              for f in sorted(role.glob("model_world_size_3_rank_*.pt"))]
    fused = {k: torch.cat([s[k]._local_tensor for s in states]) for k in states[0] if ".experts." in k}
    assert fused and all(v.dim() == 3 for v in fused.values()), sorted(fused)
    out = tmp_path / "out"
    run("merge", "--local_dir", role, "--target_dir", out, "--dtype", "fp32")
    names = [n for f in hf_weight_files(out) for n in st_header(f)[0] if n != "__metadata__"]
    assert "model.layers.1.mlp.experts.3.up_proj.weight" in names and not any(n.endswith("_proj") for n in names)
    model, info = transformers.AutoModelForCausalLM.from_pretrained(str(out), output_loading_info=True,
                                                                    dtype=torch.float32)
    for kind in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info.get(kind), (kind, info[kind])
    sd = model.state_dict()
    for k, v in fused.items():
        assert torch.equal(sd[k], v), k
    model.save_pretrained(tmp_path / "saved")
    saved = [n for f in hf_weight_files(tmp_path / "saved") for n in st_header(f)[0] if n != "__metadata__"]
    assert sorted(names) == sorted(saved)
