#!/usr/bin/env python3
"""merge_bench: times, in one run, what merging a verl FSDP checkpoint costs against copying it
and against verl's own merger.

  (a) shardmerge merge                    the job
  (b) the I/O floor of the same job       reading the model rank files, then writing a file of
                                          the output size with fsync (their sum)
  (c) cp -r of the role directory         plain copy; timed with and without a final sync,
                                          since shardmerge's output is fsynced
  (d) python -m verl.model_merger merge   when --verl-python points at a Python with verl

and prints each one's median time, the ratios (a)/(b), (a)/(c), (d)/(a) and every
command's peak RSS (from wait4). (a) and (b) come from `shardmerge bench --json` (which alternates
floors and merges; for FSDP it generates the checkpoint and keeps it, --keep, for (c) and (d); for
--megatron it times the tree this script generated, --local_dir). With --lora-rank it also times
folding LoRA into the base weights against merging the same checkpoint without folding.

With --megatron the checkpoint is a verl Megatron v2 role directory instead (torch_dist tree of
TP x PP ranks, layer-stacked keys, bf16; written by bench/synthetic_megatron.py), merged with
--backend megatron; the I/O floor reads its .distcp files. verl's Megatron merger needs a GPU
and NCCL; --lora-rank is FSDP-only.

  bench/merge_bench.py --model qwen2.5-0.5b --world-size 8 --workdir /tmp/bench
  bench/merge_bench.py --megatron --model qwen2.5-1.5b --tp 8 --pp 4 --workdir /tmp/bench
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_measured(cmd, cwd=None, env=None):
    """Runs cmd; returns (seconds, peak RSS bytes of that process tree's largest process)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(proc.pid, 0)
    elapsed = time.perf_counter() - start
    err = proc.stderr.read()
    proc.stderr.close()
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{err}")
    return elapsed, usage.ru_maxrss * 1024


def fmt_bytes(n):
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1000:
            return f"{n:.2f} {unit}"
        n /= 1000
    return f"{n:.2f} PB"


def generated_role(build, workdir, model, world_size, dtype, optimizer=False):
    """The role dir of a shardmerge-gen checkpoint in workdir, generated unless a complete one is
    kept there from an earlier run."""
    run_root = Path(workdir) / f"{model}-w{world_size}-{dtype}{'-optim' if optimizer else ''}"
    role = run_root / "global_step_1" / "actor"
    if not (role / "fsdp_config.json").exists():
        shutil.rmtree(run_root, ignore_errors=True)
        cmd = [str(Path(build) / "bench" / "shardmerge-gen"), "--model", model, "--world-size", str(world_size),
               "--dtype", dtype, "--out", str(run_root)] + (["--optimizer"] if optimizer else [])
        print("generating:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return role


def shardmerge_bench(args, shardmerge, workdir, lora_rank=0, local_dir=None):
    """Runs `shardmerge bench --json`: on local_dir when given, else generating the checkpoint into
    workdir (or reusing the one kept there) with --keep; returns its JSON and the role dir."""
    cmd = [shardmerge, "bench", "--workdir", str(workdir), "--rounds", str(args.rounds),
           "--memory-limit", args.memory_limit, "--json"]
    if local_dir:
        cmd += ["--local_dir", str(local_dir), "--backend", "megatron"]
    else:
        cmd += ["--model", args.model, "--world-size", str(args.world_size), "--keep",
                "--tokenizer-from", str(ROOT / "demo" / "global_step_3" / "actor" / "huggingface")]
    if lora_rank:
        cmd += ["--lora-rank", str(lora_rank)]
    print("running:", " ".join(cmd), flush=True)
    result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    return result, Path(local_dir) if local_dir else Path(result["kept"]) / "global_step_1" / "actor"


def ensure_megatron_checkpoint(args, workdir):
    run_root = workdir / f"{args.model}_megatron_tp{args.tp}_pp{args.pp}"
    role = run_root / "global_step_1" / "actor"
    if not (role / "ckpt_contents.json").exists():  # the manifest is written last
        cmd = [args.python, str(ROOT / "bench" / "synthetic_megatron.py"), "--model", args.model, "--tp", str(args.tp),
               "--pp", str(args.pp), "--out", str(run_root),
               "--tokenizer-from", str(ROOT / "demo" / "global_step_3" / "actor" / "huggingface")]
        print("generating:", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    return role


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--workdir", default="/tmp/shardmerge-bench",
                    help="generated checkpoints are kept here for reruns; keep about 3x the checkpoint's "
                         "size free (its copy or output, the LoRA checkpoint); delete it when done")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--build-dir", default=str(ROOT / "build"))
    ap.add_argument("--verl-python", help="Python with verl installed, to time verl.model_merger")
    ap.add_argument("--lora-rank", type=int, default=0, help="also time LoRA folding at this rank")
    ap.add_argument("--memory-limit", default="512MiB")
    ap.add_argument("--megatron", action="store_true", help="benchmark a Megatron torch_dist checkpoint instead of FSDP")
    ap.add_argument("--tp", type=int, default=8, help="--megatron: tensor-parallel size")
    ap.add_argument("--pp", type=int, default=4, help="--megatron: pipeline-parallel size")
    venv_python = ROOT / ".venv" / "bin" / "python"
    ap.add_argument("--python", default=str(venv_python) if venv_python.exists() else sys.executable,
                    help="--megatron: Python with torch, to run bench/synthetic_megatron.py")
    args = ap.parse_args()
    if args.megatron and args.lora_rank:
        raise SystemExit("--lora-rank is only benchmarked for FSDP checkpoints")

    build = Path(args.build_dir)
    shardmerge = str(build / "shardmerge")
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    results = {k: [] for k in ("shardmerge", "io_floor", "cp -r", "cp -r + sync", "verl")}
    rss = {k: 0 for k in results}
    out = workdir / "out"

    def settle(*leftovers):
        """Every timed command starts alike: earlier outputs removed and nothing left to write
        back (verl and cp -r leave dirty pages that the next command would otherwise pay for)."""
        for p in leftovers:
            shutil.rmtree(p, ignore_errors=True)
        os.sync()

    if args.megatron:
        bench, role = shardmerge_bench(args, shardmerge, workdir, local_dir=ensure_megatron_checkpoint(args, workdir))
        rank_files = sorted((role / "model" / "dist_ckpt").glob("*.distcp"))
    else:
        bench, role = shardmerge_bench(args, shardmerge, workdir)
        rank_files = sorted(role.glob("model_world_size_*_rank_*.pt"))
    in_bytes, out_bytes = bench["bytes_in"], bench["bytes_out"]
    results["shardmerge"] = [bench["merge_seconds"]]
    results["io_floor"] = [bench["read_floor_seconds"] + bench["write_floor_seconds"]]
    rss["shardmerge"] = bench["merge_peak_rss_bytes"]

    for rnd in range(args.rounds):
        copy = workdir / "copy"
        settle(out, copy)
        t, m = run_measured(["cp", "-r", str(role), str(copy)])
        results["cp -r"].append(t)
        rss["cp -r"] = max(rss["cp -r"], m)
        settle(copy)
        start = time.perf_counter()
        run_measured(["cp", "-r", str(role), str(copy)])
        run_measured(["sync", "-f", str(copy)])
        results["cp -r + sync"].append(time.perf_counter() - start)
        shutil.rmtree(copy, ignore_errors=True)
        if args.verl_python:
            vout = workdir / "verl_out"
            settle(copy, vout)
            t, m = run_measured([args.verl_python, "-m", "verl.model_merger", "merge",
                                 "--backend", "megatron" if args.megatron else "fsdp",
                                 "--local_dir", str(role), "--target_dir", str(vout)])
            results["verl"].append(t)
            rss["verl"] = max(rss["verl"], m)
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)

    med = {k: statistics.median(v) for k, v in results.items() if v}
    print()
    if args.megatron:
        print(f"# {args.model}, Megatron torch_dist TP {args.tp} x PP {args.pp} ({args.tp * args.pp} ranks), bf16: "
              f"{len(rank_files)} .distcp files, {fmt_bytes(in_bytes)} in, {fmt_bytes(out_bytes)} out; "
              f"median of {args.rounds} warm-cache rounds")
    else:
        print(f"# {args.model}, world size {args.world_size}: {len(rank_files)} rank files, "
              f"{fmt_bytes(in_bytes)} in, {fmt_bytes(out_bytes)} out; median of {args.rounds} warm-cache rounds")
    print(f"# {'command':<16} {'seconds':>9} {'GB/s (in+out)':>14} {'peak RSS':>12}")
    for k, v in med.items():
        r = f"{rss[k] / 2**20:9.1f} MiB" if rss[k] else f"{'-':>12}"
        print(f"  {k:<16} {v:9.3f} {(in_bytes + out_bytes) / v / 1e9:14.2f} {r}")
    print()
    print(f"  (a)/(b) shardmerge / I/O floor      = {med['shardmerge'] / med['io_floor']:.3f}   (target <= 1.10)")
    print(f"  (a)/(c) shardmerge / cp -r          = {med['shardmerge'] / med['cp -r']:.3f}")
    print(f"  (a)/(c') shardmerge / cp -r + sync  = {med['shardmerge'] / med['cp -r + sync']:.3f}   (target <= 1.0)")
    if "verl" in med:
        print(f"  (d)/(a) verl.model_merger / shardmerge = {med['verl'] / med['shardmerge']:.2f}x, "
              f"verl peak RSS {rss['verl'] / 2**30:.2f} GiB")

    if args.lora_rank:
        _, lrole = shardmerge_bench(args, shardmerge, workdir, args.lora_rank)
        subprocess.run(["cat", *map(str, lrole.glob("model_*.pt"))], stdout=subprocess.DEVNULL, check=True)
        times = {"fold": [], "drop": []}
        lrss = 0
        for _ in range(args.rounds):
            for mode in ("drop", "fold"):
                settle(out)
                t, m = run_measured([shardmerge, "merge", "--local_dir", lrole, "--target_dir", out, "--lora", mode,
                                     "--memory-limit", args.memory_limit])
                times[mode].append(t)
                lrss = max(lrss, m)
        fold, drop = statistics.median(times["fold"]), statistics.median(times["drop"])
        print()
        print(f"# LoRA r={args.lora_rank} on every linear layer of {args.model}, world size {args.world_size}")
        print(f"  merge without folding (--lora drop) {drop:9.3f} s")
        print(f"  merge with folding    (--lora fold) {fold:9.3f} s   fold / plain = {fold / drop:.3f} (target <= 1.5)")
        print(f"  peak RSS {lrss / 2**20:.1f} MiB")
    shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
