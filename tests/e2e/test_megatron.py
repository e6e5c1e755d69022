"""Megatron checkpoints written by real megatron-core (dist_checkpointing.save, torch_dist, CPU +
gloo; TP/PP/VPP/EP; v1 dist_ckpt, v2 manifest, zstd items, legacy mp_rank files) merge to the HF
weights each fixture was converted from, bit for bit, and load in transformers."""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from e2e_util import (assert_tensors_bitwise, error_lines, hf_tensor_names, leftovers, load_hf, load_st,  # noqa: E402
                      max_abs, megatron_merge_args, ulp_distance)


# The base weights, whether or not the fixture has LoRA adapters (they have their own tests).
BASE = ("--lora", "drop")


def expected_weights(fixtures, fx):
    """The HF weights the fixture was converted from; a value model's [1, H] head is written as
    score.weight (the issue's rule; mbridge calls it lm_head.weight)."""
    exp = load_st(fixtures / fx["expected"] / "model.safetensors")
    if fx.get("value_model") and "lm_head.weight" in exp:
        exp["score.weight"] = exp.pop("lm_head.weight")
    return exp


@pytest.fixture(scope="module")
def merged_megatron(run, fixtures, tmp_path_factory):
    cache = {}
    root = tmp_path_factory.mktemp("megatron")

    def _merged(fx, *options):
        key = (fx["name"], tuple(map(str, options)))
        if key not in cache:
            out = root / f"m{len(cache):03d}"
            run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out,
                *megatron_merge_args(fixtures, fx), *options)
            cache[key] = out
        return cache[key]

    return _merged


def test_merge_equals_the_hf_weights_it_came_from(megatron_fx, fixtures, merged_megatron):
    """--dtype keep writes each tensor in the checkpoint's dtype: where save_pretrained upcasts a
    16-bit router to float32, the merge keeps the 16 bits it was trained in (an exact round trip)."""
    out = load_hf(merged_megatron(megatron_fx, "--dtype", "keep", *BASE))
    exp = expected_weights(fixtures, megatron_fx)
    for k, v in exp.items():
        if k in out and v.dtype == torch.float32 and out[k].dtype == torch.bfloat16:
            assert torch.equal(v.to(torch.bfloat16).float(), v), f"{k}: float32 in expected/ that bf16 cannot hold"
            exp[k] = v.to(torch.bfloat16)
    assert_tensors_bitwise(out, exp, megatron_fx["name"])


def test_default_dtype_is_bf16_rounded_like_torch(megatron_fx, fixtures, merged_megatron):
    """bf16, but for the tensors the model class keeps in float32 (routers, e_score_correction_bias):
    a bf16 fixture's expected/ is its class's save_pretrained, which writes those as float32."""
    out = load_hf(merged_megatron(megatron_fx, *BASE))
    kept = megatron_fx["param_dtype"] != "float32"
    exp = {k: v.to(torch.bfloat16) if v.is_floating_point() and not (kept and v.dtype == torch.float32) else v
           for k, v in expected_weights(fixtures, megatron_fx).items()}
    assert_tensors_bitwise(out, exp, megatron_fx["name"] + " (bf16)")


def test_sharded_index_counts_bytes(megatron_fx, merged_megatron):
    out = merged_megatron(megatron_fx, "--max-shard-size", "40KB", *BASE)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    tensors = load_hf(out)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in tensors.values())
    assert set(index["weight_map"]) == set(tensors)
    assert len(set(index["weight_map"].values())) > 1, "expected several shards at 40KB"


def test_config_and_tokenizer_written(megatron_fx, merged_megatron):
    out = merged_megatron(megatron_fx, *BASE)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == [megatron_fx["architecture"]] or megatron_fx.get("value_model")
    assert cfg.get("dtype", cfg.get("torch_dtype")) == "bfloat16"


@pytest.mark.parametrize("name", ["qwen2_megatron_tp2_pp2", "llama_megatron_tp2", "qwen3moe_megatron_ep2",
                                  "qwen2_megatron_tp2_pp2_legacy", "mixtral_megatron_ep2", "deepseekv3_megatron_ep2",
                                  "glm4moe_megatron_tp2", "qwen25vl_megatron_tp1"])
