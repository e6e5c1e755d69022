"""`python -m shardmerge.model_merger` against verl's own `python -m verl.model_merger`: the same
command line through both, on the FSDP fixtures, must give the same tree. verl runs from
SHARDMERGE_VERL_PYTHON (a Python with verl installed; scripts/test_wheel.sh passes the project's
.venv); the drop-in runs from the venv the wheel is installed in."""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("shardmerge")

FIXTURES = Path(os.environ.get("SHARDMERGE_FIXTURES", "/nonexistent"))
VERL_PYTHON = os.environ.get("SHARDMERGE_VERL_PYTHON", "")
# verl's adapter_config.json is PEFT's serialisation of the training run's LoraConfig (its r,
# alpha are compared below; the rest records training options that the merge does not decide);
# every other file must be byte-identical.
ADAPTER_CONFIG = "lora_adapter/adapter_config.json"


def dropin(*args):
    return subprocess.run([sys.executable, "-m", "shardmerge.model_merger", *map(str, args)],
                          capture_output=True, text=True, timeout=300)


def tree_digest(root):
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(Path(root).rglob("*")) if p.is_file()}


def role_dir(name):
    d = FIXTURES / name / "global_step_3" / "actor"
    if not d.is_dir():
        pytest.skip(f"fixture {d} absent (set SHARDMERGE_FIXTURES)")
    return d


@pytest.mark.parametrize("name", ["qwen2_fsdp2_w2", "llama_fsdp2_w4", "qwen2_fsdp1_w2", "qwen2_lora_fsdp2_w2"])
def test_merge_same_tree_as_verl(name, tmp_path):
    if not VERL_PYTHON or not Path(VERL_PYTHON).exists():
        pytest.skip("SHARDMERGE_VERL_PYTHON (a Python with verl) is not set")
    local = role_dir(name)
    argv = ["merge", "--backend", "fsdp", "--local_dir", local]
    ours, theirs = tmp_path / "ours", tmp_path / "verl"
    verl = subprocess.run([VERL_PYTHON, "-m", "verl.model_merger", *map(str, argv), "--target_dir", str(theirs)],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})
    assert verl.returncode == 0, verl.stderr[-2000:]
    r = dropin(*argv, "--target_dir", ours)
    assert r.returncode == 0, r.stderr
    a, b = tree_digest(ours), tree_digest(theirs)
    assert sorted(a) == sorted(b)
    differ = sorted(k for k in a if a[k] != b[k] and k != ADAPTER_CONFIG)
    assert not differ, f"not byte-identical to verl's output: {differ}"
    if ADAPTER_CONFIG in a:
        x, y = (json.loads((d / ADAPTER_CONFIG).read_text()) for d in (ours, theirs))
        assert (x["r"], float(x["lora_alpha"])) == (y["r"], float(y["lora_alpha"]))


def test_default_target_dir_is_tmp(tmp_path):
    local = role_dir("qwen2_fsdp2_w2")
    r = subprocess.run([sys.executable, "-m", "shardmerge.model_merger", "merge", "--backend", "fsdp",
                        "--local_dir", str(local)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert any((tmp_path / "tmp").glob("*.safetensors"))


def test_test_operation_accepts_the_merge(tmp_path):
    local = role_dir("qwen2_fsdp2_w2")
    out = tmp_path / "out"
    assert dropin("merge", "--backend", "fsdp", "--local_dir", local, "--target_dir", out).returncode == 0
    r = dropin("test", "--backend", "fsdp", "--local_dir", local, "--test_hf_dir", out)
    assert r.returncode == 0, r.stderr
    # A changed tensor must fail the check.
    st = next(out.glob("*.safetensors"))
    blob = bytearray(st.read_bytes())
    blob[-1] ^= 0xFF
    st.write_bytes(bytes(blob))
    assert dropin("test", "--backend", "fsdp", "--local_dir", local, "--test_hf_dir", out).returncode == 1


def test_accepts_verls_flags(tmp_path):
    local = role_dir("qwen2_fsdp2_w2")
    out = tmp_path / "out"
    r = dropin("merge", "--backend", "fsdp", "--local_dir", local, "--target_dir", out, "--trust-remote-code",
               "--use_cpu_initialization", "--private")
    assert r.returncode == 0, r.stderr


def test_hf_upload_fails_before_any_work(tmp_path):
    out = tmp_path / "out"
    r = dropin("merge", "--backend", "fsdp", "--local_dir", tmp_path / "nonexistent", "--target_dir", out,
               "--hf_upload_path", "me/model")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--hf_upload_path" in lines[0] and "offline" in lines[0], r.stderr
    assert not out.exists()


def test_usage_error_is_argparse_exit_2():
    r = dropin("merge", "--backend", "deepspeed", "--local_dir", "x")
    assert r.returncode == 2
