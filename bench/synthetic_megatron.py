#!/usr/bin/env python3
"""synthetic_megatron: a synthetic verl Megatron v2 checkpoint of a real model shape.

Writes RUN_ROOT/global_step_<step>/actor/ as verl 0.9.1's MegatronCheckpointManager lays it out
with dist checkpointing on (research doc verl-megatron.md §1.5, tests/fixtures/README.md §10):

  ckpt_contents.json           manifest (schema 2), contents.model = megatron_dist_checkpoint
  transformer_config.json      minimal TransformerConfig dump (parallel sizes and model shape)
  model/dist_ckpt/             megatron-core 0.16.1 torch_dist tree (PyTorch DCP):
                               metadata.json, common.pt, .metadata, __<rank>_<i>.distcp
  model/huggingface/           config.json (+ tokenizer files with --tokenizer-from)

The dist tree is what megatron-core's TorchDistSaveShardedStrategy writes for a GPTModel with
TP x PP ranks (DP = 1, global rank = pp * TP + tp) and layer-stacked keys (research §3):
every layer of every TP rank is one chunk with a leading singleton layer dim; linear_qkv and
linear_fc1 split on rows, linear_proj and linear_fc2 on columns, SwiGLU fc1 as two chunks per
TP rank (gate fragment r, up fragment TP + r); replicated layer norms, final norm and the
`_extra_state` bytes items ([None], local spec) written by TP rank 0 of the owning stage; the
embedding by the first stage, the untied output layer by the last. Each rank's items are split
into two files by megatron-core's `_split_by_size_and_type` (bytes round-robin, tensors by size
onto the lightest bin), bytes first, then tensors, each tensor a complete torch.save archive
at its recorded offset (torch's `_write_item`). `.metadata` is a pickle of torch's own
Metadata / TensorStorageMetadata / ChunkStorageMetadata / TensorProperties / MetadataIndex /
_StorageInfo / StorageMeta objects plus megatron's `all_local_plans` (SavePlan/WriteItem).

Values: one seeded pool of random bf16 (torch.randn), each chunk a copy of a window of it at
an offset fixed by the chunk's place in the layout, so any chunk can be recomputed.

  bench/synthetic_megatron.py --model qwen2.5-1.5b --tp 8 --pp 4 --out /tmp/meg
  bench/synthetic_megatron.py --model tiny --tp 2 --pp 2 --out /tmp/tiny --check build/shardmerge
"""
from __future__ import annotations

import argparse
import io
import json
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from heapq import heappop, heappush
from pathlib import Path

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

ROOT = Path(__file__).resolve().parent.parent

# Public config.json values of the models whose shapes we borrow (same table as src/synth/synthetic_fsdp.cpp,
# plus head_dim; "tiny"/"tiny-untied" are for correctness checks: vocab divisible by any small TP).
MODELS = {
    #                 arch                model_type hidden  ffn  layers heads kv head_dim vocab  tied  qkv_bias
    "tiny": ("Qwen2ForCausalLM", "qwen2", 64, 96, 4, 4, 2, 16, 256, True, True),
    "tiny-untied": ("LlamaForCausalLM", "llama", 64, 96, 4, 4, 2, 16, 256, False, False),
    "qwen2.5-0.5b": ("Qwen2ForCausalLM", "qwen2", 896, 4864, 24, 14, 2, 64, 151936, True, True),
    "qwen2.5-1.5b": ("Qwen2ForCausalLM", "qwen2", 1536, 8960, 28, 12, 2, 128, 151936, True, True),
    "qwen2.5-3b": ("Qwen2ForCausalLM", "qwen2", 2048, 11008, 36, 16, 2, 128, 151936, True, True),
    "qwen2.5-7b": ("Qwen2ForCausalLM", "qwen2", 3584, 18944, 28, 28, 4, 128, 152064, False, True),
    "llama-3-8b": ("LlamaForCausalLM", "llama", 4096, 14336, 32, 32, 8, 128, 128256, False, False),
}


@dataclass
class Shape:
    name: str
    arch: str
    model_type: str
    hidden: int
    ffn: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool

    @classmethod
    def get(cls, name):
        if name not in MODELS:
            raise SystemExit(f"unknown model {name!r}; known: {', '.join(MODELS)}")
        return cls(name, *MODELS[name])


