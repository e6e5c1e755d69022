"""verl's TorchTitan engine: TorchTitan's CheckpointManager writes global_step_N/step-N/, one
torch DCP checkpoint of the model under TorchTitan's names (tests/fixtures/fx_torchtitan.py:
TorchTitan 0.3.0's own model, adapter, FSDP and checkpoint code on gloo). The oracle is TorchTitan's
own state-dict adapter: `to_hf` of the state dict the training processes gathered
(expected_hf.safetensors), and the class's own save_pretrained of that (saved_pretrained/)."""
import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from e2e_util import assert_same_hf_files, error_lines, hf_weight_files, leftovers, st_header  # noqa: E402


def merge(fx, fixtures, run, out, *extra):
    run("merge", "--local_dir", fixtures / fx["run_root"], "--target_dir", out, "--hf_model_path", fixtures / fx["base"],
        "--dtype", "fp32", "--max-shard-size", "60KB", *extra)
    return out


def test_merge_is_torchtitans_own_to_hf(torchtitan_fx, fixtures, run, tmp_path):
    from safetensors.torch import load_file

    out = merge(torchtitan_fx, fixtures, run, tmp_path / "out")
    want = load_file(str(fixtures / torchtitan_fx["expected_hf"]))
    got = {}
    for f in hf_weight_files(out):
        got.update(load_file(str(f)))
    assert sorted(got) == sorted(want)
    bad = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert not bad, f"differ from TorchTitan's to_hf: {bad[:5]}"
    # the same files, index, order and bytes as the class's own save_pretrained of it
    assert_same_hf_files(out, fixtures / torchtitan_fx["saved_pretrained"])


def test_verify_reads_it_independently(torchtitan_fx, fixtures, run, tmp_path):
    """verify (its own index formulas for the rotary rows and the experts) accepts the merge and
    rejects one flipped element of a q_proj (reordered) or an expert (split) tensor."""
    import shutil

    out = merge(torchtitan_fx, fixtures, run, tmp_path / "out", "--verify")
    args = ("verify", "--local_dir", fixtures / torchtitan_fx["run_root"], "--hf_model_path", fixtures / torchtitan_fx["base"],
            "--dtype", "fp32")
    run(*args, "--test_hf_dir", out)
    victim = "model.layers.1.mlp.experts.3.up_proj.weight" if "moe" in torchtitan_fx["model"] else \
        "model.layers.1.self_attn.q_proj.weight"
    bad = tmp_path / "flipped"
    shutil.copytree(out, bad)
    for f in hf_weight_files(bad):
        header, _, data_start = st_header(f)
        if victim in header:
            raw = bytearray(f.read_bytes())
            raw[data_start + header[victim]["data_offsets"][0] + 6] ^= 0x40
            f.write_bytes(bytes(raw))
    proc = run(*args, "--test_hf_dir", bad, check=False)
    assert proc.returncode == 1 and victim in proc.stdout + proc.stderr, (proc.stdout, proc.stderr)


def test_transformers_loads_it_with_the_oracles_logits(torchtitan_fx, fixtures, run, tmp_path):
    import transformers

    out = merge(torchtitan_fx, fixtures, run, tmp_path / "out")
    cls = getattr(transformers, torchtitan_fx["architecture"])
    model, info = cls.from_pretrained(out, output_loading_info=True, dtype=torch.float32)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    oracle = cls.from_pretrained(fixtures / torchtitan_fx["saved_pretrained"], dtype=torch.float32)
    ids = torch.tensor([[1, 5, 17, 42]])
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, oracle(input_ids=ids).logits)


def test_needs_the_base_config_and_says_so(torchtitan_fx, fixtures, run, tmp_path):
    target = tmp_path / "out"
    proc = run("merge", "--local_dir", fixtures / torchtitan_fx["run_root"], "--target_dir", target, check=False)
    errors = error_lines(proc.stderr)
    assert proc.returncode == 1 and len(errors) == 1 and "--hf_model_path" in errors[0], proc.stderr
    assert not leftovers(target)
    info = json.loads(run("inspect", fixtures / torchtitan_fx["run_root"], "--json").stdout)
    assert info["resolves_to"].endswith("/step-3") and "--hf_model_path" in info["next"][0]
    step = json.loads(run("inspect", fixtures / info["resolves_to"], "--json").stdout)
    assert step["kind"] == "TorchTitan DCP checkpoint" and step["step"] == 3


def test_ls_sees_a_complete_step(torchtitan_fx, fixtures, run, tmp_path):
    """ls (and so prune) count the step-N checkpoint as the step's model; one missing .distcp
    file makes the step incomplete."""
    import shutil

    listing = json.loads(run("ls", fixtures / torchtitan_fx["run_root"], "--json").stdout)
    step = listing["steps"][0]
    assert step["complete"] and step["roles"][0]["kind"] == "torchtitan", listing
    root = tmp_path / "run"
    shutil.copytree(fixtures / torchtitan_fx["run_root"], root)
    next((root / "global_step_3" / "step-3").glob("__1_*.distcp")).unlink()
    step = json.loads(run("ls", root, "--json", check=False).stdout)["steps"][0]
    assert not step["complete"] and "__1_0.distcp" in " ".join(step["problems"])
