"""bench/gpu/results_file.py: one results file from a session's returned files (a side-by-side summary,
warm_repeats JSONs, trace comparisons), each recognized by its content; bad input named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "results_file.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def test_the_files_are_merged_by_kind(tmp_path):
    summary = {"gpu": "NVIDIA H200", "commit": "abc", "tg_tok_s_stock": 102.7, "tg_tok_s_patched": 180.1,
               "pause_ms_32k": 44.2, "builds": {}, "settings_per_call": ["MC_GDN_ONE=0"],
               "command": "OUT=DIR bash bench/gpu/side_by_side.sh"}  # fmt: skip
    warm = {"kind": "warm_repeats", "summary": {"on": {}}, "command": "warm_repeats.py ..."}
    compare = {"np1": {"span_delta_us": -120.0}}
    trace = {"by_name": [], "span_us_median": 6530.0, "steps": 70}
    named = {"summary": summary, "warm": warm, "warm32k": warm, "trace_compare": compare}
    named["trace_defaults"] = trace
    named["gdn"] = {"lab": "gdn", "gpu": "NVIDIA H100", "rows": [{"variant": "wide", "us": 11.4}]}
    for name, data in named.items():
        (tmp_path / f"{name}.json").write_text(json.dumps(data))
    out = tmp_path / "res.json"
    files = [str(tmp_path / f"{n}.json") for n in named]
    res = run(
        "--out", str(out), "--what", "run CI", "--command", "calls.sh ...", "--device-seconds", "1700", *files
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert (
        data["what"] == "run CI" and data["command"] == "calls.sh ..." and data["device_seconds_used"] == 1700
    )
    assert data["summary_command"] == "OUT=DIR bash bench/gpu/side_by_side.sh"  # kept, not in command's place
    assert data["tg_tok_s_patched"] == 180.1 and data["pause_ms_32k"] == 44.2 and data["gpu"] == "NVIDIA H200"
    assert (
        set(data["warm"]) == {"warm", "warm32k"} and data["warm"]["warm"]["command"] == "warm_repeats.py ..."
    )
    assert data["trace_compare"] == {"trace_compare": compare}
    assert data["trace"] == {"trace_defaults": trace}  # a step trace is not a comparison
    assert data["lab"] == {"gdn": named["gdn"]}  # nor is a kernel lab's table
    assert "settings_per_call=['MC_GDN_ONE=0']" in res.stdout
    assert not (tmp_path / "res.json.tmp").exists()


def test_bad_input_is_named_and_nothing_is_written(tmp_path):
    out = tmp_path / "res.json"
    base = ("--out", str(out), "--what", "w", "--command", "c")
    res = run(*base, str(tmp_path / "gone.json"))
    assert res.returncode != 0 and "no such file" in res.stderr and "gone.json" in res.stderr
    (tmp_path / "bad.json").write_text("{not json")
    res = run(*base, str(tmp_path / "bad.json"))
    assert res.returncode != 0 and "bad.json: not a JSON file" in res.stderr
    for n in ("a", "b"):
        (tmp_path / f"{n}.json").write_text(json.dumps({"tg_tok_s_patched": 1.0}))
    res = run(*base, str(tmp_path / "a.json"), str(tmp_path / "b.json"))
    assert res.returncode != 0 and "two side-by-side summaries" in res.stderr
    assert not out.exists()


def test_every_gpu_results_file_names_its_date_gpu_commit_and_command():
    """Each committed GPU results file (bench/results/*-h100-* / *-h200-*) records the date, the GPU,
    the git commit (or each run's, under "runs") and the commands that made it, and its command is not
    the side-by-side summary's own usage line (which replaced the session's in files written by
    results_file.py until 2026-12-07). Older files name these keys in earlier ways."""
    files = sorted((ROOT / "bench" / "results").glob("*-h[12]00-*.json"))
    assert len(files) >= 80
    for f in files:
        data = json.loads(f.read_text())
        assert "date" in data, f
        assert any(k in data for k in ("gpu", "machine", "gpu_kind")), f
        runs = data.get("runs")
        per_run = isinstance(runs, dict) and all(isinstance(r, dict) and "commit" in r for r in runs.values())
        assert per_run or any(k in data for k in ("commit", "git_commit", "git_head", "commit_note")), f
        command = data.get("command") or data.get("commands") or data.get("calls")
        assert command and command != "OUT=DIR bash bench/gpu/side_by_side.sh", f
