"""Merges whose rank files are node-local (issue 13), on one machine: `mpirun` starts the
processes, and each sees the same role-dir path with different contents (its own mount
namespace, `unshare -m`, and a bind mount of its "node" directory there), as verl leaves them on
a multi-node run: each node its own rank files, node 0 alone the sidecars. The oracle is the
single-process merge of the complete checkpoint, byte for byte."""
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

MPI_ENV = dict(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1", OMPI_MCA_rmaps_base_oversubscribe="1")


@pytest.fixture(scope="module")
def mpi(shardmerge_bin):
    if os.environ.get("SHARDMERGE_HAVE_MPI", "ON") != "ON":
        pytest.skip("shardmerge was built without MPI (libopenmpi-dev): no data plane to test")
    if not shutil.which("mpirun"):
        pytest.skip("mpirun not found (openmpi-bin)")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs none /mnt && umount /mnt"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("unshare -m with a mount is not permitted here (needs CAP_SYS_ADMIN): "
                    + probe.stderr.decode(errors="replace").strip())
    return shardmerge_bin


def role_of(fixtures, manifest, name):
    entry = next(f for f in manifest["fixtures"] if f["name"] == name)
    return fixtures / entry["role_dir"]


def split_role(role, base, shares, is_data):
    """Copies `role` into base/node<R>: the data files `shares[R]` selects (a predicate on the
    relative path) to each node, every other file to node 0 only."""
    nodes = [base / f"node{r}" for r in range(len(shares))]
    for n in nodes:
        n.mkdir(parents=True)
    for f in sorted(p for p in role.rglob("*") if p.is_file()):
        rel = f.relative_to(role)
        owners = [r for r, takes in enumerate(shares) if is_data(rel) and takes(rel)] if is_data(rel) else [0]
        for r in owners:
            (nodes[r] / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, nodes[r] / rel)
    return nodes


def fsdp_rank(rel):
    m = re.match(r"model_world_size_\d+_rank_(\d+)\.pt$", rel.name)
    return int(m.group(1)) if m else None


def is_fsdp_data(rel):
    return re.match(r"(model|optim|extra_state)_world_size_\d+_rank_\d+\.pt$", rel.name) is not None


def fsdp_shares(ranks_per_node):
    return [lambda rel, rs=set(rs): re.search(r"_rank_(\d+)\.pt$", rel.name) and int(
        re.search(r"_rank_(\d+)\.pt$", rel.name).group(1)) in rs for rs in ranks_per_node]


def mpirun(mpi, base, nprocs, args, target_per_node=False, wrap=None, timeout=300):
    """Runs `shardmerge merge` on `nprocs` processes, each with base/node<R> mounted at base/actor
    (and base/target<R> at base/target when `target_per_node`)."""
    mount = f'mount --bind "{base}/node$OMPI_COMM_WORLD_RANK" "{base}/actor"'
    (base / "actor").mkdir(exist_ok=True)
    if target_per_node:
        (base / "target").mkdir(exist_ok=True)
        for r in range(nprocs):
            (base / f"target{r}").mkdir(exist_ok=True)
        mount += f' && mount --bind "{base}/target$OMPI_COMM_WORLD_RANK" "{base}/target"'
    cmd = " ".join(f"'{a}'" for a in [mpi, "merge", "--local_dir", base / "actor", *map(str, args)])
    if wrap:
        cmd = wrap(cmd)
    script = f"{mount} && exec {cmd}" if not wrap else f"{mount} && {cmd}"
    return subprocess.run(["mpirun", "--oversubscribe", "-np", str(nprocs), "unshare", "-m", "sh", "-c", script],
                          capture_output=True, text=True, env=dict(os.environ, **MPI_ENV), timeout=timeout)


def same_tree(a, b):
    names = sorted(str(p.relative_to(a)) for p in a.rglob("*") if p.is_file())
    assert names == sorted(str(p.relative_to(b)) for p in b.rglob("*") if p.is_file())
    for n in names:
        assert (a / n).read_bytes() == (b / n).read_bytes(), n


