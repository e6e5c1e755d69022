"""Shared fixtures for the end-to-end tests: the shardmerge binary, the generated real
checkpoints (tests/fixtures/generate.py), and a runner. Tests skip, saying why, when the
fixtures or a Python package they need are absent."""
import json
import os
import subprocess
from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def shardmerge_bin():
    path = os.environ.get("SHARDMERGE_BIN")
    if not path or not Path(path).exists():
        pytest.skip("SHARDMERGE_BIN is not set (run through ctest)")
    return path


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

    def _run(*args, check=True, env=None):
        proc = subprocess.run([shardmerge_bin, *map(str, args)], capture_output=True, text=True, env=env)
        if check and proc.returncode != 0:
            raise AssertionError(
                f"shardmerge {' '.join(map(str, args))} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
        return proc

    return _run


def fsdp_fixtures(manifest):
    return [f for f in manifest["fixtures"] if f["kind"] == "fsdp"]
