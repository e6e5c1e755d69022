"""Every byte read is checked: a byte flipped in a copy of a real rank file, inside a tensor's
data or in a record's padding that no tensor reads, fails the merge (exit 1) with an error that
names the file, the zip record and the tensor, and leaves no target. Records are located with
Python's zipfile (FSDP) or the plan's record list (Megatron .distcp items, zips inside a file)."""
import json
import shutil
import struct
import zipfile
from pathlib import Path

import pytest


def copy_fixture(fixtures, manifest, name, tmp_path):
    fx = next(f for f in manifest["fixtures"] if f["name"] == name)
    if fx.get("status", "ok") != "ok":
        pytest.skip(f"{name}: {fx.get('status')}")
    shutil.copytree(fixtures / fx["run_root"], tmp_path / fx["run_root"], symlinks=True)
    return tmp_path / fx["role_dir"]


def record_data(path, name):
    """(data offset, size) of a zip record, from its local header."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(name)
    with open(path, "rb") as f:
        f.seek(info.header_offset)
        local = f.read(30)
    name_len, extra_len = struct.unpack("<HH", local[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x20]))


def tree_bytes(d):
    return {p.relative_to(d): p.read_bytes() for p in sorted(Path(d).rglob("*")) if p.is_file()}


def expect_crc_failure(run, role, target, file, record, tensor):
    proc = run("merge", "--local_dir", role, "--target_dir", target, check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    err = proc.stderr
    assert "CRC-32 mismatch: record " + record in err, err
    assert str(file) in err, err
    assert f"tensor '{tensor}'" in err, err
    assert not Path(target).exists(), "a failed merge must leave no target"


def test_flipped_byte_in_tensor_data_or_padding_fails_the_merge(run, fixtures, manifest, tmp_path):
    role = copy_fixture(fixtures, manifest, "qwen2_fsdp2_w2", tmp_path)
    rank1 = role / "model_world_size_2_rank_1.pt"
    record = "model_world_size_2_rank_1/data/0"  # model.embed_tokens.weight's local shard
    data, size = record_data(rank1, record)
    clean = run("merge", "--local_dir", role, "--target_dir", tmp_path / "clean", "--json")
    assert json.loads(clean.stdout)["crc_checked_records"] > 0
    pristine = rank1.read_bytes()

    # Inside the tensor's data.
    flip(rank1, data + 10)
    expect_crc_failure(run, role, tmp_path / "out1", rank1, record, "model.embed_tokens.weight")
    # --no-crc reads what is there: the flipped byte reaches the output.
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "nocrc1", "--no-crc")
    assert tree_bytes(tmp_path / "nocrc1") != tree_bytes(tmp_path / "clean")

    # In the record's padding: FSDP2 pads the short rank's storage, and no tensor reads the pad
    # (the --no-crc merge of this copy equals the clean one), yet the record is checked whole.
    rank1.write_bytes(pristine)
    flip(rank1, data + size - 3)
    run("merge", "--local_dir", role, "--target_dir", tmp_path / "nocrc2", "--no-crc")
    assert tree_bytes(tmp_path / "nocrc2") == tree_bytes(tmp_path / "clean"), "the byte is padding no tensor reads"
    expect_crc_failure(run, role, tmp_path / "out2", rank1, record, "model.embed_tokens.weight")


@pytest.mark.parametrize("name", ["qwen2_megatron_tp2", "qwen2_megatron_tp2_pp2_legacy"])
def test_flipped_byte_in_a_megatron_item_fails_the_merge(run, fixtures, manifest, tmp_path, name):
    role = copy_fixture(fixtures, manifest, name, tmp_path)
    plan = json.loads(run("plan", "--local_dir", role, "--json").stdout)
    copies = {(c["file"], c["offset"]) for t in plan["tensors"] for c in t["copies"]}
    rec = next(r for r in plan["records"] if (r["file"], r["offset"]) in copies and r["size"] > 64)
    flip(rec["file"], rec["offset"] + rec["size"] // 2)
    expect_crc_failure(run, role, tmp_path / "out", rec["file"], rec["record"], rec["tensor"])


def test_flipped_byte_in_a_zstd_item_fails_the_merge(run, fixtures, manifest, tmp_path):
    """zstd items: the compressed bytes are decoded into a scratch file, whose zip records are
    checked like any other; a flipped compressed byte fails decoding or their CRC-32."""
    role = copy_fixture(fixtures, manifest, "qwen2_megatron_tp2_zstd", tmp_path)
    dist = sorted((role / "model" / "dist_ckpt").glob("*.distcp"))[0]
    size = dist.stat().st_size
    flip(dist, size // 2)
    proc = run("merge", "--local_dir", role, "--target_dir", tmp_path / "out", check=False)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "zstd" in proc.stderr or "CRC-32 mismatch" in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()