def gpu_count():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def summary_of(proc):
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout[proc.stdout.index("{"):])


@pytest.mark.parametrize("nodes", [
    [[0, 2], [1, 3]],          # two nodes, interleaved ranks
    [[3], [], [0, 1, 2]],      # uneven, non-contiguous, a process with no files
])
def test_fsdp2_w4_node_local_equals_one_process(mpi, fixtures, manifest, run, tmp_path, nodes):
    role = role_of(fixtures, manifest, "qwen2_fsdp2_w4")
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "single", "--max-shard-size", "12KB")
    split_role(role, tmp_path, fsdp_shares(nodes), is_fsdp_data)
    s = summary_of(mpirun(mpi, tmp_path, len(nodes), ["--target_dir", tmp_path / "multi", "--max-shard-size", "12KB", "--json"]))
    same_tree(tmp_path / "single", tmp_path / "multi")
    assert s["transport"] == "MPI" and s["node_local_sources"] and s["target_seen_by_all"]
    assert s["data_plane"] == ("NCCL" if gpu_count() >= len(nodes) else "MPI")  # --transport auto
    assert s["bytes_sent_between_processes"] > 0
    assert s["source"] == str(tmp_path / "actor")
    assert not list(tmp_path.glob("multi.tmp-*"))


def test_fsdp2_w8_four_nodes(mpi, shardmerge_gen_bin, run, tmp_path):
    subprocess.run([shardmerge_gen_bin, "--out", tmp_path / "run", "--model", "tiny", "--world-size", "8"], check=True,
                   capture_output=True)
    role = next((tmp_path / "run").rglob("fsdp_config.json")).parent
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "single")
    split_role(role, tmp_path, fsdp_shares([[0, 5], [1, 2, 3], [], [4, 6, 7]]), is_fsdp_data)
    s = summary_of(mpirun(mpi, tmp_path, 4, ["--target_dir", tmp_path / "multi", "--json"]))
    same_tree(tmp_path / "single", tmp_path / "multi")
    assert s["processes"] == 4


def test_hsdp_replicas_on_different_nodes(mpi, fixtures, manifest, run, tmp_path):
    # (ddp=2, fsdp=2): ranks 0 and 2 hold the same shard, as do 1 and 3.
    role = role_of(fixtures, manifest, "qwen2_hsdp_2x2")
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "single")
    split_role(role, tmp_path, fsdp_shares([[0, 3], [1, 2]]), is_fsdp_data)
    s = summary_of(mpirun(mpi, tmp_path, 2, ["--target_dir", tmp_path / "multi", "--json"]))
    same_tree(tmp_path / "single", tmp_path / "multi")
    # Each replica read once: the processes read what one process reads.
    single = summary_of(subprocess.run([mpi, "merge", "--local_dir", role, "--target_dir", tmp_path / "again", "--json"],
                                       capture_output=True, text=True))
    assert s["bytes_read"] == single["bytes_read"]


def test_lora_fold_with_adapter_slices_from_other_nodes(mpi, fixtures, manifest, run, tmp_path):
    role = role_of(fixtures, manifest, "qwen2_lora_fsdp2_w4")
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "single")
    split_role(role, tmp_path, fsdp_shares([[1], [0, 2, 3]]), is_fsdp_data)
    s = summary_of(mpirun(mpi, tmp_path, 2, ["--target_dir", tmp_path / "multi", "--json"]))
    same_tree(tmp_path / "single", tmp_path / "multi")
    assert s["lora_folds"] > 0


