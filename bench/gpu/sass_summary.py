"""What the machine code of each kernel in a `cuobjdump -sass` listing spends its instructions on.

For every function: its instruction count, and its widest loop (the backward branch that spans the
most instructions: in the tensor-core kernels, the loop over K chunks) with the opcodes inside it,
counted statically (an inner loop's body counts once). `bench/gpu/side_by_side.sh` writes the
patched build's listing of mc-mmv.cu to `patched-sass.out`; `sbs_summary.py` adds this summary to
the results.

usage: python bench/gpu/sass_summary.py LISTING [--kernel REGEX] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from pathlib import Path

FUNCTION = re.compile(r"^\s*Function\s*:\s*(\S+)")
# "/*43d0*/  @!P0 BRA 0x4d40 ;" -> address, predicate, opcode with modifiers, operands
INSTRUCTION = re.compile(
    r"^\s*/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)\s*([^;]*);"
)
BRANCH_TARGET = re.compile(r"0x([0-9a-f]+)")


def parse(text: str) -> dict[str, list[tuple[int, str, str]]]:
    """{function: [(address, opcode with modifiers, operands)]} in listing order."""
    functions: dict[str, list[tuple[int, str, str]]] = {}
    current: list[tuple[int, str, str]] | None = None
    for line in text.splitlines():
        m = FUNCTION.match(line)
        if m:
            current = functions.setdefault(m.group(1), [])
            continue
        m = INSTRUCTION.match(line)
        if m and current is not None:
            current.append((int(m.group(1), 16), m.group(3), m.group(4).strip()))
    return functions


def widest_loop(code: list[tuple[int, str, str]]) -> tuple[int, int] | None:
    """(first, last) address of the backward branch spanning the most instructions, or None."""
    best = None
    for addr, op, operands in code:
        if op.split(".")[0] != "BRA":
            continue
        m = BRANCH_TARGET.search(operands)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < addr and (best is None or addr - target > best[1] - best[0]):
            best = (target, addr)
    return best


def summarize(code: list[tuple[int, str, str]], top: int = 12) -> dict:
    loop = widest_loop(code)
    out: dict = {"instructions": len(code), "loop": None}
    if loop:
        body = [op for addr, op, _ in code if loop[0] <= addr <= loop[1]]
        ops = Counter(op.split(".")[0] for op in body)
        out["loop"] = {
            "first": f"0x{loop[0]:x}",
            "last": f"0x{loop[1]:x}",
            "instructions": len(body),
            "opcodes": dict(ops.most_common(top)),
        }
    return out


def summary(text: str, kernel: str = "") -> dict[str, dict]:
    pattern = re.compile(kernel) if kernel else None
    return {
        name: summarize(code) for name, code in parse(text).items() if pattern is None or pattern.search(name)
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("listing", type=Path)
    ap.add_argument("--kernel", default="", help="a regex on the (mangled) function names")
    ap.add_argument("--json", type=Path, help="write the summary here too")
    args = ap.parse_args(argv)
    if not args.listing.is_file():
        print(f"sass_summary: no listing at {args.listing}", file=sys.stderr)
        return 2
    try:
        re.compile(args.kernel)
    except re.error as e:
        print(f"sass_summary: --kernel {args.kernel!r} is not a regular expression: {e}", file=sys.stderr)
        return 2
    result = summary(args.listing.read_text(errors="replace"), args.kernel)
    for name, s in result.items():
        loop = s["loop"]
        if loop:
            ops = ", ".join(f"{k} {v}" for k, v in loop["opcodes"].items())
            print(f"{name}: {s['instructions']} instructions; widest loop {loop['instructions']} ({ops})")
        else:
            print(f"{name}: {s['instructions']} instructions; no loop")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
