#!/usr/bin/env python3
"""Collect what bench/gpu/side_by_side.sh measured into one results JSON, and print the table.

    python3 bench/gpu/sbs_summary.py STATE_DIR --out RESULTS.json

Reads STATE_DIR's step outputs (*.out: JSON lines of mc_gpu_bench and llama-batched-bench,
test-backend-ops' text, ncu's raw CSV), bandwidth.out, engine.json, env.txt and
model-bytes.txt. Missing steps stay missing (null) rather than guessed.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import re
import statistics
import subprocess
import time
from collections import defaultdict
from pathlib import Path

from sass_summary import summary as sass_summary  # beside this file, on the path of a script run

ROOT = Path(__file__).resolve().parents[2]
# the tensor-core forms, the decode kernel and the Q6_K product at 9..16 columns
SASS_KERNELS = r"mc_mmh_q4_0|mc_mmq_q4_0|mc_mmv_q4_0ILi1E|mc_mmq_q6_KILi2E"


def json_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text(errors="replace").splitlines():
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            with contextlib.suppress(json.JSONDecodeError):
                out.append(json.loads(line))
    return out


def build_figures(state: Path, build: str) -> dict:
    f: dict = {}
    for row in json_lines(state / f"{build}-tg.out"):
        f[f"tg_depth_{row['depth']}_tok_s"] = row["tok_s"]
    for seqs in (1, 12):
        # one line per k and draw (MC_SBS_DRAWS processes, one after another): the figure is the median
        # of the draws' medians; every draw is kept, and so is the spread between processes
        draws: dict[str, list[float]] = defaultdict(list)
        for r in json_lines(state / f"{build}-verify{seqs}.out"):
            draws[str(r["k"])].append(r["median_ms"])
        if draws:
            f[f"verify{seqs}_ms"] = {k: round(statistics.median(v), 4) for k, v in draws.items()}
            if any(len(v) > 1 for v in draws.values()):
                f[f"verify{seqs}_draws_ms"] = dict(draws)
    batched = json_lines(state / f"{build}-batched.out") + json_lines(state / f"{build}-batched.err")
    if batched:
        f["agg_tok_s"] = {str(r["pl"]): round(r["speed_tg"], 2) for r in batched if "speed_tg" in r}
    ops = {}
    for path in sorted(state.glob(f"{build}-ops-*.out")):
        text = path.read_text(errors="replace")
        m = re.findall(r"(\d+)/(\d+) tests passed", text)
        ops[path.stem.split("-ops-", 1)[1]] = (
            {"passed": int(m[-1][0]), "total": int(m[-1][1])} if m else {"passed": None, "total": None}
        )
    if ops:
        f["test_backend_ops"] = ops
    for kd in sorted(state.glob(f"{build}-kdetail*.out")):  # ncu sections, under each setting
        f["kdetail" + kd.stem[len(f"{build}-kdetail") :].replace("-", "_")] = kdetail_summary(
            kd.read_text(errors="replace")
        )
    for prof in sorted(state.glob(f"{build}-profile*.out")):  # -profile (1 token), -profile-k16 ...
        key = "profile" + prof.stem[len(f"{build}-profile") :].replace("-", "_")
        f[key] = profile_summary(prof.read_text(errors="replace"))
    sass = state / f"{build}-sass.out"  # cuobjdump -sass of mc-mmv.cu
    if sass.exists():  # the instructions of each kernel's widest loop
        f["sass"] = sass_summary(sass.read_text(errors="replace"), SASS_KERNELS)
    return f


def profile_summary(text: str) -> dict:
    """ncu --csv --page raw with gpu__time_duration.sum: kernels grouped by name (one decode step)."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return {}
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    groups: dict[str, list[float]] = defaultdict(list)
    scale = {"nsecond": 1.0, "ns": 1.0, "usecond": 1e3, "us": 1e3, "msecond": 1e6, "ms": 1e6}
    unit_ns = 1.0
    for r in rows:
        name = r.get("Kernel Name") or r.get("Function Name") or "?"
        raw = (r.get("gpu__time_duration.sum") or "").replace(",", "")
        try:
            t = float(raw)
        except ValueError:
            unit_ns = scale.get(raw.strip(), unit_ns)  # the units row
            continue
        groups[re.sub(r"<.*|\(.*", "", name).strip()[:70]].append(t)
    total = sum(sum(v) for v in groups.values()) * unit_ns
    top = sorted(groups.items(), key=lambda kv: -sum(kv[1]))
    return {
        "kernels": sum(len(v) for v in groups.values()),
        "kernel_time_us": round(total / 1000, 1),
        "by_kernel": [
            {
                "name": k,
                "count": len(v),
                "us": round(sum(v) * unit_ns / 1000, 1),
                "share": round(sum(v) * unit_ns / total, 4),
            }
            for k, v in top[:25]
        ],
    }


