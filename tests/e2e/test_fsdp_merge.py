"""`shardmerge merge` on every real FSDP fixture: tensors bit-identical to expected.safetensors
under verl's rules (and to verl's own merger output where it exists), dtypes, tied lm_head,
sidecar files and sharded output."""
import json
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from e2e_util import (assert_tensors_bitwise, bits_equal, config_ties, expected_base, hf_tensor_names,  # noqa: E402
                      hf_weight_files, load_hf, load_st, role_config, st_header, tensor_nbytes,
                      verl_name)


def lora_opts(fx, mode="adapter"):
    """LoRA fixtures are compared with expected (unfolded) base weights: --lora adapter."""
    return ["--lora", mode] if fx.get("lora") else []


def default_dtype(fx):
    """What the default --dtype writes: a 16-bit float checkpoint keeps its dtype; fp32 becomes bf16 (verl's)."""
    return "keep" if fx.get("param_dtype") in ("float16", "bfloat16") else "bf16"


# ---------------------------------------------------------------------------------------------
# default merge (bf16) vs expected.safetensors


def test_merge_matches_expected_bf16(fsdp_fx, fixtures, merged):
    out = merged(fsdp_fx, *lora_opts(fsdp_fx))
    got = load_hf(out)
    exp = expected_base(fixtures, fsdp_fx, default_dtype(fsdp_fx))
    assert_tensors_bitwise(got, exp, f"{fsdp_fx['name']} (default --dtype) vs expected.safetensors, "
                                     f"{default_dtype(fsdp_fx)}")
    # integer buffers keep their dtype (verl casts them: see test_matches_verl_ref)
    for k, t in exp.items():
        if not t.is_floating_point():
            assert got[k].dtype == t.dtype, f"{k}: integer tensor written as {got[k].dtype}"
    # one file, safetensors metadata as save_pretrained writes it
    assert [p.name for p in hf_weight_files(out)] == ["model.safetensors"]
    assert not (out / "model.safetensors.index.json").exists()
    _, meta, _ = st_header(out / "model.safetensors")
    assert meta == {"format": "pt"}, f"safetensors __metadata__ is {meta}"


def test_merge_lora_fold_runs(lora_fx, fixtures, merged):
    """--lora fold: same key set as --lora adapter, no LoRA/base_layer keys, untargeted tensors
    unchanged and every targeted weight changed (values are checked against PEFT in test_lora)."""
    fold = load_hf(merged(lora_fx, "--lora", "fold"))
    base = load_hf(merged(lora_fx, "--lora", "adapter"))
    assert sorted(fold) == sorted(base)
    bad = [k for k in fold if "lora_" in k or "base_layer" in k or k.startswith("base_model.")]
    assert not bad, f"PEFT names left in a folded merge: {bad}"
    exp_raw = load_st(fixtures / lora_fx["expected"])
    targeted = {verl_name(k.split(".lora_A.")[0] + ".base_layer.weight") for k in exp_raw if ".lora_A." in k}
    assert targeted, "fixture has no LoRA A tensors"
    for k in fold:
        if k in targeted:
            assert not bits_equal(fold[k], base[k]), f"{k}: LoRA target not folded (equals the base weight)"
        else:
            assert bits_equal(fold[k], base[k]), f"{k}: not a LoRA target but differs from the base merge"
    assert targeted <= set(fold), f"targets missing from the output: {sorted(targeted - set(fold))}"


# ---------------------------------------------------------------------------------------------
# against verl's own merger