def test_megatron_tp2_pp2_dist_ckpt_spread_over_three_nodes(mpi, fixtures, manifest, run, tmp_path):
    role = role_of(fixtures, manifest, "qwen2_megatron_tp2_pp2")
    # verl's dist-only save has no HF config: the base model's, given on every process.
    config = ["--hf_model_path", fixtures / "hf_base_megatron" / "qwen2"]
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "single", *config)
    files = sorted(p.name for p in role.rglob("*.distcp"))
    assert len(files) >= 3
    # .metadata, common.pt, configs: node 0 only; node 0 holds no .distcp file at all.
    shares = [lambda rel: False, lambda rel: rel.name in files[::2], lambda rel: rel.name in files[1::2]]
    split_role(role, tmp_path, shares, lambda rel: rel.suffix == ".distcp")
    s = summary_of(mpirun(mpi, tmp_path, 3, ["--target_dir", tmp_path / "multi", "--json", *config]))
    same_tree(tmp_path / "single", tmp_path / "multi")
    assert s["bytes_sent_between_processes"] > 0


def test_target_seen_by_rank_0_only(mpi, fixtures, manifest, run, tmp_path):
    role = role_of(fixtures, manifest, "qwen2_fsdp2_w4")
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "single", "--max-shard-size", "12KB")
    split_role(role, tmp_path, fsdp_shares([[0, 1], [2], [3]]), is_fsdp_data)
    s = summary_of(mpirun(mpi, tmp_path, 3, ["--target_dir", tmp_path / "target" / "out", "--max-shard-size", "12KB",
                                             "--json"], target_per_node=True))
    assert s["writers"] == 1 and not s["target_seen_by_all"]
    same_tree(tmp_path / "single", tmp_path / "target0" / "out")
    assert not (tmp_path / "target1" / "out").exists() and not (tmp_path / "target2" / "out").exists()


def test_a_file_no_process_holds_is_named(mpi, fixtures, manifest, tmp_path):
    role = role_of(fixtures, manifest, "qwen2_fsdp2_w4")
    split_role(role, tmp_path, fsdp_shares([[0], [3]]), is_fsdp_data)  # ranks 1 and 2 nowhere
    proc = mpirun(mpi, tmp_path, 2, ["--target_dir", tmp_path / "multi"])
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "model_world_size_4_rank_1.pt" in out or "rank 1" in out, out
    assert not (tmp_path / "multi").exists() and not list(tmp_path.glob("multi.tmp-*"))


def test_a_killed_process_fails_the_job_naming_it_and_leaves_no_target(mpi, shardmerge_gen_bin, tmp_path):
    subprocess.run([shardmerge_gen_bin, "--out", tmp_path / "run", "--model", "qwen2.5-0.5b", "--world-size", "4",
                    "--dtype", "float32"], check=True, capture_output=True)
    role = next((tmp_path / "run").rglob("fsdp_config.json")).parent
    split_role(role, tmp_path, fsdp_shares([[0, 3], [1], [2]]), is_fsdp_data)
    shutil.rmtree(tmp_path / "run")
    target = tmp_path / "multi"
    # Rank 2 is killed (SIGKILL) once the output's temp directory exists, mid-merge.
    kill = (f'if [ "$OMPI_COMM_WORLD_RANK" = 2 ]; then {{ CMD & pid=$!; '
            f'while ! ls -d "{target}".tmp-* >/dev/null 2>&1; do sleep 0.05; done; sleep 0.3; kill -9 $pid; wait $pid; }}; '
            f'else exec CMD; fi')
    start = time.monotonic()
    proc = mpirun(mpi, tmp_path, 3, ["--target_dir", target, "--threads", "1"], wrap=lambda cmd: kill.replace("CMD", cmd),
                  timeout=180)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert elapsed < 120, f"the job took {elapsed:.0f} s to fail"
    # mpirun itself reports the lost process, before ours can: OpenMPI names it "[[job,1],2]".
    assert re.search(r"rank 2\b|\[\[\d+,\d+\],2\]", out), out
    assert not target.exists()


