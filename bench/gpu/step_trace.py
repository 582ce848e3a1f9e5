#!/usr/bin/env python3
"""Where a decode step's time goes, kernel by kernel, in the captured CUDA graph as it runs (PDL and
all): bench/gpu/step_trace.cpp records every kernel's start and end on the GPU through CUPTI (the
timeline Nsight Systems would give; it is not on the GPU machine). In a graph of one stream each
kernel finishes after the one before it, so a kernel's *increment*, its end minus the previous
kernel's end, is what it adds to the step: the increments of a step add up to its span. They are
summed by kernel name and by the pair (previous kernel, kernel), which shows which boundaries cost.

usage (on the GPU machine, after bench/gpu/side_by_side.sh has built the patched programs):

  python3 bench/gpu/step_trace.py trace --bench /tmp/mcs/patched/mc_gpu_bench \\
      --model /tmp/mcs/random-27b-q4_0.gguf --tokens 64 --json $OUT/trace.json \\
      [--setting VAR=VALUE ...] [--csv $OUT/trace.csv] [--k 16 --depth 512]

--k K > 1 traces one sequence's K-token verify steps (all logits) instead of one-token decode steps:
`mc_gpu_bench verify MODEL DEPTH 1 K`, 3 warm-up and 20 timed steps (--tokens unused).

or in parts: `build --out SO` (the CUPTI library, found beside the CUDA toolkit or in the
nvidia-cuda-cupti wheel), `run --so SO --csv CSV -- PROGRAM ARGS...`, `report --csv CSV --json OUT`;
`compare A.json B.json` lines two reports' steps up kernel by kernel (a setting that leaves kernels
out) and prints where B's step gains or loses time: by kernel name, and the kernels only one has.
A step is one graph launch (its kernels share a correlation id) of at least --min-kernels kernels;
the first --skip steps are left out (the warm-up). Writes JSON (the span, every position's median
increment and duration, the sums by name and by pair) and prints the largest sums."""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "step_trace.cpp"


# ---- the library ----


def cuda_roots() -> list[Path]:
    """Folders that may hold the CUDA toolkit (include/cupti.h, lib64 or lib/libcupti.so), most
    specific first: $CUDA_HOME, nvcc's toolkit, /usr/local/cuda, the nvidia-cuda-cupti wheel."""
    roots: list[Path] = []
    if os.environ.get("CUDA_HOME"):
        roots.append(Path(os.environ["CUDA_HOME"]))
    nvcc = shutil.which("nvcc")
    if nvcc:
        roots.append(Path(nvcc).resolve().parent.parent)
    roots.append(Path("/usr/local/cuda"))
    for site in map(Path, sys.path):
        roots.append(site / "nvidia" / "cuda_cupti")
        roots.append(site / "nvidia" / "cu13")
    return roots


def find_cupti(roots: list[Path]) -> tuple[Path, Path]:
    """(include folder with cupti.h, folder with libcupti.so*) from the first root that has both,
    looking also under extras/CUPTI; SystemExit naming every place looked at otherwise."""
    looked = []
    for root in roots:
        for base in (root, root / "extras" / "CUPTI"):
            inc = base / "include"
            looked.append(str(base))
            if not (inc / "cupti.h").is_file():
                continue
            for lib in (base / "lib64", base / "lib", base / "targets" / "x86_64-linux" / "lib"):
                if any(lib.glob("libcupti.so*")):
                    return inc, lib
    raise SystemExit("step_trace: cupti.h and libcupti.so not found under: " + ", ".join(looked))


def build(out: Path, roots: list[Path] | None = None) -> Path:
    """Compiles step_trace.cpp into the shared library out (g++), linked to the CUPTI found."""
    inc, lib = find_cupti(roots if roots is not None else cuda_roots())
    names = sorted(p.name for p in lib.glob("libcupti.so*"))
    link = ["-lcupti"] if "libcupti.so" in names else [f"-l:{names[0]}"]
    cmd = ["g++", "-std=c++17", "-O2", "-fPIC", "-shared", f"-I{inc}", str(SOURCE), f"-L{lib}", *link]
    cmd += [f"-Wl,-rpath,{lib}", "-o", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"step_trace: {' '.join(cmd)} failed:\n{res.stderr[-3000:]}")
    return out


def run(so: Path, out_csv: Path, argv: list[str], env_extra: dict[str, str] | None = None) -> int:
    """Runs argv with the library injected; the kernels go to out_csv."""
    env = dict(os.environ, CUDA_INJECTION64_PATH=str(so), MC_TRACE_OUT=str(out_csv))
    env.update(env_extra or {})
    return subprocess.run(argv, env=env).returncode


