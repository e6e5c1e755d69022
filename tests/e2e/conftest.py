"""Shared fixtures for the end-to-end tests: the shardmerge binary, the generated real
checkpoints (tests/fixtures/generate.py), and a runner. Tests skip, saying why, when the
fixtures or a Python package they need are absent."""
import json
import os
import subprocess
from pathlib import Path

import pytest

# transformers / huggingface_hub must never try the network: the fixtures are local dirs.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes more than a minute (deselect with -m 'not slow')")


@pytest.fixture(scope="session")
def shardmerge_bin():
    path = os.environ.get("SHARDMERGE_BIN")
    if not path or not Path(path).exists():
        pytest.skip("SHARDMERGE_BIN is not set (run through ctest)")
    return path


@pytest.fixture(scope="session")
def shardmerge_gen_bin(shardmerge_bin):
    """shardmerge-gen: SHARDMERGE_GEN_BIN, else beside shardmerge (build/bench/ or build/)."""
    env = os.environ.get("SHARDMERGE_GEN_BIN")
    candidates = [Path(env)] if env else []
    build = os.environ.get("SHARDMERGE_BUILD_DIR")
    if build:
        candidates += [Path(build) / "bench" / "shardmerge-gen", Path(build) / "shardmerge-gen"]
    here = Path(shardmerge_bin).resolve().parent
    candidates += [here / "bench" / "shardmerge-gen", here / "shardmerge-gen"]
    for c in candidates:
        if c.exists():
            return str(c)
    pytest.skip("shardmerge-gen not found (set SHARDMERGE_GEN_BIN or build the shardmerge-gen target)")


@pytest.fixture(scope="session")
def fixtures():
    d = os.environ.get("SHARDMERGE_FIXTURES")
    if not d or not (Path(d) / "manifest.json").exists():
        pytest.skip("fixtures not generated (tests/fixtures/generate.py)")
    return Path(d)


@pytest.fixture(scope="session")
def manifest(fixtures):
    return json.loads((fixtures / "manifest.json").read_text())


@pytest.fixture(scope="session")
def run(shardmerge_bin):
    """run(*args, check=True) -> CompletedProcess with text stdout/stderr."""

    def _run(*args, check=True, env=None, cwd=None):
        proc = subprocess.run([shardmerge_bin, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"shardmerge {' '.join(map(str, args))} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    return _run


def fsdp_fixtures(manifest):
    return [f for f in manifest["fixtures"] if f["kind"] == "fsdp"]


# ---------------------------------------------------------------------------------------------
# Parametrization over manifest entries. The manifest is read at collection time (from
# SHARDMERGE_FIXTURES); without it every parametrized test is collected once and skipped.

def _manifest_at_collection():
    d = os.environ.get("SHARDMERGE_FIXTURES")
    if not d:
        return None
    p = Path(d) / "manifest.json"
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except ValueError:
        return None


_SELECTORS = {
    # argument name -> (manifest list, predicate)
    "fsdp_fx": ("fixtures", lambda f: f["kind"] == "fsdp"),
    "lora_fx": ("fixtures", lambda f: f["kind"] == "fsdp" and bool(f.get("lora"))),
    "plain_fx": ("fixtures", lambda f: f["kind"] == "fsdp" and not f.get("lora")),
    "verl_fx": ("fixtures", lambda f: f["kind"] == "fsdp" and bool(f.get("verl_ref"))),
    "peft_fx": ("fixtures", lambda f: f["kind"] == "peft_adapter"),
    "megatron_fx": ("fixtures", lambda f: f["kind"] == "megatron" and f.get("status") == "ok"),
    "merge_fx": ("fixtures", lambda f: f["kind"] in ("fsdp", "megatron") and f.get("status", "ok") == "ok"),
    "zoo_fx": ("fixtures", lambda f: f["kind"] == "fsdp_zoo" and f.get("status") == "ok"),
    "zoo_lora_only_fx": ("fixtures", lambda f: f["kind"] == "fsdp_zoo_lora_only" and f.get("status") == "ok"),
    "lora_only_fx": ("fixtures", lambda f: f["kind"] == "fsdp_lora_only" and f.get("status") == "ok"),
    "automodel_fx": ("fixtures", lambda f: f["kind"] == "automodel" and f.get("status") == "ok"),
    "torchtitan_fx": ("fixtures", lambda f: f["kind"] == "torchtitan" and f.get("status") == "ok"),
    "hostile_fx": ("hostile", lambda f: True),
    "hostile_pt_fx": ("hostile", lambda f: f["file"].endswith(".pt")),
    "hostile_st_fx": ("hostile", lambda f: f["file"].endswith(".safetensors")),
}


def pytest_generate_tests(metafunc):
    m = _manifest_at_collection()
    for arg, (section, pred) in _SELECTORS.items():
        if arg not in metafunc.fixturenames:
            continue
        if m is None:
            metafunc.parametrize(arg, [pytest.param(None, marks=pytest.mark.skip(
                reason="fixtures not generated (SHARDMERGE_FIXTURES)"))], ids=["no-fixtures"])
            continue
        entries = [f for f in m.get(section, []) if pred(f)]
        if not entries:
            metafunc.parametrize(arg, [pytest.param(None, marks=pytest.mark.skip(
                reason=f"no manifest entry for {arg}"))], ids=["none"])
            continue
        metafunc.parametrize(arg, entries, ids=[f["name"] for f in entries])


# ---------------------------------------------------------------------------------------------
# Merges shared by several tests: each distinct (source, options) is merged once per session.

@pytest.fixture(scope="session")
def merged(run, fixtures, tmp_path_factory):
    """merged(fx_or_path, *options) -> Path of a target dir written by `shardmerge merge`.

    fx_or_path is a manifest entry (its role_dir is merged, with --backend fsdp) or a path."""
    cache = {}
    root = tmp_path_factory.mktemp("merged")

    def _merged(fx_or_path, *options):
        src = fixtures / fx_or_path["role_dir"] if isinstance(fx_or_path, dict) else Path(fx_or_path)
        key = (str(src), tuple(map(str, options)))
        if key not in cache:
            out = root / f"m{len(cache):03d}"
            run("merge", "--backend", "fsdp", "--local_dir", src, "--target_dir", out, *options)
            cache[key] = out
        return cache[key]

    return _merged