def test_matches_verl_ref(verl_fx, fixtures, merged, run):
    fx = verl_fx
    out = merged(fx, *lora_opts(fx), "--dtype", "bf16")  # verl casts every checkpoint to bf16
    ref_dir = fixtures / fx["verl_ref"]
    assert fx.get("verl_matches_expected_bf16"), "generator says verl_ref does not match expected (see manifest)"
    verl_wrong = set(fx.get("verl_cast_integer_to_bf16") or [])

    proc = run("diff", out, ref_dir, check=False)
    if not verl_wrong:
        assert proc.returncode == 0, f"shardmerge diff OUT verl_ref: {proc.stdout}{proc.stderr}"
        assert "equal" in proc.stdout
    else:
        assert proc.returncode == 1, f"diff should report verl's cast of {sorted(verl_wrong)}: {proc.stdout}"
        reported = {m for m in re.findall(r"^\S[^:]*: ([^\s:]+):", proc.stdout, re.M)}
        assert reported == verl_wrong, f"diff reported {reported}, expected exactly {verl_wrong}:\n{proc.stdout}"

    ours, ref = load_hf(out), load_hf(ref_dir)
    assert sorted(ours) == sorted(ref), f"key sets differ: ours-only {sorted(set(ours) - set(ref))}, " \
                                        f"verl-only {sorted(set(ref) - set(ours))}"
    exp = expected_base(fixtures, fx, "bf16")
    for k in sorted(ours):
        if k in verl_wrong:
            assert not ours[k].is_floating_point() and bits_equal(ours[k], exp[k]), \
                f"{k}: shardmerge wrote {ours[k].dtype} {ours[k].tolist()}, expected {exp[k].dtype} {exp[k].tolist()}"
            assert ref[k].dtype == torch.bfloat16 and not bits_equal(ref[k], exp[k]), \
                f"{k}: verl_ref was expected to hold verl's bf16 cast of the integer buffer, has {ref[k].dtype}"
        else:
            assert bits_equal(ours[k], ref[k]), \
                f"{k}: shardmerge {ours[k].dtype}{list(ours[k].shape)} != verl {ref[k].dtype}{list(ref[k].shape)}"
    for k in verl_wrong:
        assert k in ours, f"{k} missing from our output"

    # LoRA: verl writes base + lora_adapter/ (bf16, same PEFT keys)
    if fx.get("lora"):
        a = load_st(out / "lora_adapter" / "adapter_model.safetensors")
        b = load_st(ref_dir / "lora_adapter" / "adapter_model.safetensors")
        assert_tensors_bitwise(a, b, "lora_adapter/adapter_model.safetensors vs verl's")
        ca = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
        cb = json.loads((ref_dir / "lora_adapter" / "adapter_config.json").read_text())
        assert ca["r"] == cb["r"] and float(ca["lora_alpha"]) == float(cb["lora_alpha"]), (ca["r"], ca["lora_alpha"])
        leaf = {t.split(".")[-1] for t in ca["target_modules"]} if isinstance(ca["target_modules"], list) else None
        assert leaf == set(cb["target_modules"]), f"target modules {ca['target_modules']} vs verl {cb['target_modules']}"


# ---------------------------------------------------------------------------------------------
# --dtype


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "keep", "auto"])
def test_dtype_option(fsdp_fx, dtype, fixtures, merged):
    out = merged(fsdp_fx, "--dtype", dtype, *lora_opts(fsdp_fx))
    src_cfg = role_config(fixtures, fsdp_fx)
    if dtype == "auto":
        want = src_cfg["dtype"]  # transformers 5 writes "dtype"
    elif dtype == "keep":
        want = "keep"
    else:
        want = dtype
    exp = expected_base(fixtures, fsdp_fx, want)
    assert_tensors_bitwise(load_hf(out), exp, f"{fsdp_fx['name']} --dtype {dtype}")
    float_dtypes = {str(t.dtype).replace("torch.", "") for t in exp.values() if t.is_floating_point()}
    assert len(float_dtypes) == 1, float_dtypes
    cfg = json.loads((out / "config.json").read_text())
    assert cfg.get("dtype") == float_dtypes.pop(), f"config.json dtype {cfg.get('dtype')} for --dtype {dtype}"
    if "torch_dtype" in cfg:
        assert cfg["torch_dtype"] == cfg["dtype"], cfg


# ---------------------------------------------------------------------------------------------
# tied embeddings


def test_tied_lm_head_absent_exactly_when_config_ties(fsdp_fx, fixtures, merged):
    names = set(hf_tensor_names(merged(fsdp_fx, *lora_opts(fsdp_fx))))
    cfg = role_config(fixtures, fsdp_fx)
    assert config_ties(cfg) == bool(fsdp_fx["tied"]), "manifest 'tied' disagrees with config.json"
    src_has_lm_head = any(verl_name(k) == "lm_head.weight" for k in load_st(fixtures / fsdp_fx["expected"]))
    if config_ties(cfg):
        assert "lm_head.weight" not in names, "tie_word_embeddings=true but lm_head.weight was written"
        assert "model.embed_tokens.weight" in names
    else:
        assert ("lm_head.weight" in names) == src_has_lm_head, \
            f"untied model: lm_head.weight in source {src_has_lm_head}, in output {'lm_head.weight' in names}"