def program_argv(bench: Path, model: Path, depth: int, tokens: int, k: int) -> list[str]:
    """The traced program's command: `tokens` one-token decode steps (k = 1) or one sequence's k-token
    verify steps with all logits (mc_gpu_bench verify: 3 warm-up and 20 timed steps)."""
    if k < 1 or depth < 0 or tokens < 1:
        raise SystemExit(
            f"step_trace: --k {k}, --depth {depth}, --tokens {tokens}: need k >= 1, depth >= 0, tokens >= 1"
        )
    if k == 1:
        return [str(bench), "tg", str(model), str(depth), str(tokens)]
    return [str(bench), "verify", str(model), str(depth), "1", str(k)]


# ---- the report ----


def demangle(names: list[str]) -> dict[str, str]:
    """Mangled -> readable through c++filt where it is installed (else unchanged)."""
    tool = shutil.which("c++filt")
    if not tool or not names:
        return {n: n for n in names}
    res = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True)
    out = res.stdout.splitlines()
    if res.returncode != 0 or len(out) != len(names):
        return {n: n for n in names}
    return dict(zip(names, out, strict=True))


def short_name(name: str) -> str:
    """A kernel's name without its return type and argument list (its template arguments kept)."""
    name = re.sub(r"^void\s+", "", name)
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth -= 1
        elif ch == "(" and depth == 0:
            return name[:i]
    return name


def read_steps(path: Path, min_kernels: int) -> list[list[dict]]:
    """The graph launches of at least min_kernels kernels, in launch order, each its kernels sorted by
    end time."""
    by_corr: dict[int, list[dict]] = defaultdict(list)
    outside = 0
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            if int(row["graph"]) == 0:
                outside += 1
                continue
            by_corr[int(row["correlation"])].append(
                {"start": int(row["start_ns"]), "end": int(row["end_ns"]), "name": row["name"],
                 "grid": row["grid"], "block": row["block"], "cluster": row["cluster"]}
            )  # fmt: skip
    steps = [
        sorted(ks, key=lambda k: (k["end"], k["start"])) for ks in by_corr.values() if len(ks) >= min_kernels
    ]
    if not steps:
        sizes = sorted((len(ks) for ks in by_corr.values()), reverse=True)[:5]
        raise SystemExit(
            f"step_trace: no graph launch of at least {min_kernels} kernels in {path} ({outside} kernels "
            f"outside graphs, {len(by_corr)} graph launches, the largest of {sizes} kernels)"
        )
    return sorted(steps, key=lambda ks: min(k["start"] for k in ks))


def report(steps: list[list[dict]], skip: int) -> dict:
    """Increments and durations by position, name and pair over the steps after the first skip ones;
    steps whose sequence of kernels differs from the first kept one are counted and left out."""
    kept = steps[skip:]
    if not kept:
        raise SystemExit(f"step_trace: {len(steps)} steps, none left after skipping {skip}")
    mangled = sorted({k["name"] for ks in kept for k in ks})
    readable = {m: short_name(d) for m, d in demangle(mangled).items()}
    ref = [k["name"] for k in kept[0]]
    same = [ks for ks in kept if [k["name"] for k in ks] == ref]
    incs: list[list[float]] = []  # per step, per position (us)
    durs: list[list[float]] = []
    spans: list[float] = []
    for ks in same:
        first = min(k["start"] for k in ks)
        prev = first
        inc, dur = [], []
        for k in ks:
            inc.append((k["end"] - prev) / 1e3)
            dur.append((k["end"] - k["start"]) / 1e3)
            prev = k["end"]
        incs.append(inc)
        durs.append(dur)
        spans.append((ks[-1]["end"] - first) / 1e3)
    positions = []
    for i, m in enumerate(ref):
        positions.append({
            "i": i, "name": readable[m], "grid": same[0][i]["grid"], "block": same[0][i]["block"],
            "cluster": same[0][i]["cluster"],
            "inc_us": round(statistics.median(s[i] for s in incs), 3),
            "dur_us": round(statistics.median(s[i] for s in durs), 3),
        })  # fmt: skip
    by_name: dict[str, dict] = {}
    by_pair: dict[str, dict] = {}
    for p in positions:
        prev = positions[p["i"] - 1]["name"] if p["i"] > 0 else "(step start)"
        for table, key in ((by_name, p["name"]), (by_pair, f"{prev} -> {p['name']}")):
            e = table.setdefault(key, {"count": 0, "inc_us": 0.0, "dur_us": 0.0})
            e["count"] += 1
            e["inc_us"] += p["inc_us"]
            e["dur_us"] += p["dur_us"]

    def ranked(table: dict[str, dict]) -> list[dict]:
        rows = [{"key": k, "count": v["count"], "inc_us": round(v["inc_us"], 2),
                 "inc_us_each": round(v["inc_us"] / v["count"], 3), "dur_us": round(v["dur_us"], 2)}
                for k, v in table.items()]  # fmt: skip
        return sorted(rows, key=lambda r: -r["inc_us"])

    return {
        "steps": len(steps), "steps_used": len(same), "steps_differing": len(kept) - len(same),
        "kernels_per_step": len(ref), "span_us_median": round(statistics.median(spans), 2),
        "span_us": [round(s, 2) for s in spans],
        "sum_of_increments_us": round(sum(p["inc_us"] for p in positions), 2),
        "by_name": ranked(by_name), "by_pair": ranked(by_pair), "positions": positions,
    }  # fmt: skip


