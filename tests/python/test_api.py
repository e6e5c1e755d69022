"""shardmerge's Python API (inspect, plan, merge, merge_plan, fold_lora, verify) from the installed
wheel: run by scripts/test_wheel.sh in a fresh venv, never against the build tree. Merged tensors
are compared with verl's own merger's output on the same checkpoint (the fixtures' verl_ref,
written by tests/fixtures/generate.py), folded ones with PEFT's merge_and_unload() (merged_ref_bf16),
read with the safetensors format's spec; the CLI's --json output of the same operation is compared
only to show the two entry points agree."""
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from safetensors_dir import read_safetensors_dir

shardmerge = pytest.importorskip("shardmerge")

FIXTURES = Path(os.environ.get("SHARDMERGE_FIXTURES", "/nonexistent"))
# shardmerge-gen (the synthetic checkpoint generator of the dev build, bench/): the interrupt and
# progress tests need a checkpoint large enough to take seconds to merge.
GEN = os.environ.get("SHARDMERGE_GEN", "")


def fixture(name):
    d = FIXTURES / name
    if not (d / "verl_ref").is_dir():
        pytest.skip(f"fixture {d} absent (set SHARDMERGE_FIXTURES)")
    return d


def role_dir(name):
    return fixture(name) / "global_step_3" / "actor"


def cli_json(*args, exit_code=0):
    r = subprocess.run([str(shardmerge.binary()), *map(str, args), "--json"], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == exit_code, r.stderr
    return json.loads(r.stdout)


def assert_nothing_left(parent):
    """A failed merge into `parent`/model, where `parent` did not exist: the merge created it and
    must have removed it again, with the temp dir and the lock file it held."""
    assert not Path(parent).exists(), sorted(p.name for p in Path(parent).iterdir())


def test_stubs_ship_and_match_the_functions():
    # The type stubs in the installed package: the same parameters, kinds and defaults as the
    # functions themselves, and Error's attributes.
    import ast
    import inspect as pyinspect
    stub = Path(shardmerge.__file__).with_name("__init__.pyi")
    assert stub.is_file() and (stub.parent / "py.typed").is_file()
    tree = ast.parse(stub.read_text())
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    for name in ["inspect", "plan", "merge", "verify"]:
        a = funcs[name].args
        stub_params = [(x.arg, "pos") for x in a.args] + [(x.arg, "kw") for x in a.kwonlyargs]
        stub_defaults = [ast.literal_eval(d) for d in a.defaults] + \
                        [ast.literal_eval(d) for d in a.kw_defaults if d is not None]
        sig = pyinspect.signature(getattr(shardmerge, name)).parameters.values()
        real = [(p.name, "kw" if p.kind is p.KEYWORD_ONLY else "pos") for p in sig]
        assert stub_params == real, name
        assert stub_defaults == [p.default for p in sig if p.default is not p.empty], name
    error = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Error")
    assert {n.target.id for n in error.body if isinstance(n, ast.AnnAssign)} == {"message", "file", "tensor", "offset"}
    assert issubclass(shardmerge.Error, RuntimeError)


# --- inspect ---------------------------------------------------------------------------------

def test_inspect_reports_the_checkpoint():
    fx = fixture("qwen2_fsdp2_w2")
    layout = json.loads((fx / "layout.json").read_text())  # written by the fixture generator from torch
    report = shardmerge.inspect(fx / "global_step_3" / "actor", tensors=True)
    assert report["kind"] == "verl FSDP role directory"
    assert report["world_size"] == 2
    got = {t["name"]: t["shape"] for t in report["tensor_list"]}
    assert got == {name: v["global_shape"] for name, v in layout.items()}
    # The same report as `shardmerge inspect --json --tensors`.
    assert report == cli_json("inspect", fx / "global_step_3" / "actor", "--tensors")


def test_inspect_unknown_directory_says_so(tmp_path):
    report = shardmerge.inspect(tmp_path)
    assert report["kind"] == "unknown"
    assert report["warnings"]


# --- plan ------------------------------------------------------------------------------------

def test_plan_lists_verls_tensors(tmp_path):
    ref = read_safetensors_dir(fixture("qwen2_fsdp2_w2") / "verl_ref")
    p = shardmerge.plan(role_dir("qwen2_fsdp2_w2"), backend="fsdp", out=tmp_path / "plan.json")
    planned = {t["name"]: t for t in p["tensors"]}
    assert planned.keys() == ref.keys()
    st_dtype = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}
    for name, (dtype, shape, data) in ref.items():
        assert planned[name]["shape"] == shape, name
        assert st_dtype[planned[name]["dtype"]] == dtype, name
        assert planned[name]["nbytes"] == len(data), name
    # The plan file written is the plan returned, and `merge --plan` and merge_plan() run it.
    assert json.loads((tmp_path / "plan.json").read_text()) == p
    out = tmp_path / "out"
    cli_json("merge", "--plan", tmp_path / "plan.json", "--target_dir", out)
    assert read_safetensors_dir(out) == ref
    calls = []
    summary = shardmerge.merge_plan(tmp_path / "plan.json", tmp_path / "api", progress=lambda d, t: calls.append((d, t)))
    assert read_safetensors_dir(tmp_path / "api") == ref
    assert summary["tensors"] == len(ref) and calls and calls[-1][0] == calls[-1][1]


