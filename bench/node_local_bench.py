#!/usr/bin/env python3
"""node_local_bench: one verl FSDP checkpoint merged, in one run, by

  (a) one process reading every rank file from one shared directory (the baseline), and
  (b) 1, 2, 4 ... processes started by `mpirun`, each seeing only its own "node's" rank files at
      the same path (its own mount namespace, `unshare -m` + a bind mount, as the e2e tests do;
      node 0 alone has the sidecars), writing to a target every process sees.

It prints, per row: median wall seconds (launcher included: mpirun and unshare start in about
0.3-0.4 s here), median merge seconds (the processes' own figure, from planning to commit),
throughput (output bytes per merge second), the source bytes moved between processes (the slices
an output file needs from another node) and what moved them (MPI, or NCCL between GPUs:
--transport), and the merge-time ratio to (a).
On one machine every "node" shares the same disk, page cache and cores, so this measures the
overhead of the node-local path (summaries all-gathered, slices moved between processes), not the
scale-out of N real nodes; docs/multi-node.md sizes that on paper.

Rank files are hard links into one generated checkpoint (no copies). Needs root (mount) and
mpirun (openmpi-bin), and shardmerge built with MPI.

  bench/node_local_bench.py --model qwen2.5-0.5b --world-size 8 --processes 1 2 4 --rounds 3
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from merge_bench import fmt_bytes, generated_role

ROOT = Path(__file__).resolve().parent.parent
MPI_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")
RANK_FILE = re.compile(r"(model|optim|extra_state)_world_size_\d+_rank_(\d+)\.pt$")


def split_nodes(role, base, world, nprocs):
    """base/node<R> for R < nprocs: rank file r on node r % nprocs; every other file on node 0."""
    shutil.rmtree(base, ignore_errors=True)
    nodes = [base / f"node{r}" for r in range(nprocs)]
    for f in sorted(p for p in role.rglob("*") if p.is_file()):
        rel = f.relative_to(role)
        m = RANK_FILE.match(f.name)
        node = nodes[int(m.group(2)) % nprocs] if m else nodes[0]
        (node / rel).parent.mkdir(parents=True, exist_ok=True)
        os.link(f, node / rel)
    for n in nodes:
        n.mkdir(parents=True, exist_ok=True)
    (base / "actor").mkdir()
    return base / "actor"


def generated_checkpoint(args):
    """The checkpoint args.model/world_size/dtype asks for, generated once into args.workdir (kept
    for reruns): (the shardmerge binary, the workdir, the role dir, its bytes, the target)."""
    build = Path(args.build_dir)
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    role = generated_role(build, workdir, args.model, args.world_size, args.dtype)
    in_bytes = sum(p.stat().st_size for p in role.rglob("*") if p.is_file())
    return str(build / "shardmerge"), workdir, role, in_bytes, workdir / "out"


def timed_json(cmd, env=None):
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"failed: {' '.join(map(str, cmd))}\n{proc.stdout}\n{proc.stderr}")
    return elapsed, json.loads(proc.stdout[proc.stdout.index("{"):])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--transport", default="auto", choices=["auto", "mpi", "nccl"],
                    help="what moves the slices between the processes (merge --transport)")
    ap.add_argument("--max-shard-size", default="200MB", help="output file size: several files, so that several processes write")
    ap.add_argument("--workdir", default="/tmp/shardmerge-node-local-bench",
                    help="the checkpoint is kept here for reruns; delete it when done")
    ap.add_argument("--build-dir", default=str(ROOT / "build"))
    args = ap.parse_args()

    shardmerge, workdir, role, in_bytes, target = generated_checkpoint(args)

    def shared():
        return timed_json([shardmerge, "merge", "--local_dir", str(role), "--target_dir", str(target), "--json",
                           "--max-shard-size", args.max_shard_size])

    def node_local(n):
        actor = workdir / f"nodes{n}" / "actor"
        mount = f'mount --bind "{actor.parent}/node$OMPI_COMM_WORLD_RANK" "{actor}"'
        merge = (f"'{shardmerge}' merge --local_dir '{actor}' --target_dir '{target}' --json "
                 f"--max-shard-size {args.max_shard_size} --transport {args.transport}")
        return timed_json(["mpirun", "--oversubscribe", "--bind-to", "none", "-np", str(n), "unshare", "-m", "sh", "-c",
                           f"{mount} && exec {merge}"], env=dict(os.environ, **MPI_ENV))

    for n in args.processes:
        split_nodes(role, workdir / f"nodes{n}", args.world_size, n)
    rows = {"shared dir, 1 process": (shared, [])}
    for n in args.processes:
        rows[f"node-local, {n} process{'es' if n > 1 else ''}"] = (lambda n=n: node_local(n), [])

    out_bytes = 0
    sent, planes = {}, {}
    merge_times = {name: [] for name in rows}
    for _ in range(args.rounds):
        for name, (job, times) in rows.items():
            shutil.rmtree(target, ignore_errors=True)
            subprocess.run(["sync"], check=True)
            seconds, summary = job()
            times.append(seconds)
            merge_times[name].append(summary["seconds"])
            out_bytes = sum(p.stat().st_size for p in target.rglob("*") if p.is_file())
            sent[name] = summary.get("bytes_sent_between_processes", 0)
            planes[name] = summary.get("data_plane", "none")
    shutil.rmtree(target, ignore_errors=True)

    print(f"\n{args.model} W={args.world_size} {args.dtype}: {fmt_bytes(in_bytes)} in, {fmt_bytes(out_bytes)} out; "
          f"median of {args.rounds} rounds, warm page cache, {os.cpu_count()} cores")
    base = statistics.median(merge_times["shared dir, 1 process"])
    print(f"{'job':<28}{'wall s':>8}{'merge s':>9}{'GB/s out':>10}{'sent between':>15}{'over':>6}{'ratio':>8}")
    for name, (_, times) in rows.items():
        t = statistics.median(merge_times[name])
        print(f"{name:<28}{statistics.median(times):>8.2f}{t:>9.2f}{out_bytes / t / 1e9:>10.2f}"
              f"{fmt_bytes(sent[name]):>15}{planes[name]:>6}{t / base:>8.2f}")
    for n in args.processes:
        shutil.rmtree(workdir / f"nodes{n}", ignore_errors=True)


if __name__ == "__main__":
    main()
