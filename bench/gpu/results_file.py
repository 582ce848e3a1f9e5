#!/usr/bin/env python3
"""One results file from what a session's device calls brought back: side_by_side.sh's summary.json (its
figures at the top level: the issue's keys such as tg_tok_s_stock, verify_ms_patched, pause_ms_32k, with
the GPU, the commit and the series), and beside it every warm_repeats.py JSON (under "warm", by file
name: the draws, the summary, the command), step_trace.py traces (under "trace") and comparisons (under
"trace_compare"), with the date, what was measured, the commands and the device seconds used. Written
to a temp name, then renamed.

usage: python3 bench/gpu/results_file.py --out bench/results/DATE-h200-NAME.json --what "..." \\
           --command "..." [--device-seconds N] [--note "..."] FILE.json ...

A FILE is recognized by its content: a summary (it has "builds" or "tg_tok_s_patched"), a warm_repeats
JSON ("kind": "warm_repeats"), a step trace (it has "by_name" and "span_us_median"), a kernel_lab.py
JSON (it has "lab": under "lab") or a trace comparison (anything else, kept by file name
under "trace_compare"). Two summaries are refused (which one's figures would be the file's?)."""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path


def kind_of(data: object) -> str:
    if isinstance(data, dict) and data.get("kind") == "warm_repeats":
        return "warm"
    if isinstance(data, dict) and ("builds" in data or "tg_tok_s_patched" in data):
        return "summary"
    if isinstance(data, dict) and "by_name" in data and "span_us_median" in data:
        return "trace"
    if isinstance(data, dict) and "lab" in data:
        return "lab"
    return "trace_compare"


def build(files: list[Path], what: str, command: str, device_seconds: int | None, note: str | None) -> dict:
    res: dict = {}
    extra: dict[str, dict] = {"warm": {}, "trace": {}, "lab": {}, "trace_compare": {}}
    summaries = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise SystemExit(f"{f}: not a JSON file this can read ({e})") from None
        kind = kind_of(data)
        if kind == "summary":
            summaries.append(f)
            res.update(data)
        else:
            extra[kind][f.stem] = data
    if len(summaries) > 1:
        raise SystemExit(f"two side-by-side summaries ({summaries[0]}, {summaries[1]}): give one")
    # the session's commands win: a summary's own "command" is side_by_side.sh's usage line, kept beside
    summary_command = res.pop("command", None)
    out = {
        "date": datetime.date.today().isoformat(),
        "what": what,
        "command": command,
        **({"summary_command": summary_command} if summary_command is not None else {}),
        **res,
    }
    for key, group in extra.items():
        if group:
            out[key] = group
    if device_seconds is not None:
        out["device_seconds_used"] = device_seconds
    if note:
        out["note"] = note
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--what", required=True, help="what the runs measured")
    ap.add_argument("--command", required=True, help="the commands that made the files")
    ap.add_argument("--device-seconds", type=int, help="the session's device time these runs used")
    ap.add_argument("--note")
    ap.add_argument("files", nargs="+", type=Path)
    a = ap.parse_args(argv)
    missing = [str(f) for f in a.files if not f.is_file()]
    if missing:
        raise SystemExit(f"no such file: {', '.join(missing)}")
    result = build(a.files, a.what, a.command, a.device_seconds, a.note)
    tmp = a.out.with_name(a.out.name + ".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(a.out)
    keys = [
        k for k in ("gpu", "commit", "tg_tok_s_stock", "tg_tok_s_patched", "settings_per_call") if k in result
    ]
    print(f"{a.out}: " + ", ".join(f"{k}={result[k]}" for k in keys))
    return 0


if __name__ == "__main__":
    sys.exit(main())
