"""Architectures whose FSDP rank files hold transformers 5's run-time names (fused MoE experts,
VLM prefixes) merge into exactly what the model class's own `save_pretrained` writes: the same
files (shards and index), tensor names, order, shapes, dtypes and bytes. The oracle is
saved_pretrained/ in each zoo fixture, written by transformers itself (tests/fixtures/fx_fsdp.py),
not by shardmerge's name table."""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from e2e_util import assert_same_hf_files, hf_weight_files, st_header  # noqa: E402


def merge_like_oracle(merged, fx, *extra):
    # save_pretrained wrote fp32 (the models are fp32) sharded at 60KB
    return merged(fx, "--dtype", "fp32", "--max-shard-size", "60KB", *extra)


def test_merge_equals_save_pretrained(zoo_fx, fixtures, merged):
    """(With LoRA: folded, as PEFT's merge_and_unload() then the class's save_pretrained.)"""
    assert_same_hf_files(merge_like_oracle(merged, zoo_fx), fixtures / zoo_fx["saved_pretrained"])


def test_lora_adapter_is_what_peft_saves(zoo_fx, fixtures, merged):
    """LoRA over converted modules (a VLM's vision blocks and language model): --lora adapter
    writes the base as the class saves it without the adapter (PEFT's unload()), and the adapter
    with the tensor names and bytes PEFT's own save_pretrained writes; PEFT applies that adapter
    to that base and gives the folded model's logits."""
    if not zoo_fx.get("lora"):
        pytest.skip("no LoRA")
    import peft
    import transformers
    from safetensors.torch import load_file

    out = merge_like_oracle(merged, zoo_fx, "--lora", "adapter")
    assert_same_hf_files(out, fixtures / zoo_fx["lora"]["saved_base"])
    ours = load_file(str(out / "lora_adapter" / "adapter_model.safetensors"))
    theirs = load_file(str(fixtures / zoo_fx["lora"]["peft_adapter"] / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    config = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"]) == (zoo_fx["lora"]["r"], zoo_fx["lora"]["lora_alpha"])
    peft_config = json.loads((fixtures / zoo_fx["lora"]["peft_adapter"] / "adapter_config.json").read_text())
    assert sorted(config["target_modules"]) == sorted(peft_config["target_modules"])
    cls = getattr(transformers, zoo_fx["architecture"])
    with_adapter = peft.PeftModel.from_pretrained(cls.from_pretrained(out, dtype=torch.float32), out / "lora_adapter")
    folded = cls.from_pretrained(merge_like_oracle(merged, zoo_fx), dtype=torch.float32)
    ids = torch.tensor([[1, 5, 17, 42, 99, 3]])
    with torch.no_grad():
        torch.testing.assert_close(with_adapter(input_ids=ids).logits, folded(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_lora_only_onto_the_base_is_what_peft_writes(zoo_lora_only_fx, fixtures, merged):
    """verl's save_lora_only of a VLM (rank files with the adapter alone, run-time names): folded
    onto the base's saved-name weights given as --hf_model_path, it is byte for byte PEFT's
    merge_and_unload saved by the class; the adapter alone is PEFT's own save_pretrained."""
    from safetensors.torch import load_file

    fx = zoo_lora_only_fx
    assert_same_hf_files(merge_like_oracle(merged, fx, "--hf_model_path", fixtures / fx["base"]),
                         fixtures / fx["saved_pretrained"])
    out = merge_like_oracle(merged, fx, "--lora", "adapter")
    ours = load_file(str(out / "lora_adapter" / "adapter_model.safetensors"))
    theirs = load_file(str(fixtures / fx["lora"]["peft_adapter"] / "adapter_model.safetensors"))
    assert sorted(ours) == sorted(theirs)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)


def model_inputs(config):
    """Token ids, and for a Qwen-VL model one 4x4-patch image among them, so that the logits
    depend on the vision tower and the merger too."""
    if not hasattr(config, "vision_config"):
        return {"input_ids": torch.tensor([[1, 5, 17, 42, 99, 3]])}
    vc = config.vision_config
    thw = torch.tensor([[1, 4, 4]])
    image_tokens = [config.image_token_id] * (16 // vc.spatial_merge_size ** 2)
    pixels = torch.randn(16, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2,
                         generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[1, 5, config.vision_start_token_id, *image_tokens, 17, 42]])
    # which positions are image tokens (the processor's output, for M-RoPE)
    return {"input_ids": ids, "pixel_values": pixels, "image_grid_thw": thw,
            "mm_token_type_ids": (ids == config.image_token_id).long()}


def test_transformers_loads_with_no_missing_keys(zoo_fx, fixtures, merged):
    """The merge loads into its class with no missing or unexpected key and gives the logits of
    the saved oracle (a VLM's with an image in the prompt). Both run eager attention: the
    checkpoint's config may name another implementation than the oracle's."""
    import transformers

    out = merge_like_oracle(merged, zoo_fx)
    cls = getattr(transformers, zoo_fx["architecture"])
    kw = {"dtype": torch.float32, "attn_implementation": "eager"}
    model, info = cls.from_pretrained(out, output_loading_info=True, **kw)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    oracle = cls.from_pretrained(fixtures / zoo_fx["saved_pretrained"], **kw)
    inputs = model_inputs(oracle.config)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, oracle(**inputs).logits)


def test_keep_runtime_names_writes_the_rank_files_names(zoo_fx, fixtures, merged, run):
    """--keep-runtime-names: the names, shapes and bytes of the gathered run-time state dict
    (expected.safetensors, written by the training processes)."""
    from safetensors.torch import load_file

    lora = ("--lora", "adapter") if zoo_fx.get("lora") else ()
    out = merged(zoo_fx, "--dtype", "fp32", "--keep-runtime-names", *lora)
    got = {}
    for f in hf_weight_files(out):
        got.update(load_file(str(f)))
    exp = load_file(str(fixtures / zoo_fx["role_dir"] / ".." / ".." / "expected.safetensors"))
    if lora:  # the base under PEFT's wrapper: base_model.model.<name>, <module>.base_layer.<param>
        exp = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v for k, v in exp.items() if "lora_" not in k}
    tied = set(exp) - set(got)
    assert tied <= {"lm_head.weight"}, f"missing: {sorted(tied)}"
    assert sorted(got) == sorted(set(exp) - tied)
    for k, t in got.items():
        assert torch.equal(t, exp[k]), k


def test_verify_checks_the_converted_names(zoo_fx, fixtures, merged, run):
    """verify (an independent assembly) accepts the saved-name merge and rejects one flipped
    element of a per-expert or renamed tensor."""
    out = merge_like_oracle(merged, zoo_fx)
    role = fixtures / zoo_fx["role_dir"]
    run("verify", "--local_dir", role, "--test_hf_dir", out, "--dtype", "fp32")
    assert run("merge", "--local_dir", role, "--target_dir", out.parent / (out.name + "-v"), "--dtype", "fp32",
               "--verify").returncode == 0
    # one flipped byte in the last tensor of the last shard (a per-expert or renamed one)
    import shutil

    bad = out.parent / (out.name + "-flipped")
    shutil.copytree(out, bad)
    last = hf_weight_files(bad)[-1]
    header, _, data_start = st_header(last)
    name, entry = max(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    raw = bytearray(last.read_bytes())
    raw[data_start + entry["data_offsets"][0]] ^= 0x40
    last.write_bytes(bytes(raw))
    proc = run("verify", "--local_dir", role, "--test_hf_dir", bad, "--dtype", "fp32", check=False)
    assert proc.returncode == 1 and name in proc.stdout + proc.stderr, (name, proc.stdout, proc.stderr)


def saves_runtime_names(fixtures, fx):
    """Whether the class's save_pretrained (the oracle) keeps the names the training processes
    gathered (expected.safetensors), a tied lm_head aside."""
    from safetensors import safe_open

    with safe_open(str(fixtures / fx["expected"]), "pt") as f:
        gathered = {k.removeprefix("base_model.model.").replace(".base_layer.", ".") for k in f.keys() if "lora_" not in k}
    saved = set()
    for shard in hf_weight_files(fixtures / (fx["lora"]["saved_base"] if fx["lora"] else fx["saved_pretrained"])):
        with safe_open(str(shard), "pt") as f:
            saved |= set(f.keys())
    return gathered - {"lm_head.weight"} == saved - {"lm_head.weight"}


def test_inspect_names_the_conversion(zoo_fx, fixtures, run):
    info = json.loads(run("inspect", fixtures / zoo_fx["role_dir"], "--json").stdout)
    conv = info.get("saved_names")
    assert conv is not None, f"inspect --json has no saved_names: {sorted(info)}"
    assert conv["class"] == zoo_fx["architecture"]
    if saves_runtime_names(fixtures, zoo_fx):
        assert conv["conversion"] is None
    else:
        assert conv["conversion"]


def test_matches_verl_merger(zoo_fx, fixtures, merged, run):
    """verl's own merger (python -m verl.model_merger, run by the generator) is a second oracle:
    cast to bf16 as verl casts, the merge holds its tensor names, shapes and bytes (under LoRA
    the base without the adapter, as verl does not fold)."""
    from safetensors.torch import load_file

    if not zoo_fx.get("verl_ref"):
        pytest.skip("no verl_ref (verl not installed when the fixtures were made)")
    assert zoo_fx.get("verl_matches_expected_bf16"), "verl_ref differs from the class's save_pretrained (see manifest)"
    lora = ("--lora", "adapter") if zoo_fx.get("lora") else ()
    out = merged(zoo_fx, "--dtype", "bf16", *lora)
    ours, verls = {}, {}
    for d, into in ((out, ours), (fixtures / zoo_fx["verl_ref"], verls)):
        for f in hf_weight_files(d):
            into.update(load_file(str(f)))
    assert sorted(ours) == sorted(verls)
    bad = [k for k in verls if ours[k].dtype != verls[k].dtype or not torch.equal(ours[k], verls[k])]
    assert not bad, f"differ from verl's merger: {bad[:5]}"


def test_unknown_class_with_runtime_names_is_refused(fixtures, run, tmp_path):
    """A fused-expert checkpoint whose config names a class the table does not know: one line
    naming the keys, exit 1, nothing written."""
    import shutil

    zoo = [f for f in json.loads((fixtures / "manifest.json").read_text())["fixtures"]
           if f["kind"] == "fsdp_zoo" and f["model"] == "qwen3_moe" and f.get("status") == "ok"]
    if not zoo:
        pytest.skip("no qwen3_moe zoo fixture")
    role = tmp_path / "actor"
    shutil.copytree(fixtures / zoo[0]["role_dir"], role)
    cfg_path = role / "huggingface" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["architectures"] = ["SomeFutureMoeForCausalLM"]
    cfg_path.write_text(json.dumps(cfg))
    target = tmp_path / "out"
    proc = run("merge", "--local_dir", role, "--target_dir", target, check=False)
    assert proc.returncode == 1, proc.stderr
    err = [l for l in proc.stderr.splitlines() if l.startswith("shardmerge: error")]
    assert len(err) == 1 and "mlp.experts.gate_up_proj" in err[0] and "SomeFutureMoeForCausalLM" in err[0], proc.stderr
    assert not target.exists()
    # and the escape hatch writes the run-time names
    run("merge", "--local_dir", role, "--target_dir", target, "--keep-runtime-names")
    assert any("experts.gate_up_proj" in n for f in hf_weight_files(target) for n in st_header(f)[0])
