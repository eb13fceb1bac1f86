"""The long-context yardstick: cases built as documented, every policy run on each, the record and its plot."""

import json

import pytest
from transformers import AutoTokenizer

from slimlm.cli import main
from slimlm.eval import long_context, records, report
from slimlm.runtime.engine import Engine, EngineConfig
from slimlm.runtime.kv_policy import KVPolicy


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    return AutoTokenizer.from_pretrained(tiny_llama)


def _find(haystack: list[int], needle: list[int]) -> list[int]:
    return [i for i in range(len(haystack) - len(needle) + 1) if haystack[i : i + len(needle)] == needle]


@pytest.mark.parametrize("task", long_context.TASKS)
def test_each_case_hides_its_answer_at_its_depth_in_a_prompt_of_its_length(tokenizer, calib_txt, task):
    cases = long_context.make_cases(tokenizer, [task], [300, 480], samples=4, seed=3, source=str(calib_txt))
    assert [(c.length, c.depth) for c in cases] == [(n, d) for n in (300, 480) for d in (0.125, 0.375, 0.625, 0.875)]
    for case in cases:
        assert abs(len(case.prompt) - case.length) <= 2  # facts and question are tokenized apart from the filler
        assert case.answer.strip() in case.fact
        where = _find(case.prompt, tokenizer.encode(f"\n{case.fact}\n", add_special_tokens=False))
        assert len(where) == 1
        head = len(tokenizer.encode(long_context.HEADER))
        fact = len(tokenizer.encode(f"\n{case.fact}\n", add_special_tokens=False))
        question = len(tokenizer.encode("\n\n" + case.question, add_special_tokens=False))
        room = len(case.prompt) - head - question - fact  # the filler (and, for multikey, the other facts)
        if task == "multikey":  # the other three facts sit at random places, before or after it
            assert abs((where[0] - head) / room - case.depth) < 0.45
        else:
            assert where[0] - head == round(room * case.depth)
    again = long_context.make_cases(tokenizer, [task], [300, 480], samples=4, seed=3, source=str(calib_txt))
    assert [c.prompt for c in again] == [c.prompt for c in cases]  # seeded
    other = long_context.make_cases(tokenizer, [task], [300, 480], samples=4, seed=4, source=str(calib_txt))
    assert [c.answer for c in other] != [c.answer for c in cases]


def test_an_answer_is_right_when_the_output_begins_with_it():
    assert long_context.is_right(" 60574. Remember", " 60574")
    assert long_context.is_right("60574", " 60574")
    assert not long_context.is_right(" 605. Remember it.", " 60574")
    assert not long_context.is_right(" The pass key is 60574", " 60574")


def test_every_case_runs_under_every_policy_and_reports_the_kv_it_kept(tiny_llama, tokenizer, calib_txt):
    engine = Engine(str(tiny_llama), EngineConfig(block_size=8, max_model_len=500, kv_cache_memory=8 << 20))
    cases = long_context.make_cases(tokenizer, ["passkey", "copy"], [300], samples=1, source=str(calib_txt))
    policies = [KVPolicy(), KVPolicy("window", 64), KVPolicy("snapkv", 96)]
    rows = long_context.run(engine, cases, policies, progress=lambda line: None)
    assert len(rows) == 6 and [r["policy"] for r in rows] == ["full", "window", "snapkv"] * 2
    per_token = engine.runner.kv_bytes_per_token
    for case, (full, window, snap) in zip(cases, [rows[:3], rows[3:]], strict=True):
        assert full["kv_tokens"] == len(case.prompt) + full["output_tokens"] - 1  # all but the last token
        assert 64 - 8 < window["kv_tokens"] <= 64  # whole blocks after the sink, within the budget
        assert snap["kv_tokens"] == 96 + snap["output_tokens"] - 1  # the prompt down to 96, the output all kept
        assert all(r["kv_bytes"] == r["kv_tokens"] * per_token for r in (full, window, snap))
        assert (full["budget"], window["budget"], snap["budget"]) == (None, 64, 96)
    summary = long_context.summarize(rows)
    assert {(s["task"], s["policy"], s["cases"]) for s in summary} == {
        (t, p, 1) for t in ("passkey", "copy") for p in ("full", "window", "snapkv")
    }
    assert "passkey" in long_context.table(summary).splitlines()[1]
    assert engine.blocks.num_free == engine.runner.num_blocks


def test_the_command_writes_a_record_the_report_plots(tiny_llama, calib_txt, tmp_path, capsys):
    out = tmp_path / "run" / "long_context.json"
    out.parent.mkdir()
    args = ["long-context", str(tiny_llama), "--lengths", "200", "--samples", "2", "--tasks", "passkey"]
    args += ["--policies", "full,window:64", "--source", str(calib_txt), "--output", str(out)]
    assert main(args) == 0
    record = records.read(records.LongContext, json.loads(out.read_text()), str(out))
    assert record.lengths == [200] and len(record.rows) == 4 and len(record.summary) == 2
    curves = report.kv_budget_curve([report.load_run(out.parent)])
    assert list(curves) == ["run: full", "run: window"]
    (full_mib, _, full_label), (window_mib, _, window_label) = curves["run: full"][0], curves["run: window"][0]
    assert full_label == "" and window_label == "64" and window_mib < full_mib
    result = report.render([out.parent], tmp_path / "report.html")
    assert result["plots"] == 1
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(["long-context", str(tiny_llama), "--policies", "full,window"])
    assert "'window': give window a budget, e.g. window:512" in capsys.readouterr().err
    assert main(["long-context", str(tiny_llama), "--policies", "snapkv:10", "--source", str(calib_txt)]) == 2
    assert "--policies snapkv:10: kv_budget 10 is too small for kv_policy snapkv" in capsys.readouterr().err
    assert main(["long-context", str(tiny_llama), "--lengths", "256,490", "--source", str(calib_txt)]) == 2
    assert "--lengths 490 leaves no room to answer in the model's context of 512 tokens" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags,message",
    [
        (["--policies", ""], "'' names no policy there; give e.g. full,window:512,snapkv:1024"),
        (["--policies", "full:5"], "'full:5': full keeps the whole history; it takes no budget"),
        (["--policies", "full,window:64,window:64"], "'window:64' is given twice"),
        (["--lengths", "64,64"], "'64,64' gives a length twice"),
    ],
)
def test_policy_and_length_lists_refuse_empty_duplicate_and_meaningless_items(capsys, flags, message):
    from slimlm.cli import main

    with pytest.raises(SystemExit):
        main(["long-context", "m", *flags])
    assert capsys.readouterr().err.splitlines()[-1].endswith(message)


def test_a_pool_too_small_names_this_commands_lengths(tiny_llama, capsys):
    from slimlm.cli import main

    assert main(["long-context", str(tiny_llama), "--lengths", "256", "--kv-cache-memory", "64K"]) == 2
    err = capsys.readouterr().err
    assert "or lower the longest of --lengths" in err and "max-model-len" not in err and err.count("\n") == 1
