"""verl's save_lora_only checkpoints: rank files that hold only the LoRA A/B tensors. `--lora adapter`
writes the adapter (its tensors equal to what the training processes held). Fold, both and drop take
the base weights from `--hf_model_path BASE_HF_DIR` (the model the run started from); without it
they fail in one line that says to pass the base, and nothing is written."""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from e2e_util import assert_within_ulp, error_lines, leftovers, load_hf, load_st  # noqa: E402


def base_dir(fixtures, fx):
    return fixtures / fx["base"]


def peft_merged(fixtures, fx):
    """PEFT's own merge_and_unload, in fp32, of the base model with the LoRA tensors the training
    processes held (expected.safetensors) — the oracle for a fold, computed without shardmerge."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    meta = json.loads((fixtures / fx["role_dir"] / "lora_train_meta.json").read_text())
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir(fixtures, fx)), dtype=torch.float32)
    model = peft.get_peft_model(base, peft.LoraConfig(r=meta["r"], lora_alpha=meta["lora_alpha"],
                                                      target_modules="all-linear", lora_dropout=0.0, bias="none",
                                                      task_type="CAUSAL_LM"))
    lora = {k: v for k, v in load_st(fixtures / fx["expected"]).items() if ".lora_" in k}
    _, unexpected = model.load_state_dict(lora, strict=False)
    assert not unexpected, unexpected
    saved = set(load_hf(base_dir(fixtures, fx)))  # a tied lm_head is not saved
    return {k: v for k, v in model.merge_and_unload().state_dict().items() if k in saved}, len(lora) // 2


def test_adapter_is_written_exactly(lora_only_fx, fixtures, run, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "out"
    run("merge", "--local_dir", fixtures / lora_only_fx["role_dir"], "--target_dir", out, "--lora", "adapter",
        "--dtype", "fp32")  # the training dtype, so that bytes compare
    got = load_file(str(out / "lora_adapter" / "adapter_model.safetensors"))
    exp = {k.replace(".default.", "."): v for k, v in load_file(str(fixtures / lora_only_fx["expected"])).items()
           if ".lora_" in k}
    assert exp, "the fixture's expected.safetensors has no LoRA tensors"
    assert sorted(got) == sorted(exp)
    for k, t in exp.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k
    assert not list(out.glob("model*.safetensors")), "a LoRA-only checkpoint has no base weights to write"


@pytest.mark.parametrize("mode", ["fold", "both", "drop"])
def test_fold_and_drop_need_the_base(lora_only_fx, fixtures, run, tmp_path, mode):
    target = tmp_path / "out"
    proc = run("merge", "--local_dir", fixtures / lora_only_fx["role_dir"], "--target_dir", target, "--lora", mode,
               check=False)
    assert proc.returncode == 1, proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "only LoRA adapter tensors" in lines[0] and f"--lora {mode} needs the base model" in lines[0], lines[0]
    assert "--hf_model_path BASE_HF_DIR" in lines[0], lines[0]
    assert not target.exists() and not leftovers(target), proc.stderr


def test_fold_onto_the_base_equals_peft(lora_only_fx, fixtures, run, tmp_path):
    """One step: the base streamed from --hf_model_path, every adapted weight folded as PEFT's
    merge_and_unload folds it, the rest the base's bytes; --verify re-reads base and rank files."""
    out = tmp_path / "out"
    proc = run("merge", "--local_dir", fixtures / lora_only_fx["role_dir"], "--target_dir", out,
               "--hf_model_path", base_dir(fixtures, lora_only_fx), "--dtype", "fp32", "--verify")
    assert "base weights from --hf_model_path" in proc.stdout, proc.stdout
    ref, modules = peft_merged(fixtures, lora_only_fx)
    got = load_hf(out)
    assert_within_ulp(got, ref, 2, "save_lora_only fold vs PEFT merge_and_unload")
    base = load_hf(base_dir(fixtures, lora_only_fx))
    changed = [k for k in base if not torch.equal(got[k], base[k].float())]
    assert len(changed) == modules, (len(changed), modules)
    assert (out / "config.json").is_file() and not (out / "lora_adapter").exists()


def test_both_and_drop_onto_the_base(lora_only_fx, fixtures, run, tmp_path):
    base = load_hf(base_dir(fixtures, lora_only_fx))
    args = ("--local_dir", fixtures / lora_only_fx["role_dir"], "--hf_model_path", base_dir(fixtures, lora_only_fx),
            "--dtype", "fp32")
    run("merge", *args, "--target_dir", tmp_path / "drop", "--lora", "drop")
    dropped = load_hf(tmp_path / "drop")
    assert sorted(dropped) == sorted(base)
    for k, t in base.items():
        assert dropped[k].dtype == t.dtype and torch.equal(dropped[k], t), k
    both = tmp_path / "both"
    run("merge", *args, "--target_dir", both, "--lora", "both")
    unfolded = load_hf(both / "unfolded")
    for k, t in base.items():
        assert torch.equal(unfolded[k], t), k
    adapter = load_st(both / "unfolded" / "lora_adapter" / "adapter_model.safetensors")
    exp = {k.replace(".default.", "."): v for k, v in load_st(fixtures / lora_only_fx["expected"]).items() if ".lora_" in k}
    assert sorted(adapter) == sorted(exp)
    folded = load_hf(both)
    assert sum(not torch.equal(folded[k], base[k]) for k in base) == len(exp) // 2