KDETAIL_SHOWN = (
    "Duration",
    "Memory Throughput",
    "DRAM Throughput",
    "Compute (SM) Throughput",
    "Achieved Occupancy",
    "Warp Cycles Per Issued Instruction",
    "Issue Slots Busy",
    "Registers Per Thread",
)


def kdetail_summary(text: str) -> dict:
    """ncu --csv --page details (sections): per kernel (name with its template arguments), the mean of
    every numeric metric over the profiled launches, with its unit; `launches` counts them."""
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    if not lines:
        return {}
    sums: dict[str, dict[str, list]] = defaultdict(dict)
    launches: dict[str, set] = defaultdict(set)
    for r in csv.DictReader(io.StringIO("\n".join(lines))):
        name = re.sub(r"\(.*", "", r.get("Kernel Name") or "?").strip()
        metric = r.get("Metric Name")
        try:
            value = float((r.get("Metric Value") or "").replace(",", ""))
        except ValueError:
            continue
        if not metric:
            continue
        launches[name].add(r.get("ID"))
        unit = r.get("Metric Unit") or ""
        # one name in two sections with different units (Memory Throughput: % of peak in
        # SpeedOfLight, byte/second in MemoryWorkloadAnalysis) stays two metrics
        first = sums[name].get(metric)
        if first is not None and first[2] != unit:
            metric = f"{metric} ({unit})"
        entry = sums[name].setdefault(metric, [0.0, 0, unit])
        entry[0] += value
        entry[1] += 1
    return {
        name: {
            "launches": len(launches[name]),
            "metrics": {m: {"mean": round(v[0] / v[1], 4), "unit": v[2]} for m, v in sorted(ms.items())},
        }
        for name, ms in sums.items()
    }


STALL = re.compile(r"smsp__average_warps_issue_stalled_(\w+?)_per_issue_active")


def stall_reasons(metrics: dict) -> list:
    """ncu's warp-state breakdown (smsp__average_warps_issue_stalled_<reason>_per_issue_active):
    (reason, warps stalled on it per issued instruction), largest first."""
    out = []
    for m, v in metrics.items():
        hit = STALL.match(m)
        if hit:
            out.append((hit.group(1), v["mean"]))
    return sorted(out, key=lambda x: -x[1])


def variants_below(state: Path) -> dict[str, list[str]]:
    """For each setting of the patched build (side_by_side.sh logs "variant NAME: VAR=VAL+VAR=VAL"), the
    settings whose VAR=VAL are a strict part of its own: vct (MC_FUSE_CONV_TOKENS=1+MC_MMH_REPACK=3) adds
    to vcopies (MC_MMH_REPACK=3), so its logits against vcopies' tell what the added setting changes."""
    log = (state / "steps.log").read_text() if (state / "steps.log").exists() else ""
    sets: dict[str, frozenset[str]] = {}
    for name, settings in re.findall(r"variant (v\w+): (\S+)$", log, re.M):
        sets[name] = frozenset(settings.split("+"))  # the last call's, where calls differ
    return {v: sorted(w for w in sets if sets[w] < sets[v]) for v in sets}


def compare_logits(state: Path, build: str = "patched", ref: str = "stock") -> dict | None:
    """Teacher-forced logits of two builds or settings (mc_gpu_bench logits), build against ref:
    relative L2 error per row, whether the argmax agrees and whether the files are the same bytes (a
    patch that claims the same bits). Rows: a 64-token prefill's last, 8
    single-token steps, 16 rows of one 16-token step, then 12 sequences: their 32-token prompts' last
    and 6 steps of one token each."""
    a, b = state / f"{ref}-logits.bin", state / f"{build}-logits.bin"
    if not (a.exists() and b.exists()):
        return None
    import numpy as np

    info = (json_lines(state / f"{ref}-logits.out") or [{}])[0]
    n_vocab = info.get("n_vocab")
    if not n_vocab:
        return None
    # mc_gpu_bench prints its line after writing every row: a run that stopped (an abort, a timeout)
    # leaves a file without it, perhaps cut mid-row; say so instead of comparing (or failing on) it
    if not json_lines(state / f"{build}-logits.out"):
        return {"error": f"{build}-logits did not finish (no result line in {build}-logits.out)"}
    x = np.fromfile(a, dtype=np.float32)
    y = np.fromfile(b, dtype=np.float32)
    if x.size % n_vocab or y.size != x.size:
        return {
            "error": f"{build}-logits.bin holds {y.size} floats against {x.size} in {ref}-logits.bin "
            f"({n_vocab} a row)"
        }
    x = x.reshape(-1, n_vocab).astype(np.float64)
    y = y.reshape(-1, n_vocab).astype(np.float64)
    rel = np.linalg.norm(y - x, axis=1) / np.linalg.norm(x, axis=1)
    return {
        "rows": int(x.shape[0]),
        "rel_l2_max": float(rel.max()),
        "rel_l2_median": float(np.median(rel)),
        "argmax_agree": int((x.argmax(1) == y.argmax(1)).sum()),
        "finite": bool(np.isfinite(y).all()),
        "same_bytes": a.read_bytes() == b.read_bytes(),
    }


