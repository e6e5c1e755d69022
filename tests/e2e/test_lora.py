"""LoRA: folding FSDP LoRA checkpoints (vs PEFT's merge_and_unload and a hand fold), the PEFT
adapter export, drop/both, missing alpha, and `shardmerge fold-lora` on PEFT adapters."""
import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from e2e_util import (assert_tensors_bitwise, assert_within_ulp, bits_equal, error_lines, expected_base,  # noqa: E402
                      leftovers, load_hf, load_st, tree_digest, verl_name)


def train_meta(fixtures, fx):
    return json.loads((fixtures / fx["role_dir"] / "lora_train_meta.json").read_text())


def hand_fold(fixtures, fx):
    """W + (alpha/r)·(B@A) in fp32, cast once to bf16, for every LoRA module; other tensors cast."""
    raw = load_st(fixtures / fx["expected"])
    meta = train_meta(fixtures, fx)
    scale = meta["lora_alpha"] / meta["r"]
    assert scale == pytest.approx(fx["lora"]["scaling"])
    out = expected_base(fixtures, fx, "fp32")
    n = 0
    for k in raw:
        if ".lora_A." not in k:
            continue
        mod = k.split(".lora_A.")[0]
        a, b = raw[k].float(), raw[k.replace(".lora_A.", ".lora_B.")].float()
        w = verl_name(mod + ".base_layer.weight")
        out[w] = out[w] + scale * (b @ a)
        n += 1
    assert n > 0
    return {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in out.items()}, n


