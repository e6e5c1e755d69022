#!/usr/bin/env python3
"""reshard_bench: times, in one run, `shardmerge reshard` of a verl FSDP checkpoint with optimizer
state to other world sizes against copying the same role directory.

  (a) shardmerge reshard W -> each of --to   the job (it reads and writes about the whole role dir)
  (b) cp -r of the role directory + sync     a kernel copy of the same bytes, flushed like (a)

The checkpoint (model_, optim_ and extra_state_ rank files) comes from bench/shardmerge-gen
--optimizer and is kept in --workdir for reruns. Rounds alternate (a) and (b), outputs removed
and `sync` before every timed command; medians are printed with each command's peak RSS (wait4).

  bench/reshard_bench.py --model qwen2.5-1.5b --world-size 8 --to 4 16 --workdir /tmp/rbench
"""
import argparse
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from merge_bench import fmt_bytes, generated_role, run_measured

ROOT = Path(__file__).resolve().parent.parent


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-1.5b")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--to", type=int, nargs="+", default=[4, 16], help="target world sizes")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="parameter dtype")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workdir", default="/tmp/shardmerge-reshard-bench",
                    help="the checkpoint is kept here for reruns; keep about twice its size free; delete it when done")
    ap.add_argument("--build-dir", default=str(ROOT / "build"))
    args = ap.parse_args()

    build = Path(args.build_dir)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    role = generated_role(build, workdir, args.model, args.world_size, args.dtype, optimizer=True)
    in_bytes = sum(p.stat().st_size for p in role.rglob("*") if p.is_file())
    out = workdir / "out"

    def settle():
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run(["sync"], check=True)

    times = {"cp -r + sync": []}
    rss = {"cp -r + sync": 0}
    for w2 in args.to:
        times[f"reshard {args.world_size} -> {w2}"] = []
        rss[f"reshard {args.world_size} -> {w2}"] = 0
    for rnd in range(args.rounds):
        settle()
        start = time.perf_counter()
        _, m = run_measured(["cp", "-r", str(role), str(out)])
        run_measured(["sync", "-f", str(out)])
        times["cp -r + sync"].append(time.perf_counter() - start)
        rss["cp -r + sync"] = max(rss["cp -r + sync"], m)
        for w2 in args.to:
            settle()
            key = f"reshard {args.world_size} -> {w2}"
            t, m = run_measured([str(build / "shardmerge"), "reshard", "--local_dir", str(role), "--world_size", str(w2),
                                 "--target_dir", str(out)])
            times[key].append(t)
            rss[key] = max(rss[key], m)
        print(f"round {rnd + 1}/{args.rounds} done", flush=True)
    shutil.rmtree(out, ignore_errors=True)

    med = {k: statistics.median(v) for k, v in times.items()}
    print()
    print(f"# {args.model}, world size {args.world_size}, {args.dtype} parameters + AdamW state: {fmt_bytes(in_bytes)} "
          f"role dir; median of {args.rounds} alternating rounds, page cache as the previous command left it")
    print(f"# {'command':<20} {'seconds':>9} {'GB/s (in+out)':>14} {'peak RSS':>12} {'/ cp -r + sync':>15}")
    for k, v in med.items():
        print(f"  {k:<20} {v:9.3f} {2 * in_bytes / v / 1e9:14.2f} {rss[k] / 2**20:8.1f} MiB {v / med['cp -r + sync']:15.3f}")


if __name__ == "__main__":
    sys.exit(main())