def around(rep: dict, pattern: str, nth: int = 4, width: int = 12) -> list[dict]:
    """The positions within width of the nth kernel (from 0) whose name matches pattern (a regex), or
    of its last match where there are fewer: one stretch of the step to read kernel by kernel."""
    hits = [p["i"] for p in rep["positions"] if re.search(pattern, p["name"])]
    if not hits:
        return []
    c = hits[min(nth, len(hits) - 1)]
    return rep["positions"][max(0, c - width) : c + width + 1]


def print_report(rep: dict, top: int, pattern: str | None = None) -> None:
    print(f"steps {rep['steps_used']} of {rep['steps']} ({rep['steps_differing']} differing), "
          f"{rep['kernels_per_step']} kernels a step, span {rep['span_us_median']:.1f} us (median), "
          f"sum of median increments {rep['sum_of_increments_us']:.1f} us")  # fmt: skip
    for title, rows in (("by kernel", rep["by_name"]), ("by boundary (previous -> kernel)", rep["by_pair"])):
        print(f"\n{title}: {'count':>6} {'inc us':>9} {'each':>7} {'dur us':>9}")
        for r in rows[:top]:
            print(f"  {r['key'][:100]:<100} {r['count']:>6} {r['inc_us']:>9.1f} {r['inc_us_each']:>7.2f} "
                  f"{r['dur_us']:>9.1f}")  # fmt: skip
    if pattern:
        print(f"\naround a kernel matching {pattern!r}: {'inc us':>8} {'dur us':>8}  grid / block / cluster")
        for p in around(rep, pattern):
            print(f"  {p['i']:>5} {p['name'][:90]:<90} {p['inc_us']:>8.2f} {p['dur_us']:>8.2f}  "
                  f"{p['grid']} / {p['block']} / {p['cluster']}")  # fmt: skip


def compare(a: dict, b: dict) -> dict:
    """B's step against A's: the positions lined up by kernel name (difflib), the increment
    differences (B - A) of the kernels both have summed by name, and the kernels only one of them
    has with their increments, so that what B leaves out and which kernels take its time show."""
    from difflib import SequenceMatcher

    pa, pb = a["positions"], b["positions"]
    sm = SequenceMatcher(None, [p["name"] for p in pa], [p["name"] for p in pb], autojunk=False)
    delta: dict[str, dict] = {}
    only: dict[str, dict] = {}
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            for i, j in zip(range(i1, i2), range(j1, j2), strict=True):
                e = delta.setdefault(pb[j]["name"], {"count": 0, "inc_us": 0.0, "dur_us": 0.0})
                e["count"] += 1
                e["inc_us"] += pb[j]["inc_us"] - pa[i]["inc_us"]
                e["dur_us"] += pb[j]["dur_us"] - pa[i]["dur_us"]
            continue
        for side, ps in (("A", pa[i1:i2]), ("B", pb[j1:j2])):
            for p in ps:
                e = only.setdefault(f"{side}: {p['name']}", {"count": 0, "inc_us": 0.0, "dur_us": 0.0})
                e["count"] += 1
                e["inc_us"] += p["inc_us"]
                e["dur_us"] += p["dur_us"]

    def rows(table: dict[str, dict]) -> list[dict]:
        out = [{"key": k, "count": v["count"], "inc_us": round(v["inc_us"], 2),
                "dur_us": round(v["dur_us"], 2)} for k, v in table.items()]  # fmt: skip
        return sorted(out, key=lambda r: -abs(r["inc_us"]))

    return {
        "span_us": [a["span_us_median"], b["span_us_median"]],
        "span_delta_us": round(b["span_us_median"] - a["span_us_median"], 2),
        "matched": sum(r.size for r in sm.get_matching_blocks()),
        "delta_by_name": rows(delta), "only": rows(only),
    }  # fmt: skip