def test_merge_plan_refuses_a_changed_source(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(fixture("qwen2_fsdp2_w2"), src)
    role = src / "global_step_3" / "actor"
    shardmerge.plan(role, out=tmp_path / "plan.json")
    rank1 = role / "model_world_size_2_rank_1.pt"
    rank1.write_bytes(rank1.read_bytes())  # same bytes, a new mtime: not the file the plan describes
    os.utime(rank1, ns=(1, 1))
    with pytest.raises(shardmerge.Error) as e:
        shardmerge.merge_plan(tmp_path / "plan.json", tmp_path / "out")
    assert e.value.file == str(rank1)
    assert not (tmp_path / "out").exists()


# --- fold_lora -------------------------------------------------------------------------------

def _bf16_ulps(a, b):
    """Largest distance in bf16 units in the last place between two equal-length bf16 buffers."""
    def ordered(h):  # sign-magnitude bit patterns to integers that sort like the values
        return 0x8000 - (h & 0x7FFF) if h & 0x8000 else 0x8000 + h
    xs, ys = struct.unpack(f"<{len(a) // 2}H", a), struct.unpack(f"<{len(b) // 2}H", b)
    return max((abs(ordered(x) - ordered(y)) for x, y in zip(xs, ys)), default=0)


def test_fold_lora_matches_peft(tmp_path):
    """A PEFT adapter folded into its base, against PEFT's own merge_and_unload() of the same
    adapter (the fixture's merged_ref_bf16, written by peft): every tensor within 1 bf16 ulp."""
    fx = FIXTURES / "peft" / "peft_qwen2_all_linear_r8"
    if not (fx / "merged_ref_bf16.safetensors").is_file():
        pytest.skip(f"fixture {fx} absent (set SHARDMERGE_FIXTURES)")
    summary = shardmerge.fold_lora(FIXTURES / "hf_base" / "qwen2", fx / "adapter", tmp_path / "out", dtype="bf16")
    got = read_safetensors_dir(tmp_path / "out")
    ref = read_safetensors_dir(fx / "merged_ref_bf16.safetensors")
    assert got.keys() == ref.keys()
    for name, (dtype, shape, data) in ref.items():
        assert got[name][:2] == (dtype, shape), name
        assert _bf16_ulps(got[name][2], data) <= 1, name
    assert summary["lora_folds"] > 0
    with pytest.raises(ValueError):
        shardmerge.fold_lora(FIXTURES / "hf_base" / "qwen2", fx / "adapter", tmp_path / "out2", dtype="int8")
    assert not (tmp_path / "out2").exists()



# --- merge -----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2_fsdp2_w2", "llama_fsdp2_w4", "qwen2_fsdp1_w2", "qwen2_lora_fsdp2_w2"])
def test_merge_equals_verls_output(name, tmp_path):
    ref = read_safetensors_dir(fixture(name) / "verl_ref")
    # verl writes LoRA checkpoints unfolded, with the adapter beside: shardmerge's `adapter` mode.
    lora = "adapter" if "lora" in name else "fold"
    out = tmp_path / "out"
    summary = shardmerge.merge(role_dir(name), out, backend="fsdp", lora=lora, threads=2)
    assert read_safetensors_dir(out) == ref
    adapter = fixture(name) / "verl_ref" / "lora_adapter"
    if adapter.is_dir():
        assert read_safetensors_dir(out / "lora_adapter") == read_safetensors_dir(adapter)
    files = list(out.rglob("*.safetensors"))
    assert summary["tensors"] == sum(len(read_safetensors_dir(f.parent)) for f in files)
    assert summary["files"] == len(files)
    assert summary["bytes_written"] == sum(f.stat().st_size for f in files)
    assert summary["target"] == str(out)


def test_merge_same_tree_as_cli(tmp_path):
    local = role_dir("qwen2_lora_fsdp2_w2")
    api = shardmerge.merge(local, tmp_path / "api", dtype="fp32", verify=True)
    cli = cli_json("merge", "--local_dir", local, "--target_dir", tmp_path / "cli", "--dtype", "fp32", "--verify")
    files = sorted(p.relative_to(tmp_path / "api") for p in (tmp_path / "api").rglob("*"))
    assert files == sorted(p.relative_to(tmp_path / "cli") for p in (tmp_path / "cli").rglob("*"))
    for f in files:
        if (tmp_path / "api" / f).is_file():
            assert (tmp_path / "api" / f).read_bytes() == (tmp_path / "cli" / f).read_bytes(), f
    assert api["verified"] is True
    # Timing-dependent: how many reads overlap depends on thread scheduling.
    volatile = {"target", "seconds", "plan_seconds", "gb_per_s", "peak_rss_bytes", "peak_read_bytes_in_flight",
                "cpu_seconds"}
    assert {k: v for k, v in api.items() if k not in volatile} == {k: v for k, v in cli.items() if k not in volatile}


def test_merge_ignores_launcher_variables_unless_distributed(tmp_path, monkeypatch):
    # A training job's process (torchrun sets these) merging alone must not wait for peers.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    summary = shardmerge.merge(role_dir("qwen2_fsdp2_w2"), tmp_path / "out")
    assert "processes" not in summary
    assert read_safetensors_dir(tmp_path / "out") == read_safetensors_dir(fixture("qwen2_fsdp2_w2") / "verl_ref")


DISTRIBUTED = textwrap.dedent("""
    import json, sys, shardmerge
    print(json.dumps(shardmerge.merge(sys.argv[1], sys.argv[2], backend="fsdp", distributed=True)))
    """)


def test_distributed_merge_shares_the_work(tmp_path):
    fx = fixture("llama_fsdp2_w4")
    with socket.socket() as s:  # a free port for the processes' rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "SHARDMERGE_PORT": str(port)}
    procs = [subprocess.Popen([sys.executable, "-c", DISTRIBUTED, str(fx / "global_step_3" / "actor"),
                               str(tmp_path / "out")], env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(2)]
    results = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err for _, err in results]
    root, other = (json.loads(out) for out, _ in results)
    assert root["processes"] == 2 and other is None
    assert read_safetensors_dir(tmp_path / "out") == read_safetensors_dir(fx / "verl_ref")


TWICE = textwrap.dedent("""
    import json, sys, shardmerge
    for out in sys.argv[2:]:  # MPI is initialised once per process: a second merge must work too
        summary = shardmerge.merge(sys.argv[1], out, backend="fsdp", distributed=True)
        # Only rank 0 has one (the others get None) and prints: mpirun interleaves the processes'
        # output, and another process's line could land inside rank 0's.
        if summary is not None:
            print(json.dumps(summary), flush=True)
    """)


def test_distributed_merge_under_mpirun_with_node_local_rank_files_twice(tmp_path):
    if not shutil.which("mpirun"):
        pytest.skip("mpirun not found (openmpi-bin)")
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs none /mnt && umount /mnt"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("unshare -m with a mount is not permitted here (needs CAP_SYS_ADMIN)")
    fx = fixture("llama_fsdp2_w4")
    role = fx / "global_step_3" / "actor"
    # Two "nodes": ranks 0, 2 and the sidecars on node 0, ranks 1, 3 on node 1, at one path.
    for f in sorted(p for p in role.rglob("*") if p.is_file()):
        rel = f.relative_to(role)
        rank = rel.name.rsplit("_rank_", 1)[1].split(".")[0] if "_rank_" in rel.name else "0"
        dest = tmp_path / f"node{int(rank) % 2}" / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(f, dest)
    (tmp_path / "node1").mkdir(exist_ok=True)
    (tmp_path / "actor").mkdir()
    script = tmp_path / "twice.py"
    script.write_text(TWICE)
    run = (f'mount --bind "{tmp_path}/node$OMPI_COMM_WORLD_RANK" "{tmp_path}/actor" && '
           f'exec "{sys.executable}" "{script}" "{tmp_path}/actor" "{tmp_path}/out1" "{tmp_path}/out2"')
    env = {**os.environ, "OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        env.pop(k, None)
    proc = subprocess.run(["mpirun", "--oversubscribe", "--bind-to", "none", "-np", "2", "unshare", "-m", "sh", "-c", run],
                          capture_output=True, text=True, env=env, timeout=300)
    out = proc.stdout + proc.stderr
    if proc.returncode != 0 and "moves no bytes between processes" in out:
        pytest.skip("this wheel was built without MPI (libopenmpi-dev): no data plane")
    assert proc.returncode == 0, out
    summaries = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(summaries) == 2, out  # rank 0's two summaries
    for s in summaries:
        assert s["transport"] == "MPI" and s["node_local_sources"] and s["bytes_sent_between_processes"] > 0, s
    for target in ("out1", "out2"):
        assert read_safetensors_dir(tmp_path / target) == read_safetensors_dir(fx / "verl_ref")


def test_merge_progress_on_a_small_merge(tmp_path):
    calls = []
    summary = shardmerge.merge(role_dir("qwen2_fsdp2_w2"), tmp_path / "out", progress=lambda d, t: calls.append((d, t)))
    # Too fast to be seen running: the one call at the end, with every tensor byte written.
    tensor_bytes = sum(len(b) for _, _, b in read_safetensors_dir(tmp_path / "out").values())
    assert calls and calls[-1] == (tensor_bytes, tensor_bytes)
    assert summary["tensors"] > 0


# --- verify ----------------------------------------------------------------------------------

def test_verify_accepts_verls_output_and_names_a_changed_tensor(tmp_path):
    fx = fixture("qwen2_fsdp2_w2")
    ok = shardmerge.verify(fx / "global_step_3" / "actor", fx / "verl_ref")
    assert ok["equal"] is True and ok["tensors"]
    bad = tmp_path / "bad"
    shutil.copytree(fx / "verl_ref", bad)
    st = bad / "model.safetensors"
    blob = bytearray(st.read_bytes())
    n = struct.unpack("<Q", blob[:8])[0]
    header = json.loads(blob[8:8 + n])
    name = "model.norm.weight"
    begin = 8 + n + header[name]["data_offsets"][0]
    blob[begin] ^= 0x40
    st.write_bytes(bytes(blob))
    result = shardmerge.verify(fx / "global_step_3" / "actor", bad)
    assert result["equal"] is False
    assert [k for k, v in result["tensors"].items() if v["mismatched"]] == [name]
    assert result == cli_json("verify", "--local_dir", fx / "global_step_3" / "actor", "--test_hf_dir", bad,
                              exit_code=1)


# --- errors ----------------------------------------------------------------------------------

def corrupt_copy(tmp_path, name="qwen2_fsdp2_w2"):
    """A copy of the fixture's role dir with one byte of rank 1's tensor data flipped: the zip
    record's CRC-32 no longer matches."""
    dst = tmp_path / "ckpt" / "actor"
    shutil.copytree(role_dir(name), dst)
    rank = dst / "model_world_size_2_rank_1.pt"
    blob = bytearray(rank.read_bytes())
    blob[len(blob) // 2] ^= 0xFF  # tensor data: the embedding and lm_head fill most of the file
    rank.write_bytes(bytes(blob))
    return dst, rank


def test_corrupt_rank_file_raises_error_with_file_and_tensor(tmp_path):
    local, rank = corrupt_copy(tmp_path)
    with pytest.raises(shardmerge.Error) as info:
        shardmerge.merge(local, tmp_path / "out" / "model")
    e = info.value
    assert isinstance(e, RuntimeError)
    assert e.file == str(rank)
    assert e.tensor
    assert e.file in str(e) and e.message in str(e)
    assert_nothing_left(tmp_path / "out")
    # The CLI says the same of the same file (exit 1, bad data).
    r = subprocess.run([str(shardmerge.binary()), "merge", "--local_dir", str(local), "--target_dir",
                        str(tmp_path / "cli")], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and str(e) in r.stderr


def test_corrupt_safetensors_raises_error_with_file(tmp_path):
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(b"\xff" * 100)  # header length far past the end of the file
    with pytest.raises(shardmerge.Error) as info:
        shardmerge.inspect(bad)
    assert info.value.file == str(bad)
    assert info.value.tensor is None


@pytest.mark.parametrize("kwargs", [{"dtype": "fp64"}, {"backend": "deepspeed"}, {"lora": "merge"},
                                    {"memory_limit": "lots"}, {"max_shard_size": "0"}, {"threads": -1},
                                    {"device": "tpu"}, {"lora_alpha": -1.0}, {"transport": "gloo"},
                                    {"peer_timeout": 0}, {"peer_timeout": -5.0}])
def test_bad_option_raises_value_error(kwargs, tmp_path):
    with pytest.raises(ValueError):
        shardmerge.merge(role_dir("qwen2_fsdp2_w2"), tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


def test_usage_errors_raise_value_error(tmp_path):
    local = role_dir("qwen2_fsdp2_w2")
    with pytest.raises(ValueError):
        shardmerge.plan(tmp_path / "does-not-exist")
    with pytest.raises(ValueError, match="not empty"):
        (tmp_path / "full").mkdir()
        (tmp_path / "full" / "x").write_text("x")
        shardmerge.merge(local, tmp_path / "full")
    with pytest.raises(ValueError):
        shardmerge.verify(local, tmp_path / "no-such-dir")
    with pytest.raises(TypeError):
        shardmerge.merge(local, tmp_path / "out", verify="yes")


# --- a merge that takes seconds: progress rate, a failing callback, Ctrl-C ----------------------

@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    """A synthetic 1.1 GB bf16 checkpoint (qwen2.5-0.5b shapes, one rank file) with rank-128 LoRA
    on every linear layer: folding it takes seconds of arithmetic on one thread."""
    if not GEN or not Path(GEN).is_file():
        pytest.skip("SHARDMERGE_GEN (bench/shardmerge-gen of a dev build) is not set")
    root = tmp_path_factory.mktemp("big")
    subprocess.run([GEN, "--model", "qwen2.5-0.5b", "--world-size", "1", "--dtype", "bfloat16", "--lora-rank", "128",
                    "--out", str(root / "run")], check=True, capture_output=True, timeout=600)
    yield root / "run" / "global_step_1" / "actor"
    shutil.rmtree(root)  # pytest keeps its last temp dirs: not 1.1 GB of them


# Folded and written as fp32 (twice the bytes) by one thread: a merge of several seconds (10 s on
# the 2-core test machine), so an interrupt that did not stop it would be seen.
SLOW = dict(dtype="fp32", threads=1)


def test_progress_rate_and_failing_callback(big_checkpoint, tmp_path):
    calls = []

    def progress(done, total):
        calls.append((time.monotonic(), done, total))
        if len(calls) == 4:
            raise LookupError("stop here")

    with pytest.raises(LookupError, match="stop here"):
        shardmerge.merge(big_checkpoint, tmp_path / "out" / "model", progress=progress, **SLOW)
    assert len(calls) == 4
    times = [t for t, _, _ in calls]
    assert all(b - a >= 0.09 for a, b in zip(times, times[1:])), times  # at most ~10 calls a second
    totals = {t for _, _, t in calls}
    assert len(totals) == 1 and totals.pop() > 0
    dones = [d for _, d, _ in calls]
    assert dones == sorted(dones) and dones[-1] < calls[-1][2]
    # The exception stopped the merge: nothing at the target, no temp dir, no lock file.
    assert_nothing_left(tmp_path / "out")


INTERRUPTED = textwrap.dedent("""
    import signal, sys, time, shardmerge
    # Ctrl-C raises KeyboardInterrupt even where the test runs as a background job (which a
    # non-interactive shell starts with SIGINT ignored, and Python then keeps it ignored).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    local, target = sys.argv[1], sys.argv[2]
    def progress(done, total):
        if done:
            print("merging", flush=True)
    try:
        shardmerge.merge(local, target, progress=progress, dtype="fp32", threads=1)
    except KeyboardInterrupt:
        print("interrupted", flush=True)
        sys.exit(0)
    print("finished", flush=True)
    """)


def test_ctrl_c_raises_keyboard_interrupt_and_leaves_nothing(big_checkpoint, tmp_path):
    target = tmp_path / "out" / "model"
    child = subprocess.Popen([sys.executable, "-c", INTERRUPTED, str(big_checkpoint), str(target)],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "merging"  # the merge is writing tensors
        sent = time.monotonic()
        child.send_signal(signal.SIGINT)
        line = child.stdout.readline().strip()
        while line == "merging":
            line = child.stdout.readline().strip()
        elapsed = time.monotonic() - sent
        assert child.wait(timeout=60) == 0, child.stderr.read()
    finally:
        child.kill()
    assert line == "interrupted"
    assert elapsed < 2.0
    assert not target.exists()
    assert_nothing_left(tmp_path / "out")
