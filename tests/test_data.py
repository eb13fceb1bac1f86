import pytest
import torch
from transformers import AutoTokenizer

from slimlm import SlimlmError, data


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def test_windows_are_deterministic_and_cut_from_one_stream(tokenizer, calib_txt):
    a = data.calibration_windows(str(calib_txt), tokenizer, 8, 64, seed=3)
    b = data.calibration_windows(str(calib_txt), tokenizer, 8, 64, seed=3)
    c = data.calibration_windows(str(calib_txt), tokenizer, 8, 64, seed=4)
    assert a.shape == (8, 64) and a.dtype == torch.long
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert (a == tokenizer.eos_token_id).any()  # passages are joined with EOS, not dropped when short


def test_jsonl_source(tokenizer, tmp_path):
    f = tmp_path / "c.jsonl"
    f.write_text('{"text": "the city river music"}\n\n{"text": "school team war"}\n')
    assert data.passages(str(f)) == ["the city river music", "school team war"]


@pytest.mark.parametrize(
    "name,content,msg",
    [
        ("empty.txt", "\n\n  \n", "holds no text"),
        ("bad.jsonl", '{"text": "ok"}\nnot json\n', r"bad.jsonl:2 is not a JSON object"),
        ("notext.jsonl", '{"body": "x"}\n', r"notext.jsonl:1 is not a JSON object with a \"text\" field"),
    ],
)
def test_bad_files(tmp_path, name, content, msg):
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(SlimlmError, match=msg):
        data.passages(str(f))


def test_missing_file_and_unknown_source(tmp_path):
    with pytest.raises(SlimlmError, match="does not exist"):
        data.passages(str(tmp_path / "nope.txt"))
    with pytest.raises(SlimlmError, match="unknown text source 'c5'; use one of owt, wiki, c4, wikitext2"):
        data.passages("c5")


def test_too_little_text(tokenizer, tmp_path):
    f = tmp_path / "short.txt"
    f.write_text("the city river")
    with pytest.raises(SlimlmError, match="yields only 0 windows of 64 tokens"):
        data.calibration_windows(str(f), tokenizer, 2, 64)


def test_hub_unreachable_names_the_offline_alternative():
    with pytest.raises(SlimlmError, match=r"cannot fetch 'c4'.*offline, use --calib owt"):
        data.passages("c4")
