#!/usr/bin/env python3
"""Kernel labs: the patched tree's own kernels launched directly at the 27B's shapes, without building
llama.cpp (the sdist unpacked, the patch series applied, one source file compiled into a small
program with the launchers' host dependencies stubbed): ~1 min on a fresh GPU machine against ~5 for
the side-by-side build, so a kernel change is timed in one short call. Writes JSON, prints a table.

  gdn: bench/gpu/gdn_lab.cu, the Gated DeltaNet recurrence (stock, staged, MC_GDN_WIDE's "wide", and at
       2+ tokens MC_GDN_COLS's "wide2" / "wide4"), a step's 48 launches for each token count, outputs
       against the default kernel's and against the recurrence in double on the host.
  mmr: bench/gpu/mmr_lab.cu, the Q4_0 products on the 27B's product groups, a step's 256 launches: --columns
       9..16 the verify step's 2-tile repacked tensor-core kernel (mc_mmr_q4_0), --columns 1 decode's dp4a
       kernel (mc_mmv_q4_0, the FFN's gate and up fused); under each --setting (environment variables the
       kernels read, e.g. MC_MMR_FORM=1; MC_MMR_FORM=4, patch 0025's warpgroup kernel, with --arch 90a),
       rounds in alternating order; each setting's output checksums against the first setting's, and (from the
       weight bytes each launch reads) each group's and the step's rate in TB/s, to set against the machine's
       copy bandwidth. With --columns 1 the library's persistent decode kernel runs by default (patch 0031:
       each CTA streams whole rows through a ring of bulk-copy stages; MC_MMV_PERSIST=0: mc_mmv_q4_0
       throughout; MC_MMV_PERSIST_STAGES / _CTAS / _STAGE_KB / _MIN_PIECES / _YSMEM; the groups it declines on
       the dp4a kernel), MC_LAB_PMV_COPIES=1 its copies alone (a bound). A setting with MC_LAB_Q6K=1 (9..16
       columns) times the verify step's Q6_K output product alone instead (mc_mmq_q6_K on the 27B's 248,320 x
       5,120 matrix, group out_q6k; e.g. with MC_MMQ_Q6K_CARVEOUT=64 against without; MC_LAB_Q6K_HOST=1: each
       launch followed by its outputs' copy to page-locked host memory, =2: the kernel writes that memory
       itself, patch 0035; the checksum then the host memory's).
  pstep: bench/gpu/pstep_lab.cu, a standalone prototype (not in the patch series) of a decode step's
       products with no launch boundaries: the 27B's 256 product tasks (13.7 GB of distinct weights)
       on persistent CTAs (the library's piece plan and arithmetic), one ring of bulk-copy stages across
       the tasks, a grid barrier where the small kernels would run, its wait lengthened by
       MC_LAB_PSTEP_GAP_NS / MC_LAB_PSTEP_CORE_NS (after every task / after each layer's input group) to
       model their time; MC_LAB_PSTEP_SCOPE 0 / 1 / 2 (a launch per task / layer / the step),
       MC_LAB_PSTEP_STAGES, _STAGE_KB, _CTAS, MC_LAB_PSTEP_MATH=0 (the copies alone: a bound); settings
       and rounds as mmr's; each group's outputs against a reference in double (ref rel), the step's
       ms and TB/s.
  wg: bench/gpu/wg_lab.cu, a standalone prototype (not in the patch series) of the 16-column product on
       sm_90a's asynchronous warpgroup MMAs, on the same product groups, checked against a host
       reference (which of the descriptor's two stride fields is which, tried both ways), for --wg 1
       and 2 warpgroups a CTA; compiled for 90a whatever --arch says.

usage (on the GPU machine; nvcc):
  python3 bench/gpu/kernel_lab.py gdn --json OUT.json [--tokens 1,16] [--repeats 50]
  python3 bench/gpu/kernel_lab.py mmr --json OUT.json [--columns 16] [--setting base=]
      [--setting form1=MC_MMR_FORM=1] [--rounds 2] [--repeats 20]
  python3 bench/gpu/kernel_lab.py pstep --json OUT.json [--setting gap5=MC_LAB_PSTEP_GAP_NS=5000]
      [--rounds 2] [--repeats 20]
  python3 bench/gpu/kernel_lab.py wg --json OUT.json [--wg 1,2] [--repeats 20]
  python3 bench/gpu/kernel_lab.py pstep --build-only /tmp/pstep   (then, e.g., ncu ... /tmp/pstep 1)
  common: [--sdist .device/llama_cpp_python-0.3.36.tar.gz | --src PATCHED/vendor/llama.cpp]
      [--without 0040] (the series less that patch: two calls, with and without it, A/B a patch that
      has no setting of its own)"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
STUB = ROOT / "tests" / "ggml_patches" / "cuda_stub"  # cuBLAS names for a toolkit without cuBLAS
LABS = {"gdn": "gdn_lab.cu", "mmr": "mmr_lab.cu", "pstep": "pstep_lab.cu", "wg": "wg_lab.cu"}


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def parse(lines: list[str]) -> list[dict]:
    rows = []
    for line in (x.strip() for x in lines):
        if line.startswith("{"):
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise SystemExit(f"a lab printed a line that is not JSON ({e}): {line}") from None
    return rows


def rel(x) -> str:
    """A relative difference for a table: None is the lab's mark for a value that is not finite."""
    return f"{x:>11.2e}" if x is not None else f"{'NOT FINITE':>11}"


