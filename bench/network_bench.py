#!/usr/bin/env python3
"""network_bench: node-local merges over a real, shaped TCP network (issue 28), side by side in
one run with the same build:

  (a) one process that sees every rank file (the baseline);
  (b) 2 and 4 "nodes", each a network namespace with its own mount namespace and only its own
      rank files, joined by the netsim harness (../shared/netsim: veth pairs, a bridge or a
      user-space delay line, tc tbf shaping each node's egress); mpirun starts them over an rsh
      agent as it would over ssh, and Open MPI's TCP transport carries the slices.

Per row: the link (rate, round trip as configured and as measured: the median of 20 one-byte TCP round trips), wall seconds of
the merge (the processes' own figure), bytes the busiest node sent, how much of its link that
used, the CPU of all processes together, the largest process's peak RSS, and the ratio to the
issue's bound:
  - latency rows (10 Gbit/s + 5 ms, + 20 ms): time / (2-node time on the unshaped bridge),
    bound 1.25 and 1.5;
  - bandwidth rows (1 Gbit/s + 0.5 ms): time / max(bridge time, busiest node's bytes / rate),
    bound 1.25;
  - overhead (2 nodes, unshaped bridge): time / one process, bound 1.5;
  - CPU: all processes' CPU / one process's, bound 1.5.
On one machine every node shares the same cores, disk and page cache: the network is real, the
nodes' compute is not separate. Needs root, iproute2, tc, a C compiler and Open MPI.

  sudo bench/network_bench.py --netsim ../shared/netsim --rounds 2
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from merge_bench import fmt_bytes
from node_local_bench import generated_checkpoint, split_nodes

ROOT = Path(__file__).resolve().parent.parent
MPI_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
RATES = {"1gbit": 1e9 / 8, "10gbit": 10e9 / 8}
# (nodes, rate, round trip in ms or "bridge", what the row is held to)
CASES = [
    (2, "none", "bridge", "overhead"),
    (2, "10gbit", "5", "latency"),
    (2, "10gbit", "20", "latency"),
    (2, "1gbit", "0.5", "bandwidth"),
    (4, "none", "bridge", "base4"),
    (4, "1gbit", "0.5", "bandwidth"),
]
BOUND = {"overhead": 1.5, "bandwidth": 1.25}


def sh(*cmd, **kw):
    return subprocess.run([str(c) for c in cmd], check=True, capture_output=True, text=True, **kw)


def tx_bytes(n):
    return [int(sh("ip", "netns", "exec", f"smn{i}", "cat", "/sys/class/net/data0/statistics/tx_bytes").stdout)
            for i in range(n)]


ECHO = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("10.77.0.2", 7999)); s.listen(1)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while (b := c.recv(64)):
    c.sendall(b)
"""
PING = """
import socket, time
for _ in range(50):
    try:
        c = socket.create_connection(("10.77.0.2", 7999)); break
    except OSError:
        time.sleep(0.1)
c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
times = []
for _ in range(20):
    t = time.perf_counter(); c.sendall(b"x"); c.recv(64); times.append(time.perf_counter() - t)
print(sorted(times)[len(times) // 2] * 1e3)
"""


