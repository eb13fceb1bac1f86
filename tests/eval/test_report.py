"""`compress report` from real run directories (a float run and an RTN W4 run of the tiny model, each
with eval.json and bench.json): the numbers it shows are the runs' own, the Pareto frontier is right, bad
run directories are named, and the page renders in headless Chromium with its tables and images loaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess

import pytest

from slimlm.cli import main
from slimlm.eval import report

BENCH = [
    "--batch",
    "1,2",
    "--context",
    "32",
    "--prefill-len",
    "16",
    "--requests",
    "3",
    "--rate",
    "50",
    "--prompt-len",
    "8,12",
    "--output-len",
    "2,4",
    "--kv-cache-memory",
    "4M",
]


@pytest.fixture(scope="module")
def runs(tiny_llama, calib_txt, tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    float_run, w4_run = root / "float", root / "rtn-w4"
    float_run.mkdir()
    (float_run / "run.json").write_text(json.dumps({"name": "float", "model": str(tiny_llama)}))
    assert main(["rtn", "--model", str(tiny_llama), "--group-size", "32", "--out", str(w4_run / "model")]) == 0
    (w4_run / "run.json").write_text(json.dumps({"name": "rtn-w4", "model": str(w4_run / "model")}))
    for run, model, baseline in ((float_run, tiny_llama, "none"), (w4_run, w4_run / "model", str(tiny_llama))):
        assert (
            main(
                [
                    "eval",
                    str(model),
                    "--ppl",
                    str(calib_txt),
                    "--max-tokens",
                    "2048",
                    "--seq-len",
                    "128",
                    "--output",
                    str(run / "eval.json"),
                ]
            )
            == 0
        )
        assert main(["bench", str(model), "--baseline", baseline, *BENCH, "--json", str(run / "bench.json")]) == 0
    return [float_run, w4_run]


def test_the_report_shows_each_runs_own_numbers(runs, tmp_path, capsys):
    out = tmp_path / "report.html"
    assert main(["report", *map(str, runs), "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "rtn-w4" in text and f"report: {out}" in text
    result = report.render(runs, tmp_path / "again.html")
    float_run, w4 = result["runs"]
    evaluation = json.loads((runs[1] / "eval.json").read_text())
    bench = json.loads((runs[1] / "bench.json").read_text())
    assert w4["wiki_ppl"] == evaluation["perplexity"] and w4["method"].startswith("rtn (bits=4, group_size=32")
    assert w4["ppl_change"] == pytest.approx(evaluation["perplexity"] / float_run["wiki_ppl"] - 1)
    base_b1 = bench["systems"]["baseline"]["offline"]["decode"][0]["tok_s"]
    assert w4["speedup_b1"] == pytest.approx(bench["systems"]["model"]["offline"]["decode"][0]["tok_s"] / base_b1)
    assert w4["memory_ratio"] < 1 and float_run["method"] == "float" and result["plots"] == 3
    html = out.read_text()
    assert html.count("<img") == 3 and "data:image/png;base64," in html and html.count("<tr") >= 2 + 4 + 7


def test_the_report_replaces_no_file_unless_asked_and_never_a_checkpoints(runs, tiny_llama, tmp_path, capsys):
    out = tmp_path / "report.html"
    out.write_text("mine")
    for target, fragment in (
        (out, "exists; pass --overwrite to replace it"),
        (tmp_path, "is a directory; name a file"),
        (tiny_llama / "config.json", "is in a checkpoint's directory"),
        (tiny_llama / "tokenizer.json", "is in a checkpoint's directory"),
        (runs[0] / "eval.json", "is one of this command's inputs"),
    ):
        before = target.read_text() if target.is_file() else None
        asked = [] if target == out else ["--overwrite"]  # asking does not make the others writable
        assert main(["report", *map(str, runs), "--out", str(target), *asked]) == 2
        err = capsys.readouterr().err
        assert fragment in err and err.count("\n") == 1 and "Traceback" not in err
        assert before is None or target.read_text() == before
    assert main(["report", *map(str, runs), "--out", str(out), "--overwrite"]) == 2  # not a report: kept
    assert "exists and is not a slimlm result (JSON or report)" in capsys.readouterr().err
    assert out.read_text() == "mine"
    out.unlink()
    for _ in range(2):  # then its own report, replaced
        assert main(["report", *map(str, runs), "--out", str(out), "--overwrite"]) == 0
    assert "<html" in out.read_text()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temp file left


def test_a_busy_machine_is_flagged_in_the_report(runs, tmp_path):
    busy = tmp_path / "busy"
    shutil.copytree(runs[1], busy)
    bench = json.loads((busy / "bench.json").read_text())
    bench["warnings"] = ["warning: other processes kept 1.9 of 2 cores busy during the baseline's offline measurement"]
    (busy / "bench.json").write_text(json.dumps(bench))
    result = report.render([runs[0], busy], tmp_path / "report.html")
    assert "rtn-w4: warning: other processes kept 1.9" in report.main_table(result["runs"])
    assert "rtn-w4: warning: other processes kept 1.9" in (tmp_path / "report.html").read_text()


def test_pareto_keeps_the_points_nothing_beats():
    points = [(10.0, 5.0), (20.0, 6.0), (15.0, 7.0), (5.0, 4.0), (20.0, 5.5)]
    assert report.pareto(points, x_higher=True) == [0, 3, 4]  # (15, 7) and (20, 6) are beaten
    assert report.pareto(points, x_higher=False) == [3]


def test_bad_run_directories_are_named(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty), "--out", str(tmp_path / "r.html")]) == 2
    assert "has none of eval.json, bench.json, long_context.json" in capsys.readouterr().err
    (empty / "eval.json").write_text("{not json")
    assert main(["report", str(empty), "--out", str(tmp_path / "r.html")]) == 2
    assert "eval.json is not valid JSON" in capsys.readouterr().err
    assert not (tmp_path / "r.html").exists()


def chromium() -> str:
    """Debian's chromium, installed when missing (as root with apt); the test skips only where it cannot be."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        pytest.skip("chromium is not installed and this machine cannot install it (needs apt-get as root)")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", "chromium"],
    ):
        if subprocess.run(command, capture_output=True, env=env, timeout=900).returncode != 0:
            pytest.skip(f"chromium could not be installed ({' '.join(command)} failed)")
    return shutil.which("chromium")


CHECK = """<script>
window.addEventListener("load", () => {
  const images = [...document.images];
  const broken = images.filter(i => !(i.complete && i.naturalWidth > 0)).length;
  const tables = document.querySelectorAll("table").length;
  document.body.insertAdjacentHTML("beforeend",
    `<div id="check">images=${images.length} broken=${broken} tables=${tables}</div>`);
});
</script></body>"""


def test_the_report_renders_in_headless_chromium(runs, tmp_path):
    browser = chromium()
    out = tmp_path / "report.html"
    report.render(runs, out)
    probe = tmp_path / "probe.html"
    probe.write_text(out.read_text().replace("</body>", CHECK))
    flags = [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--virtual-time-budget=5000",
    ]
    dom = subprocess.run([*flags, "--dump-dom", probe.as_uri()], capture_output=True, text=True, timeout=120)
    assert 'id="check">images=3 broken=0 tables=3<' in dom.stdout, dom.stderr[-2000:]
    shot = tmp_path / "report.png"
    subprocess.run(
        [*flags, f"--screenshot={shot}", "--window-size=1300,1800", out.as_uri()], capture_output=True, timeout=120
    )
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
