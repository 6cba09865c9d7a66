"""mmgen.placement.upload: checkpoint tensors copied by several threads (into host buffers, or to a GPU
through page-locked chunks, cast there) hold exactly what torch's own copy or cast gives."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from mmgen.errors import LoadError
from mmgen.loading.safetensors_dir import load_into_module, read_tensors, tensor_offsets
from mmgen.placement import upload as upload_module
from mmgen.placement.upload import upload


def checkpoint(tmp_path, count: int = 9) -> dict[str, torch.Tensor]:
    """Memory-mapped tensors of several sizes and dtypes (as read_tensors gives them), written once."""
    generator = torch.Generator().manual_seed(0)
    tensors = {
        f"w{i}": torch.randn(1 + 37 * i, 5 + i, generator=generator).to(
            (torch.float32, torch.bfloat16, torch.float16)[i % 3]
        )
        for i in range(count)
    }
    tensors["step"] = torch.tensor(7, dtype=torch.int64)  # a 0-d integer tensor keeps its dtype
    save_file(tensors, str(tmp_path / "w.safetensors"))
    return {name: t for name, (t, _) in read_tensors([tmp_path / "w.safetensors"]).items()}


def test_allocate_makes_every_result_and_each_is_read_on_the_cpu_too(tmp_path):
    """allocate (a PinnedStore's empty for an offload placement): every result is the allocator's, read
    by the workers (from the file; one cast, from its mapping), none kept as the mapped tensor."""
    source, _, files = in_files(tmp_path)
    dtypes = {name: torch.float32 if t.is_floating_point() else t.dtype for name, t in source.items()}
    made = {}

    def allocate(shape, dtype):
        made[len(made)] = torch.empty(shape, dtype=dtype)
        return made[len(made) - 1]

    out = upload(source, dtypes, "cpu", files=files, allocate=allocate)
    assert len(made) == len(source)
    assert {id(t) for t in out.values()} == {id(t) for t in made.values()}
    for name, t in source.items():
        assert out[name].dtype == dtypes[name] and torch.equal(out[name], t.to(dtypes[name])), name


def test_pieces_cover_every_byte_once_cut_and_grouped_near_the_piece_size(tmp_path, monkeypatch):
    """Any worker (or rank) may take a piece: a large tensor kept in its dtype is cut, small ones are
    grouped, a tensor cast on the device is one whole span (cast once all its bytes arrived)."""
    monkeypatch.setattr(upload_module, "PIECE_BYTES", 1000)
    source = checkpoint(tmp_path, count=12)
    dtypes = {name: torch.bfloat16 if t.is_floating_point() else t.dtype for name, t in source.items()}
    pieces = upload_module.read_pieces(source, dtypes)
    for name, t in source.items():
        spans = sorted((first, end) for piece in pieces for item, first, end in piece if item == name)
        size = upload_module._nbytes(t)
        if t.dtype != dtypes[name]:
            assert spans == [(0, -1)]
            continue
        assert spans[0][0] == 0 and spans[-1][1] == size
        assert all(end == following for (_, end), (following, _) in zip(spans, spans[1:], strict=False))
    sizes = [upload_module.piece_bytes(piece, source) for piece in pieces]
    grouped = [size for piece, size in zip(pieces, sizes, strict=True) if piece[0][2] >= 0]
    assert all(size <= 2000 for size in grouped)  # below the limit plus one span
    assert sum(1 for piece in pieces if len(piece) > 1) > 0  # small tensors grouped


def test_a_process_reads_only_the_pieces_it_claims_and_allocates_those_alone(tmp_path, monkeypatch):
    """claims: this process's part of a shared load; the rest is left for another (allocate_all False:
    not even allocated)."""
    monkeypatch.setattr(upload_module, "MIN_PIECE_BYTES", 64)  # several pieces of this small load
    source = checkpoint(tmp_path, count=12)
    dtypes = {name: torch.float32 if t.is_floating_point() else t.dtype for name, t in source.items()}
    seen = {}

    def odd(pieces, sizes):
        seen["pieces"] = pieces
        mine = iter(range(1, len(pieces), 2))
        return lambda: next(mine, None)

    out = upload(source, dtypes, "cpu", claims=odd, allocate_all=False)
    where = {
        name: {i % 2 for i, piece in enumerate(seen["pieces"]) for n, _, _ in piece if n == name}
        for name in source
    }
    assert len(seen["pieces"]) > 4 and {1} in where.values() and {0} in where.values()
    assert set(out) == {name for name, parities in where.items() if 1 in parities}
    for name, parities in where.items():
        if parities == {1}:
            assert torch.equal(out[name], source[name].to(dtypes[name])), name


def in_files(tmp_path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict]:
    """checkpoint()'s tensors, the same as meta tensors (shapes and dtypes, no bytes), and where each
    one's bytes lie in the file."""
    source = checkpoint(tmp_path, count=12)
    path = tmp_path / "w.safetensors"
    offsets = tensor_offsets(path)
    shapes = {name: torch.empty(t.shape, dtype=t.dtype, device="meta") for name, t in source.items()}
    return source, shapes, {name: (path, offsets[name]) for name in source}


