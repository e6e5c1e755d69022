"""Drop-in for `python -m verl.model_merger merge|test ...` (verl 0.9's command line).

Parses verl's flags with verl's defaults (--target_dir tmp; LoRA checkpoints written in verl's
layout, i.e. `shardmerge merge --lora adapter`) and runs the bundled shardmerge CLI. Flags that
need the network fail with one line before any work is done.
"""
from __future__ import annotations

import argparse
import sys

from shardmerge import main as _run_cli


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m shardmerge.model_merger",
                                     description="verl model merger, run by shardmerge")
    sub = parser.add_subparsers(dest="operation", required=True, help="'merge' or 'test'")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", required=True, choices=["fsdp", "megatron"])
    common.add_argument("--local_dir", default=None, help="checkpoint directory (global_step_N/actor)")
    common.add_argument("--hf_model_path", default=None, help="HF directory with config.json and tokenizer")
    common.add_argument("--tie-word-embedding", action="store_true")
    common.add_argument("--trust-remote-code", action="store_true", help="accepted; shardmerge runs no model code")
    common.add_argument("--is-value-model", action="store_true")
    common.add_argument("--use_cpu_initialization", action="store_true",
                        help="accepted; shardmerge never builds the model, so it has no effect")
    merge = sub.add_parser("merge", parents=[common], help="merge the checkpoint into a HF directory")
    merge.add_argument("--target_dir", default="tmp")
    merge.add_argument("--hf_upload_path", default=None, help="not supported: shardmerge works offline")
    merge.add_argument("--private", action="store_true", help="only meaningful with --hf_upload_path")
    test = sub.add_parser("test", parents=[common], help="check a HF directory against the checkpoint")
    test.add_argument("--test_hf_dir", required=True)
    return parser


def translate(argv: list[str]) -> list[str]:
    """shardmerge CLI arguments for verl's command line `argv` (argparse exits 2 on bad usage)."""
    parser = _parser()
    a = parser.parse_args(argv)
    if a.operation == "merge" and a.hf_upload_path:
        parser.exit(2, "shardmerge.model_merger: error: --hf_upload_path is not supported: shardmerge works "
                       "offline; upload the merged directory with `huggingface-cli upload`\n")
    if a.local_dir is None:
        parser.exit(2, "shardmerge.model_merger: error: --local_dir is required\n")
    args = ["merge" if a.operation == "merge" else "test", "--backend", a.backend, "--local_dir", a.local_dir,
            "--lora", "adapter"]
    if a.operation == "merge":
        args += ["--target_dir", a.target_dir]
    else:
        args += ["--test_hf_dir", a.test_hf_dir]
    if a.hf_model_path:
        args += ["--hf_model_path", a.hf_model_path]
    for flag in ("tie_word_embedding", "trust_remote_code", "is_value_model"):
        if getattr(a, flag):
            args.append("--" + flag.replace("_", "-"))
    return args


def main(argv: list[str] | None = None) -> None:
    _run_cli(translate(sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    main()