@pytest.mark.parametrize("transport", ["mpi", "nccl"])
def test_explicit_transport_moves_the_slices(mpi, fixtures, manifest, run, tmp_path, transport):
    if transport == "nccl" and gpu_count() < 2:
        pytest.skip(f"--transport nccl needs 2 GPUs, one per process; this machine has {gpu_count()}")
    role = role_of(fixtures, manifest, "qwen2_lora_fsdp2_w4")
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "single", "--max-shard-size", "20KB")
    split_role(role, tmp_path, fsdp_shares([[0, 3], [1, 2]]), is_fsdp_data)
    s = summary_of(mpirun(mpi, tmp_path, 2, ["--target_dir", tmp_path / "multi", "--max-shard-size", "20KB",
                                             "--transport", transport, "--json"]))
    same_tree(tmp_path / "single", tmp_path / "multi")
    assert s["data_plane"] == transport.upper() and s["bytes_sent_between_processes"] > 0


def test_transport_nccl_where_a_process_has_no_gpu_of_its_own_is_refused(mpi, fixtures, manifest, tmp_path):
    if gpu_count() >= 2:
        pytest.skip("this machine has a GPU for each of the 2 processes")
    role = role_of(fixtures, manifest, "qwen2_fsdp2_w4")
    split_role(role, tmp_path, fsdp_shares([[0, 1], [2, 3]]), is_fsdp_data)
    proc = mpirun(mpi, tmp_path, 2, ["--target_dir", tmp_path / "multi", "--transport", "nccl"])
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    # No GPU at all, no libnccl, a build without NCCL, or one GPU that both processes would share.
    assert re.search(r"--transport nccl: process rank [01] cannot use NCCL: "
                     r"(no CUDA device|.*libnccl|this shardmerge was built without NCCL|it would share its GPU)", out), out
    assert not (tmp_path / "multi").exists() and not list(tmp_path.glob("multi.tmp-*"))


def leftovers(tmp_path, name):
    """What a merge into tmp_path/name left beside it: the target, its temp dirs, its lock."""
    return sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(name) or p.name.startswith("." + name))


def spread_checkpoint(gen, tmp_path, nodes, model="qwen2.5-0.5b"):
    """A generated W=4 checkpoint (0.5B: 1 GB of bf16, a merge of a second or more on one thread)
    spread over the nodes by hard links."""
    subprocess.run([gen, "--out", tmp_path / "run", "--model", model, "--world-size", "4"], check=True,
                   capture_output=True)
    role = next((tmp_path / "run").rglob("fsdp_config.json")).parent
    for r, ranks in enumerate(nodes):
        (tmp_path / f"node{r}").mkdir()
    for f in sorted(p for p in role.rglob("*") if p.is_file()):
        rel = f.relative_to(role)
        data = is_fsdp_data(rel)
        rank = int(re.search(r"_rank_(\d+)\.pt$", rel.name).group(1)) if data else None
        for r, ranks in enumerate(nodes):
            if (rank in ranks) if data else r == 0:
                (tmp_path / f"node{r}" / rel).parent.mkdir(parents=True, exist_ok=True)
                os.link(f, tmp_path / f"node{r}" / rel)


# Stopping rank 1 leaves the launcher to end it. Rank 0 made the temp directory and holds the lock;
# stopped where the launcher's signals cannot reach it (its own session: a hung node), it never
# cleans up, and the process that found it silent removes both.
@pytest.mark.parametrize("stopped,unreachable", [(1, False), (0, True)])
def test_a_stopped_process_fails_the_job_after_the_peer_timeout_and_a_rerun_succeeds(mpi, shardmerge_gen_bin, tmp_path,
                                                                                     stopped, unreachable):
    spread_checkpoint(shardmerge_gen_bin, tmp_path, [[0, 3], [1, 2]])
    target = tmp_path / "multi"
    pid_file = tmp_path / "stopped.pid"
    # One process is stopped (SIGSTOP: alive, answering nothing) once the output's temp directory exists.
    stop = (f'if [ "$OMPI_COMM_WORLD_RANK" = {stopped} ]; then {{ {"setsid " if unreachable else ""}CMD & pid=$!; '
            f'echo $pid > "{pid_file}"; '
            f'while ! ls -d "{target}".tmp-* >/dev/null 2>&1; do sleep 0.05; done; sleep 0.1; kill -STOP $pid; wait $pid; }}; '
            f'else exec CMD; fi')
    start = time.monotonic()
    try:
        proc = mpirun(mpi, tmp_path, 2, ["--target_dir", target, "--threads", "1", "--peer-timeout", "3"],
                      wrap=lambda cmd: stop.replace("CMD", cmd), timeout=120)
    finally:
        if unreachable:  # what the launcher could not end
            subprocess.run(["kill", "-KILL", pid_file.read_text().strip()], capture_output=True)
    elapsed = time.monotonic() - start
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert elapsed < 60, f"the job took {elapsed:.0f} s to fail"
    assert re.search(rf"process rank {stopped} on host {re.escape(socket.gethostname())} has not answered for \d+ s "
                     r"\(--peer-timeout\)", out), out
    assert leftovers(tmp_path, "multi") == [], out
    # The same run again, with nobody stopped, merges.
    s = summary_of(mpirun(mpi, tmp_path, 2, ["--target_dir", target, "--json"]))
    assert s["processes"] == 2 and target.is_dir()