@dataclass
class Item:
    """One write item of one rank: a tensor chunk or a bytes item."""
    fqn: str
    rank: int
    global_size: tuple = ()
    offsets: tuple = ()
    sizes: tuple = ()
    stacked: bool = False
    pool_offset: int = 0
    is_bytes: bool = False

    @property
    def numel(self):
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def nbytes(self):  # megatron-core's _item_size: chunk numel * element size
        return self.numel * 2


def contiguous_strides(sizes):
    strides, acc = [], 1
    for s in reversed(sizes):
        strides.append(acc)
        acc *= s
    return tuple(reversed(strides))


def divide(a, b, what):
    if a % b:
        raise SystemExit(f"{what}: {a} is not divisible by {b}")
    return a // b


def megatron_config_warnings(m: Shape, tp: int, pp: int):
    """Checks TransformerConfig would make (megatron-core 0.16.1 transformer_config.py __post_init__)."""
    out = []
    if m.heads % tp:
        out.append(f"num_attention_heads ({m.heads}) is not a multiple of TP ({tp}): megatron-core would refuse "
                   f"this config; the layout is extrapolated from the sharding rules (rows/cols cut evenly)")
    if m.kv_heads % tp and tp % m.kv_heads:
        out.append(f"num_query_groups ({m.kv_heads}) is neither a multiple nor a divisor of TP ({tp})")
    return out


