"""bench/gpu/side_by_side.sh refuses a bad MC_SBS_DRAWS (how many processes each verify measure runs)
with a clear message before it builds or fetches anything; a good value passes that check; a machine
without the python modules the call needs is refused before the build (bench/gpu/prepare_device.py). The
measuring itself needs a GPU (bench/results)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "side_by_side.sh"


def run_script(tmp_path: Path, python3: str, **env: str) -> subprocess.CompletedProcess:
    """side_by_side.sh with deadline 30 in tmp_path: OUT and MC_STATE there, env on top, MC_SDIST a file
    that does not exist (a run past its checks stops at once, "no sdist", instead of fetching) and a
    python3 first on the PATH whose sh body is python3 (so the sdist step cannot reach the network)."""
    (tmp_path / "bin").mkdir(parents=True, exist_ok=True)
    fake = tmp_path / "bin" / "python3"
    fake.write_text(f"#!/bin/sh\n{python3}\n")
    fake.chmod(0o755)
    full = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "MC_STATE": str(tmp_path / "state"),
        "MC_SDIST": str(tmp_path / "missing" / "sdist.tar.gz"),
        "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}",
        **env,
    }
    return subprocess.run(
        ["bash", str(SCRIPT), "30"], cwd=ROOT, env=full, capture_output=True, text=True, timeout=60
    )


def run(draws: str, tmp_path: Path) -> subprocess.CompletedProcess:
    # the check's place before the sdist is part of what this asserts; python3 fails at everything
    return run_script(tmp_path, "exit 1", MC_SBS_DRAWS=draws)


def test_bad_draws_are_refused_before_anything_runs(tmp_path):
    for bad in ("0", "00", "x", "-1", "2.5", "3 4", ""):
        res = run(bad, tmp_path)
        if bad == "":  # empty: the default (3), so it passes the check and stops at the missing sdist
            assert res.returncode == 1 and "no sdist at" in res.stdout, res.stdout
            continue
        assert res.returncode == 2, (bad, res.stdout, res.stderr)
        assert f"MC_SBS_DRAWS={bad}: expected a whole number of at least 1" in res.stdout
        assert not (tmp_path / "state").exists()  # nothing made


def test_good_draws_pass_the_check(tmp_path):
    for good in ("5", "08"):  # a leading zero is a decimal number here, not an octal one
        res = run(good, tmp_path)
        assert res.returncode == 1 and "no sdist at" in res.stdout, (good, res.stdout, res.stderr)
        assert "MC_SBS_DRAWS" not in res.stdout and "value too great" not in res.stderr


def _link_line() -> str:
    """The generated build script's link line for mc_gpu_bench, expanded as bash expands it in the
    script's unquoted here-document (\\$ -> $)."""
    line = next(x for x in SCRIPT.read_text().splitlines() if "-rpath," in x and "\\$ORIGIN" in x)
    res = subprocess.run(
        ["bash", "-c", f"cat <<EOF\n{line}\nEOF"], capture_output=True, text=True, timeout=10, check=True
    )
    return res.stdout


def test_the_measuring_program_finds_its_libraries_beside_it(tmp_path):
    """mc_gpu_bench runs without LD_LIBRARY_PATH from the folder its build's libraries are copied to,
    also the libraries only libllama needs (libggml.so.0): the build has no run paths of its own
    (CMAKE_SKIP_BUILD_RPATH), and a run path written as DT_RUNPATH (the linker's default) serves only
    the program's own direct needs, which is how run BA's calls failed. Checked with the real loader: a
    program linked with the line's -Wl flags against liba.so, which needs libb.so, both beside it."""
    flags = [w for w in _link_line().split() if w.startswith("-Wl,") and "rpath-link" not in w]
    assert "-Wl,--disable-new-dtags,-rpath,'$ORIGIN'" in flags, flags
    # the same run path where the program is built beside a taken archive's libraries (no here-document)
    beside = [x for x in SCRIPT.read_text().splitlines() if "-rpath," in x and "\\$ORIGIN" not in x]
    assert len(beside) == 1 and "-Wl,--disable-new-dtags,-rpath,'$ORIGIN'" in beside[0].split(), beside
    flags = [w.replace("'", "") for w in flags]
    lib = tmp_path / "lib"
    lib.mkdir()
    (tmp_path / "b.c").write_text("int b(void) { return 7; }\n")
    (tmp_path / "a.c").write_text("int b(void);\nint a(void) { return b() * 6; }\n")
    (tmp_path / "m.c").write_text("int a(void);\nint main(void) { return a() == 42 ? 0 : 1; }\n")
    cc = ["gcc", "-fPIC"]
    for name, deps in (("b", []), ("a", [f"-L{lib}", "-lb"])):  # libb first: liba links against it
        so = f"lib{name}.so.0"
        src = tmp_path / f"{name}.c"
        subprocess.run([*cc, "-shared", f"-Wl,-soname,{so}", "-o", lib / so, src, *deps], check=True)
        (lib / f"lib{name}.so").symlink_to(so)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    for name, extra in (("with", flags), ("without", ["-Wl,-rpath,$ORIGIN"])):
        exe = lib / f"m_{name}"
        link = [f"-L{lib}", "-la", f"-Wl,-rpath-link,{lib}", *extra]
        subprocess.run([*cc, "-o", exe, tmp_path / "m.c", *link], check=True)
        res = subprocess.run([exe], capture_output=True, text=True, env=env, timeout=10)
        if name == "with":
            assert res.returncode == 0, res.stderr
        else:  # the old line: the program finds liba but not liba's libb
            assert res.returncode != 0 and "libb.so.0" in res.stderr, (res.returncode, res.stderr)