def peft_model(fixtures, fx, state_dict):
    """The fixture's PEFT model (base config + LoraConfig from the manifest) in fp32, with the
    given state dict (PEFT names, as in expected.safetensors)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    cfg = transformers.AutoConfig.from_pretrained(str(fixtures / fx["role_dir"] / "huggingface"))
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    lcfg = peft.LoraConfig(r=fx["lora"]["r"], lora_alpha=fx["lora"]["lora_alpha"],
                           target_modules=fx["lora"]["target_modules"], lora_dropout=0.0, bias="none",
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(base, lcfg)
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= {"base_model.model.lm_head.weight"}, missing
    return model.eval()


def peft_fold(fixtures, fx):
    """PEFT's own merge_and_unload of the fixture's PEFT model (fp32), cast to bf16."""
    model = peft_model(fixtures, fx, load_st(fixtures / fx["expected"]))
    merged = model.merge_and_unload().state_dict()
    exp_names = set(expected_base(fixtures, fx, "bf16"))
    return {k: v.to(torch.bfloat16) for k, v in merged.items() if k in exp_names}


# ---------------------------------------------------------------------------------------------
# FSDP LoRA checkpoints


def test_fold_matches_hand_fold_and_peft(lora_fx, fixtures, merged):
    out = merged(lora_fx, "--lora", "fold")
    got = load_hf(out)
    assert not [k for k in got if "lora_" in k or "base_layer" in k], sorted(got)
    assert not (out / "lora_adapter").exists(), "--lora fold wrote an adapter"
    ref, n = hand_fold(fixtures, lora_fx)
    assert_within_ulp(got, ref, 1, f"{lora_fx['name']} fold vs W + s·B@A (fp32, then bf16)")
    assert_within_ulp(got, peft_fold(fixtures, lora_fx), 1, f"{lora_fx['name']} fold vs PEFT merge_and_unload")
    # tensors that are not LoRA targets are plain bf16 casts, bit for bit
    base = expected_base(fixtures, lora_fx, "bf16")
    raw = load_st(fixtures / lora_fx["expected"])
    targets = {verl_name(k.split(".lora_A.")[0] + ".base_layer.weight") for k in raw if ".lora_A." in k}
    assert len(targets) == n
    for k in base:
        if k not in targets:
            assert bits_equal(got[k], base[k]), f"{k}: untargeted tensor changed by the fold"


def test_adapter_export_loads_with_peft(lora_fx, fixtures, merged):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    out = merged(lora_fx, "--lora", "adapter")
    adir = out / "lora_adapter"
    assert (adir / "adapter_config.json").exists() and (adir / "adapter_model.safetensors").exists()
    acfg = json.loads((adir / "adapter_config.json").read_text())
    assert acfg["peft_type"] == "LORA"
    assert acfg["r"] == lora_fx["lora"]["r"] and float(acfg["lora_alpha"]) == float(lora_fx["lora"]["lora_alpha"])
    # the adapter tensors are the checkpoint's A/B under PEFT's saved names, bf16
    raw = load_st(fixtures / lora_fx["expected"])
    want = {k.replace(".default.weight", ".weight"): v.to(torch.bfloat16) for k, v in raw.items() if "lora_" in k}
    assert_tensors_bitwise(load_st(adir / "adapter_model.safetensors"), want, "adapter_model.safetensors")
    # base weights are not folded in adapter mode
    assert_tensors_bitwise(load_hf(out), expected_base(fixtures, lora_fx, "bf16"), "--lora adapter base")

    base_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    model = peft.PeftModel.from_pretrained(base_model, str(adir)).eval()
    sd = model.state_dict()
    for k, v in want.items():
        pk = k.replace(".lora_A.weight", ".lora_A.default.weight").replace(".lora_B.weight", ".lora_B.default.weight")
        assert pk in sd, f"PEFT model lacks {pk}"
        assert torch.equal(sd[pk], v.float()), f"{pk}: adapter weight not loaded"
    ids = torch.tensor([[2, 17, 45, 100, 200, 250, 3, 1, 0, 77]])
    folded = transformers.AutoModelForCausalLM.from_pretrained(str(merged(lora_fx, "--lora", "fold")),
                                                               dtype=torch.float32).eval()
    base_only = transformers.AutoModelForCausalLM.from_pretrained(str(merged(lora_fx, "--lora", "drop")),
                                                                  dtype=torch.float32).eval()
    # the PEFT model of the checkpoint with every weight rounded to bf16 once (what the export holds)
    ref16 = peft_model(fixtures, lora_fx, {k: v.to(torch.bfloat16).float() for k, v in raw.items()})
    with torch.no_grad():
        a, b, c, r = (m(input_ids=ids).logits for m in (model, folded, base_only, ref16))
    assert torch.allclose(a, r, rtol=1e-5, atol=1e-5), \
        f"PEFT(merged base + lora_adapter) vs PEFT(checkpoint in bf16): max abs {(a - r).abs().max().item():g}"
    # folding rounds W + s·B@A once to bf16; the adapter path rounds W, A and B separately: they agree
    # to bf16 precision (a few % of the logit scale on this tiny model), far closer than without LoRA
    diff, lora_effect = (a - b).abs().max().item(), (c - b).abs().max().item()
    scale = b.abs().max().item()
    assert torch.allclose(a, b, rtol=0, atol=0.03 * scale), \
        f"PEFT(base + adapter) vs folded: max abs logit diff {diff:g} (logit scale {scale:g})"
    assert diff < 0.25 * lora_effect, f"fold/adapter diff {diff:g} not small against the LoRA effect {lora_effect:g}"


def test_adapter_is_not_a_no_op(lora_fx, fixtures, merged):
    """The folded model must differ from the base model (LoRA B is non-zero in the fixtures)."""
    fold = load_hf(merged(lora_fx, "--lora", "fold"))
    base = load_hf(merged(lora_fx, "--lora", "drop"))
    changed = [k for k in fold if not bits_equal(fold[k], base[k])]
    assert changed, "--lora fold output equals the base weights"


def test_drop_and_both(lora_fx, fixtures, merged):
    drop = merged(lora_fx, "--lora", "drop")
    assert not (drop / "lora_adapter").exists(), "--lora drop wrote an adapter"
    assert_tensors_bitwise(load_hf(drop), expected_base(fixtures, lora_fx, "bf16"), "--lora drop")
    both = merged(lora_fx, "--lora", "both")
    fold, adapter = merged(lora_fx, "--lora", "fold"), merged(lora_fx, "--lora", "adapter")
    # both = the folded model at the root, no adapter beside it; verl's layout in unfolded/
    assert_tensors_bitwise(load_hf(both), load_hf(fold), "--lora both model vs --lora fold")
    assert not (both / "lora_adapter").exists(), "--lora both put an adapter beside the folded weights"
    assert tree_digest(both / "unfolded") == tree_digest(adapter), "--lora both unfolded/ vs --lora adapter"
    assert sorted(p.name for p in both.iterdir()) == sorted([p.name for p in fold.iterdir()] + ["unfolded"])


def test_default_is_fold_without_adapter(lora_fx, fixtures, merged, run, tmp_path):
    """docs/usage.md: the default folds LoRA, writes no adapter, and says in one line how to get verl's layout."""
    default = merged(lora_fx)
    assert tree_digest(default) == tree_digest(merged(lora_fx, "--lora", "fold")), "default vs --lora fold"
    assert not [p for p in default.rglob("*") if "adapter" in p.name], "the default wrote an adapter"
    proc = run("merge", "--local_dir", fixtures / lora_fx["role_dir"], "--target_dir", tmp_path / "out")
    lines = [line for line in proc.stdout.splitlines() if "no adapter" in line]
    assert len(lines) == 1 and "--lora adapter" in lines[0], proc.stdout