def test_the_launchers_sigterm_leaves_nothing_behind(mpi, shardmerge_gen_bin, tmp_path):
    spread_checkpoint(shardmerge_gen_bin, tmp_path, [[0, 2], [1, 3]])
    target = tmp_path / "multi"
    (tmp_path / "actor").mkdir(exist_ok=True)
    script = (f'mount --bind "{tmp_path}/node$OMPI_COMM_WORLD_RANK" "{tmp_path}/actor" && exec "{mpi}" merge '
              f'--local_dir "{tmp_path}/actor" --target_dir "{target}" --threads 1')
    launcher = subprocess.Popen(["mpirun", "--oversubscribe", "-np", "2", "unshare", "-m", "sh", "-c", script],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=dict(os.environ, **MPI_ENV))
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("multi.tmp-*")) and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert launcher.poll() is None, "the merge ended before it could be interrupted: " + launcher.stdout.read()
    time.sleep(0.1)
    launcher.send_signal(signal.SIGTERM)  # as a batch system's teardown does
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode != 0, out
    if "removed the unfinished output" in out:  # rank 0, which made them, took its SIGTERM
        assert leftovers(tmp_path, "multi") == [], out
        return
    # Rank 0 printed nothing: it was killed before it took a SIGTERM (seen in about 1 run of 3;
    # Open MPI 4's launcher SIGKILLs 1 s after its SIGTERM, odls_base_sigkill_timeout, and ends
    # the rest of a job once one process has ended; which of the two did it was not pinned down).
    # A SIGKILL cannot be handled: the temp directory and the lock stay, with no target, and the
    # next run must clean them and merge, even while the killed process is still an unreaped
    # zombie (the launcher exits without reaping it).
    assert "multi" not in leftovers(tmp_path, "multi"), out
    rerun = mpirun(mpi, tmp_path, 2, ["--target_dir", target])
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert leftovers(tmp_path, "multi") == ["multi"], rerun.stderr


def test_a_full_target_disk_fails_cleanly_on_every_node(mpi, shardmerge_gen_bin, tmp_path):
    subprocess.run([shardmerge_gen_bin, "--out", tmp_path / "run", "--model", "tiny", "--world-size", "4"], check=True,
                   capture_output=True)
    role = next((tmp_path / "run").rglob("fsdp_config.json")).parent
    split_role(role, tmp_path, fsdp_shares([[0, 2], [1, 3]]), is_fsdp_data)
    # Rank 0's node-local target disk (it alone sees its target, so it writes everything) holds 64 KiB.
    (tmp_path / "target0").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "none", tmp_path / "target0"], check=True)
    try:
        proc = mpirun(mpi, tmp_path, 2, ["--target_dir", tmp_path / "target" / "out"], target_per_node=True)
        out = proc.stdout + proc.stderr
        assert proc.returncode == 1, out
        assert re.search(r"space", out), out
        for node in ("target0", "target1"):
            assert os.listdir(tmp_path / node) == [], (node, out)
    finally:
        subprocess.run(["umount", tmp_path / "target0"], check=True)
    s = summary_of(mpirun(mpi, tmp_path, 2, ["--target_dir", tmp_path / "target" / "out", "--json"], target_per_node=True))
    assert s["writers"] == 1 and (tmp_path / "target0" / "out" / "model.safetensors").is_file()


