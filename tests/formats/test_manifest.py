"""slimlm.json: written with the tool and the files' digests, read back, and checked before loading."""

import json

import pytest
import torch
from safetensors.torch import save_file

from slimlm import SlimlmError, __version__
from slimlm.formats import manifest, shards


def checkpoint(tmp_path):
    save_file({"w": torch.ones(3)}, tmp_path / "model.safetensors")
    meta = {"method": "rtn", "arguments": {"bits": 4}}
    manifest.write(tmp_path, meta, ["model.safetensors"])
    return meta


def test_written_with_tool_size_and_digests_as_indented_json(tmp_path):
    meta = checkpoint(tmp_path)
    assert meta == {"method": "rtn", "arguments": {"bits": 4}}  # the caller's dict is left alone
    text = (tmp_path / "slimlm.json").read_text()
    data = json.loads(text)
    assert text == json.dumps(data, indent=2) + "\n"
    assert data["tool"] == f"slimlm {__version__}"
    assert data["size_bytes"] == (tmp_path / "model.safetensors").stat().st_size
    assert data["files"] == {"model.safetensors": shards.sha256(tmp_path / "model.safetensors")}
    assert manifest.read(tmp_path) == data
    manifest.verify(tmp_path)


def test_read_without_a_manifest_is_none(tmp_path):
    assert manifest.read(tmp_path) is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"\xff\xfe{",
            "is unreadable ('utf-8' codec can't decode byte 0xff in position 0: invalid start byte); "
            "re-create the checkpoint",
        ),
        (b"[1, 2]", "is not a slimlm manifest; re-create the checkpoint"),
        (b'{"files": ["model.safetensors"]}', "is not a slimlm manifest; re-create the checkpoint"),
    ],
)
def test_a_broken_manifest_is_named(tmp_path, content, message):
    (tmp_path / "slimlm.json").write_bytes(content)
    with pytest.raises(SlimlmError) as e:
        manifest.read(tmp_path)
    assert str(e.value) == f"{tmp_path / 'slimlm.json'} {message}"


def test_verify_names_a_missing_shard_a_missing_listed_file_and_a_changed_one(tmp_path):
    checkpoint(tmp_path)
    (tmp_path / shards.INDEX).write_text(json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(SlimlmError) as e:
        manifest.verify(tmp_path)
    assert str(e.value) == (
        f"checkpoint {tmp_path} is missing model-00001-of-00001.safetensors; re-create or re-download it"
    )
    (tmp_path / shards.INDEX).unlink()
    data = json.loads((tmp_path / "slimlm.json").read_text())
    data["files"]["extra.safetensors"] = "0" * 64
    (tmp_path / "slimlm.json").write_text(json.dumps(data))
    with pytest.raises(SlimlmError) as e:
        manifest.verify(tmp_path)
    assert str(e.value) == f"checkpoint {tmp_path} is missing extra.safetensors; re-create it"
    save_file({"w": torch.zeros(3)}, tmp_path / "extra.safetensors")
    with pytest.raises(SlimlmError) as e:
        manifest.verify(tmp_path)
    assert str(e.value) == (
        f"{tmp_path / 'extra.safetensors'} does not match the sha256 in slimlm.json (corrupted); re-create it"
    )
