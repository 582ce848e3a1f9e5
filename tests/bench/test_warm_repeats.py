"""bench/gpu/warm_repeats.py: rounds of a bench program under alternating settings. A stand-in for
mc_gpu_bench (a script printing its JSON lines, its figures depending on the environment) checks
the draws, the rotation of the order, the summary against the first setting, and the clear errors
for bad arguments; the real program runs on the GPU machine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "warm_repeats.py"

FAKE = """#!{python}
import json, os, sys, time
log = os.environ["FAKE_LOG"]
with open(log, "a") as f:
    f.write(os.environ.get("MC_X", "-") + " " + " ".join(sys.argv[1:]) + "\\n")
with open(log + ".lib", "a") as f:
    f.write(os.environ.get("LD_LIBRARY_PATH", "") + "\\n")
with open(log + ".prog", "a") as f:
    f.write(sys.argv[0] + " " + os.environ.get("MC_WARM_BENCH", "-") + "\\n")
scale = float(os.environ.get("MC_X", "1"))
calls = sum(1 for _ in open(log))
if calls > int(os.environ.get("FAKE_FAIL_AFTER", "1000")):
    sys.exit("broken after " + str(calls - 1) + " calls")
fail_x = os.environ.get("FAKE_FAIL_X", "none")
if os.environ.get("MC_X") == fail_x and calls > int(os.environ.get("FAKE_FAIL_X_AFTER", "0")):
    sys.exit("broken under MC_X=" + fail_x)
time.sleep(float(os.environ.get("FAKE_SLEEP", "0")))
print("loading...")
if sys.argv[1] == "verify":
    for k in sys.argv[5].split(","):
        ms = scale * (6.5 + 0.35 * int(k))
        row = {{"kind": "verify", "depth": int(sys.argv[3]), "seqs": int(sys.argv[4]), "k": int(k)}}
        print(json.dumps({{**row, "median_ms": ms}}))
elif sys.argv[1] == "tg":
    for d in sys.argv[3].split(","):
        row = {{"kind": "tg", "depth": int(d), "n": int(sys.argv[4]), "median_ms": 6.5}}
        print(json.dumps({{**row, "tok_s": 150.0 / scale, "call_ms": 0.1 * scale}}))
else:
    sys.exit(2)
