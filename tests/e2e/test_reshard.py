"""`shardmerge reshard` with real torch as the consumer and the oracle.

A source role dir is written by real torch FSDP2 (fully_shard on a 1-D "fsdp" CPU/gloo mesh of W
ranks, AdamW + LR scheduler, saved the way verl's FSDPCheckpointManager.save_checkpoint saves).
`shardmerge reshard` rewrites it for W2 ranks; W2 fresh processes then load it exactly as
FSDPCheckpointManager.load_checkpoint does (torch.load(weights_only=False), model.load_state_dict,
optimizer.load_state_dict, scheduler.load_state_dict, rng) into a freshly fully_shard-ed model
and check against what the W source processes recorded with full_tensor():
  - every parameter and every optimizer state tensor, bit for bit;
  - one more AdamW step (same gradients) on W2 gives the weights the W run got. AdamW is
    elementwise and no gradient norm is clipped, so the result is expected to be identical;
    the assertion allows fp32 reduction-order noise (rtol 1e-6, atol 1e-7) and no more.
Also `merge` of the resharded dir must equal `merge` of the source byte for byte.
"""
import filecmp
import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

FIXTURES = Path(os.environ.get("SHARDMERGE_FIXTURES", ""))
BASE = FIXTURES / "hf_base" / "qwen2"
LR, BETAS, EPS, WD = 1e-3, (0.9, 0.999), 1e-8, 1e-2


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _grads(model, seed):
    """Deterministic full-size gradients per trainable parameter (same for every world size)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            out[name] = torch.randn(tuple(p.shape), generator=g, dtype=torch.float32).to(p.dtype)
    return out


def _build(mesh_shape, dtype, lora):
    """A tiny Qwen2 (fixtures' hf_base) fully_shard-ed on a 1-D "fsdp" mesh (or HSDP on a 2-D
    ("ddp", "fsdp") mesh), with AdamW + scheduler."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, get_constant_schedule_with_warmup

    torch.manual_seed(1234)
    model = AutoModelForCausalLM.from_pretrained(BASE, dtype=dtype)
    if lora:
        from peft import LoraConfig, TaskType, get_peft_model

        model = get_peft_model(model, LoraConfig(task_type=TaskType.CAUSAL_LM, r=4, lora_alpha=8, target_modules="all-linear"))
    names = ("fsdp",) if len(mesh_shape) == 1 else ("ddp", "fsdp")
    mesh = init_device_mesh("cpu", tuple(mesh_shape), mesh_dim_names=names)
    base = model.get_base_model() if lora else model
    for layer in base.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    sched = get_constant_schedule_with_warmup(opt, num_warmup_steps=0)
    return model, opt, sched, mesh


def _step(model, opt, sched, mesh, seed):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    grads = _grads(model, seed)
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.grad = distribute_tensor(grads[name], mesh, [Replicate()] * (mesh.ndim - 1) + [Shard(0)])
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t.clone()


def _snapshot(model, opt):
    """Parameters and optimizer state by parameter name, as full tensors (torch's own gather)."""
    names = {id(p): n for n, p in model.named_parameters()}
    params = {n: _full(p.detach()) for n, p in model.named_parameters()}
    state = {}
    for p, s in opt.state.items():
        state[names[id(p)]] = {k: _full(v) for k, v in s.items()}
    return params, state