def measured_rtt_ms():
    """The median of 20 TCP round trips between node 0 and node 1 (one byte each way)."""
    echo = subprocess.Popen(["ip", "netns", "exec", "smn1", "python3", "-c", ECHO])
    try:
        return float(sh("ip", "netns", "exec", "smn0", "python3", "-c", PING, timeout=30).stdout)
    finally:
        echo.kill()
        echo.wait()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--netsim", default=str(ROOT.parent / "shared" / "netsim"), help="the harness's folder")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--world-size", type=int, default=8)
    ap.add_argument("--dtype", default="float32", choices=["bfloat16", "float32"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--workdir", default="/var/tmp/shardmerge-network-bench",
                    help="the checkpoint is kept here for reruns; delete it when done")
    ap.add_argument("--build-dir", default=str(ROOT / "build"))
    ap.add_argument("--only", nargs="+", metavar="N:RATE:RTT", help="run only these cases, e.g. 2:10gbit:5 2:none:bridge")
    ap.add_argument("--merge-args", default="", help="extra arguments for every merge, e.g. '--threads 32'")
    args = ap.parse_args()
    cases = [c for c in CASES if not args.only or f"{c[0]}:{c[1]}:{c[2]}" in args.only]
    netsim = Path(args.netsim).resolve()
    for tool in ("ip", "tc", "mpirun", "cc"):
        if not shutil.which(tool):
            raise SystemExit(f"network_bench: {tool} not found: skipped")
    if os.geteuid() != 0:
        raise SystemExit("network_bench: needs root (network namespaces): skipped")

    shardmerge, workdir, role, in_bytes, target = generated_checkpoint(args)

    def one_process():
        shutil.rmtree(target, ignore_errors=True)
        proc = sh(shardmerge, "merge", "--local_dir", role, "--target_dir", target, "--json", *args.merge_args.split())
        return json.loads(proc.stdout[proc.stdout.index("{"):])

    def nodes_merge(n):
        shutil.rmtree(target, ignore_errors=True)
        base = workdir / f"nodes{n}"
        env = dict(os.environ, **MPI_ENV, NETSIM_NODES=str(base))
        hosts = ",".join(f"n{i}:1" for i in range(n))
        before = tx_bytes(n)
        proc = subprocess.run(
            ["ip", "netns", "exec", "sml", "mpirun", "-np", str(n), "--host", hosts, "--bind-to", "none",
             "--mca", "plm_rsh_agent", str(netsim / "fakessh"), "--mca", "plm_rsh_no_tree_spawn", "1",
             "--mca", "oob_tcp_if_include", "ctl0", "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
             "--mca", "btl_tcp_if_include", "data0",
             shardmerge, "merge", "--local_dir", str(base / "actor"), "--target_dir", str(target), "--json",
             *args.merge_args.split()],
            capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise SystemExit(f"network_bench: the {n}-node merge failed:\n{proc.stdout}\n{proc.stderr}")
        sent = [a - b for a, b in zip(tx_bytes(n), before)]
        return json.loads(proc.stdout[proc.stdout.index("{"):]), max(sent)

    for n in sorted({c[0] for c in cases}):
        split_nodes(role, workdir / f"nodes{n}", args.world_size, n)

    one_process()  # warms the page cache: every row reads the same files
    base_runs = [one_process() for _ in range(args.rounds)]
    one_s = statistics.median(r["seconds"] for r in base_runs)
    one_cpu = statistics.median(r["cpu_seconds"] for r in base_runs)
    out_bytes = base_runs[0]["bytes_written"]
    rows = []
    nodes_up = 0
    try:
        for n, rate, rtt, kind in cases:
            if n != nodes_up:
                if nodes_up:
                    sh(netsim / "teardown.sh")
                sh(netsim / "setup.sh", n)
                nodes_up = n
            # (not captured: the delay line it leaves running would hold the pipe open)
            subprocess.run([str(netsim / "link.sh"), str(n), rate, rtt], check=True, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL)
            rtt_seen = measured_rtt_ms()
            runs = [nodes_merge(n) for _ in range(args.rounds)]
            t = statistics.median(r[0]["seconds"] for r in runs)
            cpu = statistics.median(r[0]["cpu_seconds"] for r in runs)
            busiest = max(r[1] for r in runs)
            rss = max(r[0]["peak_rss_bytes"] for r in runs)
            rows.append(dict(n=n, rate=rate, rtt=rtt, rtt_seen=rtt_seen, kind=kind, t=t, cpu=cpu, busiest=busiest, rss=rss))
    finally:
        if nodes_up:
            sh(netsim / "teardown.sh")
        shutil.rmtree(target, ignore_errors=True)

    bridge = {r["n"]: r["t"] for r in rows if r["rtt"] == "bridge"}
    print(f"\n{args.model} W={args.world_size} {args.dtype}: {fmt_bytes(in_bytes)} in, {fmt_bytes(out_bytes)} out; "
          f"median of {args.rounds} rounds; {os.cpu_count()} cores shared by every node")
    print(f"1 process, every file: {one_s:.2f} s, {one_cpu:.2f} s CPU, "
          f"peak RSS {max(r['peak_rss_bytes'] for r in base_runs) / 2**20:.0f} MiB")
    print(f"{'nodes':>5} {'link':>8} {'RTT ms':>7} {'seen':>6} {'merge s':>8} {'busiest sent':>13} {'link use':>9} "
          f"{'CPU s':>7} {'CPU x1':>7} {'RSS MiB':>8} {'ratio':>6} {'bound':>6}  held to")
    for r in rows:
        rate = RATES.get(r["rate"])
        use = f"{r['busiest'] / r['t'] / rate:>8.0%}" if rate else f"{'-':>8}"
        if r["kind"] == "overhead":
            ratio, bound, what = r["t"] / one_s, 1.5, "1 process"
        elif r["kind"] == "latency":
            bound = 1.25 if float(r["rtt"]) <= 5 else 1.5
            ratio, what = r["t"] / bridge.get(r["n"], float("nan")), f"{r['n']} nodes on the bridge"
        elif r["kind"] == "bandwidth":
            floor = max(bridge.get(r["n"], 0), r["busiest"] / rate)
            ratio, bound, what = r["t"] / floor, 1.25, "max(bridge, busiest bytes / rate)"
        else:
            ratio, bound, what = r["t"] / one_s, float("nan"), "1 process (the 4-node bridge baseline)"
        print(f"{r['n']:>5} {r['rate']:>8} {r['rtt']:>7} {r['rtt_seen']:>6.2f} {r['t']:>8.2f} {fmt_bytes(r['busiest']):>13} "
              f"{use} {r['cpu']:>7.2f} {r['cpu'] / one_cpu:>7.2f} {r['rss'] / 2**20:>8.0f} {ratio:>6.2f} {bound:>6.2f}  {what}")
    for n in sorted({c[0] for c in cases}):
        shutil.rmtree(workdir / f"nodes{n}", ignore_errors=True)


if __name__ == "__main__":
    main()
