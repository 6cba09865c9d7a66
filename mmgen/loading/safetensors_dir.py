"""Read safetensors checkpoints (single file or sharded with an index) and assign them to modules.

Every failure is a LoadError naming the file and the tensor, never a bare KeyError or a silent skip.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from mmgen.errors import LoadError
from mmgen.placement.tensors import PinnedStore
from mmgen.placement.upload import Claims, FileBytes, upload

INDEX_SUFFIX = ".safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"
MAX_HEADER_BYTES = 100 << 20  # the safetensors format's own limit

# What a load reads of a module's checkpoint tensors (load_into_module's `read`): all, none, or the pieces
# its claims give it (a process's part of a load its world shares, mmgen.parallel.share.SplitReads)
Reads = bool | Claims


def find_weight_files(directory: Path) -> list[Path]:
    """The safetensors files of a component directory: those its index names, else all of them."""
    directory = Path(directory)
    if not directory.is_dir():
        raise LoadError(f"{directory}: not a directory")
    indexes = sorted(directory.glob(f"*{INDEX_SUFFIX}"))
    if indexes:
        index = indexes[0]
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError) as err:
            raise LoadError(f"{index}: unreadable shard index ({err})") from err
        files = [directory / name for name in sorted(set(weight_map.values()))]
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise LoadError(f"{index}: names shard files that do not exist: {', '.join(missing)}")
        return files
    files = sorted(directory.glob(f"*{SAFETENSORS_SUFFIX}"))
    if not files:
        raise LoadError(f"{directory}: no *.safetensors weight files")
    return files


def read_tensors(
    files: list[Path], device: str | torch.device = "cpu"
) -> dict[str, tuple[torch.Tensor, Path]]:
    """All tensors of the files as {name: (tensor, file it came from)}; a name in two files is an error."""
    tensors: dict[str, tuple[torch.Tensor, Path]] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt", device=str(device)) as handle:
                for name in handle.keys():
                    if name in tensors:
                        raise LoadError(f"{path}: tensor {name!r} also appears in {tensors[name][1]}")
                    tensors[name] = (handle.get_tensor(name), path)
        except LoadError:
            raise
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise LoadError(f"{path}: not a readable safetensors file ({err})") from err
    return tensors


def tensor_offsets(path: Path) -> dict[str, int]:
    """{tensor name: the file offset of its first byte} from a safetensors file's header."""
    return {name: start for name, (start, _) in _tensor_spans(path).items()}