def _end_worker():
    """Ends a worker whose work is done at once, skipping interpreter teardown: there, torch's
    static destructors intermittently abort ("terminate called without an active exception",
    seen once in about 20 runs on a clean clone), which mp.spawn reports as SIGABRT although the
    worker had finished. A worker that raised never gets here: its exception still fails the
    test."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _source_worker(rank, world, port, mesh_shape, role, oracle, dtype, lora):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, opt, sched, mesh = _build(mesh_shape, dtype, lora)
        _step(model, opt, sched, mesh, seed=1)
        torch.manual_seed(100 + rank)  # per-rank RNG state, as training leaves it
        # verl FSDPCheckpointManager.save_checkpoint (FSDP2: plain state_dict() of DTensors)
        torch.save(model.state_dict(), role / f"model_world_size_{world}_rank_{rank}.pt")
        torch.save(opt.state_dict(), role / f"optim_world_size_{world}_rank_{rank}.pt")
        rng = {"cpu": torch.get_rng_state()}
        torch.save({"lr_scheduler": sched.state_dict(), "rng": rng}, role / f"extra_state_world_size_{world}_rank_{rank}.pt")
        before, sched_before = _snapshot(model, opt), sched.state_dict()
        _step(model, opt, sched, mesh, seed=2)
        after, _ = _snapshot(model, opt)
        if rank == 0:
            torch.save({"before": before, "after": after, "sched": sched_before, "world": world}, oracle)
            (role / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": world}))
            if lora:  # verl's _save_lora_train_meta
                (role / "lora_train_meta.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "task_type": "CAUSAL_LM"}))
            hf = role / "huggingface"
            hf.mkdir()
            for f in BASE.iterdir():
                if f.suffix != ".safetensors":
                    shutil.copy(f, hf / f.name)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _end_worker()


def _target_worker(rank, world, port, mesh_shape, role, oracle, dtype, lora, errors):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        model, opt, sched, mesh = _build(mesh_shape, dtype, lora)
        # verl FSDPCheckpointManager.load_checkpoint
        model_sd = torch.load(role / f"model_world_size_{world}_rank_{rank}.pt", weights_only=False)
        # Local storages padded as fully_shard pads its own (compared before loading changes nothing).
        own = model.state_dict()
        padding = [k for k, v in model_sd.items()
                   if v._local_tensor.untyped_storage().nbytes() != own[k]._local_tensor.untyped_storage().nbytes()]
        model.load_state_dict(model_sd)
        opt.load_state_dict(torch.load(role / f"optim_world_size_{world}_rank_{rank}.pt", weights_only=False))
        extra = torch.load(role / f"extra_state_world_size_{world}_rank_{rank}.pt", weights_only=False)
        sched.load_state_dict(extra["lr_scheduler"])
        torch.set_rng_state(extra["rng"]["cpu"])
        want = torch.load(oracle, weights_only=False)
        params, state = _snapshot(model, opt)
        problems = [f"local storage of {k} is not padded as fully_shard pads it" for k in padding]
        # The documented RNG rule: rank R takes source rank R mod W's state.
        rng = torch.get_rng_state()
        torch.manual_seed(100 + rank % want["world"])
        if not torch.equal(rng, torch.get_rng_state()):
            problems.append(f"RNG state is not source rank {rank % want['world']}'s")
        for n, t in want["before"][0].items():
            if t.dtype != params[n].dtype or not torch.equal(t, params[n]):
                problems.append(f"parameter {n} differs")
        if set(state) != set(want["before"][1]):
            problems.append(f"optimizer state covers {sorted(state)} not {sorted(want['before'][1])}")
        for n, s in want["before"][1].items():
            for k, t in s.items():
                got = state.get(n, {}).get(k)
                if got is None or got.dtype != t.dtype or not torch.equal(got, t):
                    problems.append(f"optimizer state {n}.{k} differs")
        if sched.state_dict() != want["sched"]:
            problems.append("scheduler state differs")
        _step(model, opt, sched, mesh, seed=2)
        after, _ = _snapshot(model, opt)
        for n, t in want["after"].items():
            if not torch.allclose(after[n].float(), t.float(), rtol=1e-6, atol=1e-7):
                problems.append(f"after one step, parameter {n} differs by {(after[n].float() - t.float()).abs().max()}")
        errors.put((rank, problems))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    _end_worker()


def _spawn(fn, mesh_shape, *args):
    import math

    import torch.multiprocessing as mp

    world = math.prod(mesh_shape)
    mp.spawn(fn, args=(world, _free_port(), tuple(mesh_shape), *args), nprocs=world, join=True)


@pytest.fixture(scope="module")
def reshard_available(shardmerge_bin):
    if not BASE.is_dir():
        pytest.skip("fixtures' hf_base/qwen2 is absent (SHARDMERGE_FIXTURES)")
    subcommands = subprocess.run([shardmerge_bin, "--help"], capture_output=True, text=True).stdout
    if not any(line.split()[:1] == ["reshard"] for line in subcommands.splitlines()):
        pytest.skip("this shardmerge has no `reshard` subcommand yet")
    return shardmerge_bin


# (source mesh, target mesh, dtype, LoRA); a 2-D mesh is HSDP (ddp, fsdp).
CASES = [
    pytest.param((4,), (2,), torch.float32, False, id="4to2"),
    pytest.param((2,), (4,), torch.float32, False, id="2to4"),
    pytest.param((8,), (3,), torch.float32, False, id="8to3", marks=pytest.mark.slow),  # 11 processes
    pytest.param((2,), (3,), torch.bfloat16, False, id="bf16_2to3"),
    pytest.param((4,), (2,), torch.float32, True, id="lora_4to2"),
    pytest.param((2, 2), (4,), torch.float32, False, id="hsdp2x2to4"),
    pytest.param((4,), (2, 2), torch.float32, False, id="4tohsdp2x2"),
]


@pytest.mark.parametrize("mesh, mesh2, dtype, lora", CASES)
def test_reshard_loads_in_torch(reshard_available, tmp_path, mesh, mesh2, dtype, lora):
    import torch.multiprocessing as mp

    src = tmp_path / "src" / "global_step_1" / "actor"
    src.mkdir(parents=True)
    oracle = tmp_path / "oracle.pt"
    _spawn(_source_worker, mesh, src, oracle, dtype, lora)
    before = sorted(p.name for p in src.rglob("*"))

    out = tmp_path / "out"
    w2 = mesh2[0] * (mesh2[1] if len(mesh2) == 2 else 1)
    args = ["--mesh", f"ddp={mesh2[0]},fsdp={mesh2[1]}"] if len(mesh2) == 2 else []
    r = subprocess.run([reshard_available, "reshard", "--local_dir", str(src), "--world_size", str(w2), "--target_dir", str(out),
                        *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert sorted(p.name for p in src.rglob("*")) == before, "the source was modified"
    assert json.loads((out / "fsdp_config.json").read_text())["world_size"] == w2
    assert (out / "huggingface" / "config.json").exists()

    errors = mp.get_context("spawn").SimpleQueue()
    _spawn(_target_worker, mesh2, out, oracle, dtype, lora, errors)
    for _ in range(w2):
        rank, problems = errors.get()
        assert problems == [], f"rank {rank}: {problems[:5]}"

    # merge of the resharded checkpoint equals merge of the original, byte for byte
    merged = {}
    for name, d in (("src", src), ("out", out)):
        merged[name] = tmp_path / f"merged_{name}"
        r = subprocess.run([reshard_available, "merge", "--local_dir", str(d), "--target_dir", str(merged[name])],
                           capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    files = sorted(p.relative_to(merged["src"]) for p in merged["src"].rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(merged["out"]) for p in merged["out"].rglob("*") if p.is_file())
    for f in files:
        assert filecmp.cmp(merged["src"] / f, merged["out"] / f, shallow=False), f"merged {f} differs"


def _role(name):
    role = FIXTURES / name / "global_step_3" / "actor"
    if not role.is_dir():
        pytest.skip(f"fixture {name} is absent")
    return role


def _reshard(bin_, src, world, out, *extra):
    return subprocess.run([bin_, "reshard", "--local_dir", str(src), "--world_size", str(world), "--target_dir", str(out), *extra],
                          capture_output=True, text=True)


def _merged_equal(bin_, a, b, tmp_path, *extra):
    outs = []
    for i, d in enumerate((a, b)):
        outs.append(tmp_path / f"merged_{i}")
        r = subprocess.run([bin_, "merge", "--local_dir", str(d), "--target_dir", str(outs[-1]), *extra], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    files = sorted(p.relative_to(outs[0]) for p in outs[0].rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(outs[1]) for p in outs[1].rglob("*") if p.is_file())
    for f in files:
        assert filecmp.cmp(outs[0] / f, outs[1] / f, shallow=False), f"merged {f} differs"


# The fixtures were written by real torch FSDP2 (tests/fixtures/fx_fsdp.py), with optimizer and extra state.
@pytest.mark.parametrize("name, world, extra", [
    ("qwen2_fsdp2_w4", 2, []),
    ("qwen2_fsdp2_w4", 3, []),
    ("qwen2_bf16_fsdp2_w2", 4, []),
    ("qwen2_fsdp2_buffers_w2", 3, []),
    ("qwen2_hsdp_2x2", 3, []),
    ("qwen2_fsdp2_w2", 4, ["--mesh", "ddp=2,fsdp=2"]),
    ("qwen2_lora_fsdp2_w2", 3, []),
])
def test_reshard_fixture_merges_the_same(reshard_available, tmp_path, name, world, extra):
    src = _role(name)
    out = tmp_path / "out"
    r = _reshard(reshard_available, src, world, out, *extra)
    assert r.returncode == 0, r.stderr
    names = {p.name for p in out.iterdir()}
    for prefix in ("model", "optim", "extra_state"):
        assert {f"{prefix}_world_size_{world}_rank_{k}.pt" for k in range(world)} <= names
    assert not any(f"_world_size_{world}_" not in n for n in names if n.endswith(".pt")), names
    for f in src.rglob("*"):  # everything but the rank files and fsdp_config.json is copied as it is
        rel = f.relative_to(src)
        if f.is_file() and not f.name.endswith(".pt") and f.name != "fsdp_config.json":
            assert filecmp.cmp(f, out / rel, shallow=False), rel
    _merged_equal(reshard_available, src, out, tmp_path, *(["--lora", "adapter"] if "lora" in name else []))


@pytest.mark.parametrize("name, message", [
    ("qwen2_fsdp1_w2", "plain tensor, not a DTensor"),
    ("qwen2_fsdp1_sharded_tensor_w2", "ShardedTensor"),
    ("qwen2_fsdp2_tp_2x2", "model parallelism"),
    ("llama_fsdp2_shard1_w4", "only dim-0 sharding"),
])
def test_reshard_refuses_unknown_layouts(reshard_available, tmp_path, name, message):
    r = _reshard(reshard_available, _role(name), 2, tmp_path / "out")
    assert r.returncode == 1, r.stderr
    assert message in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert ".pt" in r.stderr, "the error names the file"
    assert not (tmp_path / "out").exists()


def test_reshard_refuses_truncated_optimizer_file(reshard_available, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(_role("qwen2_fsdp2_w2"), src)
    optim = src / "optim_world_size_2_rank_1.pt"
    optim.write_bytes(optim.read_bytes()[:-4096])
    r = _reshard(reshard_available, src, 3, tmp_path / "out")
    assert r.returncode == 1 and "optim_world_size_2_rank_1.pt" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["src"]


def test_reshard_refuses_flipped_storage_byte(reshard_available, tmp_path):
    """A byte of a storage record changed: the zip CRC-32 catches it while the bytes stream."""
    src = tmp_path / "src"
    shutil.copytree(_role("qwen2_fsdp2_w2"), src)
    model = src / "model_world_size_2_rank_0.pt"
    data = bytearray(model.read_bytes())
    import zipfile

    with zipfile.ZipFile(model) as z:
        info = z.getinfo("model_world_size_2_rank_0/data/0")
    h = info.header_offset  # the local header's name and extra lengths give where the data starts
    start = h + 30 + int.from_bytes(data[h + 26:h + 28], "little") + int.from_bytes(data[h + 28:h + 30], "little")
    data[start + 8] ^= 0x40
    model.write_bytes(bytes(data))
    r = _reshard(reshard_available, src, 3, tmp_path / "out")
    assert r.returncode == 1 and "CRC" in r.stderr and "model_world_size_2_rank_0.pt" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_reshard_refuses_missing_rank(reshard_available, tmp_path):
    src = tmp_path / "src"
    shutil.copytree(_role("qwen2_fsdp2_w2"), src)
    (src / "model_world_size_2_rank_1.pt").unlink()
    r = _reshard(reshard_available, src, 3, tmp_path / "out")
    assert r.returncode == 1 and "model_world_size_2_rank_1.pt" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()


def test_reshard_synthetic_optimizer_state(reshard_available, shardmerge_gen_bin, tmp_path):
    """shardmerge-gen --optimizer (the benchmark's input) read back by torch.load, before and after
    a 4 -> 3 reshard: every DTensor's rows, in rank order, are the same; param_groups and steps too."""
    r = subprocess.run([shardmerge_gen_bin, "--model", "tiny", "--world-size", "4", "--optimizer", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    src = tmp_path / "run" / "global_step_1" / "actor"
    r = _reshard(reshard_available, src, 3, tmp_path / "out")
    assert r.returncode == 0, r.stderr

    def load(d, kind, w):
        sds = [torch.load(d / f"{kind}_world_size_{w}_rank_{k}.pt", weights_only=False) for k in range(w)]
        if kind == "optim":
            return [{f"{i}.{n}": v for i, s in sd["state"].items() for n, v in s.items()} for sd in sds], sds[0]["param_groups"]
        return sds, None

    for kind in ("model", "optim"):
        a, groups_a = load(src, kind, 4)
        b, groups_b = load(tmp_path / "out", kind, 3)
        assert groups_a == groups_b
        assert set(a[0]) == set(b[0]) and a[0]
        for k in a[0]:
            if hasattr(a[0][k], "to_local"):
                assert b[0][k].device_mesh.shape == (3,) and b[0][k].placements == a[0][k].placements
                assert torch.equal(torch.cat([x[k].to_local() for x in a]), torch.cat([x[k].to_local() for x in b])), k
            else:
                assert all(torch.equal(x[k], a[0][k]) for x in b), k


def test_reshard_stays_within_its_memory_limit(reshard_available, shardmerge_gen_bin, tmp_path):
    """A checkpoint with optimizer state reshards within a 64 MiB limit (peak RSS measured here, by
    wait4); a limit below what it needs is refused, in one line, before anything is written."""
    r = subprocess.run([shardmerge_gen_bin, "--model", "tiny", "--world-size", "4", "--optimizer", "--out", str(tmp_path / "run")],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    src = tmp_path / "run" / "global_step_1" / "actor"
    # Measured by a small Python parent (its children's peak RSS): a child forked from this
    # pytest, torch loaded, would start with this process's RSS as its high-water mark.
    measure = ("import resource, subprocess, sys; rc = subprocess.run(sys.argv[1:]).returncode; "
               "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", measure, reshard_available, "reshard", "--local_dir", str(src), "--world_size",
                        "3", "--target_dir", str(tmp_path / "out"), "--memory-limit", "64MiB"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout.split()[-1]) * 1024 <= 64 << 20, r.stdout

    r = _reshard(reshard_available, src, 3, tmp_path / "out2", "--memory-limit", "1MiB")
    assert r.returncode == 1 and "--memory-limit is 1.05 MB" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "out2").exists()
