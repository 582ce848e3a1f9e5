#!/usr/bin/env python3
"""Repeated draws of mc_gpu_bench on a warm machine, settings alternating, so that a change within the
draws' spread is seen as such. Each round runs every setting (in a rotated order, so no setting
always runs first) and every measure; the figures are the program's medians.

usage (on the GPU machine, after bench/gpu/side_by_side.sh has built the patched programs):

  python3 bench/gpu/warm_repeats.py --bench /tmp/mcs/patched/mc_gpu_bench \\
      --model /tmp/mcs/random-27b-q4_0.gguf --rounds 3 \\
      --setting copies=MC_MMH_REPACK=3 --setting rs5=MC_MMH_REPACK=3,MC_MMR_RS=5 \\
      --measure verify:512:1:1,16 --measure verify:512:12:1 --measure tg:0,4096:64 --json $OUT/warm.json

A setting is NAME=VAR=VALUE[,VAR=VALUE...] (NAME= alone: the defaults). A setting's MC_WARM_BENCH=PATH
runs another build's program (PATH, its folder leading LD_LIBRARY_PATH) instead of --bench, so two
builds alternate on one machine (the prebuilt patched programs against a build made there:
calls.sh's builds plan); it is not passed to the program. A setting's LD_LIBRARY_PATH replaces the
bench's folder, but mc_gpu_bench as side_by_side.sh and prebuild.py link it (a DT_RPATH of $ORIGIN,
since 537300b) loads its own folder's libraries first, so that no longer swaps builds (run AY's swap
was made before, with a DT_RUNPATH). A measure is
verify:DEPTH:SEQS:K[,K...] (ms of one decode of K tokens for each of SEQS sequences) or
tg:DEPTH[,DEPTH...]:N (tokens/s of single-stream decode). A verify measure that has K = 1 beside
larger K also gives each larger K's cost over one token's from the same process
(verify_dD_sS_kK_over_k1: the issue's verify16 / verify1 figure for K = 16, draw by draw). Writes JSON
(every draw, mean / median / min / max, and each setting's mean against the first setting's) after
every round, so a call cut short keeps the rounds it finished (run CH's eight rounds ran past the
call's timeout and left nothing), and prints a table. --deadline SECONDS starts a round only while
the longest round so far still fits before it (the JSON says how many rounds ran and why it stopped).
A setting whose program fails is left out of the rest of the rounds, its error in the JSON (`failed`),
and the others go on: a setting under test that breaks costs the call only itself. When no setting
is left, the run stops with the error (the rounds finished stay in the JSON)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

VERIFY_KEY = re.compile(r"verify_d(\d+)_s(\d+)_k(\d+)_ms")
BENCH_VAR = "MC_WARM_BENCH"  # a setting's own program (another build), not passed to it


def program_for(bench: Path, env: dict[str, str]) -> tuple[Path, dict[str, str]]:
    """The program a setting runs (its MC_WARM_BENCH, else --bench) and the environment it gets."""
    other = env.get(BENCH_VAR)
    return (Path(other) if other else bench), {k: v for k, v in env.items() if k != BENCH_VAR}


def parse_setting(text: str) -> tuple[str, dict[str, str]]:
    name, sep, rest = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"--setting {text!r}: expected NAME=VAR=VALUE[,VAR=VALUE...] or NAME=")
    env: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        var, sep, value = item.partition("=")
        if not sep or not var:
            raise SystemExit(f"--setting {text!r}: {item!r} is not VAR=VALUE")
        env[var] = value
    return name, env


def parse_measure(text: str) -> list[str]:
    """The mc_gpu_bench arguments after the model, e.g. ['verify', '512', '1', '1,16']."""
    parts = text.split(":")
    ints = lambda s: all(p.strip().isdigit() for p in s.split(","))  # noqa: E731
    if parts[0] == "verify" and len(parts) == 4 and all(ints(p) for p in parts[1:]):
        return ["verify", parts[1], parts[2], parts[3]]
    if parts[0] == "tg" and len(parts) == 3 and all(ints(p) for p in parts[1:]):
        return ["tg", parts[1], parts[2]]
    raise SystemExit(f"--measure {text!r}: expected verify:DEPTH:SEQS:K[,K...] or tg:DEPTH[,DEPTH...]:N")


def figures_of(row: dict) -> list[tuple[str, float]]:
    """One mc_gpu_bench JSON line's figures as (name, value) pairs; none for other lines. A tg line's
    call_ms (the step until llama_decode returned; benches built before it have none) is a figure too."""
    if row.get("kind") == "verify":
        return [(f"verify_d{row['depth']}_s{row['seqs']}_k{row['k']}_ms", float(row["median_ms"]))]
    if row.get("kind") == "tg":
        figs = [(f"tg_d{row['depth']}_tok_s", float(row["tok_s"]))]
        if "call_ms" in row:
            figs.append((f"tg_d{row['depth']}_call_ms", float(row["call_ms"])))
        return figs
    return []


def run_one(bench: Path, model: Path, args: list[str], env: dict[str, str]) -> dict[str, float]:
    full = dict(os.environ)
    full["LD_LIBRARY_PATH"] = str(bench.parent) + (
        ":" + full["LD_LIBRARY_PATH"] if full.get("LD_LIBRARY_PATH") else ""
    )
    full.update(env)
    cmd = [str(bench), args[0], str(model), *args[1:]]
    res = subprocess.run(cmd, env=full, capture_output=True, text=True, check=False)
    if res.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} (env {env}) exit {res.returncode}: {res.stderr[-2000:]}")
    out: dict[str, float] = {}
    for line in res.stdout.splitlines():
        line = line.strip()
        if not line.startswith("{"):
            continue
        out.update(figures_of(json.loads(line)))
    if not out:
        raise SystemExit(f"{' '.join(cmd)}: no figures in its output")
    return with_ratios(out)


def with_ratios(out: dict[str, float]) -> dict[str, float]:
    """out and, for each verify figure of K > 1 whose K = 1 figure (same depth and sequences) came from
    the same process, their ratio."""
    ratios = {}
    for key, value in out.items():
        m = VERIFY_KEY.fullmatch(key)
        one = m and out.get(f"verify_d{m[1]}_s{m[2]}_k1_ms")
        if m and m[3] != "1" and one:
            ratios[f"verify_d{m[1]}_s{m[2]}_k{m[3]}_over_k1"] = round(value / one, 4)
    return {**out, **ratios}


def summarize(draws: dict[str, dict[str, list[float]]], first: str) -> dict:
    summary: dict[str, dict] = {}
    for name, figs in draws.items():
        summary[name] = {}
        for key, vals in figs.items():
            mean = sum(vals) / len(vals)
            entry = {
                "mean": round(mean, 4),
                "median": round(statistics.median(vals), 4),
                "min": min(vals),
                "max": max(vals),
                "n": len(vals),
            }
            base = draws[first].get(key)
            if name != first and base:
                entry["vs_first"] = round(mean / (sum(base) / len(base)), 4)
            summary[name][key] = entry
    return summary


def print_table(summary: dict, names: list[str]) -> None:
    keys = sorted({k for n in names for k in summary[n]})
    w = 30  # a cell: "10.01 [9.84-10.20] (+2.1%)" and a gap (at 22 the cells ran into each other)
    print(f"{'figure':<28}" + "".join(f"{n:>{w}}" for n in names))
    for key in keys:
        cells = []
        for n in names:
            e = summary[n].get(key)
            if e is None:
                cells.append(f"{'-':>{w}}")
                continue
            rel = f" ({100 * (e['vs_first'] - 1):+.1f}%)" if "vs_first" in e else ""
            f = ".3f" if key.endswith("_over_k1") else ".2f"  # a ratio near the goal's 1.5
            cells.append(f"{e['mean']:{f}} [{e['min']:{f}}-{e['max']:{f}}]{rel}".rjust(w))
        print(f"{key:<28}" + "".join(cells))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", type=Path, required=True, help="mc_gpu_bench (its folder holds its libraries)")
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--setting", action="append", required=True, help="NAME=VAR=VALUE[,VAR=VALUE...]")
    ap.add_argument("--measure", action="append", required=True, help="verify:DEPTH:SEQS:KS or tg:DEPTHS:N")
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument(
        "--deadline", type=float, help="seconds from the start: no round starts that would end after it"
    )
    a = ap.parse_args()
    if a.rounds < 1:
        raise SystemExit("--rounds: at least 1")
    if a.deadline is not None and a.deadline <= 0:
        raise SystemExit(f"--deadline {a.deadline}: expected seconds greater than 0")
    if not os.access(a.bench, os.X_OK):
        raise SystemExit(f"--bench {a.bench}: no such program (bench/gpu/side_by_side.sh builds it)")
    settings = [parse_setting(s) for s in a.setting]
    for name, env in settings:
        other = env.get(BENCH_VAR)
        if other is not None and not os.access(other, os.X_OK):
            raise SystemExit(f"--setting {name}: {BENCH_VAR}={other}: no such program")
    names = [n for n, _ in settings]
    if len(set(names)) != len(names):
        raise SystemExit(f"--setting: names must differ, got {names}")
    measures = [parse_measure(m) for m in a.measure]
    draws: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    order_log: list[list[str]] = []
    t0 = time.monotonic()
    longest = 0.0
    stopped = None
    failed: dict[str, str] = {}  # a setting whose program failed: its error; it runs no more rounds
    for r in range(a.rounds):
        used = time.monotonic() - t0
        if a.deadline is not None and r > 0 and used + longest > a.deadline:
            stopped = (
                f"deadline: {used:.0f} s used, a round takes up to {longest:.0f} s, --deadline {a.deadline:g}"
            )
            print(f"round {r + 1}/{a.rounds} not started ({stopped})", file=sys.stderr, flush=True)
            break
        live = [s for s in settings if s[0] not in failed]
        order = live[r % len(live) :] + live[: r % len(live)]
        start = time.monotonic()
        round_draws: dict[str, dict[str, float]] = {}
        for name, env in order:
            try:
                figs: dict[str, float] = {}
                for m in measures:
                    bench, penv = program_for(a.bench, env)
                    figs.update(run_one(bench, a.model, m, penv))
                round_draws[name] = figs
            except SystemExit as e:  # this setting's program failed: the others go on without it
                failed[name] = f"round {r + 1}: {e}"
                print(f"setting {name} left out from round {r + 1} on: {e}", file=sys.stderr, flush=True)
        if not round_draws:  # every setting left failed: stop, the finished rounds stay in the JSON
            error = failed[order[0][0]]  # the round's first failure
            if order_log:
                write_result(a, settings, order_log, draws, error, failed)
            raise SystemExit(error)
        for name, figs in round_draws.items():
            for key, value in figs.items():
                draws[name].setdefault(key, []).append(value)
        order_log.append([n for n, _ in order if n in round_draws])
        longest = max(longest, time.monotonic() - start)
        write_result(a, settings, order_log, draws, None, failed)
        print(f"round {r + 1}/{a.rounds} done", file=sys.stderr, flush=True)
    summary = write_result(a, settings, order_log, draws, stopped, failed)
    print_table(summary, names)
    for name, error in failed.items():
        print(f"{name}: failed ({error})")


def write_result(
    a: argparse.Namespace,
    settings: list[tuple[str, dict[str, str]]],
    order_log: list[list[str]],
    draws: dict[str, dict[str, list[float]]],
    stopped: str | None,
    failed: dict[str, str],
) -> dict:
    """The JSON of the rounds finished so far (written to a temporary name, then renamed); its summary."""
    summary = summarize(draws, settings[0][0])
    result = {
        "kind": "warm_repeats",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "bench": str(a.bench),
        "model": str(a.model),
        "settings": {n: env for n, env in settings},
        "rounds": a.rounds,
        "rounds_done": len(order_log),
        "stopped": stopped,
        "failed": failed,
        "order": order_log,
        "draws": draws,
        "summary": summary,
    }
    tmp = a.json.with_name(a.json.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(a.json)
    return summary


if __name__ == "__main__":
    main()