# ---------------------------------------------------------------------------------------------
# every tree each mode writes, loaded the way a user would


INPUT_IDS = torch.tensor([[2, 17, 45, 100, 200, 250, 3, 1, 0, 77]])


def model_dirs(out):
    """Every directory of an output tree that holds a model (config.json)."""
    return sorted(p.parent for p in out.rglob("config.json") if "lora_adapter" not in p.parts)


def load_like_a_user(model_dir):
    """AutoModelForCausalLM.from_pretrained(dir); with dir/lora_adapter/ there, PeftModel on top of it
    (what a verl user does with verl's layout, and what vLLM --enable-lora does)."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if (model_dir / "lora_adapter").exists():
        model = peft.PeftModel.from_pretrained(model, str(model_dir / "lora_adapter"))
    with torch.no_grad():
        return model.eval()(input_ids=INPUT_IDS).logits


@pytest.mark.parametrize("mode", ["fold", "adapter", "both", "default"])
def test_every_tree_loads_as_the_folded_model(lora_fx, mode, fixtures, merged):
    """fp32 output, so the only differences left are fp32 summation order: each model dir a mode
    writes (with its adapter, where one is beside it) gives the logits of the fixture's PEFT
    merge_and_unload. A folded base loaded with an adapter applies the LoRA twice and fails this."""
    opts = ["--dtype", "fp32"] + ([] if mode == "default" else ["--lora", mode])
    out = merged(lora_fx, *opts)
    ref_model = peft_model(fixtures, lora_fx, load_st(fixtures / lora_fx["expected"])).merge_and_unload().eval()
    with torch.no_grad():
        ref = ref_model(input_ids=INPUT_IDS).logits
    dirs = model_dirs(out)
    assert dirs == ([out, out / "unfolded"] if mode == "both" else [out]), dirs
    for d in dirs:
        got = load_like_a_user(d)
        diff = (got - ref).abs().max().item()
        assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), \
            f"--lora {mode}: {d.relative_to(out.parent)} loaded as a user would: max abs logit diff {diff:g}"
    adapters = [p.parent for p in out.rglob("adapter_config.json")]
    assert len(adapters) == (1 if mode in ("adapter", "both") else 0), adapters


def test_adapter_mode_is_verls_layout(manifest, fixtures, run, tmp_path):
    """--lora adapter writes what `python -m verl.model_merger merge` writes for a LoRA checkpoint:
    the same files, byte for byte, except adapter_config.json, which PEFT's LoraConfig of the
    training run serialises (its r, lora_alpha and target modules are the same)."""
    fx = next((f for f in manifest["fixtures"] if f.get("lora") and f.get("verl_ref")), None)
    if fx is None:
        pytest.skip("no LoRA fixture with a verl reference output (generate.py --verl)")
    out = tmp_path / "out"
    run("merge", "--local_dir", fixtures / fx["role_dir"], "--target_dir", out, "--lora", "adapter")
    ours, verls = tree_digest(out), tree_digest(fixtures / fx["verl_ref"])
    config = "lora_adapter/adapter_config.json"
    assert sorted(ours) == sorted(verls), (sorted(ours), sorted(verls))
    differ = sorted(k for k in ours if ours[k] != verls[k] and k != config)
    assert not differ, f"not byte-identical to verl's output: {differ}"
    a, b = (json.loads((d / config).read_text()) for d in (out, fixtures / fx["verl_ref"]))
    assert (a["r"], float(a["lora_alpha"])) == (b["r"], float(b["lora_alpha"]))
    assert {t.split(".")[-1] for t in a["target_modules"]} == set(b["target_modules"])


def _fixture(manifest, name):
    fx = next((f for f in manifest["fixtures"] if f["name"] == name), None)
    if fx is None:
        pytest.skip(f"{name} not in the manifest")
    return fx


@pytest.mark.parametrize("meta_alpha", [0, None], ids=["alpha0", "alpha_missing"])
@pytest.mark.parametrize("mode", ["fold", "both", "adapter"])
def test_missing_alpha(meta_alpha, mode, manifest, fixtures, run, merged, tmp_path):
    fx = _fixture(manifest, "qwen2_lora_fsdp2_w4")  # no lora_adapter/: lora_train_meta.json is the only alpha
    role = tmp_path / "actor"
    shutil.copytree(fixtures / fx["role_dir"], role)
    assert not (role / "lora_adapter").exists()
    meta = json.loads((role / "lora_train_meta.json").read_text())
    if meta_alpha is None:
        del meta["lora_alpha"]
    else:
        meta["lora_alpha"] = meta_alpha
    (role / "lora_train_meta.json").write_text(json.dumps(meta))
    out = tmp_path / "out"
    proc = run("merge", "--backend", "fsdp", "--local_dir", role, "--target_dir", out, "--lora", mode, check=False)
    assert proc.returncode == 1, f"alpha {meta_alpha}: exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("shardmerge: error:"), proc.stderr
    assert "--lora-alpha" in lines[0] and "lora_train_meta.json" in lines[0], lines[0]
    assert leftovers(out) == [], f"left behind: {leftovers(out)}"
    ok = run("merge", "--backend", "fsdp", "--local_dir", role, "--target_dir", out, "--lora", mode,
             "--lora-alpha", "16", check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    ref = merged(fx, "--lora", mode)
    assert_tensors_bitwise(load_hf(out), load_hf(ref), f"--lora-alpha 16 vs the fixture's own alpha (16), {mode}")
    if mode != "fold":
        adir = out / ("unfolded/lora_adapter" if mode == "both" else "lora_adapter")
        acfg = json.loads((adir / "adapter_config.json").read_text())
        assert float(acfg["lora_alpha"]) == 16.0, acfg["lora_alpha"]


def test_drop_needs_no_alpha(manifest, fixtures, run, tmp_path):
    fx = _fixture(manifest, "qwen2_lora_fsdp2_w4")
    role = tmp_path / "actor"
    shutil.copytree(fixtures / fx["role_dir"], role)
    (role / "lora_train_meta.json").write_text(json.dumps({"r": 8, "lora_alpha": 0, "task_type": "CAUSAL_LM"}))
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "out", "--lora", "drop")
    assert_tensors_bitwise(load_hf(tmp_path / "out"), expected_base(fixtures, fx, "bf16"), "--lora drop, alpha 0")


# ---------------------------------------------------------------------------------------------
# shardmerge fold-lora on PEFT adapters


def operand_magnitude(fixtures, fx):
    """Per changed base weight: |W| + s·(|B|@|A|) (transposed for embeddings and fan_in_fan_out),
    the scale of the fold's rounding error; an fp32 'ulp' of the fold is an ulp of this."""
    base = load_hf(fixtures / fx["base_dir"])
    adir = fixtures / fx["adapter_dir"]
    ad = load_st(adir / "adapter_model.safetensors")
    s = fx["lora"]["scaling"]
    mags = {}
    for k in ad:
        if k.endswith(".lora_A.weight"):
            mod, a, b, t = k[:-len(".lora_A.weight")], ad[k], ad[k.replace(".lora_A.", ".lora_B.")], fx["lora"]["fan_in_fan_out"]
        elif k.endswith(".lora_embedding_A"):
            mod, a, b, t = k[:-len(".lora_embedding_A")], ad[k], ad[k[:-1] + "B"], True
        else:
            continue
        name = verl_name(mod + ".weight")
        d = s * (b.double().abs() @ a.double().abs())
        mags[name] = base[name].double().abs() + (d.T if t else d)
    return mags


