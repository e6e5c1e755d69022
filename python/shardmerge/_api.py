"""The Python API: shardmerge.inspect, plan, merge, fold_lora, merge_plan and verify, on the
compiled module _core.

Each returns what the CLI's --json prints for the same operation, as a dict. Errors in the data
raise shardmerge.Error (a RuntimeError) with .file, .tensor and .offset; bad options raise
ValueError. merge() runs on a thread of its own with the GIL released; this thread waits for it
in short slices, so Ctrl-C (KeyboardInterrupt) and the progress callback run here, and either
one raising stops the merge, leaving no target and no temporary directory behind.
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Optional, Union

from shardmerge import _core
from shardmerge._core import Error

__all__ = ["Error", "inspect", "plan", "merge", "fold_lora", "merge_plan", "verify"]

PathLike = Union[str, "os.PathLike[str]"]
# How long the waiting thread sleeps between looks: Ctrl-C is noticed within this, and the
# progress callback is called at most once per slice.
_SLICE_S = 0.1


def _size(name: str, value: Union[str, int]) -> str:
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ValueError(f"{name}: expected a size such as '512MiB' or a number of bytes, got {value!r}")
    return str(value)


def _merge_options(local_dir: PathLike, backend: str, dtype: str, max_shard_size: Union[str, int], lora: str,
                   lora_alpha: Optional[float], force_lora_alpha: bool, tie_word_embedding: bool,
                   is_value_model: bool, role: str, hf_model_path: Optional[PathLike],
                   runtime_names: bool = False) -> _core.MergeOptions:
    o = _core.MergeOptions()
    o.local_dir = os.fspath(local_dir)
    o.backend = backend
    o.dtype = dtype
    o.max_shard_size = _size("max_shard_size", max_shard_size)
    o.lora = lora
    if lora_alpha is not None:
        if not lora_alpha > 0:
            raise ValueError(f"lora_alpha must be positive, got {lora_alpha!r}")
        o.lora_alpha = float(lora_alpha)
    o.force_lora_alpha = force_lora_alpha
    o.tie_word_embedding = tie_word_embedding
    o.is_value_model = is_value_model
    o.role = role
    o.hf_model_path = "" if hf_model_path is None else os.fspath(hf_model_path)
    o.runtime_names = runtime_names
    return o


def inspect(path: PathLike, *, tensors: bool = False) -> dict[str, Any]:
    """What `path` holds and what to run next (`shardmerge inspect --json`); reads no tensor data.

    tensors: also list every tensor ("tensor_list")."""
    return json.loads(_core.inspect(os.fspath(path), tensors))


def plan(local_dir: PathLike, *, out: Optional[PathLike] = None, backend: str = "auto", dtype: str = "default",
         max_shard_size: Union[str, int] = "5GB", lora: str = "fold", lora_alpha: Optional[float] = None,
         force_lora_alpha: bool = False, tie_word_embedding: bool = False, is_value_model: bool = False,
         role: str = "actor", hf_model_path: Optional[PathLike] = None, runtime_names: bool = False) -> dict[str, Any]:
    """The merge plan (`shardmerge plan --json`): every output tensor and the source byte ranges
    it is made of. out: also write it there as a plan file for `shardmerge merge --plan`."""
    o = _merge_options(local_dir, backend, dtype, max_shard_size, lora, lora_alpha, force_lora_alpha,
                       tie_word_embedding, is_value_model, role, hf_model_path, runtime_names)
    return json.loads(_core.plan(o, "" if out is None else os.fspath(out)))


def merge(local_dir: PathLike, target_dir: PathLike, *, backend: str = "auto", dtype: str = "default",
          max_shard_size: Union[str, int] = "5GB", lora: str = "fold", lora_alpha: Optional[float] = None,
          force_lora_alpha: bool = False, tie_word_embedding: bool = False, is_value_model: bool = False,
          role: str = "actor", hf_model_path: Optional[PathLike] = None, runtime_names: bool = False, threads: Optional[int] = None,
          memory_limit: Union[str, int] = "512MiB", device: str = "cpu", gpu_memory: Union[str, int] = "auto",
          verify: bool = False, force: bool = False, check_crc: bool = True, distributed: bool = False,
          transport: str = "auto", peer_timeout: float = 300,
          progress: Optional[Callable[[int, int], Any]] = None) -> Optional[dict[str, Any]]:
    """Merge the checkpoint at `local_dir` into the HF directory `target_dir` (created atomically);
    returns the summary `shardmerge merge --json` prints. The options are the CLI's.

    progress: called as progress(bytes_done, bytes_total) (tensor bytes) at most about ten times
    a second while the merge writes, and once more when it is done. An exception it raises stops
    the merge and propagates, as KeyboardInterrupt does.

    distributed: this process is one of those a launcher started (torchrun, mpirun: RANK and
    WORLD_SIZE in the environment), each calling merge() with the same arguments; they share the
    work, rank 0 returns the summary and the others None (no progress is reported). Off, the
    launcher's variables are ignored and this process merges alone.

    transport: what moves slices between those processes when each holds only its node's rank
    files: "nccl" (their GPUs), "mpi" (mpirun/srun), "auto" (the CLI's --transport).

    peer_timeout: seconds a process that stopped answering is waited for before the job fails
    (the CLI's --peer-timeout)."""
    if transport not in ("auto", "mpi", "nccl"):
        raise ValueError(f"transport must be 'auto', 'mpi' or 'nccl', got {transport!r}")
    w = _write_options(target_dir, threads, memory_limit, device, gpu_memory, verify, force, check_crc, distributed)
    w.transport = transport
    w.peer_timeout = float(peer_timeout)
    job = _core.MergeJob.merge(_merge_options(local_dir, backend, dtype, max_shard_size, lora, lora_alpha,
                                              force_lora_alpha, tie_word_embedding, is_value_model, role,
                                              hf_model_path, runtime_names), w)
    return _wait(job, progress)


def fold_lora(base: PathLike, adapter: PathLike, target_dir: PathLike, *, dtype: str = "auto",
              max_shard_size: Union[str, int] = "5GB", lora_alpha: Optional[float] = None,
              force_lora_alpha: bool = False, threads: Optional[int] = None, memory_limit: Union[str, int] = "512MiB",
              device: str = "cpu", gpu_memory: Union[str, int] = "auto", verify: bool = False, force: bool = False,
              check_crc: bool = True, progress: Optional[Callable[[int, int], Any]] = None) -> dict[str, Any]:
    """Fold the PEFT LoRA adapter at `adapter` into the HF model at `base` (W + scale * B @ A),
    writing the HF directory `target_dir` atomically; returns the summary `shardmerge fold-lora
    --json` prints. dtype "auto": the base's config.json torch_dtype. progress, Ctrl-C: as merge()."""
    f = _core.FoldLoraOptions()
    f.base = os.fspath(base)
    f.adapter = os.fspath(adapter)
    f.dtype = dtype
    f.max_shard_size = _size("max_shard_size", max_shard_size)
    if lora_alpha is not None:
        if not lora_alpha > 0:
            raise ValueError(f"lora_alpha must be positive, got {lora_alpha!r}")
        f.lora_alpha = float(lora_alpha)
    f.force_lora_alpha = force_lora_alpha
    job = _core.MergeJob.fold_lora(f, _write_options(target_dir, threads, memory_limit, device, gpu_memory, verify,
                                                     force, check_crc, False))
    return _wait(job, progress)


def merge_plan(plan_file: PathLike, target_dir: PathLike, *, threads: Optional[int] = None,
               memory_limit: Union[str, int] = "512MiB", device: str = "cpu", gpu_memory: Union[str, int] = "auto",
               verify: bool = False, force: bool = False, check_crc: bool = True,
               progress: Optional[Callable[[int, int], Any]] = None) -> dict[str, Any]:
    """Run a plan file written by plan(..., out=...) or `shardmerge plan --out` (`shardmerge merge
    --plan FILE`): refused if a source it reads changed since the plan was made. progress, Ctrl-C:
    as merge()."""
    job = _core.MergeJob.plan_file(os.fspath(plan_file), _write_options(target_dir, threads, memory_limit, device,
                                                                        gpu_memory, verify, force, check_crc, False))
    return _wait(job, progress)


def _write_options(target_dir: PathLike, threads: Optional[int], memory_limit: Union[str, int], device: str,
                   gpu_memory: Union[str, int], verify: bool, force: bool, check_crc: bool,
                   distributed: bool) -> _core.WriteOptions:
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 0):
        raise ValueError(f"threads must be a non-negative int or None, got {threads!r}")
    if not os.fspath(target_dir):
        raise ValueError("target_dir must not be empty")
    w = _core.WriteOptions()
    w.target = os.fspath(target_dir)
    w.threads = threads or 0
    w.memory_limit = _size("memory_limit", memory_limit)
    w.device = device
    w.gpu_memory = _size("gpu_memory", gpu_memory)
    w.verify = verify
    w.force = force
    w.no_crc = not check_crc
    w.multi_process = distributed
    return w


def _wait(job: _core.MergeJob, progress: Optional[Callable[[int, int], Any]]) -> Optional[dict[str, Any]]:
    """Waits for `job` in slices, calling progress between them; any exception raised here
    (KeyboardInterrupt, or from progress) cancels the job and is re-raised once it has unwound."""
    try:
        last = 0.0
        while not job.wait(_SLICE_S):
            done, total = job.progress()
            now = time.monotonic()
            if progress is not None and total and now - last >= _SLICE_S:
                last = now
                progress(done, total)
    except BaseException:
        job.cancel()
        try:
            job.result()  # waits for the merge to unwind: no target, no temp directory
        except Exception:
            pass  # the cancellation itself, or a failure that the exception being raised outranks
        raise
    summary = json.loads(job.result())
    done, total = job.progress()
    if progress is not None and total:
        progress(done, total)
    return summary


def verify(local_dir: PathLike, test_hf_dir: PathLike, *, atol: float = 0.0, backend: str = "auto",
           dtype: str = "default", max_shard_size: Union[str, int] = "5GB", lora: str = "fold",
           lora_alpha: Optional[float] = None, force_lora_alpha: bool = False, tie_word_embedding: bool = False,
           is_value_model: bool = False, role: str = "actor",
           hf_model_path: Optional[PathLike] = None, runtime_names: bool = False) -> dict[str, Any]:
    """Whether `test_hf_dir` holds exactly the merge of `local_dir` with these options
    (`shardmerge verify --json`): every element compared with the checkpoint assembled
    independently of the merge plan. A difference is reported (result["equal"] is False), not
    raised. atol: floating-point differences accepted (0: bitwise)."""
    o = _merge_options(local_dir, backend, dtype, max_shard_size, lora, lora_alpha, force_lora_alpha,
                       tie_word_embedding, is_value_model, role, hf_model_path, runtime_names)
    return json.loads(_core.verify(o, os.fspath(test_hf_dir), float(atol)))
