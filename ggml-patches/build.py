#!/usr/bin/env python3
"""Build and install MegaCapybara's patched llama-cpp-python.

Steps: fetch the pinned sdist with pip (source only) -> unpack -> apply the patch series in
`series` -> build a wheel for the detected backend (CPU, or CUDA when nvcc and a GPU are
present) -> cache it under a key of (version, patch-series hash, backend, architectures) ->
install it into the chosen Python -> check that the installed library reports the same hash
through `mc_build_info()` (added by patch 0002).

Standard library only: this script runs before the project's own dependencies exist.

    python ggml-patches/build.py [--python PY] [--backend auto|cpu|cuda] [--cuda-arch "90;120"]
                                 [--portable] [--cache-dir DIR] [--sdist FILE] [--no-install]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "llama-cpp-python"
VERSION = "0.3.36"
PATCH_DIR = Path(__file__).resolve().parent
DEFAULT_CUDA_ARCHS = "90;120"  # H100/H200 (sm_90) and RTX 5090 (sm_120)

VERIFY_SNIPPET = """
import ctypes, json, llama_cpp.llama_cpp as lc
fn = getattr(lc._lib, "mc_build_info", None)
if fn is None:
    print("null")
else:
    fn.restype = ctypes.c_char_p
    fn.argtypes = []
    print(fn().decode())
"""


class BuildError(RuntimeError):
    """A step of the build failed; the message says which and why."""


class PatchError(BuildError):
    """A patch of the series does not apply; the message names the patch."""


@dataclass(frozen=True)
class BuildTarget:
    """What to build: the backend, its architectures, and the patch series' hash."""

    backend: str  # "cpu" or "cuda"
    arch: str  # CPU tag ("native-<hash>" or "portable") or CUDA architectures ("90;120")
    series_hash: str

    @property
    def key(self) -> str:
        arch = self.arch.replace(";", "-")
        return f"{VERSION}-{self.series_hash[:16]}-{self.backend}-{arch}"

    def cmake_args(self) -> list[str]:
        args = [
            "-DLLAVA_BUILD=OFF",
            "-DMC_BUILD_COMMON=OFF",
            f"-DMC_PATCH_SERIES_HASH={self.series_hash}",
            f"-DMC_BUILD_BACKEND={self.backend}",
            f"-DMC_BUILD_ARCH={self.arch.replace(';', ',')}",
            f"-DMC_PACKAGE_VERSION={VERSION}",
        ]
        if self.backend == "cuda":
            # --exclude-libs: libggml-cuda.so linked a static copy of libstdc++ on the GPU image (g++
            # 13.3 from /opt/gcc) and exported its 3,465 std:: symbols; with numpy or torch loaded first
            # they clashed with the system libstdc++ (a crash in llama_model::print_info, "free():
            # invalid pointer"). Hidden, 67 remain and both import orders work (H200, 2026-11-29).
            args += [
                "-DGGML_CUDA=ON",
                f"-DCMAKE_CUDA_ARCHITECTURES={self.arch}",
                "-DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL",
            ]
        else:
            args += [f"-DGGML_NATIVE={'OFF' if self.arch == 'portable' else 'ON'}"]
        if self.arch != "portable" and NATIVE_CPU_FLAGS:  # every -march=native build (CUDA ones too)
            args += [f"-DCMAKE_C_FLAGS={NATIVE_CPU_FLAGS}", f"-DCMAKE_CXX_FLAGS={NATIVE_CPU_FLAGS}"]
        return args


# ---------------------------------------------------------------------------------------------
# The patch series


def read_series(patch_dir: Path = PATCH_DIR) -> list[Path]:
    """The patches named by `series`, in order. Raises PatchError for a missing patch file."""
    names = []
    for line in (patch_dir / "series").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    paths = [patch_dir / "patches" / name for name in names]
    for path in paths:
        if not path.is_file():
            raise PatchError(f"patch {path.name}: named in {patch_dir / 'series'} but missing")
    return paths


def series_hash(patch_dir: Path = PATCH_DIR) -> str:
    """sha256 over the series file and each patch's name and bytes, in series order."""
    digest = hashlib.sha256((patch_dir / "series").read_bytes())
    for path in read_series(patch_dir):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def apply_series(src_dir: Path, patch_dir: Path = PATCH_DIR) -> list[str]:
    """Apply every patch of the series to the unpacked sdist at `src_dir` (patch -p1).

    Each patch is first tried with --dry-run, so a failing patch leaves the tree as the
    previous patch left it. Returns the applied patch names; raises PatchError naming the
    first patch that does not apply.
    """
    if shutil.which("patch") is None:
        raise BuildError("the 'patch' program is missing: install it (Debian: apt-get install patch)")
    applied = []
    for path in read_series(patch_dir):
        for extra in (["--dry-run"], []):
            proc = subprocess.run(
                ["patch", "-p1", "--forward", "--batch", "--silent", "-d", str(src_dir), *extra],
                input=path.read_bytes(),
                capture_output=True,
            )
            if proc.returncode != 0:
                detail = (proc.stdout + proc.stderr).decode(errors="replace").strip()
                raise PatchError(f"patch {path.name} does not apply to {src_dir.name}: {detail}")
        applied.append(path.name)
    return applied