def test_loads_in_transformers_without_missing_keys(name, manifest, fixtures, merged_megatron):
    """Loads with no missing or unexpected keys, and gives the logits of the model the fixture's
    expected/ weights make."""
    transformers = pytest.importorskip("transformers")
    fx = next((f for f in manifest["fixtures"] if f["name"] == name and f.get("status") == "ok"), None)
    if fx is None:
        pytest.skip(f"{name} not in the manifest")
    out = merged_megatron(fx)
    cls = getattr(transformers, fx["architecture"])
    model, info = cls.from_pretrained(str(out), output_loading_info=True)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        assert not info[key], f"{name}: {key} {info[key]}"
    model = model.float()  # as the oracle: both computed in float32 from the same values
    oracle = cls.from_pretrained(str(fixtures / fx["expected"]), dtype=torch.float32)
    with torch.no_grad():
        ids = torch.tensor([[1, 5, 9, 200]])
        logits = model(input_ids=ids).logits
        assert torch.isfinite(logits).all()
        if not fx.get("value_model"):
            assert torch.equal(logits, oracle(input_ids=ids).logits), f"{name}: logits differ from expected/'s model"
        if hasattr(model, "get_image_features"):  # the vision tower and merger, on one 4x4-patch image
            vc = model.config.vision_config
            thw = torch.tensor([[1, 4, 4]])
            pixels = torch.randn(16, vc.in_channels * vc.temporal_patch_size * vc.patch_size ** 2,
                                 generator=torch.Generator().manual_seed(0))
            got, want = (m.get_image_features(pixel_values=pixels, image_grid_thw=thw) for m in (model, oracle))
            got, want = (x.pooler_output if hasattr(x, "pooler_output") else x for x in (got, want))
            got, want = (torch.cat(list(x)) if isinstance(x, (tuple, list)) else x for x in (got, want))
            assert torch.equal(got, want), f"{name}: image features differ from expected/'s model"


def test_mtp_layers_pass_the_given_configs_check(manifest, fixtures, merged_megatron):
    """--hf_model_path's config states num_hidden_layers without the MTP layer that follows them."""
    fx = next((f for f in manifest["fixtures"] if f["name"] == "deepseekv3_mtp_megatron_tp2" and f.get("status") == "ok"), None)
    if fx is None:
        pytest.skip("deepseekv3_mtp_megatron_tp2 not in the manifest")
    out = merged_megatron(fx, "--hf_model_path", fixtures / fx["hf_config_dir_fallback"], *BASE)
    assert_tensors_bitwise(load_hf(out), expected_weights(fixtures, fx), fx["name"])


def test_dist_only_save_without_config_says_how_to_fix(manifest, fixtures, run, tmp_path):
    fx = next((f for f in manifest["fixtures"] if f["kind"] == "megatron" and f.get("status") == "ok"
               and not f.get("hf_config_dir")), None)
    if fx is None:
        pytest.skip("no dist-only Megatron fixture")
    target = tmp_path / "out"
    proc = run("merge", "--backend", "megatron", "--local_dir", fixtures / fx["role_dir"], "--target_dir", target,
               check=False)
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "--hf_model_path" in lines[0], proc.stderr
    assert not target.exists() and leftovers(target) == []


@pytest.mark.parametrize("name,holds", [
    # what fx_megatron's tiny configs build
    ("deepseekv3_mtp_megatron_tp2", {"layers": 2, "attention": "multi-head latent (q_lora_rank 16, kv_lora_rank 16)",
                                     "experts": 4, "moe_layers": 1, "shared_experts": True, "expert_bias": True,
                                     "mtp_layers": 1}),
    ("qwen3moe_megatron_ep2", {"layers": 2, "attention": "4 heads, 2 KV groups", "experts": 4, "moe_layers": 2,
                               "shared_experts": False, "expert_bias": False}),
    ("llama_megatron_tp2", {"layers": 2, "attention": "4 heads, 2 KV groups"}),
    ("qwen25vl_megatron_tp1", {"layers": 2, "attention": "4 heads, 2 KV groups", "vision_tower": True}),
])
def test_inspect_says_what_the_model_holds(name, holds, manifest, fixtures, run):
    fx = next((f for f in manifest["fixtures"] if f["name"] == name and f.get("status") == "ok"), None)
    if fx is None:
        pytest.skip(f"{name} not in the manifest")
    report = json.loads(run("inspect", fixtures / fx["role_dir"], "--json").stdout)
    assert report["model"] == holds


def test_inspect_lists_dist_ckpt_tensors(manifest, fixtures, run):
    fx = next((f for f in manifest["fixtures"] if f["name"] == "qwen2_megatron_tp2_pp2"), None)
    if fx is None:
        pytest.skip("qwen2_megatron_tp2_pp2 not in the manifest")
    proc = run("inspect", fixtures / fx["role_dir"], "--json", "--tensors")
    report = json.loads(proc.stdout)
    text = json.dumps(report)
    for key, meta in fx["dcp"]["model/dist_ckpt"]["keys"].items():
        if "shape" in meta:
            assert key in text, f"inspect does not list {key}"
    assert "optimizer" not in {k.split(".")[0] for k in fx["dcp"]["model/dist_ckpt"]["keys"]}


