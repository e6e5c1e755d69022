"""Reads a directory of .safetensors files with the format's spec alone (8-byte little-endian
header length, JSON header, data), so that the wheel's fresh venv needs no torch or safetensors."""
import json
import struct
from pathlib import Path


def read_safetensors_dir(d):
    """{name: (dtype, shape, raw bytes)} over every .safetensors file in d (or of the file d)."""
    out = {}
    d = Path(d)
    for f in [d] if d.is_file() else sorted(d.glob("*.safetensors")):
        blob = f.read_bytes()
        n = struct.unpack("<Q", blob[:8])[0]
        header = json.loads(blob[8:8 + n])
        header.pop("__metadata__", None)
        for name, h in header.items():
            b, e = h["data_offsets"]
            assert name not in out, name
            out[name] = (h["dtype"], h["shape"], blob[8 + n + b:8 + n + e])
    return out