def gdn_table(rows: list[dict]) -> str:
    head = ("variant", "tokens", "us", "step ms", "out rel", "state rel", "host out", "host state")
    lines = [f"{head[0]:<9}{head[1]:>7}{head[2]:>10}{head[3]:>9}" + "".join(f"{h:>11}" for h in head[4:])]
    for r in rows:
        lines.append(
            f"{r['variant']:<9}{r['tokens']:>7}{r['us']:>10.2f}{r['step_ms']:>9.3f}"
            + "".join(rel(r.get(k)) for k in ("out_rel", "state_rel", "host_out_rel", "host_state_rel"))
        )
    return "\n".join(lines)


def mmr_summary(runs: dict[str, list[list[dict]]]) -> dict[str, dict]:
    """Each setting's step ms (mean, min, max over its runs), group us means and the largest relative
    difference of its output checksums from the first setting's first run; where the lab printed the
    weight bytes a launch reads, each group's and the step's rate in TB/s (against the machine's
    copy bandwidth: how far the products are from streaming), or from the step's bytes where the lab
    printed them (pstep: one launch, no group times); the largest difference from the lab's reference
    in double where it printed one (ref_rel)."""
    first = next(iter(runs.values()))[0]
    ref = {r["group"]: r for r in first if r["kind"] == "check"}
    out: dict[str, dict] = {}
    for name, rounds in runs.items():
        steps = [r["step_ms"] for run in rounds for r in run if r["kind"] == "step"]
        groups: dict[str, list[float]] = {}
        sizes: dict[str, tuple[int, int]] = {}  # a group's bytes a launch and its launches a step
        worst = 0.0
        printed = [r["bytes"] for run in rounds for r in run if r["kind"] == "step" and "bytes" in r]
        ref_rel = [
            math.inf if r["ref_rel"] is None else r["ref_rel"]
            for run in rounds
            for r in run
            if r["kind"] == "check" and "ref_rel" in r
        ]
        for run in rounds:
            for r in run:
                if r["kind"] == "group":
                    groups.setdefault(r["group"], []).append(r["us"])
                    if "bytes" in r:
                        sizes[r["group"]] = (r["bytes"], r["launches"])
                elif r["kind"] == "check" and r["group"] in ref:
                    for key in ("sum", "sumsq"):
                        base = ref[r["group"]][key]
                        if r[key] is None or base is None:  # not finite (the lab prints null)
                            worst = math.inf
                        else:
                            worst = max(worst, abs(r[key] - base) / max(abs(base), 1e-30))
        group_us = {g: sum(v) / len(v) for g, v in groups.items()}
        out[name] = {
            "step_ms": {
                "mean": sum(steps) / len(steps),
                "min": min(steps),
                "max": max(steps),
                "n": len(steps),
            }
            if steps
            else None,
            "group_us": group_us,
            "checksum_rel": worst,
        }
        if sizes and steps:  # bytes / us = MB/s; / 1e6 = TB/s
            out[name]["group_tb_s"] = {g: b / group_us[g] / 1e6 for g, (b, _) in sizes.items()}
            step_bytes = sum(b * n for b, n in sizes.values())
            out[name]["step_gb"] = step_bytes / 1e9
            out[name]["step_tb_s"] = step_bytes / (out[name]["step_ms"]["mean"] * 1e9)
        elif printed and steps:
            out[name]["step_gb"] = printed[0] / 1e9
            out[name]["step_tb_s"] = printed[0] / (out[name]["step_ms"]["mean"] * 1e9)
        if ref_rel:
            out[name]["ref_rel"] = max(ref_rel)
    return out