def fp32_ulp(x):
    _, e = torch.frexp(x.clamp(min=2.0 ** -126).float())
    return torch.ldexp(torch.ones_like(x, dtype=torch.float64), (e - 24).to(torch.int64))


# bf16: within 1 ulp (PEFT and shardmerge may land on either side of a rounding boundary).
# fp32: within 8 ulps of |W| + s·|B|·|A| (observed <= 3; summation order differs between BLAS kernels).
@pytest.mark.parametrize("dtype,ref_key,max_ulp", [("bf16", "merged_ref_bf16", 1), ("fp32", "merged_ref_fp32", 8)])
def test_fold_lora_matches_peft(peft_fx, dtype, ref_key, max_ulp, fixtures, run, tmp_path):
    out = tmp_path / "out"
    proc = run("fold-lora", "--base", fixtures / peft_fx["base_dir"], "--adapter", fixtures / peft_fx["adapter_dir"],
               "--dtype", dtype, "--target_dir", out, "--json")
    summary = json.loads(proc.stdout)
    changed = peft_fx["lora"]["changed_base_keys"]
    assert summary["lora_folds"] == len(changed), summary
    got, ref = load_hf(out), load_st(fixtures / peft_fx[ref_key])
    assert sorted(got) == sorted(ref), f"keys: missing {sorted(set(ref) - set(got))}, extra {sorted(set(got) - set(ref))}"
    assert not [k for k in got if "lora_" in k or "base_layer" in k]
    assert {t.dtype for t in got.values()} == {ref[k].dtype for k in ref}
    base = load_hf(fixtures / peft_fx["base_dir"])
    for k in ref:
        if k not in changed:
            assert bits_equal(got[k], ref[k]), f"{k}: not adapted, yet differs from PEFT's"
    if dtype == "bf16":
        # bf16: one rounding of the fp32 fold; PEFT and shardmerge may round a tie differently
        assert_within_ulp(got, ref, max_ulp, f"fold-lora {peft_fx['name']} --dtype bf16 vs PEFT")
    else:
        # fp32: W + s·B@A can cancel, so measure the error in ulps of the operands' magnitude
        mags = operand_magnitude(fixtures, peft_fx)
        assert sorted(mags) == sorted(changed)
        worst = (0.0, 0.0, "")
        for k in changed:
            err = (got[k].double() - ref[k].double()).abs()
            units = (err / fp32_ulp(mags[k])).max().item()
            worst = max(worst, (units, err.max().item(), k))
        assert worst[0] <= max_ulp, \
            f"fold-lora {peft_fx['name']} --dtype fp32 vs PEFT: {worst[2]} off by {worst[0]:g} operand ulps " \
            f"(max abs error {worst[1]:g})"
    for k in changed:
        assert not torch.equal(got[k].float(), base[k].to(got[k].dtype).float()), f"{k}: adapter not folded"
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dtype"] == {"bf16": "bfloat16", "fp32": "float32"}[dtype]


