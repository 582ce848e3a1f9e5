"""bench/gpu/calls.sh: the GPU machine's calls as named plans. Here (no GPU) its refusals: a bad
plan or setting is named before anything is built, measured or written."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "calls.sh"


def call(tmp_path: Path, *args: str, cwd: Path = ROOT, **extra: str) -> subprocess.CompletedProcess:
    """calls.sh ARGS from cwd with OUT and MC_STATE under tmp_path, the environment's MC_SBS_VARIANTS
    left out, and extra variables."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "MC_STATE": str(tmp_path / "state"), **extra}
    if "MC_SBS_VARIANTS" not in extra:
        env.pop("MC_SBS_VARIANTS", None)
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True)


def test_bad_plans_and_settings_are_refused_before_anything_runs(tmp_path):
    cases = {
        ("nope",): "usage: OUT=DIR bash bench/gpu/calls.sh sbs|builds [OPS]|setting",
        ("setting", "bad-name=X=1"): "with NAME of letters, digits and _ (not on), got 'bad-name=X=1'",
        ("setting", "fs=MC_A=1,oops", "300"): "setting fs: 'oops' is not VAR=VALUE",
        ("setting", "fs=", "300"): "setting fs: no VAR=VALUE given",
        ("setting",): "got ''",
        ("setting", "on=MC_A=1"): "(not on), got 'on=MC_A=1'",  # the defaults' name in the rounds
        ("settings",): "settings: expected OPS NAME=VAR=VAL[,...] ...",
        ("settings", "MUL_MAT"): "settings: expected OPS NAME=VAR=VAL[,...] ...",
        ("settings", "MUL_MAT", "a=MC_A=1", "a=MC_A=2", "300"): "setting a: named twice",
        ("settings", "MUL_MAT", "a=MC_A=1", "b=oops"): "setting b: 'oops' is not VAR=VALUE",
        ("builds", "MUL_MAT", "ROPE", "300"): "builds: expected at most OPS (a comma list",
    }
    for args, message in cases.items():
        res = call(tmp_path, *args)
        assert res.returncode == 2, (args, res.stdout, res.stderr)
        assert message in res.stdout, (args, res.stdout)
    assert not (tmp_path / "out").exists() and not (tmp_path / "state").exists()
    for bad in ("0", "x", "-1", "016"):  # the traced steps' tokens
        res = call(tmp_path, "setting", "fs=MC_A=1", MC_CALLS_TRACE_K=bad)
        assert res.returncode == 2 and "MC_CALLS_TRACE_K: expected a whole number >= 1" in res.stdout, bad
    assert not (tmp_path / "out").exists() and not (tmp_path / "state").exists()


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], capture_output=True).returncode == 0


def test_the_side_by_side_measures_the_engines_verify_with_the_copies_unless_variants_are_given(tmp_path):
    # calls.sh runs bench/gpu/side_by_side.sh of the folder it is called from: a stand-in that records
    # the variants it was asked for and fails, so the plan stops there
    root = tmp_path / "root"
    (root / "bench" / "gpu").mkdir(parents=True)
    seen = tmp_path / "seen.txt"
    (root / "bench" / "gpu" / "side_by_side.sh").write_text(
        f'echo "$MC_SBS_VARIANTS|${{MC_SBS_VARIANT_MEASURE_vcopies:-}}" > {seen}\nexit 7\n'
    )
    res = call(tmp_path, "sbs", "300", cwd=root)
    assert res.returncode == 7, res.stdout + res.stderr
    assert seen.read_text() == "vcopies:MC_MMH_REPACK=3|verify1\n"
    res = call(tmp_path, "sbs", "300", cwd=root, MC_SBS_VARIANTS="")
    assert res.returncode == 7 and seen.read_text() == "|\n"  # set (even empty): the caller's choice


def lean_standins(tmp_path: Path) -> tuple[Path, Path]:
    """Stand-ins for the scripts calls.sh runs from the folder it is called from (the returned root):
    the side-by-side succeeds, the rounds and the traces record their arguments in the returned file,
    and a trace writes its --json file as step_trace.py does."""
    root = tmp_path / "root"
    (root / "bench" / "gpu").mkdir(parents=True)
    ran = tmp_path / "ran.txt"
    (root / "bench" / "gpu" / "side_by_side.sh").write_text("exit 0\n")
    for name in ("warm_repeats.py", "step_trace.py"):
        (root / "bench" / "gpu" / name).write_text(
            f"import sys\nopen({str(ran)!r}, 'a').write({name!r} + ' ' + ' '.join(sys.argv[1:]) + '\\n')\n"
            "a = sys.argv[1:]\n"
            "if 'trace' in a: open(a[a.index('--json') + 1], 'w').write('{\"span_us_median\": 1.0}')\n"
        )
    return root, ran


