import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

__version__: str

_Path = Union[str, os.PathLike[str]]
_Size = Union[str, int]

class Error(RuntimeError):
    """A checkpoint, plan or output that shardmerge cannot handle."""

    message: str
    file: Optional[str]
    tensor: Optional[str]
    offset: Optional[int]

def binary() -> Path: ...
def main(argv: list[str] | None = None) -> None: ...
def inspect(path: _Path, *, tensors: bool = False) -> dict[str, Any]: ...
def plan(
    local_dir: _Path,
    *,
    out: Optional[_Path] = None,
    backend: str = "auto",
    dtype: str = "default",
    max_shard_size: _Size = "5GB",
    lora: str = "fold",
    lora_alpha: Optional[float] = None,
    force_lora_alpha: bool = False,
    tie_word_embedding: bool = False,
    is_value_model: bool = False,
    role: str = "actor",
    hf_model_path: Optional[_Path] = None,
    runtime_names: bool = False,
) -> dict[str, Any]: ...
def merge(
    local_dir: _Path,
    target_dir: _Path,
    *,
    backend: str = "auto",
    dtype: str = "default",
    max_shard_size: _Size = "5GB",
    lora: str = "fold",
    lora_alpha: Optional[float] = None,
    force_lora_alpha: bool = False,
    tie_word_embedding: bool = False,
    is_value_model: bool = False,
    role: str = "actor",
    hf_model_path: Optional[_Path] = None,
    runtime_names: bool = False,
    threads: Optional[int] = None,
    memory_limit: _Size = "512MiB",
    device: str = "cpu",
    gpu_memory: _Size = "auto",
    verify: bool = False,
    force: bool = False,
    check_crc: bool = True,
    distributed: bool = False,
    transport: str = "auto",
    peer_timeout: float = 300,
    progress: Optional[Callable[[int, int], Any]] = None,
) -> Optional[dict[str, Any]]: ...
def fold_lora(
    base: _Path,
    adapter: _Path,
    target_dir: _Path,
    *,
    dtype: str = "auto",
    max_shard_size: _Size = "5GB",
    lora_alpha: Optional[float] = None,
    force_lora_alpha: bool = False,
    threads: Optional[int] = None,
    memory_limit: _Size = "512MiB",
    device: str = "cpu",
    gpu_memory: _Size = "auto",
    verify: bool = False,
    force: bool = False,
    check_crc: bool = True,
    progress: Optional[Callable[[int, int], Any]] = None,
) -> dict[str, Any]: ...
def merge_plan(
    plan_file: _Path,
    target_dir: _Path,
    *,
    threads: Optional[int] = None,
    memory_limit: _Size = "512MiB",
    device: str = "cpu",
    gpu_memory: _Size = "auto",
    verify: bool = False,
    force: bool = False,
    check_crc: bool = True,
    progress: Optional[Callable[[int, int], Any]] = None,
) -> dict[str, Any]: ...
def verify(
    local_dir: _Path,
    test_hf_dir: _Path,
    *,
    atol: float = 0.0,
    backend: str = "auto",
    dtype: str = "default",
    max_shard_size: _Size = "5GB",
    lora: str = "fold",
    lora_alpha: Optional[float] = None,
    force_lora_alpha: bool = False,
    tie_word_embedding: bool = False,
    is_value_model: bool = False,
    role: str = "actor",
    hf_model_path: Optional[_Path] = None,
    runtime_names: bool = False,
) -> dict[str, Any]: ...
