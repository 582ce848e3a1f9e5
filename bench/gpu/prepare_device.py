#!/usr/bin/env python3
"""Prepare .device/ for a call on the GPU machine, which has no network: the pinned llama-cpp-python
sdist, trimmed (ggml-patches/build.py --pack-sdist; the labs and side_by_side.sh build from it), and
the pure-Python wheels the machine's image lacks (gguf for the random 27B model, diskcache for
llama_cpp in the engine part), at the versions this checkout's environment runs. .device/ is
ignored by git, so a fresh checkout has none of it: run this before the first device call (a call
without them failed at once, or only after its build, run BG). Whatever is already there is kept.

usage: python3 bench/gpu/prepare_device.py [--python .venv/bin/python] [--dir .device]"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SDIST_NAME = "llama_cpp_python-0.3.36.tar.gz"
WHEELS = ("gguf", "diskcache")  # what side_by_side.sh's need_module asks for


def installed_version(python: str, module: str) -> str:
    """The version of module's distribution in that python's environment."""
    code = f"import importlib.metadata as m; print(m.version({module!r}))"
    try:
        res = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    except OSError as e:
        raise SystemExit(f"--python {python}: cannot run it ({e.strerror}); run `make setup` first") from None
    if res.returncode != 0:
        raise SystemExit(
            f"{python}: no {module} installed ({res.stderr.strip()[-300:]}); run `make setup` first"
        )
    return res.stdout.strip()


def missing(device: Path, versions: dict[str, str]) -> list[str]:
    """What device lacks: 'sdist' and the wheels (name==version) with no file of that version."""
    out = [] if (device / SDIST_NAME).is_file() else ["sdist"]
    for name, version in versions.items():
        if not list((device / "whl").glob(f"{name}-{version}-*.whl")):
            out.append(f"{name}=={version}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--python", default=str(ROOT / ".venv" / "bin" / "python"), help="the environment's python"
    )
    ap.add_argument("--dir", default=str(ROOT / ".device"), help="the folder the device tool carries")
    a = ap.parse_args(argv)
    device = Path(a.dir)
    versions = {name: installed_version(a.python, name) for name in WHEELS}
    lacking = missing(device, versions)
    if "sdist" in lacking:
        device.mkdir(parents=True, exist_ok=True)
        cmd = [a.python, str(ROOT / "ggml-patches" / "build.py"), "--pack-sdist", str(device / SDIST_NAME)]
        subprocess.run(cmd, check=True)
    wheels = [t for t in lacking if t != "sdist"]
    if wheels:
        (device / "whl").mkdir(parents=True, exist_ok=True)
        cmd = [a.python, "-m", "pip", "download", "--quiet", "--no-deps", *wheels, "-d", str(device / "whl")]
        subprocess.run(cmd, check=True)
    left = missing(device, versions)
    if left:
        raise SystemExit(f"still missing in {device}: {', '.join(left)}")
    print(f"{device}: {SDIST_NAME}, " + ", ".join(f"{n} {v}" for n, v in versions.items()) + " (ready)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