def build_layout(m: Shape, tp: int, pp: int):
    """Per-rank write items in megatron-core's plan order (as observed in the tp2_pp2 fixture)."""
    L, H, F, V = m.layers, m.hidden, m.ffn, m.vocab
    qkv_rows = m.kv_heads * (m.heads // m.kv_heads + 2) * m.head_dim
    proj_in = m.heads * m.head_dim
    lps = divide(L, pp, "layers per pipeline stage")
    qkv_r = divide(qkv_rows, tp, "linear_qkv rows")
    proj_c = divide(proj_in, tp, "linear_proj columns")
    ffn_r = divide(F, tp, "ffn_hidden_size")
    vocab_r = divide(V, tp, "vocab (verl/mbridge never pad it)")
    ranks = []
    for p in range(pp):
        layers = range(p * lps, (p + 1) * lps)
        for t in range(tp):
            rank = p * tp + t
            items, names = [], {}  # one fqn string object per key and rank, as in megatron's plans

            def T(fqn, gsize, offsets, sizes, stacked=True):
                fqn = names.setdefault(fqn, fqn)
                items.append(Item(fqn, rank, tuple(gsize), tuple(offsets), tuple(sizes), stacked))

            def B(fqn, layer):
                items.append(Item(f"{fqn}._extra_state/shard_{layer}_{L}", rank, is_bytes=True))

            d = "decoder.layers."
            if p == 0:
                T("embedding.word_embeddings.weight", (V, H), (vocab_r * t, 0), (vocab_r, H), stacked=False)
            if t == 0:
                for l in layers:
                    T(d + "self_attention.linear_qkv.layer_norm_weight", (L, H), (l, 0), (1, H))
            for l in layers:
                T(d + "self_attention.linear_proj.weight", (L, H, proj_in), (l, 0, proj_c * t), (1, H, proj_c))
            if t == 0:
                B(d + "self_attention.linear_proj", layers[0])
            for l in layers:
                T(d + "self_attention.linear_qkv.weight", (L, qkv_rows, H), (l, qkv_r * t, 0), (1, qkv_r, H))
            if m.qkv_bias:
                for l in layers:
                    T(d + "self_attention.linear_qkv.bias", (L, qkv_rows), (l, qkv_r * t), (1, qkv_r))
            if t == 0:
                B(d + "self_attention.linear_qkv", layers[0])
                for l in layers:
                    T(d + "mlp.linear_fc1.layer_norm_weight", (L, H), (l, 0), (1, H))
            for l in layers:  # SwiGLU: gate = fragment t of 2*tp, up = fragment tp + t
                T(d + "mlp.linear_fc1.weight", (L, 2 * F, H), (l, ffn_r * t, 0), (1, ffn_r, H))
                T(d + "mlp.linear_fc1.weight", (L, 2 * F, H), (l, F + ffn_r * t, 0), (1, ffn_r, H))
            if t == 0:
                B(d + "mlp.linear_fc1", layers[0])
            for l in layers:
                T(d + "mlp.linear_fc2.weight", (L, H, F), (l, 0, ffn_r * t), (1, H, ffn_r))
            if t == 0:
                B(d + "mlp.linear_fc2", layers[0])
                for l in layers[1:]:
                    for mod in ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2"):
                        B(d + mod, l)
            if p == pp - 1:
                if t == 0:
                    T("decoder.final_layernorm.weight", (H,), (0,), (H,), stacked=False)
                if not m.tied:
                    T("output_layer.weight", (V, H), (vocab_r * t, 0), (vocab_r, H), stacked=False)
            ranks.append(items)
    return ranks


def assign_pool_offsets(ranks, pool_numel):
    """Each chunk reads pool[off : off + numel]; off depends only on the chunk's place in the layout."""
    cursor = 0
    for items in ranks:
        for it in items:
            if it.is_bytes:
                continue
            if it.numel > pool_numel:
                raise SystemExit(f"chunk {it.fqn} {it.sizes} is larger than the value pool")
            if cursor + it.numel > pool_numel:
                cursor = (cursor * 7 + 12345) % max(1, pool_numel - it.numel)  # wrap to a new, shifted start
            it.pool_offset = cursor
            cursor += it.numel + 11  # odd shift: neighbouring chunks never hold the same values


def split_by_size_and_type(bins, items):
    """megatron-core 0.16.1 strategies/filesystem_async.py `_split_by_size_and_type`."""
    if bins == 1:
        return [items]
    bytes_items = [i for i in items if i.is_bytes]
    tensor_items = [i for i in items if not i.is_bytes]
    buckets = [[] for _ in range(bins)]
    for i, item in enumerate(bytes_items):
        buckets[i % bins].append(item)
    sized = sorted(((it, it.nbytes()) for it in tensor_items), key=lambda x: x[1], reverse=True)
    heap = [(0, i) for i in range(bins)]
    for item, size in sized:
        total, idx = heappop(heap)
        buckets[idx].append(item)
        heappush(heap, (total + size, idx))
    return buckets


def chunk_tensor(pool, it: Item):
    return pool[it.pool_offset: it.pool_offset + it.numel].view(it.sizes).clone()


def bytes_payload():
    # megatron-core's _mcore_to_torch_sharded_object: torch.save of a list of the local objects;
    # the local spec's _extra_state is None.
    buf = io.BytesIO()
    torch.save([None], buf)
    return buf


def write_file(path: Path, bucket, pool, fsync=False):
    """Bytes items first, then tensors, each at f.tell() (torch filesystem._write_item, TORCH_SAVE)."""
    results = []
    with open(path, "wb") as f:
        for it in [i for i in bucket if i.is_bytes] + [i for i in bucket if not i.is_bytes]:
            offset = f.tell()
            if it.is_bytes:
                f.write(bytes_payload().getbuffer())
            else:
                torch.save(chunk_tensor(pool, it), f)
            results.append((it, _StorageInfo(path.name, offset, f.tell() - offset)))
        if fsync:
            f.flush()
            os.fsync(f.fileno())
    return results


def md_index(it: Item):
    # a fresh object each call (fqn string included): the pickled storage_data keys are not the plans' indices
    fqn = it.fqn.encode().decode()
    return MetadataIndex(fqn=fqn) if it.is_bytes else MetadataIndex(fqn=fqn, offset=torch.Size(it.offsets))


def strides(it: Item):
    # as observed: non-stacked keys (CheckpointableShardedTensor) carry the local strides, stacked ones None
    return None if it.stacked else contiguous_strides(it.sizes)


def local_plan(items):
    """A rank's SavePlan as megatron keeps it in all_local_plans (one global-size object per key)."""
    sizes, out = {}, []
    for it in items:
        index = MetadataIndex(fqn=it.fqn) if it.is_bytes else MetadataIndex(fqn=it.fqn, offset=torch.Size(it.offsets))
        if it.is_bytes:
            out.append(WriteItem(index=index, type=WriteItemType.BYTE_IO))
            continue
        props = TensorProperties(dtype=torch.bfloat16, strides=strides(it))
        size = sizes.setdefault(it.fqn, torch.Size(it.global_size))
        chunk = ChunkStorageMetadata(torch.Size(it.offsets), torch.Size(it.sizes))
        out.append(WriteItem(index=index, type=WriteItemType.SHARD,
                             tensor_data=TensorWriteData(chunk=chunk, properties=props, size=size)))
    return SavePlan(items=out, storage_data=None, planner_data={}, usable=True)


def build_metadata(ranks, storage, checkpoint_id):
    """torch's create_default_global_save_plan over the ranks' local plans (which megatron keeps as
    all_local_plans): a key's metadata shares its first item's properties and size, and every item's chunk.
    `storage` is {MetadataIndex: _StorageInfo} in write-result order."""
    plans = [local_plan(items) for items in ranks]
    sdm = {}
    for plan in plans:
        for wi in plan.items:
            if wi.type == WriteItemType.BYTE_IO:
                sdm[wi.index.fqn] = BytesStorageMetadata()
                continue
            td = wi.tensor_data
            sdm.setdefault(wi.index.fqn, TensorStorageMetadata(properties=td.properties, size=td.size, chunks=[]))
            sdm[wi.index.fqn].chunks.append(td.chunk)
    md = Metadata(state_dict_metadata=sdm, planner_data=None, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=str(checkpoint_id), save_id=str(uuid.uuid4())),
                  version="1.0.0")
    md.all_local_plans = plans
    return md