@pytest.fixture
def netsim(mpi, tmp_path):
    """Two "nodes" on the netns harness (../shared/netsim, or $SHARDMERGE_NETSIM): network and mount
    namespaces of their own, joined by a veth bridge; mpirun starts them over its rsh agent."""
    harness = Path(os.environ.get("SHARDMERGE_NETSIM", Path(__file__).resolve().parents[3] / "shared" / "netsim"))
    if not (harness / "setup.sh").is_file():
        pytest.skip(f"the netns harness is not at {harness} (set SHARDMERGE_NETSIM)")
    if shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("the netns harness needs root and iproute2")
    if subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.strip():
        pytest.skip("network namespaces exist already (another harness run?): not touching them")
    subprocess.run([harness / "setup.sh", "2"], check=True, capture_output=True)
    try:
        subprocess.run([harness / "link.sh", "2", "none", "bridge"], check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        yield harness
    finally:
        subprocess.run([harness / "teardown.sh"], capture_output=True)


def test_a_dropped_link_fails_the_job_after_the_peer_timeout(mpi, netsim, shardmerge_gen_bin, tmp_path):
    spread_checkpoint(shardmerge_gen_bin, tmp_path, [[0, 2], [1, 3]])
    target = tmp_path / "multi"
    (tmp_path / "actor").mkdir(exist_ok=True)
    env = dict(os.environ, **MPI_ENV, NETSIM_NODES=str(tmp_path))
    launcher = subprocess.Popen(
        ["ip", "netns", "exec", "sml", "mpirun", "-np", "2", "--host", "n0:1,n1:1", "--bind-to", "none",
         "--mca", "plm_rsh_agent", str(netsim / "fakessh"), "--mca", "plm_rsh_no_tree_spawn", "1",
         "--mca", "oob_tcp_if_include", "ctl0", "--mca", "pml", "ob1", "--mca", "btl", "tcp,self",
         "--mca", "btl_tcp_if_include", "data0",
         str(mpi), "merge", "--local_dir", str(tmp_path / "actor"),
         "--target_dir", str(target), "--threads", "1", "--peer-timeout", "3"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob("multi.tmp-*")) and launcher.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert launcher.poll() is None, "the merge ended before its link could be dropped: " + launcher.stdout.read()
    subprocess.run(["ip", "netns", "exec", "smn1", "ip", "link", "set", "data0", "down"], check=True)
    start = time.monotonic()
    out, _ = launcher.communicate(timeout=120)
    elapsed = time.monotonic() - start
    assert launcher.returncode != 0, out
    assert elapsed < 60, f"the job took {elapsed:.0f} s to fail"
    assert re.search(r"process rank (1 on host n1|0 on host n0) has not answered for \d+ s \(--peer-timeout\)", out), out
    assert leftovers(tmp_path, "multi") == [], out


def test_a_process_stopped_before_it_joins_ends_the_job_after_the_peer_timeout(mpi, shardmerge_gen_bin, tmp_path):
    spread_checkpoint(shardmerge_gen_bin, tmp_path, [[0, 2], [1, 3]], model="tiny")
    # Rank 1 stops before shardmerge starts: rank 0 would wait in MPI_Init for ever.
    stop = 'if [ "$OMPI_COMM_WORLD_RANK" = 1 ]; then kill -STOP $$; fi; exec CMD'
    start = time.monotonic()
    proc = mpirun(mpi, tmp_path, 2, ["--target_dir", tmp_path / "multi", "--peer-timeout", "3"],
                  wrap=lambda cmd: stop.replace("CMD", cmd), timeout=120)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out
    assert time.monotonic() - start < 60, out
    assert "MPI_Init did not finish in 3 s (--peer-timeout)" in out, out
    assert leftovers(tmp_path, "multi") == [], out