def test_verify_against_expected(megatron_fx, fixtures, run):
    if megatron_fx.get("value_model"):
        pytest.skip("the expected tree names the value head lm_head.weight (mbridge), we write score.weight")
    args = megatron_merge_args(fixtures, megatron_fx)
    # expected/ is save_pretrained's: a bf16 model's float32 routers are what --dtype default writes
    dtype = "keep" if megatron_fx["param_dtype"] == "float32" else "default"
    proc = run("verify", "--local_dir", fixtures / megatron_fx["role_dir"], "--test_hf_dir",
               fixtures / megatron_fx["expected"], "--dtype", dtype, *BASE, *args, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_value_model_head(manifest, fixtures, merged_megatron):
    fx = next((f for f in manifest["fixtures"] if f["kind"] == "megatron" and f.get("value_model")), None)
    if fx is None:
        pytest.skip("no Megatron critic fixture")
    names = set(hf_tensor_names(merged_megatron(fx)))
    assert "score.weight" in names and "lm_head.weight" not in names


def lora_fixture(manifest):
    fx = next((f for f in manifest["fixtures"] if f["kind"] == "megatron" and f.get("status") == "ok"
               and f.get("lora")), None)
    if fx is None:
        pytest.skip("no Megatron LoRA fixture")
    return fx


def test_lora_fold_matches_the_fused_fold(manifest, fixtures, merged_megatron):
    """W + (alpha/dim)·linear_out@linear_in folded in Megatron layout before the QKV / gate-up
    split (fixture, fp32 then bf16) equals our per-HF-part fold within one bf16 ulp."""
    fx = lora_fixture(manifest)
    got = load_hf(merged_megatron(fx, "--lora", "fold", "--dtype", "keep"))
    ref = load_st(fixtures / fx["expected_folded"] / "model.safetensors")
    assert set(got) == set(ref), sorted(set(got) ^ set(ref))
    worst = max((ulp_distance(got[k], ref[k]), max_abs(got[k], ref[k]), k) for k in ref)
    assert worst[0] <= 1, f"{worst[2]} is {worst[0]} ulp off (max abs error {worst[1]:g})"
    base = load_st(fixtures / fx["expected"] / "model.safetensors")
    changed = [k for k in ref if not torch.equal(ref[k], base[k])]
    assert changed, "the fixture's fold changes nothing"
    assert all(torch.equal(got[k], ref[k]) for k in ref if k not in changed), "unadapted tensors must be byte-identical"


def test_lora_adapter_export_reproduces_the_fold(manifest, fixtures, merged_megatron):
    """--lora adapter: the base weights plus a PEFT adapter (q/k/v and gate/up get their own
    lora_A, the shared Megatron linear_in) that PEFT merges into the same weights."""
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    fx = lora_fixture(manifest)
    out = merged_megatron(fx, "--lora", "adapter", "--dtype", "fp32")
    cfg = json.loads((out / "lora_adapter" / "adapter_config.json").read_text())
    assert cfg["r"] == fx["lora"]["dim"] and cfg["lora_alpha"] == fx["lora"]["alpha"]
    assert not any(".lora_" in k for k in hf_tensor_names(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    merged = peft.PeftModel.from_pretrained(model, str(out / "lora_adapter")).merge_and_unload()
    sd = {k: v.to(torch.bfloat16) for k, v in merged.state_dict().items()}
    ref = load_st(fixtures / fx["expected_folded"] / "model.safetensors")
    worst = max((ulp_distance(sd[k], ref[k]), k) for k in ref)
    assert worst[0] <= 1, f"{worst[1]} is {worst[0]} ulp off"


def test_lora_without_alpha_says_how_to_pass_it(manifest, fixtures, run, tmp_path):
    fx = lora_fixture(manifest)
    args = [a for a in megatron_merge_args(fixtures, fx)]
    i = args.index("--lora-alpha")
    del args[i:i + 2]
    proc = run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", tmp_path / "out", *args, check=False)
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "--lora-alpha" in lines[0], proc.stderr
    assert not (tmp_path / "out").exists()


def test_lora_both_is_fold_plus_verls_layout_in_unfolded(manifest, fixtures, merged_megatron):
    """--lora both on Megatron LoRA: the folded model at the root (no adapter beside it) and
    --lora adapter's tree in unfolded/, as for FSDP; the default is --lora fold."""
    from e2e_util import tree_digest

    fx = lora_fixture(manifest)
    both = merged_megatron(fx, "--lora", "both", "--dtype", "fp32")
    fold = merged_megatron(fx, "--lora", "fold", "--dtype", "fp32")
    adapter = merged_megatron(fx, "--lora", "adapter", "--dtype", "fp32")
    assert_tensors_bitwise(load_hf(both), load_hf(fold), "--lora both root vs --lora fold")
    assert not (both / "lora_adapter").exists(), "an adapter beside the folded weights"
    assert tree_digest(both / "unfolded") == tree_digest(adapter), "--lora both unfolded/ vs --lora adapter"
    assert tree_digest(merged_megatron(fx, "--dtype", "fp32")) == tree_digest(fold), "default vs --lora fold"