# ---------------------------------------------------------------------------------------------
# Detection and cache


def cache_root(explicit: str | None = None) -> Path:
    base = explicit or os.environ.get("MC_CACHE_DIR") or Path.home() / ".cache" / "megacapybara"
    return Path(base)


# Added to -march=native for CPU builds (one flag: CMAKE_ARGS is split at spaces). ggml's AMX
# matrix path (compiled where the compiler defines __AMX_INT8__) died with SIGILL on `tilezero` in
# its first Q4_K product on a Sapphire Rapids VM that reports AMX (CPUID, XCR0 and the arch_prctl
# permission all say yes; 2026-12-01, the Gemma 3 270M tests; llama.cpp issues 28756 and 28328
# report the same class of failure on other hosts); without it ggml takes its AVX-512 VNNI kernels.
# Part of the CPU build key, so a wheel built before the flag is not reused. CUDA builds (also
# -march=native for their CPU backend, which runs whatever is not offloaded) get it too.
# x86 with gcc / clang only (MSVC and other architectures take no such flag).
NATIVE_CPU_FLAGS = (
    "-mno-amx-int8" if platform.machine().lower() in ("x86_64", "amd64") and os.name != "nt" else ""
)


def cpu_tag() -> str:
    """Native builds use -march=native: key them on this CPU's model and flags (and the flags added
    to -march=native)."""
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.exists() else f"model name {platform.processor()} {platform.machine()}"
    wanted = [ln for ln in text.splitlines() if ln.startswith(("model name", "flags", "Features"))]
    wanted.append(f"extra {NATIVE_CPU_FLAGS}")
    return "native-" + hashlib.sha256("\n".join(sorted(set(wanted))).encode()).hexdigest()[:8]