def test_tie_word_embedding_flag_keeps_untied_lm_head(fixtures, manifest, run, tmp_path):
    """verl's --tie-word-embedding is accepted for compatibility (verl's FSDP merger ignores it).
    On an untied model whose lm_head differs from the embedding, dropping lm_head.weight loses
    trained weights: transformers then initialises lm_head randomly. shardmerge must keep it
    (or refuse), never silently drop it."""
    fx = next((f for f in manifest["fixtures"] if f["name"] == "llama_fsdp2_w4"), None)
    if fx is None:
        pytest.skip("llama_fsdp2_w4 not in the manifest")
    exp = expected_base(fixtures, fx, "bf16")
    assert not bits_equal(exp["lm_head.weight"], exp["model.embed_tokens.weight"])
    out = tmp_path / "out"
    proc = run("merge", "--backend", "fsdp", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out,
               "--tie-word-embedding")
    assert "note: --tie-word-embedding is ignored for FSDP" in proc.stdout, proc.stdout
    assert "lm_head.weight" in hf_tensor_names(out), "the trained output projection was dropped"
    assert_tensors_bitwise(load_hf(out), exp, "--tie-word-embedding on an untied model")


# ---------------------------------------------------------------------------------------------
# sidecars


def test_sidecars_copied(fsdp_fx, fixtures, merged):
    out = merged(fsdp_fx, *lora_opts(fsdp_fx))
    src = fixtures / fsdp_fx["role_dir"] / "huggingface"
    src_files = sorted(p.name for p in src.iterdir() if p.is_file())
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert name in src_files, f"fixture lacks huggingface/{name}"
    for name in src_files:
        assert (out / name).exists(), f"huggingface/{name} not copied"
        if name == "config.json":
            continue
        assert (out / name).read_bytes() == (src / name).read_bytes(), f"{name} differs from the source"
    # generation_config.json: copied exactly when the checkpoint has one (the critic has none)
    assert (out / "generation_config.json").exists() == (src / "generation_config.json").exists()
    cfg_src = json.loads((src / "config.json").read_text())
    cfg_out = json.loads((out / "config.json").read_text())
    want = "bfloat16" if default_dtype(fsdp_fx) == "bf16" else fsdp_fx["param_dtype"]
    assert cfg_out.get("dtype") == want, f"config.json dtype {cfg_out.get('dtype')}, want {want}"
    diff = {k for k in set(cfg_src) | set(cfg_out) if cfg_src.get(k) != cfg_out.get(k)} - {"dtype", "torch_dtype"}
    assert not diff, f"config.json keys changed besides dtype: {sorted(diff)}"
    expected_files = set(src_files) | {"model.safetensors"}
    if fsdp_fx.get("lora"):
        expected_files.add("lora_adapter")
    assert {p.name for p in out.iterdir()} == expected_files


# ---------------------------------------------------------------------------------------------
# --max-shard-size

SHARD_FIXTURES = ["qwen2_fsdp2_w2", "llama_fsdp2_w4", "qwen2_fsdp2_buffers_w2", "qwen2_lora_fsdp2_w2"]


@pytest.mark.parametrize("limit,limit_bytes", [("20KB", 20_000), ("10KB", 10_000), ("16KiB", 16_384)])
@pytest.mark.parametrize("name", SHARD_FIXTURES)
def test_max_shard_size(name, limit, limit_bytes, manifest, fixtures, merged, run):
    fx = next((f for f in manifest["fixtures"] if f["name"] == name), None)
    if fx is None:
        pytest.skip(f"{name} not in the manifest")
    opts = lora_opts(fx, "fold")
    out = merged(fx, "--max-shard-size", limit, *opts)
    single = merged(fx, *opts)
    shards = sorted(p.name for p in out.glob("model*.safetensors"))
    assert "model.safetensors" not in shards
    n = len(shards)
    assert n >= 2, f"{limit}: expected several shards for {sum(tensor_nbytes(e) for e in st_header(single / 'model.safetensors')[0].values())} bytes, got {shards}"
    assert shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    index = json.loads((out / "model.safetensors.index.json").read_text())
    where, total = {}, 0
    for s in shards:
        h, meta, _ = st_header(out / s)
        assert meta == {"format": "pt"}, f"{s}: metadata {meta}"
        size = sum(tensor_nbytes(e) for e in h.values())
        assert size <= limit_bytes or len(h) == 1, f"{s}: {size} tensor bytes in {len(h)} tensors > {limit_bytes}"
        for k in h:
            assert k not in where, f"{k} in {where[k]} and {s}"
            where[k] = s
        total += size
    assert index["weight_map"] == where, "weight_map does not name the shard that holds each tensor"
    assert index["metadata"]["total_size"] == total
    got = load_hf(out)
    assert_tensors_bitwise(got, load_hf(single), f"{name} sharded at {limit} vs single file")
    proc = run("diff", out, single, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = run("verify", "--local_dir", fixtures / fx["role_dir"], "--test_hf_dir", out, *opts, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
