"""verl's save_lora_only checkpoints: rank files that hold only the LoRA A/B tensors. `--lora adapter`
writes the adapter (its tensors equal to what the training processes held); fold, both and drop
have no base weights to work on and fail in one line that says how to fold with the base; nothing
is written."""
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from e2e_util import error_lines, leftovers  # noqa: E402


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
    assert "shardmerge fold-lora --base BASE_HF_DIR" in lines[0], lines[0]
    assert not target.exists() and not leftovers(target), proc.stderr


def test_the_two_steps_the_error_names_fold_the_adapter(lora_only_fx, fixtures, run, tmp_path):
    """merge --lora adapter, then fold-lora onto the base the run started from: every adapted weight
    changes, the others are the base's bytes."""
    from safetensors.torch import load_file

    adapter_out = tmp_path / "adapter"
    run("merge", "--local_dir", fixtures / lora_only_fx["role_dir"], "--target_dir", adapter_out, "--lora", "adapter")
    base = fixtures / "hf_base" / lora_only_fx["model"]
    folded = tmp_path / "folded"
    run("fold-lora", "--base", base, "--adapter", adapter_out / "lora_adapter", "--target_dir", folded,
        "--dtype", "fp32")
    got = load_file(str(folded / "model.safetensors"))
    base_w = load_file(str(base / "model.safetensors"))
    adapted = {k.split("base_model.model.", 1)[1].split(".lora_A.")[0] + ".weight"
               for k in load_file(str(adapter_out / "lora_adapter" / "adapter_model.safetensors")) if ".lora_A." in k}
    assert adapted and adapted <= set(got)
    for k, t in base_w.items():
        assert (not torch.equal(got[k], t)) == (k in adapted), k