def mmr_table(summary: dict[str, dict]) -> str:
    head = f"{'setting':<14}{'step ms':>9}{'min':>9}{'max':>9}{'vs first':>10}{'checksum rel':>14}"
    refs = any("ref_rel" in s for s in summary.values())
    lines = [head + f"{'TB/s':>7}" + (f"{'ref rel':>10}" if refs else "")]
    base = None
    for name, s in summary.items():
        st = s["step_ms"]
        if st is None:
            lines.append(f"{name:<14}{'failed':>9}")
            continue
        base = base or st["mean"]
        lines.append(
            f"{name:<14}{st['mean']:>9.3f}{st['min']:>9.3f}{st['max']:>9.3f}"
            f"{100 * (st['mean'] / base - 1):>+9.1f}%{s['checksum_rel']:>14.2e}"
            + (f"{s['step_tb_s']:>7.2f}" if "step_tb_s" in s else "")
            + (f"{s['ref_rel']:>10.2e}" if "ref_rel" in s else "")
        )
    return "\n".join(lines)


def wg_table(rows: list[dict]) -> str:
    """The wg lab's runs: the layout it settled on, each group's check and speed, the step."""
    lines = []
    for r in rows:
        if r["kind"] == "layout":
            lines.append(f"layout lbo {r['lbo']} sbo {r['sbo']}: max rel {r['max_rel']:.2e}")
        elif r["kind"] == "check":
            ok = "ok" if r["ok"] else "DIFFERS from the host reference"
            where = f"k slices {r['k_slices']}  ctas {r['ctas']:>5}"
            lines.append(f"{r['group']:<12} {where}  max rel {r['max_rel']:.2e} {ok}")
        elif r["kind"] == "group":
            lines.append(
                f"{r['group']:<12} {r['launches']:>3} launches  {r['us']:>9.2f} us  {r['tb_s']:.2f} TB/s"
            )
        elif r["kind"] == "step":
            conv = r.get("step_ms_with_convert")
            more = f" ({conv:.3f} with the activations' conversion before each)" if conv is not None else ""
            lines.append(f"step (wg {r['wg']}, {r['ctas_per_sm']} CTAs an SM): {r['step_ms']:.3f} ms{more}")
    return "\n".join(lines)


def wg_arg(text: str) -> list[int]:
    values = text.split(",")
    if any(v not in ("1", "2") for v in values):
        raise SystemExit(f"--wg {text!r}: expected a comma list of 1 and / or 2 (warpgroups a CTA)")
    return [int(v) for v in values]


def tokens_arg(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",")]
    except ValueError:
        values = []
    if not values or any(not 1 <= v <= 2048 for v in values):
        raise SystemExit(f"--tokens {text!r}: expected a comma list of token counts, each 1..2048")
    return values


