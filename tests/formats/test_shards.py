import hashlib
import json

import pytest
import torch
from safetensors import safe_open

from slimlm import SlimlmError
from slimlm.formats import shards


def tensors(n: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((256,), float(i)) for i in range(n)}  # 1 KiB each


def test_tensors_written_as_they_arrive_split_at_the_limit(tmp_path):
    writer = shards.ShardWriter(tmp_path, max_bytes=2048)
    for name, t in tensors(5).items():
        writer.add({name: t})
    files = writer.finish()
    assert files == [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([*files, shards.INDEX])
    index = json.loads((tmp_path / shards.INDEX).read_text())
    assert index["metadata"]["total_size"] == 5 * 1024
    assert index["weight_map"] == {"t0": files[0], "t1": files[0], "t2": files[1], "t3": files[1], "t4": files[2]}
    back = shards.read(tmp_path)
    assert back.keys() == tensors(5).keys()
    assert all(torch.equal(back[k], v) for k, v in tensors(5).items())


def test_one_shard_is_model_safetensors_without_an_index(tmp_path):
    writer = shards.ShardWriter(tmp_path, max_bytes=5 * 1024)
    writer.add(tensors(3))
    writer.add({"t3": torch.zeros(256), "t4": torch.ones(256)})
    assert writer.finish() == ["model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]
    assert sorted(shards.read(tmp_path)) == [f"t{i}" for i in range(5)]


def test_each_tensor_is_on_disk_once_added_and_shards_split_before_the_limit(tmp_path):
    """Nothing waits in memory: the writer's whole point (a 1.5B's float layers once outgrew a 4 GB cap)."""
    writer = shards.ShardWriter(tmp_path, max_bytes=3000)
    written = 0
    for name, t in tensors(7).items():
        writer.add({name: t})
        written += 1024
        on_disk = sum(p.stat().st_size for p in tmp_path.glob("part-*.data"))
        assert on_disk == written - 1024 * 2 * (len(writer.written))  # the open shard's data, all of it
    assert len(writer.finish()) == 4  # two tensors of 1 KiB fit under 3000 bytes
    assert not list(tmp_path.glob("*.data"))


def test_files_read_back_by_safetensors_in_every_dtype_and_shape(tmp_path):
    torch.manual_seed(0)
    made = {
        "bf16": torch.randn(3, 5).bfloat16(),
        "i32": torch.randint(-9, 9, (7,), dtype=torch.int32),
        "scalar": torch.tensor(2.5),
        "empty": torch.zeros(0, 4),
        "u8": torch.arange(9, dtype=torch.uint8),
        "strided": torch.randn(4, 6).t(),
        "f8": torch.randn(5).to(torch.float8_e4m3fn),
    }
    writer = shards.ShardWriter(tmp_path)
    writer.add(made)
    assert writer.finish() == ["model.safetensors"]
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        for name, t in made.items():
            back = f.get_tensor(name)
            assert back.dtype == t.dtype and back.shape == t.shape
            assert torch.equal(back.reshape(-1).view(torch.uint8), t.contiguous().reshape(-1).view(torch.uint8)), name


def test_write_is_one_file_below_the_limit_and_sha256_covers_every_file_in_order(tmp_path):
    assert shards.write(tmp_path, tensors(2)) == ["model.safetensors"]
    path = tmp_path / "model.safetensors"
    assert shards.total_size(tmp_path) == path.stat().st_size
    other = tmp_path / "other.bin"
    other.write_bytes(b"x" * (5 << 20))  # more than one 4 MiB chunk
    assert shards.sha256(path, other) == hashlib.sha256(path.read_bytes() + other.read_bytes()).hexdigest()
    assert shards.sha256(other, path) != shards.sha256(path, other)


def test_weight_files_from_the_index_else_model_safetensors_else_every_safetensors(tmp_path):
    for name in ("b.safetensors", "a.safetensors"):
        (tmp_path / name).write_bytes(b"")
    assert shards.weight_files(tmp_path) == [tmp_path / "a.safetensors", tmp_path / "b.safetensors"]
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert shards.weight_files(tmp_path) == [tmp_path / "model.safetensors"]
    index = {"weight_map": {"x": "m-2.safetensors", "y": "m-1.safetensors", "z": "m-2.safetensors"}}
    (tmp_path / shards.INDEX).write_text(json.dumps(index))
    assert shards.weight_files(tmp_path) == [tmp_path / "m-1.safetensors", tmp_path / "m-2.safetensors"]


@pytest.mark.parametrize("index", ["{not json", '{"metadata": {}}', '{"weight_map": 3}', "[1]", b"\xff\xfe"])
def test_a_corrupt_index_is_named(tmp_path, index):
    path = tmp_path / shards.INDEX
    path.write_bytes(index if isinstance(index, bytes) else index.encode())
    with pytest.raises(SlimlmError) as e:
        shards.weight_files(tmp_path)
    assert str(e.value) == f"{path} is corrupt; re-create or re-download the checkpoint"


def test_a_directory_without_safetensors_says_pickles_are_not_loaded(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(SlimlmError) as e:
        shards.weight_files(tmp_path)
    assert str(e.value) == f"{tmp_path} has no .safetensors weights (pickle .bin files are not loaded, for safety)"


def layout_error(path) -> str:
    with pytest.raises(SlimlmError) as e:
        shards.check_layout(path)
    return str(e.value)


def test_check_layout_accepts_an_intact_file_and_names_each_kind_of_damage(tmp_path):
    shards.write(tmp_path, tensors(2))
    path = tmp_path / "model.safetensors"
    shards.check_layout(path)
    data = path.read_bytes()
    bad, fix = f"{path} is truncated or corrupt", "re-create or re-download it"
    path.write_bytes(data[:-1])
    assert layout_error(path) == f"{bad} (expected {len(data)} bytes, found {len(data) - 1}); {fix}"
    path.write_bytes(data + b"\0")
    assert layout_error(path) == f"{bad} (expected {len(data)} bytes, found {len(data) + 1}); {fix}"
    path.write_bytes(data[:5])
    assert layout_error(path) == f"{bad} (file is 5 bytes); re-create or re-download it"
    n = int.from_bytes(data[:8], "little")
    path.write_bytes(data[: 8 + n - 1])
    assert layout_error(path) == (
        f"{bad} (header length {n} exceeds file size {8 + n - 1}); re-create or re-download it"
    )
    path.write_bytes(data[:8] + b"\xff" + data[9:])
    assert layout_error(path) == f"{bad} (unreadable header); re-create or re-download it"
    path.unlink()
    assert layout_error(path) == f"cannot read {path}: No such file or directory"


def test_an_empty_safetensors_file_has_no_data_after_its_header(tmp_path):
    shards.write(tmp_path, {})
    shards.check_layout(tmp_path / "model.safetensors")


def test_read_names_a_file_it_cannot_open_and_why(tmp_path):
    (tmp_path / "model.safetensors").mkdir()
    with pytest.raises(SlimlmError) as e:
        shards.read(tmp_path)
    assert str(e.value) == f"cannot read {tmp_path}/model.safetensors: Is a directory"


def test_read_gives_back_every_dtype_bit_for_bit(tmp_path):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, generator=g)
    written = {
        "f32": x,
        "bf16": x.bfloat16(),
        "f16": x.half(),
        "f64": x.double(),
        "fp8": x.to(torch.float8_e4m3fn),
        "i8": (x * 9).to(torch.int8),
        "u8": (x.abs() * 9).to(torch.uint8),
        "i32": (x * 1e6).int(),
        "i64": torch.arange(7),
        "bool": x > 0,
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
    }
    shards.write(tmp_path, written)
    read = shards.read(tmp_path)
    assert set(read) == set(written)
    for name, t in written.items():
        assert read[name].dtype == t.dtype and read[name].shape == t.shape, name
        assert torch.equal(read[name].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def test_read_tensors_hold_their_own_memory_not_the_files(tmp_path):
    """A tensor mapped from the file keeps the file's pages counted as the process's memory while it lives
    (a float model held its weights twice) and changes when the file does."""
    shards.write(tmp_path, tensors(3))
    path = tmp_path / "model.safetensors"
    read = shards.read(tmp_path)
    n = int.from_bytes(path.read_bytes()[:8], "little")
    with open(path, "r+b") as f:  # the data overwritten in place, the file's pages changed
        f.seek(8 + n)
        f.write(bytes(path.stat().st_size - 8 - n))
    assert all(torch.equal(read[k], v) for k, v in tensors(3).items())


def test_read_names_a_tensor_it_cannot_take(tmp_path):
    path = tmp_path / "model.safetensors"

    def file_with(entry: dict, data: bytes) -> str:
        header = json.dumps({"w": {"data_offsets": [0, len(data)], **entry}}).encode()
        path.write_bytes(len(header).to_bytes(8, "little") + header + data)
        with pytest.raises(SlimlmError) as e:
            shards.read(tmp_path)
        return str(e.value)

    unknown = file_with({"dtype": "Q4", "shape": [2]}, b"\0")
    assert unknown == f"{path}: tensor w has dtype 'Q4', which slimlm does not read"
    short = file_with({"dtype": "F32", "shape": [3]}, bytes(8))
    assert short == f"{path}: tensor w: 8 bytes do not hold shape [3] of F32; the file is corrupt"


def test_shards_carry_the_pt_format_tag_and_the_index_is_indented_json(tmp_path):
    """transformers refuses safetensors files whose metadata lacks format=pt."""
    writer = shards.ShardWriter(tmp_path, max_bytes=1024)
    writer.add(tensors(2))
    files = writer.finish()
    for name in files:
        with safe_open(tmp_path / name, framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
    text = (tmp_path / shards.INDEX).read_text()
    assert text == json.dumps(json.loads(text), indent=2) + "\n"


def test_a_header_length_past_2_63_is_too_long_not_negative(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"\xff" * 8 + b"{}")
    assert layout_error(path) == (
        f"{path} is truncated or corrupt (header length {2**64 - 1} exceeds file size 10); re-create or re-download it"
    )
