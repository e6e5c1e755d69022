"""Mutation test: corrupt real fixture files and check that no run gives a silently wrong model.

Every mutated source must either make `shardmerge` fail with exit 1, one `shardmerge: error:`
line and nothing at (or beside) the target, or produce an output tree byte-identical to the
merge of the unmutated source. The oracle is that unmutated merge (same binary, same flags):
these tests do not judge what a correct merge is (the other e2e tests do), only that damage
never turns into a different, plausible model.

Files are located with Python's own zipfile module and the safetensors header layout, never
with shardmerge's readers. Mutations are seeded (SHARDMERGE_MUTATION_SEED, default 11) and
their number per group is SHARDMERGE_MUTATIONS (default 100; six groups, ~20 s in all).
"""
import io
import json
import os
import random
import shutil
import struct
import subprocess
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

SEED = int(os.environ.get("SHARDMERGE_MUTATION_SEED", "11"))
COUNT = int(os.environ.get("SHARDMERGE_MUTATIONS", "100"))
TIMEOUT_S = 60


# ---------------------------------------------------------------------------------------------
# Where the structures of a zip (torch.save archive) lie, from Python's zipfile.

@dataclass
class ZipMap:
    records: list        # (name, data_start, data_end), absolute
    local_headers: list  # (start, end) of each local header incl. name and extra, absolute
    central: tuple       # (start, end) of the central directory
    tail: tuple          # (start, end): ZIP64 end record, locator and end of central directory


def zip_map(blob: bytes, base: int = 0) -> ZipMap:
    zf = zipfile.ZipFile(io.BytesIO(blob))
    records, headers = [], []
    for info in zf.infolist():
        h = info.header_offset
        name_len, extra_len = struct.unpack_from("<HH", blob, h + 26)
        data = h + 30 + name_len + extra_len
        headers.append((base + h, base + data))
        records.append((info.filename, base + data, base + data + info.compress_size))
    start_dir = zf.start_dir
    eocd = blob.rfind(b"PK\x05\x06")
    zip64 = blob.rfind(b"PK\x06\x06", 0, eocd)
    end_dir = zip64 if zip64 >= start_dir else eocd
    return ZipMap(records, headers, (base + start_dir, base + end_dir), (base + end_dir, base + len(blob)))


def distcp_items(path: Path):
    """(offset, length) of every torch.save item in a .distcp file, from torch's DCP metadata."""
    import pickle
    meta_path = path.parent / ".metadata"
    import torch.distributed.checkpoint  # noqa: F401  (the classes the metadata pickle names)
    with open(meta_path, "rb") as f:
        meta = pickle.load(f)
    items = sorted({(s.offset, s.length) for s in meta.storage_data.values() if s.relative_path == path.name})
    return items


def zip_maps_of(path: Path):
    blob = path.read_bytes()
    if path.suffix == ".distcp":
        return [zip_map(blob[o:o + n], o) for o, n in distcp_items(path)]
    return [zip_map(blob)]


# ---------------------------------------------------------------------------------------------
# Mutations: each returns (description, new bytes).

def flip(blob: bytes, at: int, rng: random.Random) -> bytes:
    b = bytearray(blob)
    b[at] ^= rng.randrange(1, 256)
    return bytes(b)


def mutate_zip_file(path: Path, rng: random.Random):
    blob = path.read_bytes()
    zm = rng.choice(zip_maps_of(path))
    kind = rng.choice(["tensor data", "pickle", "local header", "central directory", "zip tail",
                       "anywhere", "truncate"])
    if kind in ("tensor data", "pickle"):
        recs = [r for r in zm.records if r[0].endswith("data.pkl") == (kind == "pickle") and r[2] > r[1]]
        if not recs:  # e.g. an item without tensor records
            kind, recs = "pickle", [r for r in zm.records if r[2] > r[1]]
        name, a, b = rng.choice(recs)
        at = rng.randrange(a, b)
        return f"{kind} byte {at} ({name})", flip(blob, at, rng)
    if kind == "local header":
        a, b = rng.choice(zm.local_headers)
        at = rng.randrange(a, b)
        return f"local header byte {at}", flip(blob, at, rng)
    if kind == "central directory":
        at = rng.randrange(*zm.central)
        return f"central directory byte {at}", flip(blob, at, rng)
    if kind == "zip tail":
        at = rng.randrange(*zm.tail)
        return f"zip64/eocd byte {at}", flip(blob, at, rng)
    if kind == "anywhere":
        at = rng.randrange(len(blob))
        return f"byte {at}", flip(blob, at, rng)
    cut = rng.randrange(len(blob))
    return f"truncated to {cut} bytes", blob[:cut]


