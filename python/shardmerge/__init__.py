"""shardmerge: verl's distributed checkpoints (FSDP, Megatron dist_ckpt) to HuggingFace safetensors.

The wheel bundles the C++ command-line program built by the project's CMake build; the
`shardmerge` console command and `python -m shardmerge` run that same binary, so their flags,
output and exit codes are the CLI's own. The same operations are also functions here (inspect,
plan, merge, fold_lora, merge_plan, verify: see shardmerge._api), run in this process by the compiled module _core.
"""
from __future__ import annotations

import os
import sys
from importlib import metadata
from pathlib import Path

from shardmerge._api import Error, fold_lora, inspect, merge, merge_plan, plan, verify

__all__ = ["Error", "binary", "fold_lora", "inspect", "main", "merge", "merge_plan", "plan", "verify", "__version__"]

try:
    __version__ = metadata.version("shardmerge")
except metadata.PackageNotFoundError:  # imported from a source tree, not installed
    __version__ = "0+unknown"


def binary() -> Path:
    """Path of the bundled `shardmerge` executable."""
    path = Path(__file__).resolve().parent / "bin" / "shardmerge"
    if not path.is_file():
        raise FileNotFoundError(f"shardmerge: bundled binary missing at {path} (reinstall the wheel)")
    return path


def main(argv: list[str] | None = None) -> None:
    """Run the CLI with `argv` (default: this process's arguments); does not return."""
    args = sys.argv[1:] if argv is None else list(argv)
    exe = str(binary())
    # exec, not a child process: signals (Ctrl-C cleanup of temp dirs), exit codes and the
    # terminal go straight to the binary, exactly as when it is run directly.
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(exe, ["shardmerge", *args])