"""


def fake_bench(tmp_path: Path) -> Path:
    bench = tmp_path / "mc_gpu_bench"
    bench.write_text(FAKE.format(python=sys.executable))
    bench.chmod(0o755)
    return bench


def run(tmp_path: Path, *args: str, **fake: str) -> subprocess.CompletedProcess:
    env = {"FAKE_LOG": str(tmp_path / "log"), "PATH": "/usr/bin:/bin", **fake}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env)


def test_rounds_alternate_the_settings_and_summarize_against_the_first(tmp_path):
    bench = fake_bench(tmp_path)
    out = tmp_path / "warm.json"
    res = run(
        tmp_path,
        *("--bench", str(bench), "--model", "m.gguf", "--rounds", "3", "--json", str(out)),
        *("--setting", "base=", "--setting", "slow=MC_X=1.1"),
        *("--measure", "verify:512:1:1,16", "--measure", "tg:0,4096:64"),
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert data["settings"] == {"base": {}, "slow": {"MC_X": "1.1"}}
    assert data["order"] == [["base", "slow"], ["slow", "base"], ["base", "slow"]]
    assert data["draws"]["base"]["verify_d512_s1_k16_ms"] == [12.1] * 3
    assert len(data["draws"]["slow"]["tg_d4096_tok_s"]) == 3
    s = data["summary"]
    assert abs(s["slow"]["verify_d512_s1_k1_ms"]["vs_first"] - 1.1) < 1e-3
    assert abs(s["slow"]["tg_d0_tok_s"]["vs_first"] - 1 / 1.1) < 1e-3
    assert "vs_first" not in s["base"]["tg_d0_tok_s"]
    # the host's part of a decode step (until llama_decode returned), beside its tok/s
    assert data["draws"]["base"]["tg_d0_call_ms"] == [0.1] * 3
    assert abs(s["slow"]["tg_d4096_call_ms"]["vs_first"] - 1.1) < 1e-3
    # every call: the setting's environment, the measure's arguments after the model
    calls = (tmp_path / "log").read_text().splitlines()
    assert len(calls) == 12
    assert calls[0] == "- verify m.gguf 512 1 1,16" and calls[2] == "1.1 verify m.gguf 512 1 1,16"
    assert "verify_d512_s1_k16_ms" in res.stdout and "+10.0%" in res.stdout
    # the 16-token step over the one-token step of the same process, draw by draw: (6.5 + 5.6) / 6.85
    ratio = round(12.1 / 6.85, 4)
    assert data["draws"]["base"]["verify_d512_s1_k16_over_k1"] == [ratio] * 3
    assert data["draws"]["slow"]["verify_d512_s1_k16_over_k1"] == [ratio] * 3  # the scale cancels
    assert s["base"]["verify_d512_s1_k16_over_k1"]["median"] == ratio
    assert s["base"]["verify_d512_s1_k1_ms"]["median"] == 6.85
    assert "verify_d512_s1_k1_over_k1" not in data["draws"]["base"]  # no ratio of K = 1 to itself
    assert "verify_d512_s1_k16_over_k1" in res.stdout


def test_a_tg_line_without_call_ms_gives_its_tok_s_alone():
    """A bench built before call_ms (an older archive's) still gives its decode figure."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import warm_repeats
    finally:
        sys.path.pop(0)
    old = {"kind": "tg", "depth": 0, "n": 64, "median_ms": 6.7, "tok_s": 149.25}
    assert warm_repeats.figures_of(old) == [("tg_d0_tok_s", 149.25)]
    assert warm_repeats.figures_of({**old, "call_ms": 0.12})[1] == ("tg_d0_call_ms", 0.12)
    assert warm_repeats.figures_of({"kind": "profile", "median_ms": 1.0}) == []


def test_ratios_pair_figures_of_one_depth_and_sequence_count():
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import warm_repeats
    finally:
        sys.path.pop(0)
    out = warm_repeats.with_ratios(
        {
            "verify_d512_s1_k1_ms": 6.0,
            "verify_d512_s1_k16_ms": 9.0,
            "verify_d512_s12_k1_ms": 10.0,
            "verify_d512_s12_k4_ms": 15.0,
            "verify_d4096_s1_k16_ms": 12.0,  # no K = 1 at this depth: no ratio
            "tg_d0_tok_s": 150.0,
        }
    )
    assert out["verify_d512_s1_k16_over_k1"] == 1.5 and out["verify_d512_s12_k4_over_k1"] == 1.5
    assert "verify_d4096_s1_k16_over_k1" not in out and out["tg_d0_tok_s"] == 150.0


def test_bad_arguments_name_the_field(tmp_path):
    bench = fake_bench(tmp_path)
    base = ("--bench", str(bench), "--model", "m", "--json", str(tmp_path / "o.json"))
    res = run(tmp_path, *base, "--setting", "a=", "--measure", "verify:512:x:1")
    assert res.returncode != 0 and "--measure 'verify:512:x:1'" in res.stderr
    res = run(tmp_path, *base, "--setting", "a=MC_X", "--measure", "tg:0:64")
    assert res.returncode != 0 and "'MC_X' is not VAR=VALUE" in res.stderr
    res = run(tmp_path, *base, "--setting", "a=", "--setting", "a=MC_X=2", "--measure", "tg:0:64")
    assert res.returncode != 0 and "names must differ" in res.stderr
    assert not (tmp_path / "o.json").exists()


def test_a_failing_program_stops_with_its_error(tmp_path):
    bench = fake_bench(tmp_path)
    bench.write_text("#!/bin/sh\necho broken >&2\nexit 3\n")
    res = run(tmp_path, "--bench", str(bench), "--model", "m", "--json", str(tmp_path / "o.json"),
              "--setting", "a=", "--measure", "tg:0:64")  # fmt: skip
    assert res.returncode != 0 and "exit 3" in res.stderr and "broken" in res.stderr
    assert not (tmp_path / "o.json").exists()


def test_a_setting_can_run_another_builds_libraries(tmp_path):
    """By default the bench's own folder leads LD_LIBRARY_PATH; a setting's LD_LIBRARY_PATH replaces it
    (a program without a DT_RPATH then loads another build's libraries; mc_gpu_bench has one: see
    MC_WARM_BENCH)."""
    bench = fake_bench(tmp_path)
    res = run(
        tmp_path,
        *("--bench", str(bench), "--model", "m.gguf", "--rounds", "1", "--json", str(tmp_path / "w.json")),
        *("--setting", "here=", "--setting", "other=LD_LIBRARY_PATH=/builds/other"),
        *(
            "--measure",
            "verify:512:1:1",
        ),
    )
    assert res.returncode == 0, res.stderr
    seen = sorted((tmp_path / "log.lib").read_text().split())
    assert seen == sorted([str(tmp_path), "/builds/other"]), seen


def test_a_setting_can_run_another_builds_program(tmp_path):
    """MC_WARM_BENCH=PATH runs that program for the setting (its folder leading LD_LIBRARY_PATH), not
    passed to it; the others run --bench. A path that is no program is refused before any round."""
    bench = fake_bench(tmp_path)
    (tmp_path / "built").mkdir()
    other = fake_bench(tmp_path / "built")
    base = ("--bench", str(bench), "--model", "m.gguf", "--json", str(tmp_path / "w.json"))
    res = run(
        tmp_path, *base, "--rounds", "2",
        *("--setting", "prebuilt=", "--setting", f"built=MC_WARM_BENCH={other},MC_X=2"),
        *("--measure", "tg:0:64"),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    progs = (tmp_path / "log.prog").read_text().split("\n")[:-1]
    assert sorted(progs) == sorted([f"{bench} -", f"{other} -"] * 2), progs
    libs = (tmp_path / "log.lib").read_text().split()
    assert sorted(libs) == sorted([str(tmp_path), str(tmp_path / "built")] * 2), libs
    summary = json.loads((tmp_path / "w.json").read_text())["summary"]
    assert summary["built"]["tg_d0_tok_s"]["mean"] == 75.0
    assert summary["prebuilt"]["tg_d0_tok_s"]["mean"] == 150.0
    bad = ("--setting", "a=", "--setting", "b=MC_WARM_BENCH=/no/such", "--measure", "tg:0:64")
    res = run(tmp_path, *base, *bad)
    assert res.returncode != 0 and "--setting b: MC_WARM_BENCH=/no/such: no such program" in res.stderr


def test_the_json_keeps_the_rounds_finished_when_the_program_fails_later(tmp_path):
    """Written after every round: a program failing in round 3 (after 4 calls: 2 settings x 1
    measure x 2 rounds) leaves rounds 1-2 in the JSON with the error, and the exit is an error."""
    bench = fake_bench(tmp_path)
    out = tmp_path / "w.json"
    res = run(
        tmp_path,
        *("--bench", str(bench), "--model", "m", "--rounds", "5", "--json", str(out)),
        *("--setting", "a=", "--setting", "b=MC_X=2", "--measure", "tg:0:64"),
        FAKE_FAIL_AFTER="4",
    )
    assert res.returncode != 0 and "broken after 4 calls" in res.stderr
    data = json.loads(out.read_text())
    assert data["rounds_done"] == 2 and data["order"] == [["a", "b"], ["b", "a"]]
    assert data["draws"]["a"]["tg_d0_tok_s"] == [150.0, 150.0] and len(data["draws"]["b"]["tg_d0_tok_s"]) == 2
    assert data["stopped"].startswith("round 3:") and "broken after 4 calls" in data["stopped"]
    assert data["summary"]["b"]["tg_d0_tok_s"]["vs_first"] == 0.5
    assert not (tmp_path / "w.json.tmp").exists()


def test_a_setting_whose_program_fails_is_left_out_and_the_others_go_on(tmp_path):
    """A setting under test that breaks the program (here MC_X=3, from the fourth call on: in round 2)
    is left out of the rest of the rounds with its error in the JSON; the others run every round, the
    summary compares them as before, and the run ends well."""
    bench = fake_bench(tmp_path)
    out = tmp_path / "w.json"
    res = run(
        tmp_path,
        *("--bench", str(bench), "--model", "m", "--rounds", "4", "--json", str(out)),
        *("--setting", "a=", "--setting", "b=MC_X=2", "--setting", "c=MC_X=3", "--measure", "tg:0:64"),
        FAKE_FAIL_X="3",
        FAKE_FAIL_X_AFTER="3",
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert data["rounds_done"] == 4 and data["stopped"] is None
    assert list(data["failed"]) == ["c"] and data["failed"]["c"].startswith("round 2:")
    assert "broken under MC_X=3" in data["failed"]["c"]
    assert data["order"] == [["a", "b", "c"], ["b", "a"], ["a", "b"], ["b", "a"]]
    assert len(data["draws"]["a"]["tg_d0_tok_s"]) == 4 and len(data["draws"]["b"]["tg_d0_tok_s"]) == 4
    assert data["draws"]["c"]["tg_d0_tok_s"] == [50.0]  # its round before it broke
    assert data["summary"]["b"]["tg_d0_tok_s"]["vs_first"] == 0.5
    assert "setting c left out from round 2 on" in res.stderr and "c: failed (round 2:" in res.stdout


def test_a_deadline_starts_no_round_that_would_end_after_it(tmp_path):
    """Each call sleeps 0.4 s, a round (2 calls) ~0.8-1 s: with --deadline 2.5 the third round would
    end past it, so two rounds run, the JSON says why it stopped, and the table is printed."""
    bench = fake_bench(tmp_path)
    out = tmp_path / "w.json"
    res = run(
        tmp_path,
        *("--bench", str(bench), "--model", "m", "--rounds", "6", "--json", str(out), "--deadline", "2.5"),
        *("--setting", "a=", "--setting", "b=MC_X=2", "--measure", "tg:0:64"),
        FAKE_SLEEP="0.4",
    )
    assert res.returncode == 0, res.stderr
    data = json.loads(out.read_text())
    assert 1 <= data["rounds_done"] <= 3 and data["rounds_done"] < 6
    assert data["stopped"].startswith("deadline:") and "--deadline 2.5" in data["stopped"]
    assert "not started" in res.stderr and "tg_d0_tok_s" in res.stdout
    assert len((tmp_path / "log").read_text().splitlines()) == 2 * data["rounds_done"]
    res = run(tmp_path, "--bench", str(bench), "--model", "m", "--json", str(out), "--deadline", "0",
              "--setting", "a=", "--measure", "tg:0:64")  # fmt: skip
    assert res.returncode != 0 and "--deadline 0" in res.stderr
