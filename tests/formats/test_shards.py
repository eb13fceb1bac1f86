import json

import torch

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


def test_a_write_flushes_what_has_gathered_before_the_limit_is_passed(tmp_path):
    """Nothing past max_bytes waits in memory: the writer's whole point."""
    writer = shards.ShardWriter(tmp_path, max_bytes=3000)
    for name, t in tensors(7).items():
        writer.add({name: t})
        assert writer.pending_bytes <= 3000
    assert len(writer.finish()) == 4  # two tensors of 1 KiB fit under 3000 bytes
