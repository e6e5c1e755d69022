"""verl's NeMo-Automodel engine saves model/consolidated/, the whole HF model its training
processes consolidated (tests/fixtures/fx_automodel.py: torch DCP's HuggingFace storage and
consolidation, real FSDP2 on gloo). `merge` writes a verified copy of it; the oracle is the state
dict the training processes gathered (expected.safetensors)."""
import json
import shutil

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("safetensors")

from e2e_util import hf_weight_files  # noqa: E402


def load(d):
    from safetensors.torch import load_file

    out = {}
    for f in hf_weight_files(d):
        out.update(load_file(str(f)))
    return out


def test_merge_is_the_gathered_state_dict(automodel_fx, fixtures, run, tmp_path):
    from safetensors.torch import load_file

    expected = load_file(str(fixtures / automodel_fx["expected"]))
    for dtype, cast in (("fp32", torch.float32), ("default", torch.bfloat16)):
        out = tmp_path / dtype
        run("merge", "--local_dir", fixtures / automodel_fx["run_root"], "--target_dir", out, "--dtype", dtype, "--verify")
        got = load(out)
        assert sorted(got) == sorted(expected)
        bad = [k for k in expected if got[k].dtype != cast or not torch.equal(got[k], expected[k].to(cast))]
        assert not bad, f"--dtype {dtype}: {bad[:5]}"
        assert json.loads((out / "config.json").read_text())["architectures"] == [automodel_fx["architecture"]]
        assert (out / "tokenizer.json").is_file()


def test_inspect_and_ls_name_the_layout(automodel_fx, fixtures, run, tmp_path):
    role = fixtures / automodel_fx["role_dir"]
    info = json.loads(run("inspect", role, "--json").stdout)
    assert info["kind"] == "verl NeMo-Automodel role directory"
    assert info["consolidated"]["weights_complete"] and info["model_shard_files"] == automodel_fx["world_size"]
    assert info["optimizer"] is True
    # the suggested command merges it
    cmd = info["next"][0].split()
    assert cmd[:2] == ["shardmerge", "merge"]
    target = tmp_path / "next"
    run(*cmd[1:cmd.index("--target_dir")], "--target_dir", target)
    assert hf_weight_files(target)
    listing = run("ls", fixtures / automodel_fx["run_root"], "--json").stdout
    step = json.loads(listing)["steps"][0]
    assert step["complete"] and step["roles"][0]["kind"] == "automodel", listing


def test_incomplete_consolidation_is_refused(automodel_fx, fixtures, run, tmp_path):
    """A save that did not finish its consolidated model: one line naming the missing file, exit
    1, nothing at the target; ls calls the step incomplete."""
    root = tmp_path / "run"
    shutil.copytree(fixtures / automodel_fx["run_root"], root)
    consolidated = root / automodel_fx["role_dir"].split("/", 1)[1] / "model" / "consolidated"
    shard = next(consolidated.glob("model-*.safetensors"))
    shard.unlink()
    target = tmp_path / "out"
    proc = run("merge", "--local_dir", root, "--target_dir", target, check=False)
    err = [l for l in proc.stderr.splitlines() if l.startswith("shardmerge: error")]
    assert proc.returncode == 1 and len(err) == 1 and shard.name in err[0], proc.stderr
    assert not target.exists()
    step = json.loads(run("ls", root, "--json", check=False).stdout)["steps"][0]
    assert not step["complete"]