def patched_tree(sdist: Path, work: Path, without: list[str] | None = None) -> Path:
    """The sdist unpacked under work with the patch series applied, less the patches named in without
    (a name or its number, e.g. 0040: the tree before that patch, for an A/B of a patch that has no
    setting of its own); its vendor/llama.cpp."""
    build = load("mc_build_script", ROOT / "ggml-patches" / "build.py")
    top = build.unpack(sdist, work)
    patch_dir = build.PATCH_DIR
    if without:
        names = [path.name for path in build.read_series(patch_dir)]

        def named(n: str, w: str) -> bool:  # w names patch n: its whole name or its number
            return n == w or n.startswith(w + "-")

        left = [n for n in names if not any(named(n, w) for w in without)]
        unknown = [w for w in without if not any(named(n, w) for n in names)]
        if unknown:
            have = f"{names[0]} .. {names[-1]}"
            raise SystemExit(f"--without {', '.join(unknown)}: not in the series (it has {have})")
        patch_dir = work / "series-without"
        (patch_dir / "patches").mkdir(parents=True)
        (patch_dir / "series").write_text("".join(n + "\n" for n in left))
        for n in left:
            (patch_dir / "patches" / n).symlink_to(build.PATCH_DIR / "patches" / n)
    build.apply_series(top, patch_dir)
    return top / "vendor" / "llama.cpp"


def compile_cmd(nvcc: str, tree: Path, lab: str, exe: Path, arch: str) -> list[str]:
    cmd = [nvcc, "-std=c++17", "-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"]
    cuda_include = Path(shutil.which(nvcc) or nvcc).resolve().parent.parent / "include"
    if not (cuda_include / "cublas_v2.h").exists():
        cmd.append(f"-I{STUB}")
    for sub in ("ggml/include", "ggml/src", "ggml/src/ggml-cuda"):
        cmd.append(f"-I{tree / sub}")
    return [*cmd, str(HERE / LABS[lab]), "-o", str(exe)]