def test_a_lean_plan_runs_the_verify_rounds_alone_and_a_bad_lean_value_is_refused(tmp_path):
    res = call(tmp_path, "setting", "ct=MC_A=1", "300", MC_CALLS_LEAN="2")
    assert res.returncode == 2
    assert "MC_CALLS_LEAN: expected 0 or 1 (1: verify rounds only), got '2'" in res.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "state").exists()
    root, ran = lean_standins(tmp_path)
    args = ("settings", "MC_CONV_STEP", "copies=MC_MMH_REPACK=3", "ct=MC_A=1,MC_MMH_REPACK=3", "300")
    res = call(tmp_path, *args, cwd=root, MC_CALLS_LEAN="1")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = ran.read_text().splitlines()
    assert len(lines) == 1 and lines[0].startswith("warm_repeats.py "), lines
    assert "--setting on= --setting copies=MC_MMH_REPACK=3 --setting ct=MC_A=1,MC_MMH_REPACK=3" in lines[0]
    assert "--rounds 4 --measure verify:512:1:1,16 --json " + str(tmp_path / "out" / "warmv.json") in lines[0]
    assert "plan settings done (lean)" in res.stdout
    # called again (a call cut short asks for that), the finished rounds are not run twice
    res = call(tmp_path, *args, cwd=root, MC_CALLS_LEAN="1")
    assert res.returncode == 0 and len(ran.read_text().splitlines()) == 1


def test_a_lean_plan_can_trace_the_defaults_steps_after_its_rounds(tmp_path):
    res = call(tmp_path, "setting", "ct=MC_A=1", "300", MC_CALLS_LEAN="1", MC_CALLS_LEAN_TRACE="yes")
    assert res.returncode == 2
    assert "MC_CALLS_LEAN_TRACE: expected 0, 1 or 2" in res.stdout
    assert not (tmp_path / "out").exists() and not (tmp_path / "state").exists()
    root, ran = lean_standins(tmp_path)
    args = ("settings", "MC_ADD_RMS_NORM_MUL", "copies=MC_MMH_REPACK=3", "300")
    res = call(tmp_path, *args, cwd=root, MC_CALLS_LEAN="1", MC_CALLS_LEAN_TRACE="1")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = ran.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["warm_repeats.py", "step_trace.py"], lines
    assert "--measure verify:512:1:1,16" in lines[0]
    assert lines[1].startswith("step_trace.py trace ") and "--tokens 64" in lines[1]
    assert "--k " not in lines[1]  # decode steps
    assert "--setting" not in lines[1]  # the defaults alone
    assert json.loads((tmp_path / "out" / "trace_on.json").read_text()) == {"span_us_median": 1.0}
    # again: nothing runs twice
    res = call(tmp_path, *args, cwd=root, MC_CALLS_LEAN="1", MC_CALLS_LEAN_TRACE="1")
    assert res.returncode == 0 and len(ran.read_text().splitlines()) == 2
    # K-token verify steps instead: their own marker and file
    res = call(tmp_path, *args, cwd=root, MC_CALLS_LEAN="1", MC_CALLS_LEAN_TRACE="1", MC_CALLS_TRACE_K="16")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = ran.read_text().splitlines()
    assert len(lines) == 3 and "--k 16 --depth 512" in lines[2], lines
    assert (tmp_path / "out" / "trace_on-k16.json").exists()