def every_piece(pieces, sizes):
    return upload_module._every(pieces, sizes)


def test_with_files_a_worker_reads_the_bytes_from_the_files(tmp_path, monkeypatch):
    """files: the workers read each tensor kept in its dtype from its file (os.preadv); the tensors give
    only shapes and dtypes (meta here: a copy from them fails)."""
    monkeypatch.setattr(upload_module, "MIN_PIECE_BYTES", 64)  # pieces over both workers
    source, shapes, files = in_files(tmp_path)
    dtypes = {name: t.dtype for name, t in source.items()}
    out = upload(shapes, dtypes, "cpu", claims=every_piece, files=files)
    for name, t in source.items():
        assert out[name].dtype == dtypes[name] and torch.equal(out[name], t.to(dtypes[name])), name


def test_a_file_that_ends_inside_a_tensor_is_a_load_error_naming_it(tmp_path):
    source, shapes, files = in_files(tmp_path)
    dtypes = {name: t.dtype for name, t in source.items()}
    path = tmp_path / "w.safetensors"
    last = max(source, key=lambda name: files[name][1])
    path.write_bytes(path.read_bytes()[: files[last][1] + 1])  # the last tensor's first byte only
    with pytest.raises(LoadError, match=f"w.safetensors: the file ends inside tensor '{last}'"):
        upload(shapes, dtypes, "cpu", claims=every_piece, files=files)


def test_load_into_module_reads_a_safetensors_tensor_from_its_file_and_copies_any_other(tmp_path):
    """The tensors named beside a .safetensors file are read from the file (meta stand-ins: a copy from them
    fails), those beside another file (a .pth, or a name for tensors made in memory) are copied."""
    module = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    state = {name: t.detach().clone() for name, t in module.state_dict().items()}
    path = tmp_path / "m.safetensors"
    save_file(state, str(path))
    stand_ins = {name: (torch.empty(t.shape, device="meta"), path) for name, t in state.items()}

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))

    loaded = load_into_module(
        build(), stand_ins, source=path, dtype=torch.float32, device="cpu", read=every_piece
    )
    assert all(torch.equal(loaded.state_dict()[name], t) for name, t in state.items())
    elsewhere = {name: (t, tmp_path / "m.pth") for name, (t, _) in stand_ins.items()}
    with pytest.raises(NotImplementedError):  # copied from the meta stand-ins
        load_into_module(build(), elsewhere, source=path, dtype=torch.float32, device="cpu", read=every_piece)


def test_a_file_gone_before_its_read_is_a_load_error_naming_it(tmp_path):
    source, shapes, files = in_files(tmp_path)
    (tmp_path / "w.safetensors").unlink()
    dtypes = {name: t.dtype for name, t in source.items()}
    with pytest.raises(LoadError, match="w.safetensors: cannot be opened to read its tensors"):
        upload(shapes, dtypes, "cpu", claims=every_piece, files=files)