# ---------------------------------------------------------------------------------------------
# --lora-alpha against an alpha the checkpoint records


@pytest.mark.parametrize("name,recorded_in", [("qwen2_lora_fsdp2_w4", "lora_train_meta.json"),
                                              ("qwen2_lora_fsdp2_w2", "adapter_config.json")])
def test_recorded_alpha_is_replaced_only_with_force(name, recorded_in, manifest, fixtures, run, merged, tmp_path):
    fx = _fixture(manifest, name)
    role = fixtures / fx["role_dir"]
    alpha = fx["lora"]["lora_alpha"]
    out = tmp_path / "out"
    proc = run("merge", "--local_dir", role, "--target_dir", out, "--lora-alpha", str(2 * alpha), check=False)
    assert proc.returncode == 2, f"exit {proc.returncode}\n{proc.stdout}{proc.stderr}"
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("shardmerge: error:"), proc.stderr
    for part in (recorded_in, f"lora_alpha={float(alpha)}", f"--lora-alpha {float(2 * alpha)}", "--force-lora-alpha"):
        assert part in lines[0], f"{part!r} not in: {lines[0]}"
    assert leftovers(out) == [], f"left behind: {leftovers(out)}"
    # the value it records is no conflict
    assert_tensors_bitwise(load_hf(merged(fx, "--lora-alpha", str(alpha))), load_hf(merged(fx)), "--lora-alpha = recorded")
    # with --force-lora-alpha: what a checkpoint recording 2·alpha merges to
    run("merge", "--local_dir", role, "--target_dir", out, "--lora-alpha", str(2 * alpha), "--force-lora-alpha")
    copy = tmp_path / "actor"
    shutil.copytree(role, copy)
    for f in [copy / "lora_train_meta.json", copy / "lora_adapter" / "adapter_config.json"]:
        if f.exists():
            j = json.loads(f.read_text())
            j["lora_alpha"] = 2 * alpha
            f.write_text(json.dumps(j))
    run("merge", "--local_dir", copy, "--target_dir", tmp_path / "ref")
    assert_tensors_bitwise(load_hf(out), load_hf(tmp_path / "ref"), "--force-lora-alpha vs a checkpoint recording it")
    assert not all(bits_equal(a, b) for a, b in zip(load_hf(out).values(), load_hf(merged(fx)).values())), \
        "the forced alpha changed nothing"


def test_fold_lora_alpha_needs_force(peft_fx, fixtures, run, tmp_path):
    base, adapter = fixtures / peft_fx["base_dir"], fixtures / peft_fx["adapter_dir"]
    alpha = peft_fx["lora"]["lora_alpha"]
    proc = run("fold-lora", "--base", base, "--adapter", adapter, "--target_dir", tmp_path / "out",
               "--lora-alpha", str(alpha + 1), check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "adapter_config.json" in lines[0] and "--force-lora-alpha" in lines[0], proc.stderr
    assert leftovers(tmp_path / "out") == []
    run("fold-lora", "--base", base, "--adapter", adapter, "--target_dir", tmp_path / "out",
        "--lora-alpha", str(alpha + 1), "--force-lora-alpha")