def run_on_state(tmp_path: Path, held: str | None, builds: str) -> subprocess.CompletedProcess:
    """The script on a state folder whose build-for.txt says held ("HASH STOCK"; None: no file), with
    a python3 that computes the series hash (python3 -c) and fails at anything else, so a call past
    the check stops at the missing sdist instead of fetching it."""
    state = tmp_path / "state"
    state.mkdir(parents=True, exist_ok=True)
    if held is not None:
        (state / "build-for.txt").write_text(held + "\n")
    (state / "build.started").write_text("")
    python3 = f'[ "$1" = -c ] && exec {sys.executable} "$@"\nexit 1'
    return run_script(tmp_path, python3, MC_SBS_BUILDS=builds)


def test_a_state_built_from_other_patches_or_without_stock_is_refused(tmp_path):
    """A state folder built from another patch series, or without the stock build a call asks for, is
    refused before anything runs (run BD measured a stale patched-only build under the next commit),
    naming what to do; the state's files stay as they were."""
    here = subprocess.run(
        [sys.executable, "-c", "import build; print(build.series_hash())"],
        cwd=ROOT / "ggml-patches",
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    other = "0" * 64
    res = run_on_state(tmp_path, f"{other} 1", "stock,patched")
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert f"holds a build of patch series {other[:16]}, this tree's is {here[:16]}" in res.stdout
    assert "use another MC_STATE" in res.stdout
    res = run_on_state(tmp_path, f"{here} 0", "stock,patched")
    assert res.returncode == 2 and "was built without stock (MC_SBS_BUILDS=patched)" in res.stdout, res.stdout
    assert (tmp_path / "state" / "build-for.txt").read_text() == f"{here} 0\n"
    assert not (tmp_path / "out").exists()  # nothing ran
    # what the state holds serves the call: past the check (to the missing sdist)
    for held, builds in ((f"{here} 0", "patched"), (f"{here} 1", "stock,patched"), (f"{here} 1", "patched")):
        res = run_on_state(tmp_path, held, builds)
        assert res.returncode == 1 and "no sdist at" in res.stdout, (held, builds, res.stdout)
    res = run_on_state(tmp_path / "old", None, "stock,patched")  # a state from before the file
    assert res.returncode == 1 and "no sdist at" in res.stdout, res.stdout


def test_a_machine_without_gguf_or_diskcache_is_refused_before_the_build(tmp_path):
    """The GPU machine has no network: the random model needs gguf and the engine part diskcache,
    importable there or as wheels in MC_SBS_WHEELS (bench/gpu/prepare_device.py puts them in
    .device/whl). Without them the call is refused before anything is built, naming the module and
    the fix (run BG's model generation failed only after its build); an existing model needs no gguf,
    and MC_SBS_ENGINE=0 no diskcache."""
    sdist = tmp_path / "sdist.tar.gz"
    sdist.write_text("")  # past the sdist check
    wheels = tmp_path / "whl"
    wheels.mkdir()
    base = {"MC_SDIST": str(sdist), "MC_SBS_WHEELS": str(wheels)}
    res = run_script(tmp_path, "exit 1", **base)
    assert res.returncode == 2, (res.stdout, res.stderr)
    assert "the random model" in res.stdout and "needs the python module gguf" in res.stdout
    assert "bench/gpu/prepare_device.py" in res.stdout
    assert not (tmp_path / "state").exists()  # nothing built or made
    (wheels / "gguf-0.19.0-py3-none-any.whl").write_text("")
    res = run_script(tmp_path, "exit 1", **base)
    assert (
        res.returncode == 2
        and "the engine part (MC_SBS_ENGINE=1) needs the python module diskcache" in res.stdout
    )
    model = tmp_path / "model.gguf"
    model.write_text("")
    (wheels / "gguf-0.19.0-py3-none-any.whl").unlink()
    res = run_script(tmp_path, "exit 1", **base, MC_BENCH_MODEL=str(model), MC_SBS_ENGINE="0")
    # past the check: the empty sdist stops it at the unpacking, before any build starts
    assert "needs the python module" not in res.stdout, res.stdout
    assert res.returncode == 1 and "cannot unpack" in res.stdout, (res.stdout, res.stderr)


def test_prepare_device_names_what_a_device_folder_lacks(tmp_path):
    """bench/gpu/prepare_device.py: the sdist and each wheel at the environment's version; a wheel of
    another version does not count; a complete folder lacks nothing (then nothing is fetched)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "prepare_device", ROOT / "bench" / "gpu" / "prepare_device.py"
    )
    prep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(prep)
    versions = {"gguf": "0.19.0", "diskcache": "5.6.3"}
    assert prep.missing(tmp_path, versions) == ["sdist", "gguf==0.19.0", "diskcache==5.6.3"]
    (tmp_path / "whl").mkdir()
    (tmp_path / "whl" / "gguf-0.18.0-py3-none-any.whl").write_text("")
    (tmp_path / "whl" / "diskcache-5.6.3-py3-none-any.whl").write_text("")
    (tmp_path / prep.SDIST_NAME).write_text("")
    assert prep.missing(tmp_path, versions) == ["gguf==0.19.0"]
    (tmp_path / "whl" / "gguf-0.19.0-py3-none-any.whl").write_text("")
    assert prep.missing(tmp_path, versions) == []
    assert prep.installed_version(sys.executable, "pytest")  # a version string from that environment
    with pytest.raises(SystemExit, match="no not_a_module_here installed"):
        prep.installed_version(sys.executable, "not_a_module_here")
    with pytest.raises(SystemExit, match=r"--python .*missing-python: cannot run it"):
        prep.installed_version(str(tmp_path / "missing-python"), "gguf")