def hf_config(m: Shape):
    cfg = {
        "architectures": [m.arch],
        "model_type": m.model_type,
        "hidden_size": m.hidden,
        "intermediate_size": m.ffn,
        "num_hidden_layers": m.layers,
        "num_attention_heads": m.heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "vocab_size": m.vocab,
        "tie_word_embeddings": m.tied,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "rope_theta": 1000000.0,
        "rope_parameters": {"rope_theta": 1000000.0, "rope_type": "default"},
        "dtype": "bfloat16",
    }
    if m.model_type == "llama":
        cfg.update(attention_bias=False, mlp_bias=False)
    return cfg


def transformer_config(m: Shape, tp, pp):
    return {
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "virtual_pipeline_model_parallel_size": None, "expert_model_parallel_size": 1,
        "sequence_parallel": False, "context_parallel_size": 1,
        "fp16": False, "bf16": True, "params_dtype": "torch.bfloat16",
        "num_layers": m.layers, "hidden_size": m.hidden, "ffn_hidden_size": m.ffn,
        "num_attention_heads": m.heads, "num_query_groups": m.kv_heads, "kv_channels": m.head_dim,
        "add_bias_linear": False, "add_qkv_bias": m.qkv_bias, "gated_linear_unit": True,
        "normalization": "RMSNorm", "layernorm_epsilon": 1e-6,
    }


def manifest(m: Shape, world, step, has_tokenizer):
    contents = {
        "hf_config": {"format": "huggingface", "path": "model/huggingface",
                      "note": "config.json, tokenizer, and optional generation_config.json"},
        "model": {"backend": "dist_checkpointing", "format": "megatron_dist_checkpoint", "path": "model/dist_ckpt"},
        "transformer_config": {"format": "json", "path": "transformer_config.json"},
    }
    if has_tokenizer:
        contents["tokenizer"] = {"format": "huggingface", "path": "model/huggingface"}
    return {
        "arch": m.arch, "backend": {"has_bridge": True, "peft": False, "use_dist_checkpointing": True},
        "contents": contents,
        "directories": {
            "model/dist_ckpt": "Megatron dist_checkpointing shards for model weights (or PEFT adapter shards when mbridge is enabled).",
            "model/huggingface": "HuggingFace config and tokenizer files.",
        },
        "framework": "megatron", "global_step": step, "role": "actor", "save_contents": ["model"],
        "saved_any_dist_ckpt": True, "schema_version": 2, "world_size": world,
    }


