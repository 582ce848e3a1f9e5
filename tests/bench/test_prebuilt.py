"""The patched build made on the CPU machine for a device call (bench/gpu/prebuild.py) and its use there
(bench/gpu/use_prebuilt.sh, called by side_by_side.sh): the archive's name ties it to the patch series
and the GPU's arch; an archive is taken only when its series is the tree's, every library is found by
the loader and a patched op's cases pass; a refused one leaves nothing in the state. The programs here
are shell scripts and one real C program (the loader's check); building the real archive takes
~35 min on this machine and running it needs a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
USE = ROOT / "bench" / "gpu" / "use_prebuilt.sh"
sys.path.insert(0, str(ROOT / "bench" / "gpu"))
import prebuild  # noqa: E402

SERIES = "ab" * 32


def make_archive(tmp: Path, series: str = SERIES, tbo: str = 'echo "  7/7 tests passed"', extra=None) -> Path:
    """An archive laid out as prebuild.py writes it, its programs shell scripts (tbo: test-backend-ops)."""
    top = tmp / "arch"
    (top / "patched").mkdir(parents=True)
    (top / "obj").mkdir()
    for name, body in (
        ("test-backend-ops", tbo),
        ("mc_gpu_bench", "exit 0"),
        ("llama-batched-bench", "exit 0"),
    ):
        f = top / "patched" / name
        f.write_text(f"#!/bin/sh\n{body}\n")
        f.chmod(0o755)
    (top / "patched" / "libggml-cuda.so").write_text("not a library\n")
    (top / "obj" / "mc-mmv.cu.o").write_bytes(b"object")
    (top / "MANIFEST.json").write_text(json.dumps({"series_hash": series, "arch": "90"}, indent=1) + "\n")
    if extra:
        extra(top / "patched")
    out = tmp / prebuild.archive_name(SERIES, "90")
    with tarfile.open(out, "w:xz") as t:
        for item in ("MANIFEST.json", "patched", "obj"):
            t.add(top / item, arcname=item)
    return out


def use(state: Path, archive: Path, series: str = SERIES) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(USE), str(state), str(archive), "CUDA0", series],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_archive_name_holds_the_series_and_the_arch():
    assert prebuild.archive_name(SERIES, "90") == f"prebuilt-patched-{SERIES[:16]}-sm90.tar.xz"
    assert prebuild.archive_name(SERIES, "120").endswith("-sm120.tar.xz")
    for series, arch, field in (
        ("abc", "90", "series hash"),
        (SERIES, "sm_90", "--arch"),
        (SERIES, "9", "--arch"),
    ):
        with pytest.raises(ValueError, match=field):
            prebuild.archive_name(series, arch)
    # side_by_side.sh looks for the same name
    script = (ROOT / "bench" / "gpu" / "side_by_side.sh").read_text()
    name = "prebuilt-patched-${HASH:0:16}-sm$ARCH.tar.xz"
    assert "PREBUILT=${MC_SBS_PREBUILT_DIR:-$ROOT/.device}/" + name in script
    assert 'use_prebuilt.sh" "$S" "$PREBUILT" CUDA0 "$HASH") && TAKEN=1' in script


def test_max_version_reads_the_highest_version():
    text = (
        "0 DF *UND* GLIBC_2.2.5 memcpy\n0 DF *UND* GLIBC_2.34 pthread_create\n0 DF *UND* GLIBC_2.4 x\n"
        "0 DF *UND* GLIBCXX_3.4.30 _ZSt28__throw_bad_array_new_lengthv\n0 DF *UND* GLIBCXX_3.4.9 y\n"
    )
    assert prebuild.max_version(text, "GLIBC") == "2.34"  # numbers, not strings: 2.34 > 2.4 > 2.2.5
    assert prebuild.max_version(text, "GLIBCXX") == "3.4.30"
    assert prebuild.max_version("no versions") is None


def test_a_good_archive_is_taken(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    res = use(state, make_archive(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "taken: MC_ADD_RMS_NORM_MUL passed here" in res.stdout
    assert (state / "patched" / "mc_gpu_bench").exists() and (state / "patched" / "test-backend-ops").exists()
    obj = state / "build" / "ggml" / "src" / "ggml-cuda" / "CMakeFiles" / "ggml-cuda.dir" / "mc-mmv.cu.o"
    assert obj.read_bytes() == b"object"  # where side_by_side.sh's SASS step finds it
    times = dict(ln.split() for ln in (state / "build-times.txt").read_text().splitlines())
    assert times["patched_prebuilt"] == prebuild.archive_name(SERIES, "90")
    assert json.loads((state / "prebuilt-manifest.json").read_text())["series_hash"] == SERIES
    assert not (state / "prebuilt.tmp").exists()


@pytest.mark.parametrize(
    "case",
    ["failing op", "no passed line", "other series", "missing library", "not an archive"],
)
def test_a_bad_archive_is_refused_and_leaves_nothing(tmp_path, case):
    state = tmp_path / "state"
    state.mkdir()
    if case == "failing op":
        archive, want = make_archive(tmp_path, tbo='echo "  6/7 tests passed"; echo FAIL; exit 1'), "exit 1"
    elif case == "no passed line":
        archive, want = make_archive(tmp_path, tbo="echo nothing"), "MC_ADD_RMS_NORM_MUL exit 0"
    elif case == "other series":
        archive, want = make_archive(tmp_path, series="cd" * 32), "built from another patch series"
    elif case == "missing library":

        def linked(patched: Path) -> None:  # a real program needing a library the archive lacks
            (tmp_path / "z.c").write_text("int z(void) { return 0; }\n")
            (tmp_path / "m.c").write_text("int z(void);\nint main(void) { return z(); }\n")
            lib = tmp_path / "libzz.so"
            subprocess.run(["gcc", "-shared", "-fPIC", "-o", lib, tmp_path / "z.c"], check=True)
            exe = patched / "needs-zz"
            subprocess.run(["gcc", "-o", exe, tmp_path / "m.c", f"-L{tmp_path}", "-lzz"], check=True)

        archive, want = make_archive(tmp_path, extra=linked), "the loader here lacks: libzz.so => not found"
    else:
        archive = tmp_path / prebuild.archive_name(SERIES, "90")
        archive.write_text("not xz\n")
        want = "cannot unpack it"
    res = use(state, archive)
    assert res.returncode == 1, res.stdout + res.stderr
    assert f"prebuilt {archive.name} not used: " in res.stdout and want in res.stdout, res.stdout
    left = sorted(p.name for p in state.iterdir())
    assert left in ([], ["prebuilt-check.out"]), left  # the check's output only: no programs, no times


def test_needed_reads_what_a_library_names(tmp_path):
    """prebuild.py refuses to pack a libggml-cuda.so that does not name libcuda.so.1 (this machine's gcc
    links with --as-needed, which drops a stub defining no symbol: the first archive was so)."""
    (tmp_path / "s.c").write_text("")
    stub = tmp_path / "libcuda.so"
    subprocess.run(["gcc", "-shared", "-Wl,-soname,libcuda.so.1", "-o", stub, tmp_path / "s.c"], check=True)
    (tmp_path / "u.c").write_text("int cuInit(unsigned);\nint f(void) { return cuInit(0); }\n")
    lib = tmp_path / "libu.so"
    base = ["gcc", "-shared", "-fPIC", "-Wl,--as-needed"]
    for extra, named in (([], False), (["-Wl,--no-as-needed"], True)):  # the second as prebuild.py links
        subprocess.run([*base, *extra, "-o", lib, tmp_path / "u.c", stub], check=True)
        assert ("libcuda.so.1" in prebuild.needed(lib)) is named, (extra, prebuild.needed(lib))


def test_prebuild_builds_what_side_by_side_builds():
    """The archive stands in for side_by_side.sh's patched build: the same targets and every configure
    flag of that build (a value from the script's variables compared by its name), so a flag added
    there and not here is caught."""
    script = (ROOT / "bench" / "gpu" / "side_by_side.sh").read_text()
    stock = script.split('TARGETS_STOCK="', 1)[1].split('"', 1)[0].split()
    assert 'TARGETS="$TARGETS_STOCK test-backend-ops"' in script
    assert list(prebuild.TARGETS) == [*stock, "test-backend-ops"]
    configure = script.split("cmake -S \\$L -B $S/build -G Ninja", 1)[1].split("|| exit 1", 1)[0]
    flags = [f for f in configure.split() if f.startswith("-D")]
    assert len(flags) >= 12, flags
    source = (ROOT / "bench" / "gpu" / "prebuild.py").read_text()
    for flag in flags:
        name, _, value = flag.partition("=")
        assert (flag if "$" not in value else f"{name}=") in source, flag


def tool(bin_dir: Path, name: str, body: str) -> None:
    f = bin_dir / name
    f.write_text("#!/bin/sh\n" + body + "\n")
    f.chmod(0o755)


@pytest.mark.parametrize(
    ("builds", "bench_builds"), [("stock,patched", True), ("patched", True), ("patched", False)]
)
def test_side_by_side_builds_only_stock_beside_a_taken_archive(tmp_path, builds, bench_builds):
    """side_by_side.sh with an archive for this series in MC_SBS_PREBUILT_DIR: a patched-only call builds
    nothing but the measuring program; a call with stock builds stock alone (its targets, once), then
    patches the source tree for the labs, and keeps the archive's patched programs; both times' lines
    kept. The archive's mc_gpu_bench is replaced by this tree's, built against the archive's libraries
    (the archive is keyed by the series alone); where that build fails the archive's stays. The
    machine's tools are stand-ins here (cmake, g++, patch, nvidia-smi as scripts logging their
    arguments); the measurements after the build stop at the short deadline (exit 3)."""
    series = prebuild.build.series_hash()  # the hash prebuild.py names its archive with
    archive = make_archive(tmp_path, series=series)
    pre = tmp_path / "pre"
    pre.mkdir()
    archive.rename(pre / prebuild.archive_name(series, "90"))
    src = tmp_path / "sd" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    src.mkdir(parents=True)
    sdist = tmp_path / "sdist.tar.gz"
    with tarfile.open(sdist, "w:gz") as t:
        t.add(tmp_path / "sd" / "llama_cpp_python-0.3.36", arcname="llama_cpp_python-0.3.36")
    bin_dir, log = tmp_path / "bin", tmp_path / "tools.log"
    bin_dir.mkdir()
    tool(bin_dir, "nvidia-smi", 'case "$*" in *compute_cap*noheader*) echo 9.0 ;; esac')
    tool(
        bin_dir,
        "cmake",
        f'echo "cmake $*" >> {log}\n'
        'if [ "$1" = --build ]; then\n'
        '  mkdir -p "$2/bin" && touch "$2/bin/libllama.so" "$2/bin/llama-batched-bench"\nfi',
    )
    out_arg = 'while [ $# -gt 1 ]; do [ "$1" = -o ] && touch "$2"; shift; done'
    fail_bench = 'case "$*" in *patched/mc_gpu_bench.new*) echo "no llama.h" >&2; exit 1 ;; esac\n'
    fail_bench = "" if bench_builds else fail_bench
    tool(bin_dir, "g++", f'echo "g++ $*" >> {log}\n{fail_bench}{out_arg}')
    tool(bin_dir, "patch", f'echo "patch $*" >> {log}\ncat > /dev/null')
    model = tmp_path / "model.gguf"
    model.write_text("")
    state = tmp_path / "state"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("MC_")},
        "OUT": str(tmp_path / "out"),
        "MC_STATE": str(state),
        "MC_SDIST": str(sdist),
        "MC_BENCH_MODEL": str(model),
        "MC_SBS_ENGINE": "0",
        "MC_SBS_BUILDS": builds,
        "MC_SBS_PREBUILT_DIR": str(pre),
        "MC_SBS_WHEELS": str(tmp_path / "nowheels"),
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
    }
    res = subprocess.run(
        ["bash", str(ROOT / "bench" / "gpu" / "side_by_side.sh"), "45"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    steps = (state / "steps.log").read_text()
    assert f"prebuilt {prebuild.archive_name(series, '90')} taken" in steps, (steps, res.stdout)
    assert (state / "build.rc").read_text().strip() == "0", (state / "build.log").read_text()
    assert res.returncode == 3, res.stdout  # past the build, stopped by the deadline
    calls = log.read_text().splitlines() if log.exists() else []
    builds_run = [c for c in calls if c.startswith("cmake --build")]
    series_file = (ROOT / "ggml-patches" / "series").read_text()
    n_patches = len([p for p in series_file.split() if p.endswith(".patch")])
    patches = [c for c in calls if c.startswith("patch ")]
    times = dict(ln.split() for ln in (state / "build-times.txt").read_text().splitlines())
    assert times["patched_prebuilt"] == prebuild.archive_name(series, "90")
    bench_gpp = [c for c in calls if c.startswith("g++ ") and f"-o {state}/patched/mc_gpu_bench.new" in c]
    assert len(bench_gpp) == 1, calls
    assert f"-L{state}/patched" in bench_gpp[0] and f"{state}/mc_gpu_bench.cpp" in bench_gpp[0]
    assert "-rpath,$ORIGIN" in bench_gpp[0]  # found beside the archive's libraries, as the archive's was
    assert not (state / "patched" / "mc_gpu_bench.new").exists()
    if bench_builds:  # this tree's (the stand-in g++ leaves an empty file)
        assert (state / "patched" / "mc_gpu_bench").read_text() == ""
        assert "patched_bench_rebuilt_s" in times
        assert "mc_gpu_bench built from this tree's source" in steps
    else:
        assert (state / "patched" / "mc_gpu_bench").read_text() == "#!/bin/sh\nexit 0\n"  # the archive's
        assert "patched_bench_rebuilt_s" not in times
        assert "did not build, the archive's kept: no llama.h" in steps
    if builds == "patched":
        assert builds_run == [] and "stock_build_s" not in times
        assert not (state / "build.sh").exists()
    else:
        assert len(builds_run) == 1, calls
        assert builds_run[0].endswith("--target llama ggml llama-batched-bench"), calls
        assert "stock_build_s" in times and "patched_rebuild_s" not in times
        for prog in ("llama-batched-bench", "mc_gpu_bench"):
            assert (state / "stock" / prog).exists(), prog
        assert calls.index(builds_run[0]) < calls.index(patches[0])  # stock from the source as shipped
    assert len(patches) == n_patches  # the source tree patched once, for the labs
