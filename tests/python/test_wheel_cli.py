"""The installed wheel: the `shardmerge` console command and `python -m shardmerge` run the
bundled CLI with its flags, output and exit codes. Run by scripts/test_wheel.sh in a fresh venv
with the wheel installed (never the build tree); the merged output is checked against the
fixtures' HuggingFace reference, which the C++ code did not write."""
import json
import os
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest
from safetensors_dir import read_safetensors_dir

shardmerge = pytest.importorskip("shardmerge")

FIXTURES = Path(os.environ.get("SHARDMERGE_FIXTURES", "/nonexistent"))


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, **kw)


def entry_points():
    exe = shutil.which("shardmerge", path=str(Path(sys.executable).parent))
    assert exe, "the wheel installed no `shardmerge` console command beside this Python"
    return {"console": [exe], "module": [sys.executable, "-m", "shardmerge"]}


def test_installed_from_wheel_not_source_tree():
    # The package must come from site-packages: these tests exist to check the installed wheel.
    assert "site-packages" in Path(shardmerge.__file__).parts
    assert shardmerge.binary().is_file()


@pytest.mark.parametrize("how", ["console", "module"])
def test_version_is_the_package_version(how):
    r = run(entry_points()[how] + ["--version"])
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == f"shardmerge {metadata.version('shardmerge')}"


@pytest.mark.parametrize("how", ["console", "module"])
def test_usage_error_exit_code(how):
    r = run(entry_points()[how] + ["merge", "--dtype", "nonsense"])
    assert r.returncode == 2
    assert r.stderr.startswith("shardmerge: error:")
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("how", ["console", "module"])
def test_bad_data_exit_code(how, tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\xff" * 100)  # header length far past the file: bad data, exit 1
    r = run(entry_points()[how] + ["inspect", str(bad)])
    assert r.returncode == 1
    assert r.stderr.startswith("shardmerge: error:") and "safetensors" in r.stderr


@pytest.mark.parametrize("how", ["console", "module"])
def test_merge_fsdp_fixture_matches_verl(how, tmp_path):
    # verl_ref: verl's own merger's output on the same checkpoint (tests/fixtures/generate.py).
    fixture = FIXTURES / "llama_fsdp2_w4"
    if not (fixture / "verl_ref").is_dir():
        pytest.skip(f"fixture {fixture} absent (set SHARDMERGE_FIXTURES)")
    target = tmp_path / "out"
    r = run(entry_points()[how] + ["merge", "--backend", "fsdp", "--local_dir", str(fixture / "global_step_3" / "actor"),
                                   "--target_dir", str(target), "--json"])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)
    got, ref = read_safetensors_dir(target), read_safetensors_dir(fixture / "verl_ref")
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k] == ref[k], k
