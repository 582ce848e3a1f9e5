"""bench/gpu/side_by_side.sh checks the patched build with test-backend-ops; its default list of ops
(MC_SBS_OPS) is meant to cover every patched op and fusion. Each MegaCapybara case in the patched
test-backend-ops names its op "MC_..." (op_desc): every such name must be in that list, so a new
patch's GPU check runs in every side-by-side (runs before 2026-12-06 missed MC_CONV_STEP, MC_ATTN_PRO,
MC_GATE_CONT and MC_FATTN_PAD, whose patches are on by default)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_every_patched_case_is_in_the_side_by_sides_default_ops(patched):
    source = (patched / "tests/test-backend-ops.cpp").read_text()
    cases = set(re.findall(r'return "(MC_[A-Z0-9_]+)";', source))
    script = (ROOT / "bench/gpu/side_by_side.sh").read_text()
    default = re.search(r"^OPS=\$\{MC_SBS_OPS:-([A-Z0-9_,]+)\}", script, re.M)
    assert default, "side_by_side.sh's OPS default not found"
    ops = set(default.group(1).split(","))
    assert cases and "MC_CONV_STEP" in cases
    assert cases <= ops, sorted(cases - ops)