def test_a_lean_plan_can_trace_the_first_settings_verify_steps_too(tmp_path):
    root, ran = lean_standins(tmp_path)
    args = ("settings", "MC_ADD_RMS_NORM_MUL", "copies=MC_MMH_REPACK=3,MC_B=2", "other=MC_C=1", "300")
    res = call(tmp_path, *args, cwd=root, MC_CALLS_LEAN="1", MC_CALLS_LEAN_TRACE="2")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = ran.read_text().splitlines()
    assert [line.split()[0] for line in lines] == ["warm_repeats.py", "step_trace.py", "step_trace.py"], lines
    assert "--k " not in lines[1] and "--setting" not in lines[1]  # the defaults' decode steps first
    # then the first setting's 16-token verify steps (decode's K is 1), under each of its variables
    assert "--k 16 --depth 512 --setting MC_MMH_REPACK=3 --setting MC_B=2 " in lines[2], lines[2]
    assert "MC_C" not in lines[2]
    assert (tmp_path / "out" / "trace_on.json").exists()
    assert json.loads((tmp_path / "out" / "trace_copies-k16.json").read_text()) == {"span_us_median": 1.0}
    res = call(tmp_path, *args, cwd=root, MC_CALLS_LEAN="1", MC_CALLS_LEAN_TRACE="2")
    assert res.returncode == 0 and len(ran.read_text().splitlines()) == 3  # nothing runs twice
    # with K-token traces asked for, the setting's are of K tokens as well
    res = call(tmp_path, *args, cwd=root, MC_CALLS_LEAN="1", MC_CALLS_LEAN_TRACE="2", MC_CALLS_TRACE_K="8")
    assert res.returncode == 0, res.stdout + res.stderr
    lines = ran.read_text().splitlines()
    assert len(lines) == 5 and "--k 8 --depth 512" in lines[3] and "--setting" not in lines[3], lines
    assert "--k 8 --depth 512 --setting MC_MMH_REPACK=3" in lines[4]
    assert all((tmp_path / "out" / f"trace_{n}-k8.json").exists() for n in ("on", "copies"))


SBS_STANDIN = """echo "sbs state=$MC_STATE prebuilt=${MC_SBS_PREBUILT:-} model=${MC_BENCH_MODEL:-}" \\
  "builds=$MC_SBS_BUILDS measure=$MC_SBS_MEASURE ops=$MC_SBS_OPS variants=[$MC_SBS_VARIANTS]" >> RAN
mkdir -p "$MC_STATE"
[ "${MC_SBS_PREBUILT:-1}" = 0 ] || [ -n "${STANDIN_NO_ARCHIVE:-}" ] || touch "$MC_STATE/patched.prebuilt"
echo '{"n_vocab": 4}' > "$MC_STATE/patched-logits.out"
python3 -c "import struct, sys; open(sys.argv[1], 'wb').write(struct.pack('8f', *range(8)))" \\
  "$MC_STATE/patched-logits.bin"
"""