def test_offsets_of_a_file_that_is_not_safetensors_are_a_load_error(tmp_path):
    """A .pth's first 8 bytes read as a header length are huge: refused, not read (it was a MemoryError)."""
    path = tmp_path / "t5.pth"
    torch.save({"w": torch.zeros(4)}, path)
    with pytest.raises(LoadError, match="t5.pth: not a readable safetensors header"):
        tensor_offsets(path)


def test_upload_on_the_cpu_is_a_cast(tmp_path):
    source = checkpoint(tmp_path)
    dtypes = {name: torch.float32 if t.is_floating_point() else t.dtype for name, t in source.items()}
    out = upload(source, dtypes, "cpu")
    assert list(out) == list(source)
    for name, t in source.items():
        assert out[name].dtype == dtypes[name] and torch.equal(out[name], t.to(dtypes[name])), name


def test_a_worker_error_reaches_the_caller():
    def fails():
        raise RuntimeError("disk went away")

    with pytest.raises(RuntimeError, match="disk went away"):
        upload_module.run_parallel([lambda: None, fails])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_upload_to_cuda_equals_torch_cast(tmp_path, monkeypatch):
    monkeypatch.setattr(upload_module, "CHUNK_BYTES", 4096)  # many chunks per tensor, both buffers reused
    monkeypatch.setattr(upload_module, "PIECE_BYTES", 3 * 4096 + 512)  # pieces over several workers
    source = checkpoint(tmp_path, count=30)
    dtypes = {name: torch.bfloat16 if t.is_floating_point() else t.dtype for name, t in source.items()}
    dtypes["w0"] = torch.float32  # a tensor kept in its checkpoint dtype lands directly
    out = upload(source, dtypes, "cuda")
    for name, t in source.items():
        assert out[name].device.type == "cuda" and out[name].dtype == dtypes[name], name
        assert torch.equal(out[name].cpu(), t.to(dtypes[name])), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_upload_to_cuda_from_files_equals_torch_cast(tmp_path, monkeypatch):
    """The same through os.preadv from the file: the staging buffers take several small spans each."""
    monkeypatch.setattr(upload_module, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(upload_module, "PIECE_BYTES", 3 * 4096 + 512)
    source, shapes, files = in_files(tmp_path)
    dtypes = {name: torch.bfloat16 if t.is_floating_point() else t.dtype for name, t in source.items()}
    dtypes["w0"] = torch.float32
    out = upload(shapes, dtypes, "cuda", files=files)
    for name, t in source.items():
        assert torch.equal(out[name].cpu(), t.to(dtypes[name])), name


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_upload_to_bare_cuda_on_a_second_gpu(tmp_path, monkeypatch):
    """A rank whose current device is cuda:1 uploads to "cuda": the worker threads (whose own current
    device is cuda:0) must copy, stage and wait on cuda:1 (a cuda:0 stream missed the copies, so a
    staging buffer was refilled in flight: weights differed from run to run on the second rank)."""
    monkeypatch.setattr(upload_module, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(upload_module, "PIECE_BYTES", 3 * 4096 + 512)
    source = checkpoint(tmp_path, count=60)
    dtypes = {name: torch.bfloat16 if t.is_floating_point() else t.dtype for name, t in source.items()}
    with torch.cuda.device(1):
        out = upload(source, dtypes, "cuda")
    for name, t in source.items():
        assert out[name].device == torch.device("cuda", 1), name
        assert torch.equal(out[name].cpu(), t.to(dtypes[name])), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_load_into_module_on_cuda_keeps_fp32_where_asked(tmp_path):
    module = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32))
    state = {name: t.detach().clone() for name, t in module.state_dict().items()}
    save_file(state, str(tmp_path / "m.safetensors"))
    with torch.device("meta"):
        target = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.LayerNorm(32))
    load_into_module(
        target,
        read_tensors([tmp_path / "m.safetensors"]),
        source=tmp_path,
        dtype=torch.bfloat16,
        device="cuda",
        keep_fp32=lambda name: name.startswith("1."),
    )
    assert target[0].weight.dtype == torch.bfloat16 and target[1].weight.dtype == torch.float32
    assert torch.equal(target[0].weight.cpu(), state["0.weight"].bfloat16())
    assert torch.equal(target[1].weight.cpu(), state["1.weight"])
