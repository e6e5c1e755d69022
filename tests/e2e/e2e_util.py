"""Helpers for the end-to-end tests. torch/safetensors are imported lazily, so modules that
only need the CLI can import this without them."""
import hashlib
import json
import os
import re
import struct
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# safetensors without the safetensors package (headers only)


def st_header(path):
    """(header dict without __metadata__, metadata dict or None, data start offset)."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        h = json.loads(f.read(n))
    meta = h.pop("__metadata__", None)
    return h, meta, 8 + n


def hf_weight_files(d):
    """Weight files of an HF dir: [model.safetensors] or the index's shard files."""
    d = Path(d)
    idx = d / "model.safetensors.index.json"
    if idx.exists():
        wm = json.loads(idx.read_text())["weight_map"]
        return [d / f for f in sorted(set(wm.values()))]
    return [d / "model.safetensors"]


def hf_tensor_names(d):
    names = []
    for f in hf_weight_files(d):
        h, _, _ = st_header(f)
        names += list(h)
    return names


DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


def tensor_nbytes(entry):
    n = DTYPE_BYTES[entry["dtype"]]
    for s in entry["shape"]:
        n *= s
    return n


# ---------------------------------------------------------------------------------------------
# torch side


def load_hf(d):
    """All tensors of an HF dir (single file or sharded) as a dict."""
    from safetensors.torch import load_file

    out = {}
    for f in hf_weight_files(d):
        part = load_file(str(f))
        dup = set(part) & set(out)
        assert not dup, f"{f.name}: tensors also in another shard: {sorted(dup)[:5]}"
        out.update(part)
    return out


def load_st(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def verl_name(k):
    """verl's key rules for the base model: strip base_model.model., drop .base_layer."""
    if k.startswith("base_model.model."):
        k = k[len("base_model.model."):]
    return k.replace(".base_layer.", ".")


def is_lora_key(k):
    return "lora_" in k


def torch_dtype(name):
    import torch

    return {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16,
            "fp32": torch.float32, "float32": torch.float32}[name]


def role_config(fixtures, fx):
    return json.loads((Path(fixtures) / fx["role_dir"] / "huggingface" / "config.json").read_text())


def config_ties(cfg):
    return bool(cfg.get("tie_word_embeddings", False))


def expected_base(fixtures, fx, out_dtype="bf16", drop_tied=None):
    """expected.safetensors under verl's key rules (LoRA keys removed), floats cast like
    `.to(out_dtype)` (out_dtype None or "keep": unchanged), integer tensors unchanged; the tied
    lm_head.weight dropped when the config ties embeddings."""
    exp = load_st(Path(fixtures) / fx["expected"])
    if drop_tied is None:
        drop_tied = config_ties(role_config(fixtures, fx))
    out = {}
    for k, t in exp.items():
        if is_lora_key(k):
            continue
        name = verl_name(k)
        if drop_tied and name == "lm_head.weight":
            continue
        assert name not in out, f"two expected keys map to {name}"
        if t.is_floating_point() and out_dtype not in (None, "keep"):
            t = t.to(torch_dtype(out_dtype))
        out[name] = t
    return out


def raw_bytes(t):
    import torch

    return t.contiguous().reshape(-1).view(torch.uint8)


def bits_equal(a, b):
    import torch

    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(raw_bytes(a), raw_bytes(b))


def describe_mismatch(name, a, b):
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return f"{name}: {a.dtype}{list(a.shape)} vs {b.dtype}{list(b.shape)}"
    if a.is_floating_point():
        d = (a.double() - b.double()).abs()
        return f"{name}: {int((raw_bytes(a) != raw_bytes(b)).sum())} bytes differ, max abs {d.max().item():g}"
    return f"{name}: {int((a != b).sum())} elements differ"


def assert_tensors_bitwise(out, exp, what=""):
    missing = sorted(set(exp) - set(out))
    extra = sorted(set(out) - set(exp))
    assert not missing and not extra, f"{what}: missing {missing}, unexpected {extra}"
    bad = [describe_mismatch(k, out[k], exp[k]) for k in sorted(exp) if not bits_equal(out[k], exp[k])]
    assert not bad, f"{what}: {len(bad)} tensor(s) differ: " + "; ".join(bad[:8])


def ordered_int(t):
    """Monotone integer image of a float tensor's bit pattern (adjacent floats differ by 1)."""
    import torch

    if t.dtype in (torch.bfloat16, torch.float16):
        i = t.view(torch.int16).to(torch.int64)
        return torch.where(i < 0, -32768 - i, i)
    if t.dtype == torch.float32:
        i = t.view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -2147483648 - i, i)
    raise TypeError(t.dtype)