STATUS_LINE = re.compile(r"^[ MADRCU?!]{2} \S")


def tree_changes(env: str) -> list[str]:
    """The lines `git status --short` printed into env.txt after the commit: files of the measured tree
    that differ from that commit (uncommitted changes, or a copy of the tree whose .git is older than its
    files: the H200 runs' copies have read an older HEAD)."""
    lines = env.splitlines()
    at = next((i for i, line in enumerate(lines) if line.startswith("commit ")), None)
    if at is None:
        return []
    out = []
    for line in lines[at + 1 :]:
        if not STATUS_LINE.match(line):
            break
        out.append(line.rstrip())
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("state", type=Path)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    st = args.state
    env = (st / "env.txt").read_text() if (st / "env.txt").exists() else ""
    commit = re.search(r"^commit (\w+)", env, re.M)
    bw = (json_lines(st / "bandwidth.out") or [{}])[0]
    model_bytes = int((st / "model-bytes.txt").read_text()) if (st / "model-bytes.txt").exists() else None
    res: dict = {
        "gpu": bw.get("gpu"),
        "commit": commit.group(1) if commit else None,
        "date": time.strftime("%Y-%m-%d"),
        "command": "OUT=DIR bash bench/gpu/side_by_side.sh",
        "env": env,
        "model_bytes": model_bytes,
        "copy_bw_tb_s": bw.get("copy_bw_tb_s"),
        "pinned_h2d_gb_s": bw.get("pinned_h2d_gb_s"),
        "pinned_d2h_gb_s": bw.get("pinned_d2h_gb_s"),
    }
    if model_bytes and bw.get("copy_bw_tb_s"):
        res["ceiling_tok_s"] = round(bw["copy_bw_tb_s"] * 1e12 / model_bytes, 1)
    times = st / "build-times.txt"
    if times.exists():
        res["build_times"] = dict(ln.split() for ln in times.read_text().splitlines() if ln.strip())
    prebuilt = st / "prebuilt-manifest.json"  # the patched build came from bench/gpu/prebuild.py
    if prebuilt.exists():
        res["prebuilt"] = json.loads(prebuilt.read_text())
    variants = sorted({p.name.split("-")[1] for p in st.glob("patched-v*-*.out")})  # patched-NAME-step
    builds = {b: build_figures(st, b) for b in ("stock", "patched", *[f"patched-{v}" for v in variants])}
    res["builds"] = builds
    for b, f in builds.items():
        res[f"tg_tok_s_{b}"] = f.get("tg_depth_0_tok_s")
        res[f"tg4k_tok_s_{b}"] = f.get("tg_depth_4096_tok_s")
        res[f"tg32k_tok_s_{b}"] = f.get("tg_depth_32768_tok_s")
        res[f"verify_ms_{b}"] = f.get("verify1_ms")
        res[f"verify12_ms_{b}"] = f.get("verify12_ms")
        res[f"agg_tok_s_12_{b}"] = (f.get("agg_tok_s") or {}).get("12")
        if res.get("ceiling_tok_s") and res[f"tg_tok_s_{b}"]:
            res[f"tg_fraction_of_ceiling_{b}"] = round(res[f"tg_tok_s_{b}"] / res["ceiling_tok_s"], 3)
        v = res[f"verify_ms_{b}"] or {}
        if "1" in v and "16" in v:
            res[f"verify16_over_1_{b}"] = round(v["16"] / v["1"], 3)
        d = f.get("verify1_draws_ms") or {}
        if len(d.get("1", [])) > 1 and len(d["1"]) == len(d.get("16", [])):
            # each draw's own ratio (its k = 1 and k = 16 from one process): the spread of the goal's figure
            pairs = zip(d["16"], d["1"], strict=True)
            res[f"verify16_over_1_draws_{b}"] = [round(x / y, 3) for x, y in pairs]
    ratios = {}
    for key in ("tg_tok_s", "tg4k_tok_s", "tg32k_tok_s", "agg_tok_s_12"):
        s, p = res.get(f"{key}_stock"), res.get(f"{key}_patched")
        if s and p:
            ratios[key] = round(p / s, 3)
    res["patched_over_stock"] = ratios
    res["logits_patched_vs_stock"] = compare_logits(st)
    below = variants_below(st)
    for v in variants:
        res[f"logits_patched_{v}_vs_stock"] = compare_logits(st, f"patched-{v}")
        # a setting against the patched build's defaults (patched-only runs have no stock logits)
        res[f"logits_patched_{v}_vs_patched"] = compare_logits(st, f"patched-{v}", "patched")
        # and against each setting it adds to (run CJ: 0063 with the copies against the defaults differed
        # by the copies alone, which only a hand check against the copies could tell)
        for w in variants:
            if w in below.get(v, ()):
                res[f"logits_patched_{v}_vs_patched_{w}"] = compare_logits(st, f"patched-{v}", f"patched-{w}")
        f = builds[f"patched-{v}"]
        res[f"tg_tok_s_patched_{v}"] = f.get("tg_depth_0_tok_s")
        res[f"tg32k_tok_s_patched_{v}"] = f.get("tg_depth_32768_tok_s")
    eng = st / "engine.json"
    if eng.exists():
        e = json.loads(eng.read_text())
        res["engine"] = e
        for kv, suffix in (("f16", ""), ("q8_0", "_q8")):
            for depth, name in ((32768, "32k"), (8192, "8k")):
                fig = e.get(f"swap_{kv}_{depth}")
                if fig:
                    res[f"pause_ms_{name}{suffix}"] = round(fig["pause_ms"], 2)
                    res[f"resume_ms_{name}{suffix}"] = round(fig["resume_ms"], 2)
        res["engine_agg_tok_s_12"] = e.get("agg_tok_s_12")
    rep = st / "engine-repacked.json"  # MC_SBS_ENGINE_REPACKED: the engine with patch 0015's copies
    if rep.exists():
        res["engine_repacked"] = json.loads(rep.read_text())
        res["engine_agg_tok_s_12_repacked"] = res["engine_repacked"].get("agg_tok_s_12")
        mode = res["engine_repacked"].get("repacked_weights")
        print(f"engine, repacked weights {mode}, 12 tasks: {res['engine_agg_tok_s_12_repacked']}")
    numa = st / "numa.json"  # bench/gpu/numa_probe.py: page-locked memory by NUMA binding
    if numa.exists():
        res["numa_probe"] = json.loads(numa.read_text())
        print(f"numa probe: {res['numa_probe']}")
    for lab in sorted(st.glob("lab-*.json")):  # bench/gpu/kernel_lab.py (MC_SBS_LABS)
        res.setdefault("kernel_labs", {})[lab.stem[len("lab-") :]] = json.loads(lab.read_text())
        print(f"kernel lab {lab.stem}: see {lab.name}")
    sym = st / "stdcxx-symbols.txt"
    if sym.exists():
        res["libggml_cuda_std_symbols"] = int(sym.read_text().strip() or 0)
    # the tree measured, where the commit alone does not say it: its changed files and the series' hash
    changes = tree_changes(env)
    if changes:
        res["tree_changes"] = changes
    log = (st / "steps.log").read_text() if (st / "steps.log").exists() else ""  # side_by_side.sh's log()
    series = re.search(r"series ([0-9a-f]{16,})", log)
    if series:
        res["series_hash"] = series.group(1)
    # the MC_ settings each call ran under (side_by_side.sh logs them at its start; "none": the defaults)
    settings = [m.strip() for m in re.findall(r"=== call start .*, settings: (.*)$", log, re.M)]
    if settings:
        res["settings_per_call"] = settings
    if not res["commit"]:
        res["commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True
        ).stdout.strip()
    args.out.write_text(json.dumps(res, indent=2))
    print_table(res)