def test_a_base_of_another_size_is_refused(lora_only_fx, fixtures, run, tmp_path):
    """The checkpoint's own config must describe the base: a base of another width fails in one line
    naming the field and the config, before anything is written."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(str(base_dir(fixtures, lora_only_fx)))
    cfg.hidden_size *= 2
    other = tmp_path / "other_base"
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(other)
    transformers.AutoTokenizer.from_pretrained(str(base_dir(fixtures, lora_only_fx))).save_pretrained(other)
    target = tmp_path / "out"
    proc = run("merge", "--local_dir", fixtures / lora_only_fx["role_dir"], "--target_dir", target,
               "--hf_model_path", other, check=False)
    assert proc.returncode == 1, proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr
    assert "hidden_size=" in lines[0] and "huggingface/config.json" in lines[0] and str(other) in lines[0], lines[0]
    assert not target.exists() and not leftovers(target), proc.stderr


def test_a_base_without_weights_is_refused(lora_only_fx, fixtures, run, tmp_path):
    target = tmp_path / "out"
    proc = run("merge", "--local_dir", fixtures / lora_only_fx["role_dir"], "--target_dir", target,
               "--hf_model_path", fixtures / lora_only_fx["role_dir"] / "huggingface", check=False)
    assert proc.returncode == 1, proc.stderr
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "no complete safetensors weights" in lines[0], proc.stderr
    assert not target.exists() and not leftovers(target), proc.stderr


def test_the_two_steps_fold_the_adapter_too(lora_only_fx, fixtures, run, tmp_path):
    """merge --lora adapter, then fold-lora onto the base: the same model as the one-step fold."""
    adapter_out = tmp_path / "adapter"
    run("merge", "--local_dir", fixtures / lora_only_fx["role_dir"], "--target_dir", adapter_out, "--lora", "adapter",
        "--dtype", "fp32")
    base = base_dir(fixtures, lora_only_fx)
    folded = tmp_path / "folded"
    run("fold-lora", "--base", base, "--adapter", adapter_out / "lora_adapter", "--target_dir", folded,
        "--dtype", "fp32")
    ref, _ = peft_merged(fixtures, lora_only_fx)
    assert_within_ulp(load_hf(folded), ref, 2, "fold-lora of the exported adapter vs PEFT merge_and_unload")


def test_inspect_says_how_to_fold(lora_only_fx, fixtures, run, tmp_path):
    """inspect names the checkpoint LoRA-only and its first next command, given the base, merges."""
    import shlex

    role = fixtures / lora_only_fx["role_dir"]
    info = json.loads(run("inspect", role, "--json").stdout)
    assert info["lora_only"] is True
    assert any("save_lora_only" in w for w in info["warnings"]), info["warnings"]
    fold = shlex.split(info["next"][0].split("#")[0])
    assert fold[:2] == ["shardmerge", "merge"] and "--hf_model_path" in fold, fold
    fold[fold.index("BASE_HF_DIR")] = str(base_dir(fixtures, lora_only_fx))
    fold[fold.index("--target_dir") + 1] = str(tmp_path / "out")
    run(*fold[1:])
    assert len(load_hf(tmp_path / "out")) == len(load_hf(base_dir(fixtures, lora_only_fx)))


# ---------------------------------------------------------------------------------------------
# A Megatron PEFT save: verl's Megatron checkpoint manager with Megatron-Bridge and a PEFT config
# writes model/huggingface/ with the config, tokenizer and the adapter in PEFT's format
# (bridge.save_hf_adapter), no base weights, and the adapter's Megatron shards in model/dist_ckpt/.
# Megatron-Bridge cannot be installed here: the role directory is assembled as verl's manager
# lays it out (its ckpt_contents.json keys), around an adapter written by real PEFT.

def megatron_peft_role(peft_fx, fixtures, tmp_path):
    import shutil

    role = tmp_path / "global_step_1" / "actor"
    hf = role / "model" / "huggingface"
    base = fixtures / peft_fx["base_dir"]
    hf.mkdir(parents=True)
    for f in base.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, hf / f.name)
    shutil.copytree(fixtures / peft_fx["adapter_dir"], hf / "adapter")
    (role / "model" / "dist_ckpt").mkdir()
    (role / "ckpt_contents.json").write_text(json.dumps({
        "schema_version": 2, "framework": "megatron", "role": "actor", "global_step": 1, "world_size": 2,
        "save_contents": ["model"], "backend": {"has_bridge": True, "use_dist_checkpointing": False, "peft": True},
        "contents": {
            "model": {"path": "model/huggingface", "format": "huggingface", "backend": "mbridge",
                      "peft_adapter_path": "model/huggingface/adapter"},
            "peft_adapters": {"path": "model/dist_ckpt", "format": "megatron_dist_checkpoint",
                              "note": "PEFT adapter shards sit next to base-model HF weights, under model/dist_ckpt/."}}}))
    return role


def test_megatron_peft_save_folds_onto_the_given_base(peft_fx, fixtures, run, tmp_path):
    """Folded onto --hf_model_path, it is PEFT's own merge_and_unload (in bf16, within one rounding);
    without a base, one line that says to pass it, and nothing is written."""
    if peft_fx["name"] != "peft_qwen2_all_linear_r8":
        pytest.skip("one adapter is enough")
    role = megatron_peft_role(peft_fx, fixtures, tmp_path)
    target = tmp_path / "no-base"
    proc = run("merge", "--local_dir", role, "--target_dir", target, check=False)
    errors = error_lines(proc.stderr)
    assert proc.returncode == 1 and len(errors) == 1 and "--hf_model_path" in errors[0], proc.stderr
    assert not leftovers(target)

    out = tmp_path / "out"
    run("merge", "--local_dir", role.parent.parent, "--target_dir", out, "--hf_model_path",
        fixtures / peft_fx["base_dir"], "--dtype", "bf16", "--verify")
    assert_within_ulp(load_hf(out), load_st(fixtures / peft_fx["merged_ref_bf16"]), 1, "Megatron PEFT save vs PEFT")