def print_compare(c: dict, top: int) -> None:
    print(f"span A {c['span_us'][0]:.1f} us, B {c['span_us'][1]:.1f} us (B - A {c['span_delta_us']:+.1f}), "
          f"{c['matched']} kernels lined up")  # fmt: skip
    tables = (("kernels both run, B - A", c["delta_by_name"]), ("kernels only one runs", c["only"]))
    for title, rows in tables:
        print(f"\n{title}: {'count':>6} {'inc us':>9} {'dur us':>9}")
        for r in rows[:top]:
            print(f"  {r['key'][:100]:<100} {r['count']:>6} {r['inc_us']:>+9.1f} {r['dur_us']:>+9.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="compile the CUPTI library")
    b.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run", help="run a program with the library injected")
    r.add_argument("--so", type=Path, required=True)
    r.add_argument("--csv", type=Path, required=True)
    r.add_argument("argv", nargs=argparse.REMAINDER)
    c = sub.add_parser("compare", help="two reports' steps lined up kernel by kernel")
    c.add_argument("a", type=Path)
    c.add_argument("b", type=Path)
    c.add_argument("--json", type=Path)
    c.add_argument("--top", type=int, default=30)
    for p in (
        sub.add_parser("report", help="read a CSV"),
        sub.add_parser("trace", help="build, run, report"),
    ):
        p.add_argument("--json", type=Path, required=True)
        p.add_argument("--skip", type=int, default=2, help="warm-up steps left out (default 2)")
        p.add_argument(
            "--min-kernels", type=int, default=100, help="kernels a graph launch needs to be a step"
        )
        p.add_argument("--top", type=int, default=30)
        p.add_argument("--around", help="a regex: print the step's kernels around one that matches it")
        if p.prog.endswith("report"):
            p.add_argument("--csv", type=Path, required=True)
        else:
            p.add_argument("--csv", type=Path, default=Path("/tmp/mcs/step_trace.csv"))
            p.add_argument("--so", type=Path, default=Path("/tmp/mcs/step_trace.so"))
            p.add_argument("--bench", type=Path, required=True)
            p.add_argument("--model", type=Path, required=True)
            p.add_argument("--depth", type=int, default=0)
            p.add_argument("--tokens", type=int, default=64)
            p.add_argument(
                "--k", type=int, default=1, help="tokens a step: 1 decode steps, K > 1 verify steps"
            )
            p.add_argument("--setting", action="append", default=[], help="VAR=VALUE for the traced run")
    a = ap.parse_args()
    if a.cmd == "build":
        print(build(a.out))
        return
    if a.cmd == "compare":
        cmp = compare(json.loads(a.a.read_text()), json.loads(a.b.read_text()))
        if a.json:
            a.json.write_text(json.dumps(cmp, indent=1))
        print_compare(cmp, a.top)
        return
    if a.cmd == "run":
        argv = a.argv[1:] if a.argv[:1] == ["--"] else a.argv
        if not argv:
            raise SystemExit("step_trace run: the program to run goes after --")
        raise SystemExit(run(a.so, a.csv, argv))
    meta: dict = {"command": " ".join(sys.argv)}
    if a.cmd == "trace":
        env = {}
        for s in a.setting:
            var, sep, val = s.partition("=")
            if not sep or not var:
                raise SystemExit(f"--setting {s!r}: expected VAR=VALUE")
            env[var] = val
        argv = program_argv(a.bench, a.model, a.depth, a.tokens, a.k)
        if not a.so.is_file():
            build(a.so)
        rc = run(a.so, a.csv, argv, env)
        if rc != 0:
            raise SystemExit(f"step_trace: {' '.join(argv)} exited with {rc}")
        meta.update(
            settings=env, bench=str(a.bench), model=str(a.model), depth=a.depth, tokens=a.tokens, k=a.k
        )
    rep = report(read_steps(a.csv, a.min_kernels), a.skip)
    rep.update(meta)
    a.json.write_text(json.dumps(rep, indent=1))
    print_report(rep, a.top, a.around)


if __name__ == "__main__":
    main()