def mutate_any_byte(path: Path, rng: random.Random):
    """For files without inner structure worth aiming at (DCP's pickled .metadata)."""
    blob = path.read_bytes()
    if rng.random() < 0.2:
        cut = rng.randrange(len(blob))
        return f"truncated to {cut} bytes", blob[:cut]
    at = rng.randrange(len(blob))
    return f"byte {at}", flip(blob, at, rng)


def mutate_safetensors_header(path: Path, rng: random.Random):
    blob = path.read_bytes()
    (n,) = struct.unpack_from("<Q", blob)
    kind = rng.choice(["header byte", "header byte", "header byte", "length prefix", "truncate"])
    if kind == "length prefix":
        at = rng.randrange(8)
        return f"length prefix byte {at}", flip(blob, at, rng)
    if kind == "truncate":
        cut = rng.randrange(len(blob))
        return f"truncated to {cut} bytes", blob[:cut]
    # Not inside a tensor name: a name with a flipped letter is a well-formed file that holds a
    # differently named tensor, and nothing in the format (no checksum) can tell it from a real one.
    header = blob[8:8 + n]
    names = [(header.find(json.dumps(k).encode()) + 8, len(json.dumps(k))) for k in json.loads(header)]
    at = rng.randrange(8, 8 + n)
    while any(a <= at < a + k for a, k in names):
        at = rng.randrange(8, 8 + n)
    return f"header byte {at} ({blob[at:at + 1]!r})", flip(blob, at, rng)


# ---------------------------------------------------------------------------------------------
# Runner

def linked_copy(src: Path, dst: Path):
    """A copy of the tree whose files are hard links (cheap); a mutated file is replaced, not edited."""
    shutil.copytree(src, dst, copy_function=os.link, symlinks=True)


def tree_bytes(d: Path):
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def _is_utf8(b: bytes) -> bool:
    try:
        b.decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def run_cmd(shardmerge_bin, args):
    return subprocess.run([shardmerge_bin, *map(str, args)], capture_output=True, timeout=TIMEOUT_S)


def check_mutations(shardmerge_bin, tmp_path, source_root: Path, victims, mutate, make_args, label):
    """Mutates one victim file per case; `make_args(root, target)` builds the command line. The
    cases link to a private copy: a hard link to the shared fixture would change its files'
    ctime under a merge another test worker is running from them."""
    private = tmp_path / "source"
    shutil.copytree(source_root, private, symlinks=True)
    source_root = private
    reference = tmp_path / "reference"
    proc = run_cmd(shardmerge_bin, make_args(source_root, reference))
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    expected = tree_bytes(reference)

    rng = random.Random(f"{SEED}-{label}")
    silent, bad_errors, outcomes = [], [], {"identical": 0, "refused": 0}
    for i in range(COUNT):
        case = tmp_path / f"case{i}"
        root = case / "src"
        linked_copy(source_root, root)
        victim = rng.choice(victims)
        what, data = mutate(source_root / victim, rng)
        (root / victim).unlink()
        (root / victim).write_bytes(data)
        target = case / "out"
        desc = f"{victim}: {what}"
        try:
            proc = run_cmd(shardmerge_bin, make_args(root, target))
        except subprocess.TimeoutExpired:
            silent.append(f"{desc}: hung for {TIMEOUT_S} s")
            continue
        leftovers = [p.name for p in case.iterdir() if p.name.startswith("out")]
        if proc.returncode == 0:
            got = tree_bytes(target)
            if got != expected:
                differing = sorted(k for k in set(got) | set(expected) if got.get(k) != expected.get(k))
                silent.append(f"{desc}: exit 0 with different output ({', '.join(differing)})")
            else:
                outcomes["identical"] += 1
        else:
            # One readable line, the last one: bytes from a damaged file must not reach the terminal raw.
            lines = proc.stderr.decode("utf-8", "backslashreplace").splitlines()
            errors = [l for l in lines if l.startswith("shardmerge: error:")]
            readable = proc.stderr.isascii() or _is_utf8(proc.stderr)
            if proc.returncode != 1 or len(errors) != 1 or lines[-1] != errors[0] or not readable or leftovers:
                bad_errors.append(f"{desc}: exit {proc.returncode}, {len(errors)} error line(s), "
                                  f"{'' if readable else 'not UTF-8, '}left {leftovers}: {lines[-3:]}")
            else:
                outcomes["refused"] += 1
        shutil.rmtree(case)
    print(f"{label}: {COUNT} mutations: {outcomes}")
    assert not silent, f"{len(silent)} silently wrong or hung run(s):\n" + "\n".join(silent)
    assert not bad_errors, f"{len(bad_errors)} failure(s) without one error line / clean target:\n" + "\n".join(bad_errors)


