"""`merge --verify` and `verify` compare against the checkpoint assembled from its own metadata
(DTensor placements, ShardedTensor offsets, DCP chunks, legacy per-rank rules), not against the
merge plan, and say exactly what they compared."""
import re
import shutil

import pytest

from e2e_util import hf_weight_files, st_header

# (fixture, what the sources were assembled from, extra merge flags)
CASES = [
    ("qwen2_fsdp2_w4", "the rank files' DTensor placements", []),
    ("qwen2_hsdp_2x2", "the rank files' DTensor placements", []),
    ("qwen2_fsdp2_tp_2x2", "the rank files' DTensor placements", []),  # _StridedShard
    ("qwen2_fsdp1_sharded_tensor_w2", "the rank files' ShardedTensor offsets", []),
    ("qwen2_lora_fsdp2_w2", "the rank files' DTensor placements", ["--lora", "fold"]),
    ("qwen2_megatron_tp2_pp2", "the DCP chunks' offsets in .metadata", ["--backend", "megatron"]),
    ("qwen2_megatron_tp2_pp2_legacy", "the per-rank files' TP/PP/EP ranks (legacy rules)", ["--backend", "megatron"]),
    ("qwen3moe_megatron_ep2", "the DCP chunks' offsets in .metadata", ["--backend", "megatron"]),
]


def entry(manifest, name):
    for f in manifest["fixtures"]:
        if f["name"] == name:
            return f
    pytest.skip(f"fixture {name} not generated")


def extra_args(fixtures, fx, args):
    if fx["kind"] == "megatron" and not fx.get("hf_config_dir"):
        args = [*args, "--hf_model_path", fixtures / fx["hf_config_dir_fallback"]]
    return args


VERIFIED = re.compile(r"^shardmerge: verified (\d+) tensors \((\d+|[\d.]+ M) elements\) against (.*), independently of "
                      r"the merge plan; every element held by exactly one source piece(.*)$", re.M)


@pytest.mark.parametrize("name,route,args", CASES, ids=[c[0] for c in CASES])
def test_merge_verify_says_what_it_compared(name, route, args, manifest, fixtures, run, tmp_path):
    fx = entry(manifest, name)
    out = tmp_path / "out"
    proc = run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out, "--verify",
               *extra_args(fixtures, fx, args))
    m = VERIFIED.search(proc.stdout)
    assert m, proc.stdout
    written = sum(len(st_header(f)[0]) for f in hf_weight_files(out))
    assert int(m.group(1)) == written
    assert m.group(3).startswith(route), m.group(3)
    assert "zip CRC-32 of the" in m.group(4)
    if "--lora" in args:
        assert "LoRA fold(s) recomputed as fp32 W + scale*B*A" in m.group(4)


def write_element(hf_dir, tensor, element, value_bytes):
    for f in hf_weight_files(hf_dir):
        header, _, start = st_header(f)
        if tensor in header:
            size = len(value_bytes)
            with open(f, "r+b") as fh:
                fh.seek(start + header[tensor]["data_offsets"][0] + element * size)
                fh.write(value_bytes)
            return
    raise KeyError(tensor)


@pytest.mark.parametrize("name,victim", [
    ("qwen2_fsdp2_tp_2x2", "model.layers.0.mlp.gate_proj.weight"),
    ("qwen2_megatron_tp2_pp2", "model.layers.3.self_attn.v_proj.weight"),
])
def test_verify_names_the_one_altered_tensor(name, victim, manifest, fixtures, run, tmp_path):
    fx = entry(manifest, name)
    args = extra_args(fixtures, fx, ["--backend", "megatron"] if fx["kind"] == "megatron" else [])
    good = tmp_path / "good"
    run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", good, *args)
    bad = tmp_path / "bad"
    shutil.copytree(good, bad)
    write_element(bad, victim, 7, bytes([0x80, 0x3F]))  # bf16 1.0
    proc = run("verify", "--local_dir", fixtures / fx["role_dir"], "--test_hf_dir", bad, *args, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = [line for line in proc.stdout.splitlines() if line.startswith("values differ:")]
    assert len(lines) == 1 and lines[0].startswith(f"values differ: {victim}: 1 of "), proc.stdout
    assert "DIFFERENT" in proc.stdout
    compared = re.search(r"^shardmerge: compared \d+ tensors .* independently of the merge plan", proc.stdout, re.M)
    assert compared, proc.stdout


def test_multi_process_merge_verify_checks_the_committed_tree(shardmerge_bin, manifest, fixtures, tmp_path):
    from test_multiprocess import launch

    fx = entry(manifest, "qwen2_fsdp2_tp_2x2")
    out = tmp_path / "out"
    results = launch(shardmerge_bin, 2, lambda rank: ["merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir",
                                                      out, "--max-shard-size", "20KB", "--verify"])
    assert all(rc == 0 for rc, _, _ in results), results
    m = VERIFIED.search(results[0][1])
    assert m, results[0][1]
    assert int(m.group(1)) == sum(len(st_header(f)[0]) for f in hf_weight_files(out))