def _tensor_spans(path: Path) -> dict[str, tuple[int, int]]:
    """{tensor name: its bytes [start, end) in the file} from a safetensors file's header (8 bytes of
    little-endian header length, the JSON header, then the data its `data_offsets` count from)."""
    try:
        with open(path, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            if not 0 < length <= min(MAX_HEADER_BYTES, os.fstat(handle.fileno()).st_size - 8):
                raise ValueError(f"a header of {length} bytes")
            header = json.loads(handle.read(length))
        data = 8 + length
        return {
            name: (data + info["data_offsets"][0], data + info["data_offsets"][1])
            for name, info in header.items()
            if name != "__metadata__"
        }
    except (OSError, ValueError, KeyError, TypeError, IndexError) as err:
        raise LoadError(f"{path}: not a readable safetensors header ({err})") from err


def load_into_module(
    module: torch.nn.Module,
    tensors: Mapping[str, tuple[torch.Tensor, Path]],
    *,
    source: Path,
    dtype: torch.dtype,
    device: str | torch.device,
    rename: Callable[[str], str | None] = lambda name: name,
    ignore: Callable[[str], bool] = lambda name: False,
    keep_fp32: Callable[[str], bool] = lambda name: False,
    host: PinnedStore | None = None,
    read: Reads = True,
    keep_unread: bool = True,
) -> torch.nn.Module:
    """Assign checkpoint tensors to a module built on the meta device; weights are allocated once.

    rename maps a checkpoint key to the module's parameter name (None drops it as known-unused).
    Missing keys, unknown keys and wrong shapes each raise a LoadError naming file and tensor.
    keep_fp32(parameter name) True stores that tensor in float32 whatever `dtype` is (the norms and
    modulation tables a reference keeps in fp32 when the rest runs in bf16).
    Buffers not in the checkpoint (non-persistent tables) are materialized by `module.init_buffers()`
    when the module defines it.
    host: with device 'cpu', each tensor is read (and cast) straight into a buffer of this store, then
    page-locked: the memory an offload placement will copy from (mmgen.placement.PinnedStore); the
    checkpoint's memory-mapped file is the only other copy.
    read: False = each tensor allocated on `device` in the dtype a read gives it, uninitialized, and no
    byte read (the checks above run on the files' headers); Claims: the pieces (mmgen.placement.upload.
    read_pieces) this process reads, the rest allocated so: a rank's part of the reads its world shares
    (mmgen.parallel.share.SplitReads, share_reads sending each piece from the rank that read it). Only
    True with `host`.
    keep_unread: False = a tensor this process reads no byte of is left on the meta device, not
    allocated: a rank that reads part of a module only to send it to the rank that keeps it (the text
    encoder's, SplitReads).
    A tensor named beside a .safetensors file is taken to be that file's tensor of its key (as
    read_tensors gives it): a read to a GPU (or a partial one) takes its bytes from the file with
    os.preadv (mmgen.placement.upload); any other (a .pth file's, one made in memory) is copied from the
    tensor itself.
    """
    expected = dict(module.state_dict(keep_vars=True))
    state: dict[str, torch.Tensor] = {}
    sources: dict[str, tuple[Path, str]] = {}  # each parameter's file and checkpoint key
    for key, (tensor, path) in tensors.items():
        if ignore(key):
            continue
        name = rename(key)
        if name is None:
            continue
        if name not in expected:
            raise LoadError(f"{path}: unknown tensor {key!r} (no such parameter in {type(module).__name__})")
        want = tuple(expected[name].shape)
        if tuple(tensor.shape) != want:
            raise LoadError(
                f"{path}: tensor {key!r} has shape {tuple(tensor.shape)}, the model expects {want}"
            )
        if name in state:
            raise LoadError(f"{path}: tensor {key!r} maps to {name!r}, which another tensor already filled")
        state[name] = tensor
        sources[name] = (path, key)
    missing = sorted(set(expected) - set(state))
    if missing:
        shown = ", ".join(missing[:5]) + (f" (+{len(missing) - 5} more)" if len(missing) > 5 else "")
        raise LoadError(f"{source}: checkpoint lacks tensors the model needs: {shown}")
    dtypes = {name: _target_dtype(t, name, dtype, keep_fp32) for name, t in state.items()}
    if read is not True and host is not None:
        raise ValueError(
            "load_into_module: a read of part of the tensors allocates on the device; no host store"
        )
    if host is not None and torch.device(device).type == "cpu":
        # read (and cast) by several threads straight into the store's buffers
        cast = upload(state, dtypes, "cpu", files=_file_bytes(sources), allocate=host.empty)
        host.lock()  # the pages the reads wrote, page-locked now (fast once written)
    elif read is False:
        cast = {}
    else:
        # On a GPU: read in parallel through page-locked buffers, cast on the GPU (no CPU copy).
        claims = None if read is True else read
        files = _file_bytes(sources)
        cast = upload(state, dtypes, device, claims=claims, allocate_all=keep_unread, files=files)
    unread = device if keep_unread else "meta"
    for name in state.keys() - cast.keys():
        cast[name] = torch.empty(state[name].shape, dtype=dtypes[name], device=unread)
    module.load_state_dict(cast, assign=True, strict=True)
    init_buffers = getattr(module, "init_buffers", None)
    if callable(init_buffers):
        init_buffers()
    return module


def _file_bytes(sources: Mapping[str, tuple[Path, str]]) -> dict[str, FileBytes]:
    """{parameter: where its bytes lie} for those whose source (file, checkpoint key) is a .safetensors
    file, which holds each tensor's bytes at the offset its header gives; any other is left out (copied)."""
    in_files = {path for path, _ in sources.values() if Path(path).suffix == SAFETENSORS_SUFFIX}
    offsets = {path: tensor_offsets(path) for path in in_files}
    return {name: (path, offsets[path][key]) for name, (path, key) in sources.items() if path in in_files}


def _target_dtype(
    tensor: torch.Tensor, name: str, dtype: torch.dtype, keep_fp32: Callable[[str], bool]
) -> torch.dtype:
    if not tensor.is_floating_point():
        return tensor.dtype
    return torch.float32 if keep_fp32(name) else dtype


def checkpoint_bytes(files: list[Path], counted: Callable[[str], bool] = lambda key: True) -> int:
    """The bytes of the `counted` tensors of safetensors files, from their headers (no tensor read)."""
    return sum(
        end - start for path in files for key, (start, end) in _tensor_spans(path).items() if counted(key)
    )


def read_json(path: Path) -> dict:
    """A JSON config file as a dict, with a LoadError naming the file when missing, malformed or not an object."""
    path = Path(path)
    if not path.is_file():
        raise LoadError(f"{path}: file not found")
    try:
        data = json.loads(path.read_text())
    except ValueError as err:
        raise LoadError(f"{path}: not valid JSON ({err})") from err
    # Every config file mmgen reads is an object; a list or scalar would fail later on .get().
    if not isinstance(data, dict):
        raise LoadError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