def print_table(res: dict) -> None:
    n = len(res.get("tree_changes", []))
    dirty = f" (+{n} changed file{'s' if n != 1 else ''}: see tree_changes)" if n else ""
    if res.get("series_hash"):
        dirty += f"  series {res['series_hash'][:16]}"
    print(
        f"GPU {res.get('gpu')}  commit {str(res.get('commit'))[:10]}{dirty}  "
        f"model {res.get('model_bytes')} B  "
        f"copy {res.get('copy_bw_tb_s')} TB/s  ceiling {res.get('ceiling_tok_s')} tok/s  "
        f"pinned h2d {res.get('pinned_h2d_gb_s')} GB/s"
    )
    print(f"{'figure':<34}{'stock':>12}{'patched':>12}{'ratio':>8}")
    rows = [
        ("decode tok/s, depth 0", "tg_tok_s"),
        ("decode tok/s, depth 4k", "tg4k_tok_s"),
        ("decode tok/s, depth 32k", "tg32k_tok_s"),
        ("aggregate tok/s, 12 seqs", "agg_tok_s_12"),
        ("fraction of ceiling", "tg_fraction_of_ceiling"),
        ("verify 16 / verify 1", "verify16_over_1"),
    ]
    for label, key in rows:
        s, p = res.get(f"{key}_stock"), res.get(f"{key}_patched")
        r = f"{p / s:.3f}" if s and p else ""
        print(f"{label:<34}{s if s is not None else '-':>12}{p if p is not None else '-':>12}{r:>8}")
    for key in sorted(k for k in res if k.startswith(("tg_tok_s_patched_v", "tg32k_tok_s_patched_v"))):
        base = res.get("tg_tok_s_stock" if key.startswith("tg_") else "tg32k_tok_s_stock")
        ratio = f" ({res[key] / base:.3f}x stock)" if base and res[key] else ""
        print(f"{key}: {res[key]}{ratio}")
    for key in sorted(k for k in res if k.startswith("logits_patched_v")):
        print(f"{key}: {res[key]}")
    for key in sorted(
        k
        for k in res
        if k.startswith(("agg_tok_s_12_patched-v", "verify16_over_1_patched-v", "verify16_over_1_draws_"))
    ):
        print(f"{key}: {res[key]}")
    if res.get("logits_patched_vs_stock"):
        print(f"logits patched vs stock: {res['logits_patched_vs_stock']}")
    for b in res.get("builds", {}):
        for k in ("verify_ms", "verify12_ms"):
            if res.get(f"{k}_{b}"):
                print(f"{k} {b}: {res[f'{k}_{b}']}")
        for key, prof in sorted(res["builds"].get(b, {}).items()):
            if not key.startswith("profile") or not prof:
                continue
            print(f"{key} {b}: {prof['kernels']} kernels, {prof['kernel_time_us']} us of kernel time a step")
            for g in prof["by_kernel"][:12]:
                print(f"   {g['us']:>9.1f} us {g['count']:>5}x  {g['share']:.3f}  {g['name']}")
        for key, kd in sorted(res["builds"].get(b, {}).items()):
            if not key.startswith("kdetail"):
                continue
            for name, k in kd.items():
                shown = ", ".join(
                    f"{m} {k['metrics'][m]['mean']:g} {k['metrics'][m]['unit']}".rstrip()
                    for m in KDETAIL_SHOWN
                    if m in k["metrics"]
                )
                print(f"{key} {b}: {name} ({k['launches']} launches): {shown}")
                stalls = stall_reasons(k["metrics"])
                if stalls:
                    print("   stalls (warps per issue): " + ", ".join(f"{r} {v:g}" for r, v in stalls[:6]))
        for name, k in res["builds"].get(b, {}).get("sass", {}).items():
            if k["loop"] and "mc_mmh" in name:
                top = ", ".join(f"{op} {n}" for op, n in list(k["loop"]["opcodes"].items())[:6])
                short = name[: name.find("Ev")] if "Ev" in name else name  # up to the template arguments
                print(f"sass {b}: {short}: loop {k['loop']['instructions']} instructions ({top})")
        ops = res["builds"].get(b, {}).get("test_backend_ops")
        if ops:
            print(f"test-backend-ops {b}: {ops}")
    for k in (
        "pause_ms_8k",
        "resume_ms_8k",
        "pause_ms_32k",
        "resume_ms_32k",
        "pause_ms_32k_q8",
        "resume_ms_32k_q8",
        "engine_agg_tok_s_12",
        "libggml_cuda_std_symbols",
    ):
        if k in res:
            print(f"{k}: {res[k]}")
    e = res.get("engine") or {}
    for k, v in e.items():
        if k.startswith("swap_calls"):
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
