#!/usr/bin/env python3
"""Build the patched CUDA programs that bench/gpu/side_by_side.sh measures here, on the CPU machine,
so that a device call does not spend its budget building them: run CM's build took 328 of its 520 s
on an H100 (16 cores), run CL's 250 s on an H200, while a session has 1,800 s. This machine's nvcc is
the device's (13.0) but it has no cuBLAS and no driver: the cuBLAS headers and library come from the
nvidia-cublas wheel (pip download, kept in the work folder), and the driver library is a stub of this
script's own (an empty libcuda.so named libcuda.so.1, so the real driver is the one loaded there).

The build is side_by_side.sh's patched build (the same targets and configure flags) with two
differences, both recorded in the archive's MANIFEST.json: the CPU backend is built without
-march=native (GGML_NATIVE=OFF: AVX2, as ggml's portable builds; it runs nothing of a GPU
measurement, and this machine's CPU is not the device's), and cuBLAS's headers are the wheel's
version rather than the device toolkit's. side_by_side.sh takes the archive only after its own check
on the device passes (test-backend-ops on the GPU) and otherwise builds there as before.

Writes .device/prebuilt-patched-<series hash, 16>-sm<arch>.tar.xz (a temp name, then renamed): the
libraries, test-backend-ops, llama-batched-bench, mc_gpu_bench, the mc-mmv object (for the SASS
step) and MANIFEST.json. ~30-40 min on 2 cores; a second run resumes the build in --work. The archive
is named by the series alone: side_by_side.sh builds the calling tree's mc_gpu_bench against its
libraries in a few seconds, so a change to the measuring program needs no new archive.

usage: python3 bench/gpu/prebuild.py [--arch 90] [--jobs N] [--dir .device] [--work DIR]"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "ggml-patches"))
import build  # noqa: E402  (ggml-patches/build.py: the series and its hash)

sys.path.insert(0, str(Path(__file__).resolve().parent))
from prepare_device import SDIST_NAME  # noqa: E402  (the sdist it puts in .device)

CUBLAS = "nvidia-cublas==13.1.1.3"  # CUDA 13's cuBLAS, as the device's 13.0 toolkit
TARGETS = ("llama", "ggml", "llama-batched-bench", "test-backend-ops")  # side_by_side.sh's TARGETS


def archive_name(series: str, arch: str) -> str:
    """The archive side_by_side.sh looks for: the series hash's first 16 digits and the GPU's arch."""
    if not re.fullmatch(r"[0-9a-f]{64}", series):
        raise ValueError(f"series hash: expected 64 hex digits, got {series!r}")
    if not re.fullmatch(r"[0-9]{2,3}", arch):
        raise ValueError(f"--arch: expected a compute capability such as 90 or 120, got {arch!r}")
    return f"prebuilt-patched-{series[:16]}-sm{arch}.tar.xz"


def max_version(text: str, prefix: str = "GLIBC") -> str | None:
    """The highest PREFIX_x.y version named in objdump -T output (GLIBC: what the loader there must
    have; GLIBCXX: its libstdc++)."""
    names = re.findall(rf"\b{prefix}_([0-9]+(?:\.[0-9]+)+)", text)
    found = {tuple(int(p) for p in m.split(".")) for m in names}
    return ".".join(str(p) for p in max(found)) if found else None


def needed(lib: Path) -> list[str]:
    """The libraries a shared object names as needed (its DT_NEEDED entries, readelf -d)."""
    out = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    return re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", out)


def run(cmd: list[str], **kw) -> str:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    return subprocess.run(cmd, check=True, text=True, **kw).stdout or ""


def cublas(work: Path) -> Path:
    """The cuBLAS wheel's nvidia/cu13 folder (include, lib with the unversioned links cmake looks for)."""
    home = work / "cublas"
    cu = home / "nvidia" / "cu13"
    if not (cu / "lib" / "libcublas.so").exists():
        (work / "whl").mkdir(parents=True, exist_ok=True)
        run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", CUBLAS, "-d", str(work / "whl")]
        )
        wheel = next((work / "whl").glob("nvidia_cublas-*.whl"))
        with zipfile.ZipFile(wheel) as z:
            z.extractall(home)
        for name in ("libcublas", "libcublasLt"):
            link = cu / "lib" / f"{name}.so"
            link.unlink(missing_ok=True)
            link.symlink_to(f"{name}.so.13")
    return cu


