"""bench/gpu/sass_summary.py reads a `cuobjdump -sass` listing: per function its instruction count
and its widest loop (the backward branch spanning the most instructions) with the opcodes in it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "sass_summary.py"
ENC = "/* 0x000fe20000000000 */"


def listing(functions: dict[str, list[str]]) -> str:
    """cuobjdump's layout: a Function line, then one line per instruction and one of encoding bits."""
    out = ["", "\t.target\tsm_90", ""]
    for name, code in functions.items():
        out += [f"\t\tFunction : {name}", '\t.headerflags\t@"EF_CUDA_SM90"']
        for i, ins in enumerate(code):
            out += [f"        /*{16 * i:04x}*/                   {ins} ;   {ENC}", f"{' ' * 92}{ENC}"]
        out += ["\t\t..........", ""]
    return "\n".join(out) + "\n"


KERNEL = [
    "LDC R1, c[0x0][0x28]",  # 0x00
    "S2R R0, SR_TID.X",  # 0x10
    "BAR.SYNC.DEFER_BLOCKING 0x0",  # 0x20 <- the chunk loop starts here
    "LDS R4, [R2]",  # 0x30 <- an inner loop starts here
    "LOP3.LUT R5, R4, 0xf000f, RZ, 0xc0, !PT",  # 0x40
    "@!P0 BRA 0x30",  # 0x50 inner loop back
    "HMMA.16816.F32 R8, R12, R16, RZ",  # 0x60
    "LOP3.LUT R6, R5, 0x64006400, RZ, 0xfc, !PT",  # 0x70
    "@P1 BRA 0x20",  # 0x80 chunk loop back
    "STG.E [R2.64], R8",  # 0x90
    "EXIT",  # 0xa0
    "BRA 0xb0",  # 0xb0 the usual trailing self-branch: no span
]


def test_the_widest_loop_and_its_opcodes(tmp_path):
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import sass_summary
    finally:
        sys.path.pop(0)
    text = listing({"_Z4mainv": KERNEL, "_Z4flatv": ["MOV R1, R2", "EXIT"]})
    res = sass_summary.summary(text)
    assert res["_Z4flatv"] == {"instructions": 2, "loop": None}
    k = res["_Z4mainv"]
    assert k["instructions"] == len(KERNEL)
    assert k["loop"]["first"] == "0x20" and k["loop"]["last"] == "0x80"
    assert k["loop"]["instructions"] == 7  # BAR .. BRA, the inner loop's body counted once
    assert k["loop"]["opcodes"] == {"LOP3": 2, "BRA": 2, "BAR": 1, "LDS": 1, "HMMA": 1}
    assert list(sass_summary.summary(text, "flat")) == ["_Z4flatv"]


def test_the_command_and_the_side_by_side_summary(tmp_path):
    text = listing({"_Z11mc_mmh_q4_0ILi2EEvv": KERNEL})
    (tmp_path / "patched-sass.out").write_text(text)
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "patched-sass.out"), "--json", str(tmp_path / "s.json")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    assert "_Z11mc_mmh_q4_0ILi2EEvv: 12 instructions; widest loop 7 (LOP3 2, BRA 2" in run.stdout
    assert (
        json.loads((tmp_path / "s.json").read_text())["_Z11mc_mmh_q4_0ILi2EEvv"]["loop"]["instructions"] == 7
    )
    missing = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "none.out")], capture_output=True, text=True, timeout=60
    )
    assert missing.returncode == 2 and "no listing" in missing.stderr
    bad = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path / "patched-sass.out"), "--kernel", "mc_(mmh"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 2 and "--kernel 'mc_(mmh' is not a regular expression" in bad.stderr
    # sbs_summary.py puts it under the build's figures and prints the tensor-core kernels' loops; a
    # kernel lab's JSON (side_by_side.sh's MC_SBS_LABS) goes under kernel_labs by its name
    (tmp_path / "bandwidth.out").write_text("")
    (tmp_path / "lab-gdn.json").write_text(json.dumps({"lab": "gdn", "rows": []}))
    run = subprocess.run(
        [
            sys.executable,
            str(SCRIPT.parent / "sbs_summary.py"),
            str(tmp_path),
            "--out",
            str(tmp_path / "r.json"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    res = json.loads((tmp_path / "r.json").read_text())
    assert res["builds"]["patched"]["sass"]["_Z11mc_mmh_q4_0ILi2EEvv"]["loop"]["instructions"] == 7
    assert res["kernel_labs"] == {"gdn": {"lab": "gdn", "rows": []}}
    assert "sass patched: _Z11mc_mmh_q4_0ILi2E: loop 7 instructions (LOP3 2, BRA 2" in run.stdout