@dataclass
class Generated:
    role: Path
    ranks: list
    pool: torch.Tensor
    dist_files: list = field(default_factory=list)
    dist_bytes: int = 0
    params: int = 0


def plan_values(m: Shape, tp, pp, seed=1234, pool_mib=256):
    """The per-rank write items and the value pool they read from: everything but the files."""
    ranks = build_layout(m, tp, pp)
    total = sum(it.numel for items in ranks for it in items if not it.is_bytes)
    pool_numel = min(total + 11 * sum(len(r) for r in ranks), pool_mib << 19)  # bf16: 2 bytes each
    pool_numel = max(pool_numel, max(it.numel for items in ranks for it in items))
    assign_pool_offsets(ranks, pool_numel)
    g = torch.Generator().manual_seed(seed)
    return ranks, torch.randn(pool_numel, generator=g, dtype=torch.bfloat16)


def generate(model, tp, pp, out, step=1, seed=1234, tokenizer_from=None, jobs=2, pool_mib=256, fsync=False):
    m = Shape.get(model)
    for w in megatron_config_warnings(m, tp, pp):
        print("warning:", w, file=sys.stderr)
    run = Path(out)
    role = run / f"global_step_{step}" / "actor"
    if role.exists():
        shutil.rmtree(role)
    dist = role / "model" / "dist_ckpt"
    hf = role / "model" / "huggingface"
    dist.mkdir(parents=True)
    hf.mkdir(parents=True)
    (run / "latest_checkpointed_iteration.txt").write_text(str(step))

    ranks, pool = plan_values(m, tp, pp, seed, pool_mib)
    total = sum(it.numel for items in ranks for it in items if not it.is_bytes)

    jobs_list = []
    for rank, items in enumerate(ranks):
        buckets = [b for b in split_by_size_and_type(2, items) if b]
        for i, b in enumerate(buckets):
            jobs_list.append((dist / f"__{rank}_{i}.distcp", b))
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as ex:
        results = list(ex.map(lambda jb: write_file(jb[0], jb[1], pool, fsync), jobs_list))
    storage = {}
    for res in results:
        for it, info in res:
            storage[md_index(it)] = info

    md = build_metadata(ranks, storage, dist.resolve())
    with open(dist / ".metadata.tmp", "wb") as f:
        pickle.dump(md, f)  # torch's FileSystemWriter.finish: default protocol (4 on Python 3.11)
    os.replace(dist / ".metadata.tmp", dist / ".metadata")
    torch.save({"content_metadata": {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}},
               dist / "common.pt")
    (dist / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                                                    "common_backend": "torch", "common_backend_version": 1}))
    (hf / "config.json").write_text(json.dumps(hf_config(m), indent=2) + "\n")
    if tokenizer_from:
        for e in Path(tokenizer_from).iterdir():
            if e.name.startswith("tokenizer") or e.name in ("special_tokens_map.json", "chat_template.jinja"):
                shutil.copyfile(e, hf / e.name)
    (role / "transformer_config.json").write_text(json.dumps(transformer_config(m, tp, pp), indent=2))
    tmp = role / "ckpt_contents.json.tmp"
    tmp.write_text(json.dumps(manifest(m, tp * pp, step, bool(tokenizer_from)), indent=2, sort_keys=True))
    os.replace(tmp, role / "ckpt_contents.json")

    gen = Generated(role, ranks, pool)
    gen.dist_files = [p for p, _ in jobs_list]
    gen.dist_bytes = sum(p.stat().st_size for p in gen.dist_files)
    gen.params = total
    return gen


# ---------------------------------------------------------------------------------------------
# --check: the generated tree against the values it was generated from
# ---------------------------------------------------------------------------------------------