def test_the_builds_plan_sets_the_archives_programs_against_a_build_made_there(tmp_path):
    """calls.sh builds: the side-by-side once on the archive (its state), once told to build
    (MC_SBS_PREBUILT=0, the state STATE-built, the first state's model), the two logits compared with
    sbs_summary's own comparison, the rounds alternating the two programs (MC_WARM_BENCH) and both
    decode steps traced and lined up. A state that did not take the archive stops the plan."""
    root = tmp_path / "root"
    (root / "bench" / "gpu").mkdir(parents=True)
    ran = tmp_path / "ran.txt"
    (root / "bench" / "gpu" / "side_by_side.sh").write_text(SBS_STANDIN.replace("RAN", str(ran)))
    for name in ("sbs_summary.py", "sass_summary.py"):  # the real comparison
        (root / "bench" / "gpu" / name).write_text((ROOT / "bench" / "gpu" / name).read_text())
    (root / "bench" / "gpu" / "warm_repeats.py").write_text(
        f"import sys\nopen({str(ran)!r}, 'a').write('warm ' + ' '.join(sys.argv[1:]) + '\\n')\n"
    )
    (root / "bench" / "gpu" / "step_trace.py").write_text(
        "import json, sys\n"
        f"open({str(ran)!r}, 'a').write('trace ' + ' '.join(sys.argv[1:]) + '\\n')\n"
        "a = sys.argv\n"
        "json.dump({'compared': a[2:4]} if a[1] == 'compare' else {}, open(a[a.index('--json') + 1], 'w'))\n"
    )
    path = f"{Path(os.sys.executable).parent}:{os.environ['PATH']}"  # a python3 with numpy
    res = call(tmp_path, "builds", "300", cwd=root, PATH=path)  # no archive in root/.device
    assert res.returncode == 2 and "builds: no prebuilt archive in" in res.stdout
    assert not ran.exists()
    (root / ".device").mkdir()
    (root / ".device" / "prebuilt-patched-0123456789abcdef-sm90.tar.xz").write_text("")
    res = call(tmp_path, "builds", "300", cwd=root, PATH=path)
    assert res.returncode == 0, res.stdout + res.stderr
    state, built = tmp_path / "state", tmp_path / "state-built"
    lines = ran.read_text().splitlines()
    model = state / "random-27b-q4_0.gguf"
    assert lines[0] == (
        f"sbs state={state} prebuilt= model= builds=patched measure=logits ops=MC_ADD_RMS_NORM_MUL"
        " variants=[]"
    )
    assert lines[1] == (
        f"sbs state={built} prebuilt=0 model={model} builds=patched measure=logits ops=MC_ADD_RMS_NORM_MUL"
        " variants=[]"
    )
    assert lines[2].startswith(f"warm --bench {state}/patched/mc_gpu_bench --model {model}")
    assert f"--setting prebuilt= --setting built=MC_WARM_BENCH={built}/patched/mc_gpu_bench" in lines[2]
    assert "--measure tg:0,4096:64 --measure verify:512:1:1,16" in lines[2]
    assert lines[3].startswith("trace trace --model") and f"--bench {state}/patched/mc_gpu_bench" in lines[3]
    assert lines[4].startswith("trace trace --model") and f"--bench {built}/patched/mc_gpu_bench" in lines[4]
    assert lines[5].startswith(f"trace compare {state}/trace-prebuilt.json {state}/trace-built.json")
    out = tmp_path / "out"
    logits = json.loads((out / "builds.json").read_text())["logits_built_vs_prebuilt"]
    assert logits["same_bytes"] is True and logits["rows"] == 2 and logits["rel_l2_max"] == 0.0
    assert json.loads((out / "trace_compare.json").read_text()) == {
        "built": {"compared": [f"{state}/trace-prebuilt.json", f"{state}/trace-built.json"]}
    }
    # a state whose side-by-side built instead of taking the archive: nothing to set against
    res = call(tmp_path / "again", "builds", "300", cwd=root, PATH=path, STANDIN_NO_ARCHIVE="1")
    assert res.returncode == 2 and "holds no prebuilt programs" in res.stdout


def test_a_call_for_one_gpu_stops_at_once_on_another(tmp_path):
    # a stand-in nvidia-smi first on PATH names the GPU; calls.sh runs bench/gpu/side_by_side.sh of the
    # folder it is called from: a stand-in that records that it ran
    bin_dir, root = tmp_path / "bin", tmp_path / "root"
    bin_dir.mkdir()
    (root / "bench" / "gpu").mkdir(parents=True)
    ran = tmp_path / "ran.txt"
    (root / "bench" / "gpu" / "side_by_side.sh").write_text(f"echo sbs >> {ran}\nexit 7\n")
    smi = bin_dir / "nvidia-smi"
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"

    smi.write_text("#!/bin/sh\necho 'NVIDIA H100 80GB HBM3'\n")
    smi.chmod(0o755)
    res = call(tmp_path, "sbs", "300", cwd=root, MC_CALLS_GPU="h200", PATH=path)
    assert res.returncode == 4, res.stdout + res.stderr
    assert "MC_CALLS_GPU=h200: this machine's GPU is 'NVIDIA H100 80GB HBM3': stopped" in res.stdout
    assert not ran.exists() and not (tmp_path / "out").exists() and not (tmp_path / "state").exists()

    smi.write_text("#!/bin/sh\nexit 9\n")  # no name: the same stop
    res = call(tmp_path, "sbs", "300", cwd=root, MC_CALLS_GPU="H200", PATH=path)
    assert res.returncode == 4 and "nvidia-smi named no GPU here" in res.stdout
    assert not ran.exists()

    smi.write_text("#!/bin/sh\necho 'NVIDIA H200'\n")  # the card asked for: the plan runs
    res = call(tmp_path, "sbs", "300", cwd=root, MC_CALLS_GPU="H200", PATH=path)
    assert res.returncode == 7 and "MC_CALLS_GPU=H200: 'NVIDIA H200'" in res.stdout
    assert ran.read_text() == "sbs\n"