def fixture_by_name(manifest, name):
    fx = next((f for f in manifest["fixtures"] if f["name"] == name and f.get("status", "ok") == "ok"), None)
    if fx is None:
        pytest.skip(f"fixture {name} not generated")
    return fx


# ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["qwen2_fsdp2_w4", "qwen2_fsdp1_sharded_tensor_w2", "qwen2_lora_fsdp2_w2"])
def test_fsdp_rank_file_mutations(name, manifest, fixtures, shardmerge_bin, tmp_path):
    pytest.importorskip("torch")
    fx = fixture_by_name(manifest, name)
    role = fixtures / fx["role_dir"]
    victims = sorted(p.name for p in role.glob("model_world_size_*_rank_*.pt"))
    args = lambda root, target: ["merge", "--local_dir", root, "--target_dir", target]
    check_mutations(shardmerge_bin, tmp_path, role, victims, mutate_zip_file, args, name)


@pytest.mark.parametrize("victim", ["distcp", "metadata"])
def test_megatron_dist_ckpt_mutations(victim, manifest, fixtures, shardmerge_bin, tmp_path):
    pytest.importorskip("torch")
    fx = fixture_by_name(manifest, "qwen2_megatron_tp2_pp2")
    role = fixtures / fx["role_dir"]
    dist = role / "model" / "dist_ckpt"
    pattern, mutate = ("*.distcp", mutate_zip_file) if victim == "distcp" else (".metadata", mutate_any_byte)
    victims = sorted(str(p.relative_to(role)) for p in dist.glob(pattern))
    hf = fixtures / fx["hf_config_dir_fallback"]
    args = lambda root, target: ["merge", "--backend", "megatron", "--local_dir", root, "--target_dir", target,
                                 "--hf_model_path", hf]
    check_mutations(shardmerge_bin, tmp_path, role, victims, mutate, args, f"megatron {victim}")


def test_safetensors_header_mutations(manifest, fixtures, shardmerge_bin, tmp_path):
    fx = next((f for f in manifest["fixtures"] if f["name"] == "peft_qwen2_all_linear_r8"), None)
    if fx is None:
        pytest.skip("PEFT fixture not generated")
    # One tree holding both inputs of fold-lora, so that either can be the victim.
    root = tmp_path / "inputs"
    shutil.copytree(fixtures / fx["base_dir"], root / "base")
    shutil.copytree(fixtures / fx["adapter_dir"], root / "adapter")
    victims = ["base/model.safetensors", "adapter/adapter_model.safetensors"]
    args = lambda r, target: ["fold-lora", "--base", r / "base", "--adapter", r / "adapter", "--target_dir", target]
    check_mutations(shardmerge_bin, tmp_path, root, victims, mutate_safetensors_header, args, "safetensors")