def run(args: list[str], timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(
            args,
            capture_output=True,
            text=True,
            check=False,
            timeout=timeout,
            env={**os.environ, **(env or {})},
        )
    except subprocess.TimeoutExpired as e:
        raise SystemExit(f"{Path(args[0]).name} ran past --timeout {timeout} s") from e


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("lab", choices=sorted(LABS), help="which lab")
    ap.add_argument("--json", default="", help="where to write the results (needed unless --build-only)")
    ap.add_argument(
        "--repeats", type=int, default=0, help="timed steps a run (default: gdn 50, mmr 20, pstep 20, wg 20)"
    )
    ap.add_argument("--tokens", default="1,16", help="gdn: token counts (each 1..2048; 512: a prompt ubatch)")
    ap.add_argument("--columns", type=int, default=16, help="mmr: columns of the product (1 or 9..16)")
    ap.add_argument(
        "--setting", action="append", default=[], help="mmr, pstep: NAME=VAR=VALUE[,VAR=VALUE...]"
    )
    ap.add_argument("--rounds", type=int, default=2, help="mmr, pstep: rounds over the settings")
    ap.add_argument("--wg", default="1,2", help="wg: warpgroups a CTA to run, a comma list of 1 and 2")
    ap.add_argument("--sdist", default=".device/llama_cpp_python-0.3.36.tar.gz", help="the pinned sdist")
    ap.add_argument("--src", default="", help="an already patched vendor/llama.cpp (skips the sdist)")
    ap.add_argument(
        "--without",
        action="append",
        default=[],
        help="leave this patch (its name or number, e.g. 0040) out of the series; repeatable",
    )
    ap.add_argument("--nvcc", default=os.environ.get("NVCC", "nvcc"))
    ap.add_argument("--arch", default="90", help="CUDA arch to build for (90: H100 / H200)")
    ap.add_argument("--commit", default="", help="the tree's git commit, recorded in the JSON")
    ap.add_argument("--timeout", type=float, default=240, help="seconds a run of the program may take")
    ap.add_argument(
        "--build-only",
        metavar="EXE",
        default="",
        help="compile the lab (with -lineinfo, for ncu's source view) to EXE and stop: run it under ncu",
    )
    a = ap.parse_args()
    if not a.json and not a.build_only:
        raise SystemExit("--json: needed (where to write the results), unless --build-only")
    repeats = a.repeats or {"gdn": 50, "mmr": 20, "pstep": 20, "wg": 20}[a.lab]
    if repeats < 1:
        raise SystemExit(f"--repeats {a.repeats}: must be at least 1")
    if not a.arch.rstrip("a").isdigit():
        raise SystemExit(f"--arch {a.arch!r}: expected a CUDA arch number such as 90 or 120")
    tokens = tokens_arg(a.tokens) if a.lab == "gdn" else []
    wgs = wg_arg(a.wg) if a.lab == "wg" else []
    arch = "90a" if a.lab == "wg" else a.arch  # wgmma exists on sm_90a only
    settings: dict[str, dict[str, str]] = {}
    if a.lab in ("mmr", "pstep"):
        if a.lab == "mmr" and a.columns != 1 and not 9 <= a.columns <= 16:
            raise SystemExit(f"--columns {a.columns}: 1 (decode's kernel) or 9..16 (the verify step's)")
        if a.rounds < 1:
            raise SystemExit(f"--rounds {a.rounds}: must be at least 1")
        warm = load("mc_warm_repeats", HERE / "warm_repeats.py")
        for text in a.setting or ["default="]:
            name, env = warm.parse_setting(text)
            if name in settings:
                raise SystemExit(f"--setting: names must differ, got {name!r} twice")
            settings[name] = env
    work = Path(tempfile.mkdtemp(prefix="kernel_lab"))
    if a.src:
        tree = Path(a.src)
        if not (tree / "ggml" / "src" / "ggml-cuda" / "gated_delta_net.cu").exists():
            raise SystemExit(f"--src {a.src}: no ggml/src/ggml-cuda/gated_delta_net.cu there")
    else:
        if not Path(a.sdist).exists():
            hint = "python3 ggml-patches/build.py --pack-sdist ..."
            raise SystemExit(f"--sdist {a.sdist}: no such file ({hint})")
        tree = patched_tree(Path(a.sdist), work, a.without)
    if a.build_only:
        subprocess.run([*compile_cmd(a.nvcc, tree, a.lab, Path(a.build_only), arch), "-lineinfo"], check=True)
        print(f"built {a.build_only}")
        return
    exe = work / a.lab
    subprocess.run(compile_cmd(a.nvcc, tree, a.lab, exe, arch), check=True)
    try:
        query = ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"]
        gpu = subprocess.run(query, capture_output=True, text=True, check=False).stdout.strip()
    except FileNotFoundError:
        gpu = ""
    out: dict = {
        "lab": a.lab,
        "gpu": gpu,
        "date": datetime.date.today().isoformat(),
        "commit": a.commit,
        "command": " ".join(sys.argv),
        "without": a.without,
    }
    errors = []

    def rows_of(args: list[str]) -> list[dict]:
        """One run of the lab program: its JSON rows (those before a failure are kept)."""
        res = run([str(exe), *args], a.timeout)
        if res.returncode != 0:
            errors.append(f"{a.lab}_lab exited {res.returncode}: {res.stderr.strip()[-2000:]}")
        return parse(res.stdout.splitlines())

    if a.lab == "gdn":
        out["rows"] = rows_of([str(repeats), *map(str, tokens)])
        text = gdn_table(out["rows"])
    elif a.lab == "wg":
        out["runs"] = {str(n): rows_of([str(repeats), str(n)]) for n in wgs}
        text = "\n".join(f"-- wg {n}\n{wg_table(rows)}" for n, rows in out["runs"].items())
    else:
        runs: dict[str, list[list[dict]]] = {name: [] for name in settings}
        names = list(settings)
        for rnd in range(a.rounds):
            for name in names if rnd % 2 == 0 else names[::-1]:
                cols = [str(a.columns)] if a.lab == "mmr" else []
                res = run([str(exe), str(repeats), *cols], a.timeout, settings[name])
                runs[name].append(parse(res.stdout.splitlines()))
                if res.returncode != 0:
                    tail = res.stderr.strip()[-1000:]
                    errors.append(f"{a.lab}_lab ({name}) exited {res.returncode}: {tail}")
        out["settings"] = settings
        out["runs"] = runs
        out["summary"] = mmr_summary(runs)
        text = mmr_table(out["summary"])
    if errors:
        out["error"] = "; ".join(errors)
    Path(a.json).write_text(json.dumps(out, indent=1))
    print(text)
    if errors:
        raise SystemExit(out["error"])


if __name__ == "__main__":
    main()