def driver_stub(work: Path) -> Path:
    """An empty libcuda.so named libcuda.so.1: the libraries need it by name, the device's driver
    provides it. Only shared libraries link against it (their undefined cu* names resolve there)."""
    stub = work / "stub" / "libcuda.so"
    if not stub.exists():
        stub.parent.mkdir(parents=True, exist_ok=True)
        run(["gcc", "-shared", "-x", "c", "-", "-Wl,-soname,libcuda.so.1", "-o", str(stub)], input="")
    return stub


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="90", help="CUDA compute capability, as side_by_side.sh reads it")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--dir", default=str(ROOT / ".device"), help="the folder the device tool carries")
    ap.add_argument("--work", default="/tmp/mc-prebuild", help="build folders (kept: a rerun resumes)")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        raise SystemExit(f"--jobs: expected a whole number of at least 1, got {a.jobs}")
    if shutil.which("nvcc") is None and not Path("/usr/local/cuda/bin/nvcc").exists():
        raise SystemExit("no nvcc here: the prebuilt programs need CUDA's compiler")
    series = build.series_hash()
    try:
        name = archive_name(series, a.arch)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    device = Path(a.dir)
    out = device / name
    if out.exists():
        print(f"{out}: already built for this series")
        return 0
    sdist = device / SDIST_NAME
    if not sdist.is_file():
        raise SystemExit(f"no {sdist}: run python3 bench/gpu/prepare_device.py first")
    work = Path(a.work) / f"{series[:16]}-sm{a.arch}"
    src_root = work / "src"
    if not (work / "src.done").exists():
        shutil.rmtree(src_root, ignore_errors=True)
        src_root.mkdir(parents=True)
        with tarfile.open(sdist) as t:
            t.extractall(src_root, filter="data")
        build.apply_series(next(p for p in src_root.iterdir() if p.is_dir()))
        (work / "src.done").write_text(series + "\n")
    top = next(p for p in src_root.iterdir() if p.is_dir())
    llama = top / "vendor" / "llama.cpp"
    cu = cublas(work.parent)
    stub = driver_stub(work.parent)
    env = {**os.environ, "PATH": f"/usr/local/cuda/bin:{os.environ['PATH']}"}
    bdir = work / "build"
    inc = f"-I{cu / 'include'}"
    run(
        [
            "cmake", "-S", str(llama), "-B", str(bdir), "-G", "Ninja", "-DGGML_CUDA=ON",
            f"-DCMAKE_CUDA_ARCHITECTURES={a.arch}", "-DGGML_NATIVE=OFF", "-DCMAKE_BUILD_TYPE=Release",
            "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_BUILD_TESTS=ON", "-DLLAMA_BUILD_EXAMPLES=OFF",
            "-DLLAMA_BUILD_SERVER=OFF", "-DLLAMA_BUILD_APP=OFF", "-DBUILD_SHARED_LIBS=ON",
            "-DCMAKE_SKIP_BUILD_RPATH=ON",
            # --no-as-needed: this gcc links with --as-needed, which dropped the stub (it defines no
            # symbol) from libggml-cuda.so's needs, leaving its cu* names unresolved on the device
            "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL -Wl,--no-as-needed",
            "-DCMAKE_EXE_LINKER_FLAGS=-Wl,--allow-shlib-undefined",
            f"-DCUDA_cublas_LIBRARY={cu / 'lib' / 'libcublas.so'}",
            f"-DCUDA_cublasLt_LIBRARY={cu / 'lib' / 'libcublasLt.so'}",
            f"-DCUDA_cuda_driver_LIBRARY={stub}", f"-DCMAKE_CUDA_FLAGS={inc}", f"-DCMAKE_CXX_FLAGS={inc}",
            f"-DMC_PATCH_SERIES_HASH={series}", "-DMC_BUILD_BACKEND=cuda", f"-DMC_BUILD_ARCH={a.arch}",
            "-DMC_PACKAGE_VERSION=0.3.36",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    run(["ninja", "-C", str(bdir), "-j", str(a.jobs), *TARGETS], env=env)
    # the staged folder as side_by_side.sh's stage() makes it, in the archive's top folder "patched"
    stage = work / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "patched").mkdir(parents=True)
    (stage / "obj").mkdir()
    for f in (bdir / "bin").iterdir():
        if ".so" in f.name or f.name in ("llama-batched-bench", "test-backend-ops"):
            shutil.copy2(f, stage / "patched" / f.name, follow_symlinks=False)
    run(
        [
            "g++", "-O2", "-std=c++17", f"-I{llama / 'include'}", f"-I{llama / 'ggml' / 'include'}",
            str(ROOT / "bench" / "gpu" / "mc_gpu_bench.cpp"), f"-L{stage / 'patched'}", "-lllama", "-lggml",
            "-lggml-base", "-ldl", f"-Wl,-rpath-link,{stage / 'patched'}", "-Wl,--allow-shlib-undefined",
            "-Wl,--disable-new-dtags,-rpath,$ORIGIN", "-o", str(stage / "patched" / "mc_gpu_bench"),
        ]
    )  # fmt: skip
    cuda_lib = (stage / "patched" / "libggml-cuda.so").resolve()
    for want in ("libcuda.so.1", "libcublas.so.13"):  # what the device must provide, named
        if want not in needed(cuda_lib):
            raise SystemExit(
                f"{cuda_lib.name} does not name {want} as needed ({needed(cuda_lib)}): not packed"
            )
    obj = next(bdir.rglob("mc-mmv.cu.o"))
    shutil.copy2(obj, stage / "obj" / obj.name)
    dyn = "".join(
        run(["objdump", "-T", str(f)], stdout=subprocess.PIPE)
        for f in (stage / "patched").iterdir()
        if f.is_file() and not f.is_symlink()
    )
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    nvcc = run(["nvcc", "--version"], env=env, stdout=subprocess.PIPE).strip().splitlines()[-1]
    manifest = {
        "series_hash": series,
        "arch": a.arch,
        "targets": list(TARGETS),
        "commit": commit.stdout.strip(),
        "built_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "nvcc": nvcc,
        "gcc": run(["gcc", "-dumpfullversion"], stdout=subprocess.PIPE).strip(),
        "cublas_headers": CUBLAS,
        "ggml_native": False,
        "needs_glibc": max_version(dyn, "GLIBC"),
        "needs_glibcxx": max_version(dyn, "GLIBCXX"),
    }
    (stage / "MANIFEST.json").write_text(json.dumps(manifest, indent=1) + "\n")
    device.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    with tarfile.open(tmp, "w:xz") as t:
        for item in ("MANIFEST.json", "patched", "obj"):
            t.add(stage / item, arcname=item)
    tmp.rename(out)
    print(
        f"{out}: {out.stat().st_size / 2**20:.1f} MiB, glibc >= {manifest['needs_glibc']}, "
        f"libstdc++ >= GLIBCXX {manifest['needs_glibcxx']}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