def gpu_compute_caps() -> list[str]:
    """Compute capabilities of the visible NVIDIA GPUs as "90", "120", ...; [] if none."""
    if shutil.which("nvidia-smi") is None:
        return []
    proc = subprocess.run(
        ["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        return []
    return [ln.strip().replace(".", "") for ln in proc.stdout.splitlines() if ln.strip()]


def choose_target(backend: str, cuda_arch: str | None, portable: bool) -> BuildTarget:
    """Resolve "auto" and the architectures. Raises BuildError for an impossible request."""
    caps = gpu_compute_caps()
    has_nvcc = shutil.which("nvcc") is not None
    if backend == "auto":
        backend = "cuda" if (has_nvcc and caps) else "cpu"
    if backend == "cuda":
        if not has_nvcc:
            raise BuildError("backend cuda needs nvcc on PATH (CUDA toolkit); use --backend cpu")
        archs = (cuda_arch or os.environ.get("MC_CUDA_ARCH") or DEFAULT_CUDA_ARCHS).split(";")
        archs += [c for c in caps if c not in archs and cuda_arch is None]
        arch = ";".join(a.strip() for a in archs if a.strip())
    elif backend == "cpu":
        arch = "portable" if portable else cpu_tag()
    else:
        raise BuildError(f"--backend must be one of auto, cpu, cuda (got {backend!r})")
    return BuildTarget(backend, arch, series_hash())


def fetch_sdist(cache: Path) -> Path:
    """The pinned sdist, downloaded once with pip (source only) into the cache."""
    dest = cache / "sdist"
    found = sorted(dest.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if found:
        return found[0]
    dest.mkdir(parents=True, exist_ok=True)
    log(f"downloading the {PACKAGE} {VERSION} sdist with pip")
    run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PACKAGE,
         f"{PACKAGE}=={VERSION}", "-d", str(dest)], "download of the sdist")  # fmt: skip
    found = sorted(dest.glob(f"llama_cpp_python-{VERSION}.tar.gz"))
    if not found:
        raise BuildError(f"pip did not leave llama_cpp_python-{VERSION}.tar.gz in {dest}")
    return found[0]


def unpack(sdist: Path, dest: Path) -> Path:
    """Unpack the sdist under `dest`; returns its top folder."""
    with tarfile.open(sdist) as tar:
        tar.extractall(dest, filter="data")
    (top,) = [p for p in dest.iterdir() if p.is_dir()]
    return top


TRIM_DIRS = (
    ".git/",
    "vendor/llama.cpp/docs/",
    "vendor/llama.cpp/media/",
    "vendor/llama.cpp/tools/ui/",
    "vendor/llama.cpp/benches/",
    "vendor/llama.cpp/vendor/miniaudio/miniaudio.h",  # used by libmtmd only (its CMakeLists stays)
)
TRIM_MODELS = "vendor/llama.cpp/models/"
KEEP_MODELS = ("ggml-vocab-qwen35.gguf",)


def pack_trimmed_sdist(sdist: Path, out: Path) -> Path:
    """Write a copy of the sdist without llama.cpp's docs, web UI and test vocabularies (76 MB ->
    about 8 MB), for machines that cannot download it and take it in a small upload."""
    tmp = out.with_name(out.name + ".partial")
    with tarfile.open(sdist) as src, tarfile.open(tmp, "w:gz") as dst:
        for member in src:
            rel = member.name.split("/", 1)[1] if "/" in member.name else ""
            if rel.startswith(TRIM_DIRS):
                continue
            if rel.startswith(TRIM_MODELS) and member.isfile() and Path(rel).name not in KEEP_MODELS:
                continue
            dst.addfile(member, src.extractfile(member) if member.isfile() else None)
    tmp.replace(out)
    return out


def sync_tree(src: Path, dst: Path) -> int:
    """Make `dst` equal to `src`, rewriting only files whose bytes differ.

    Unchanged files keep their timestamps, so a persistent CMake build folder rebuilds only
    what a patch touched. Returns the number of files written.
    """
    written = 0
    dst.mkdir(parents=True, exist_ok=True)
    wanted = set()
    for path in src.rglob("*"):
        rel = path.relative_to(src)
        wanted.add(rel)
        target = dst / rel
        if path.is_dir():
            target.mkdir(exist_ok=True)
        elif not target.is_file() or target.read_bytes() != path.read_bytes():
            shutil.copy2(path, target)
            written += 1
    for path in sorted(dst.rglob("*"), reverse=True):
        if path.relative_to(dst) not in wanted:
            path.rmdir() if path.is_dir() else path.unlink()
    return written


# ---------------------------------------------------------------------------------------------
# Build, install, verify


def log(msg: str) -> None:
    print(f"[ggml-patches] {msg}", flush=True)


def run(cmd: list[str], what: str, env: dict | None = None) -> None:
    proc = subprocess.run(cmd, env=env)
    if proc.returncode != 0:
        raise BuildError(f"{what} failed (exit {proc.returncode}): {' '.join(cmd)}")


def installed_build_info(python: str) -> dict | None:
    """What the llama_cpp installed in `python` reports, or None (absent, or not patched)."""
    proc = subprocess.run([python, "-c", VERIFY_SNIPPET], capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def build_wheel(target: BuildTarget, cache: Path, sdist: Path, jobs: int, offline: bool = False) -> Path:
    """Patch the sdist and build the wheel into the cache; returns the wheel's path."""
    work = cache / "work" / f"{VERSION}-{target.backend}-{target.arch.replace(';', '-')}"
    with tempfile.TemporaryDirectory(prefix="mc-sdist-") as tmp:
        fresh = unpack(sdist, Path(tmp))
        log(f"applying {len(apply_series(fresh))} patches")
        written = sync_tree(fresh, work / "src")
    log(f"{written} source files changed since the last build in {work}")
    out = cache / "wheels" / target.key
    tmp_out = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp_out, ignore_errors=True)
    env = dict(os.environ, CMAKE_ARGS=" ".join(target.cmake_args()))
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(jobs)
    log(f"building {target.key} with {jobs} jobs: CMAKE_ARGS={env['CMAKE_ARGS']}")
    t0 = time.monotonic()
    isolation = ["--no-build-isolation"] if offline else []  # offline: scikit-build-core must be installed
    run([sys.executable, "-m", "pip", "wheel", "--no-deps", *isolation, "-w", str(tmp_out),
         f"--config-settings=build-dir={work / 'build'}", str(work / "src")],
        "wheel build", env)  # fmt: skip
    log(f"wheel built in {time.monotonic() - t0:.0f} s")
    shutil.rmtree(out, ignore_errors=True)
    tmp_out.rename(out)
    return next(out.glob("*.whl"))


def install(wheel: Path, python: str, target: BuildTarget, offline: bool = False) -> None:
    log(f"installing {wheel.name} into {python}")
    run([python, "-m", "pip", "install", "--force-reinstall", "--no-deps", str(wheel)], "install")
    if not offline:  # offline, its dependencies must already be there
        run([python, "-m", "pip", "install", str(wheel)], "install of the wheel's dependencies")
    info = installed_build_info(python)
    if info is None or info.get("patch_series") != target.series_hash:
        raise BuildError(f"installed llama_cpp reports {info}, expected patch series {target.series_hash}")
    log(f"installed: patch series {target.series_hash[:16]} backend {info['backend']} arch {info['arch']}")


def ensure(args: argparse.Namespace) -> Path | None:
    """Build (or reuse) and install; returns the wheel path, or None when already installed."""
    target = choose_target(args.backend, args.cuda_arch, args.portable)
    cache = cache_root(args.cache_dir)
    info = None if (args.no_install or args.force) else installed_build_info(args.python)
    want_arch = target.arch.replace(";", ",")
    if info and (info["patch_series"], info["backend"], info["arch"]) == (
        target.series_hash,
        target.backend,
        want_arch,
    ):
        log(f"up to date: {target.key} is installed in {args.python}")
        return None
    cached = sorted((cache / "wheels" / target.key).glob("*.whl"))
    if cached and not args.force:
        wheel = cached[0]
        log(f"using the cached wheel {wheel}")
    else:
        sdist = Path(args.sdist) if args.sdist else fetch_sdist(cache)
        wheel = build_wheel(target, cache, sdist, args.jobs, args.offline)
    if not args.no_install:
        install(wheel, args.python, target, args.offline)
    return wheel


TOOL_CMAKE_ARGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DBUILD_SHARED_LIBS=OFF",
]