def ulp_distance(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    if a.numel() == 0:
        return 0
    return int((ordered_int(a) - ordered_int(b)).abs().max())


def max_abs(a, b):
    if a.numel() == 0:
        return 0.0
    return float((a.double() - b.double()).abs().max())


def assert_within_ulp(got, ref, max_ulp, what):
    """Same names; every element within max_ulp of the reference. Returns the worst (ulp, abs, name)."""
    missing, extra = sorted(set(ref) - set(got)), sorted(set(got) - set(ref))
    assert not missing and not extra, f"{what}: missing {missing}, unexpected {extra}"
    worst = max(((ulp_distance(got[k], ref[k]), max_abs(got[k], ref[k]), k) for k in ref), default=(0, 0.0, ""))
    assert worst[0] <= max_ulp, f"{what}: {worst[2]} is {worst[0]} ulp off (max abs error {worst[1]:g})"
    return worst


# ---------------------------------------------------------------------------------------------
# merge options


def megatron_merge_args(fixtures, fx):
    """--hf_model_path where the save has no HF config (verl's dist-only saves)."""
    args = ["--backend", "megatron"]
    if not fx.get("hf_config_dir"):
        args += ["--hf_model_path", fixtures / fx["hf_config_dir_fallback"]]
    if fx.get("value_model"):
        args += ["--is-value-model"]
    if fx.get("lora"):  # verl does not record Megatron LoRA's alpha in the checkpoint
        args += ["--lora-alpha", str(fx["lora"]["alpha"])]
    return args


# ---------------------------------------------------------------------------------------------
# files


def tree_digest(root):
    """{relative path: sha256} of every file under root (and directories, as 'dir')."""
    root = Path(root)
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for d in dirnames:
            out[str(Path(dirpath, d).relative_to(root)) + "/"] = "dir"
        for f in filenames:
            p = Path(dirpath, f)
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def leftovers(target):
    """Anything the writer may leave beside a failed target: the target itself, OUT.tmp-*."""
    target = Path(target)
    parent = target.parent
    if not parent.exists():
        return []
    return sorted(p.name for p in parent.iterdir() if p.name == target.name or ".tmp-" in p.name)


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.strip()]


def files_and_bytes(d):
    """{file: [(name, dtype, shape, bytes)]} in file order, and the index's weight_map if any."""
    out = {}
    for f in hf_weight_files(d):
        header, meta, data_start = st_header(f)
        raw = f.read_bytes()
        rows = []
        for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            a, b = e["data_offsets"]
            rows.append((name, e["dtype"], e["shape"], raw[data_start + a:data_start + b]))
        out[f.name] = (meta, rows)
    index = d / "model.safetensors.index.json"
    weight_map = json.loads(index.read_text())["weight_map"] if index.exists() else None
    return out, weight_map


def assert_same_hf_files(out, oracle):
    """The same shard files, index text, headers, tensor order and bytes as `oracle`."""
    got, got_map = files_and_bytes(out)
    exp, exp_map = files_and_bytes(oracle)
    assert sorted(got) == sorted(exp), f"shard files {sorted(got)} vs save_pretrained's {sorted(exp)}"
    assert got_map == exp_map, "model.safetensors.index.json weight_map differs from save_pretrained's"
    index = "model.safetensors.index.json"
    if (out / index).exists():
        # Byte for byte, but for total_parameters: transformers counts parameters, not the
        # persistent buffers it also saves (DeepSeek-V3's e_score_correction_bias), which rank
        # files do not tell apart.
        def masked(d):
            return re.sub(r'"total_parameters": \d+', '"total_parameters": N', (d / index).read_text())
        assert masked(out) == masked(oracle), f"{index} text differs"
    for f in exp:
        head = lambda d: (d / f).read_bytes()[:st_header(d / f)[2]]  # noqa: E731
        assert head(out) == head(oracle), f"{f}: header bytes differ"
        g_meta, g_rows = got[f]
        e_meta, e_rows = exp[f]
        assert g_meta == e_meta, f"{f}: __metadata__ {g_meta} vs {e_meta}"
        assert [r[:3] for r in g_rows] == [r[:3] for r in e_rows], f"{f}: tensors (name, dtype, shape) differ"
        bad = [r[0] for r, s in zip(g_rows, e_rows) if r[3] != s[3]]
        assert not bad, f"{f}: bytes differ for {bad[:5]}"