def global_tensors(gen: Generated):
    """The global tensors, assembled from the layout and the pool (not from the files)."""
    glob = {}
    seen = {}
    for items in gen.ranks:
        for it in items:
            if it.is_bytes:
                continue
            if it.fqn not in glob:
                glob[it.fqn] = torch.zeros(it.global_size, dtype=torch.bfloat16)
                seen[it.fqn] = torch.zeros(it.global_size, dtype=torch.uint8)
            t, cover = glob[it.fqn], seen[it.fqn]
            box = tuple(slice(o, o + s) for o, s in zip(it.offsets, it.sizes))
            t[box] = chunk_tensor(gen.pool, it)
            cover[box] += 1
    for k in list(seen):
        if not bool((seen.pop(k) == 1).all()):
            raise AssertionError(f"chunks of {k} do not tile it exactly once")
    return glob


def bit_equal(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def check(gen: Generated, model, shardmerge):
    from types import SimpleNamespace

    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT / "tests" / "fixtures"))
    from fx_megatron import dcp_to_hf  # the fixtures' reference mapping

    m = Shape.get(model)
    glob = global_tensors(gen)
    cfg = SimpleNamespace(hidden_size=m.hidden, num_attention_heads=m.heads, num_key_value_heads=m.kv_heads,
                          head_dim=m.head_dim, architectures=[m.arch], vocab_size=m.vocab, tie_word_embeddings=m.tied)
    expected = dcp_to_hf(glob, cfg)
    failures = []

    # 1. torch's own DCP reader, into preallocated full tensors
    dist = gen.role / "model" / "dist_ckpt"
    loaded = {k: torch.empty(v.shape, dtype=v.dtype) for k, v in glob.items()}
    dcp.load(loaded, checkpoint_id=str(dist), no_dist=True)
    bad = [k for k in glob if not bit_equal(loaded[k], glob[k])]
    print(f"torch.distributed.checkpoint.load: {len(glob) - len(bad)}/{len(glob)} keys bit-identical")
    failures += [f"dcp.load {k}" for k in bad]
    # .metadata built from the same classes a real save pickles
    md = pickle.load(open(dist / ".metadata", "rb"))
    assert type(md) is Metadata and hasattr(md, "all_local_plans") and len(md.all_local_plans) == len(gen.ranks)

    # 2. shardmerge merge --backend megatron --dtype keep
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        cmd = [shardmerge, "merge", "--backend", "megatron", "--local_dir", str(gen.role), "--target_dir", str(out),
               "--dtype", "keep"]
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode:
            raise SystemExit(f"shardmerge failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
        got = {}
        for f in sorted(out.glob("*.safetensors")):
            got.update(load_file(f))
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    bad = [k for k in expected if k in got and not bit_equal(got[k], expected[k])]
    print(f"shardmerge merge: {len(expected) - len(bad) - len(missing)}/{len(expected)} HF tensors bit-identical"
          f"{', missing ' + str(missing) if missing else ''}{', extra ' + str(extra) if extra else ''}")
    failures += [f"shardmerge {k}" for k in bad + missing + extra]
    if failures:
        raise SystemExit("CHECK FAILED: " + ", ".join(failures[:20]))
    print("check ok")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-1.5b", choices=list(MODELS))
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--out", required=True, help="run root (global_step_<step>/actor is created in it)")
    ap.add_argument("--step", type=int, default=1)
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--tokenizer-from", help="copy tokenizer files from this HF directory")
    ap.add_argument("--jobs", type=int, default=2, help="files written concurrently")
    ap.add_argument("--pool-mib", type=int, default=256, help="size of the random bf16 value pool")
    ap.add_argument("--fsync", action="store_true", help="fsync every .distcp file (megatron's use_fsync)")
    ap.add_argument("--check", metavar="SHARDMERGE",
                    help="then verify: torch DCP load and `SHARDMERGE merge` against the generated values")
    args = ap.parse_args()
    start = time.perf_counter()
    gen = generate(args.model, args.tp, args.pp, args.out, args.step, args.seed, args.tokenizer_from, args.jobs,
                   args.pool_mib, args.fsync)
    print(f"{gen.role}: {args.model} TP={args.tp} PP={args.pp}, {gen.params:,} parameters, "
          f"{len(gen.dist_files)} .distcp files, {gen.dist_bytes / 1e9:.3f} GB, {time.perf_counter() - start:.1f} s")
    if args.check:
        check(gen, args.model, args.check)


if __name__ == "__main__":
    main()