def build_tools(
    targets: list[str], target: BuildTarget, stock: bool, cache: Path, sdist: Path, jobs: int
) -> Path:
    """Build llama.cpp's own programs (llama-batched-bench, llama-perplexity, llama-bench, ...) from
    the pinned source, stock or patched, for the benchmarks and cross-checks; returns the bin folder.
    The build folder persists, so more targets later cost only their own files."""
    variant = "stock" if stock else target.series_hash[:16]
    root = cache / "tools" / f"{VERSION}-{variant}-{target.backend}-{target.arch.replace(';', '-')}"
    with tempfile.TemporaryDirectory(prefix="mc-sdist-") as tmp:
        fresh = unpack(sdist, Path(tmp))
        if not stock:
            apply_series(fresh)
        sync_tree(fresh / "vendor" / "llama.cpp", root / "src")
    args = [a for a in target.cmake_args() if a.startswith(("-DGGML_", "-DCMAKE_CUDA", "-DMC_"))]
    run(["cmake", "-S", str(root / "src"), "-B", str(root / "build"), "-G", "Ninja", *TOOL_CMAKE_ARGS, *args],
        "cmake configure of llama.cpp tools")  # fmt: skip
    t0 = time.monotonic()
    run(
        ["cmake", "--build", str(root / "build"), "--target", *targets, "-j", str(jobs)],
        "build of " + ", ".join(targets),
    )
    log(f"built {', '.join(targets)} ({'stock' if stock else 'patched'}) in {time.monotonic() - t0:.0f} s")
    return root / "build" / "bin"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--python", default=sys.executable, help="the Python to install into")
    ap.add_argument(
        "--backend", default=os.environ.get("MC_BACKEND", "auto"), choices=["auto", "cpu", "cuda"]
    )
    ap.add_argument(
        "--cuda-arch", default=None, help=f"CUDA architectures, default {DEFAULT_CUDA_ARCHS!r} + this GPU's"
    )
    ap.add_argument("--portable", action="store_true", help="CPU: no -march=native (AVX2/FMA/F16C baseline)")
    ap.add_argument("--cache-dir", default=None, help="default $MC_CACHE_DIR or ~/.cache/megacapybara")
    ap.add_argument("--sdist", default=None, help="use this sdist file instead of downloading it")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 2)
    ap.add_argument("--no-install", action="store_true", help="build or reuse the wheel, install nothing")
    ap.add_argument("--force", action="store_true", help="rebuild even if a cached wheel exists")
    ap.add_argument("--print-key", action="store_true", help="print the cache key and exit")
    ap.add_argument(
        "--offline", action="store_true", help="no network: no build isolation, no dependency installs"
    )
    ap.add_argument("--pack-sdist", metavar="OUT", help="write a trimmed sdist (about 8 MB) to OUT and exit")
    ap.add_argument("--tools", metavar="T1,T2", help="build these llama.cpp programs instead of the wheel")
    ap.add_argument("--stock", action="store_true", help="with --tools: from the unpatched source")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.pack_sdist:
            sdist = Path(args.sdist) if args.sdist else fetch_sdist(cache_root(args.cache_dir))
            out = pack_trimmed_sdist(sdist, Path(args.pack_sdist))
            log(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB)")
            return 0
        if args.tools:
            target = choose_target(args.backend, args.cuda_arch, args.portable)
            cache = cache_root(args.cache_dir)
            sdist = Path(args.sdist) if args.sdist else fetch_sdist(cache)
            print(build_tools(args.tools.split(","), target, args.stock, cache, sdist, args.jobs))
            return 0
        if args.print_key:
            print(choose_target(args.backend, args.cuda_arch, args.portable).key)
            return 0
        ensure(args)
    except BuildError as exc:
        print(f"ggml-patches/build.py: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
