"""bench/gpu/kernel_lab.py: it applies the patch series to the pinned sdist and compiles the labs
(gdn_lab.cu, mmr_lab.cu and pstep_lab.cu against that tree, the patched kernels included as they are,
the launchers' host dependencies stubbed; wg_lab.cu standalone, for sm_90a); each program refuses bad
arguments with a clear message before touching a GPU; the mmr summary compares settings by step time
and by output checksums against the first; the driver's argument errors are clear. The timings
themselves need a GPU (bench/results, on the H200)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.ggml_patches.q4_nibbles import check_high_nibbles_in_place

GPU = Path(__file__).resolve().parents[2] / "bench" / "gpu"


def load():
    spec = importlib.util.spec_from_file_location("kernel_lab", GPU / "kernel_lab.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_gdn_rows_and_table():
    lab = load()
    lines = [
        "noise",
        '{"variant": "staged", "tokens": 16, "us": 20.5, "step_ms": 0.984, "out_rel": 0, "state_rel": 0}',
        '{"variant": "chunked", "tokens": 16, "us": 6.25, "step_ms": 0.3, "out_rel": 1e-6, "state_rel": 0,'
        ' "host_out_rel": 2e-7, "host_state_rel": null}',
    ]
    rows = lab.parse(lines)
    assert [r["variant"] for r in rows] == ["staged", "chunked"]
    text = lab.gdn_table(rows)
    assert "chunked" in text and "20.50" in text and "1.00e-06" in text and "2.00e-07" in text
    # null: the lab's mark for a value that is not finite
    assert text.splitlines()[2].endswith("NOT FINITE")


def test_a_line_that_is_not_json_is_reported_with_the_line():
    lab = load()
    with pytest.raises(SystemExit, match=r"not JSON.*out_rel.: inf"):
        lab.parse(['{"variant": "wide", "out_rel": inf}'])


def test_the_wg_table_names_the_layout_the_checks_and_the_step():
    lab = load()
    rows = lab.parse(
        [
            '{"kind": "layout", "lbo": 128, "sbo": 256, "max_rel": 3.1e-01}',
            '{"kind": "layout", "lbo": 256, "sbo": 128, "max_rel": 2.0e-04}',
            '{"kind": "check", "group": "out", "k_slices": 3, "ctas": 240, "max_rel": 2.0e-04, "ok": true}',
            '{"kind": "check", "group": "down", "k_slices": 4, "ctas": 320, "max_rel": 5e-01, "ok": false}',
            '{"kind": "group", "group": "out", "launches": 64, "us": 9.5, "tb_s": 1.86}',
            '{"kind": "step", "columns": 16, "wg": 1, "ctas_per_sm": 4, "step_ms": 6.25,'
            ' "step_ms_with_convert": 6.5}',
        ]
    )
    text = lab.wg_table(rows).splitlines()
    assert text[1] == "layout lbo 256 sbo 128: max rel 2.00e-04"
    assert text[2].endswith(" ok") and "DIFFERS" in text[3]
    assert "1.86 TB/s" in text[4]
    assert (
        text[5] == "step (wg 1, 4 CTAs an SM): 6.250 ms (6.500 with the activations' conversion before each)"
    )


def mmr_run(step: float, total: float, group_us: float = 10.0, nbytes: int | None = None) -> list[dict]:
    group = {"kind": "group", "group": "out", "launches": 64, "us": group_us}
    return [
        {"kind": "check", "group": "out", "k_slices": 3, "sum": total, "sumsq": 4.0},
        group if nbytes is None else {**group, "bytes": nbytes},
        {"kind": "step", "columns": 16, "form": 3, "blocks_per_sm": 2, "step_ms": step},
    ]


def test_the_mmr_summary_compares_settings_by_time_and_checksum():
    lab = load()
    runs = {
        "base": [mmr_run(6.0, 2.0), mmr_run(6.2, 2.0)],
        "x": [mmr_run(5.0, 2.0 * (1 + 1e-5), 8.0)],
        "bad": [[]],
    }
    s = lab.mmr_summary(runs)
    assert s["base"]["step_ms"] == {"mean": pytest.approx(6.1), "min": 6.0, "max": 6.2, "n": 2}
    assert s["base"]["checksum_rel"] == 0.0
    assert s["x"]["checksum_rel"] == pytest.approx(1e-5)
    assert s["x"]["group_us"] == {"out": 8.0}
    assert s["bad"]["step_ms"] is None
    text = lab.mmr_table(s)
    assert "-18.0%" in text and "failed" in text
    assert "step_tb_s" not in s["base"]  # a lab that printed no bytes: no rate


def test_the_mmr_summary_gives_the_products_rate_from_the_labs_bytes():
    lab = load()
    # the 27B's output projection: 5,120 rows of K = 6,144 in Q4_0 (18-byte blocks of 32), 64 a step
    out_bytes = 5120 * (6144 // 32) * 18
    s = lab.mmr_summary({"base": [mmr_run(2.0, 2.0, 7.0, out_bytes)]})["base"]
    assert s["group_tb_s"]["out"] == pytest.approx(out_bytes / 7e-6 / 1e12)  # ~2.53 TB/s
    assert s["step_gb"] == pytest.approx(64 * out_bytes / 1e9)
    assert s["step_tb_s"] == pytest.approx(64 * out_bytes / 2e-3 / 1e12)
    assert f"{s['step_tb_s']:.2f}" in lab.mmr_table({"base": s})


@pytest.fixture(scope="module")
def patched_tree(build_script, tmp_path_factory):
    return load().patched_tree(
        build_script.fetch_sdist(build_script.cache_root()), tmp_path_factory.mktemp("src")
    )


GDN_BAD = (([], "usage"), (["0", "16"], "usage"), (["3", "0"], "TOKENS 0"), (["3", "2049"], "1..2048"))
MMR_BAD = (([], "usage"), (["3", "8"], "COLUMNS 1: decode"), (["3", "17"], "9..16"), (["0", "1"], "usage"))
WG_BAD = (([], "usage"), (["0"], "usage"), (["3", "4"], "WG 1 or 2"), (["3", "1", "x"], "usage"))
PSTEP_BAD = (([], "usage"), (["0"], "usage"), (["3x"], "usage"), (["3", "1"], "usage"))


@pytest.fixture(scope="module")
def compiled_lab(patched_tree, tmp_path_factory):
    """A function that compiles a lab against the patched tree once for the module (wg for sm_90a, whose
    wgmma exists nowhere else; the others for sm_90) and returns its program."""
    nvcc = shutil.which("nvcc") or (
        "/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None
    )
    if nvcc is None:
        pytest.skip("no nvcc on this machine")
    out = tmp_path_factory.mktemp("labs")
    built: dict[str, Path] = {}

    def get(lab: str) -> Path:
        if lab not in built:
            exe = out / lab
            arch = "90a" if lab == "wg" else "90"
            cmd = load().compile_cmd(nvcc, patched_tree, lab, exe, arch)
            subprocess.run(cmd, check=True, capture_output=True)
            built[lab] = exe
        return built[lab]

    return get


@pytest.mark.parametrize(
    ("lab", "bad"), [("gdn", GDN_BAD), ("mmr", MMR_BAD), ("pstep", PSTEP_BAD), ("wg", WG_BAD)]
)
def test_each_lab_compiles_against_the_patched_tree(compiled_lab, lab, bad):
    exe = compiled_lab(lab)
    for args, msg in bad:
        res = subprocess.run([str(exe), *args], capture_output=True, text=True, check=False)
        assert res.returncode == 2 and msg in res.stderr, (args, res.stderr)
    if lab == "pstep":  # settings that do not go together, refused before any GPU call
        for env, msg in (
            ({"MC_LAB_PSTEP_FORM": "1", "MC_LAB_PSTEP_RPW": "2"}, "MC_LAB_PSTEP_FORM=1 runs one row a warp"),
            ({"MC_LAB_PSTEP_WARPS": "12"}, "MC_LAB_PSTEP_WARPS=12: 8 or 16"),
            ({"MC_LAB_PSTEP_NIB": "1"}, "MC_LAB_PSTEP_NIB=1 runs with MC_LAB_PSTEP_FORM=1 only"),
        ):
            res = subprocess.run(
                [str(exe), "3"], capture_output=True, text=True, check=False, env={**os.environ, **env}
            )
            assert res.returncode == 2 and msg in res.stderr, (env, res.stderr)
    if lab == "mmr":  # the Q6_K output product's mode (MC_LAB_Q6K=1) times 9..16 columns only
        env = {**os.environ, "MC_LAB_Q6K": "1"}
        res = subprocess.run([str(exe), "3", "1"], capture_output=True, text=True, check=False, env=env)
        assert res.returncode == 2 and "MC_LAB_Q6K=1 times the verify step's Q6_K product" in res.stderr


def plans(exe: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, dict]:
    env = {**os.environ, **(env or {})}
    res = subprocess.run([str(exe), "plan", *args], capture_output=True, text=True, check=False, env=env)
    assert res.returncode == 0, res.stderr
    return {r["group"]: r for r in map(json.loads, res.stdout.splitlines())}


def test_the_verify_steps_row_tile_forms_follow_the_wave_model(compiled_lab):
    """Patches 0028 / 0029, through the library's own functions (mmr_lab plan: no GPU): on an H200 (132
    SMs; 2 blocks an SM of the 64-row form, 3 of the 48- and 32-row forms) the FFN's gate + up (544
    64-row tiles, more than one wave unsplit) runs on 48-row tiles, 726 of them in 2 waves of 396,
    unsplit; the one-wave groups (GDN and attention inputs) and the K-split ones (out, ffn_down) keep
    64 rows; MC_MMR_ROWS32=0 keeps 64 rows everywhere; a GPU without the narrower forms (occupancy 0)
    too; and the plan's arguments are checked."""
    exe = compiled_lab("mmr")
    h200 = plans(exe, "132", "2", "3", "3")
    gate_up = {"kind": "plan", "group": "ffn_gate_up", "rows": 48, "tiles": 726, "k_slices": 1}
    assert h200["ffn_gate_up"] == gate_up
    assert {g: (p["rows"], p["k_slices"]) for g, p in h200.items() if g != "ffn_gate_up"} == {
        "gdn_in": (64, 1),
        "attn_in": (64, 1),
        "out": (64, 3),
        "ffn_down": (64, 3),
    }
    off = plans(exe, "132", "2", "3", "3", env={"MC_MMR_ROWS32": "0"})
    assert off["ffn_gate_up"]["rows"] == 64 and off["ffn_gate_up"]["tiles"] == 544
    assert all(p["rows"] == 64 for p in off.values())
    assert all(p["rows"] == 64 for p in plans(exe, "132", "2", "0", "0").values())
    # the model on another GPU's shape (170 SMs, one block of each form, as ~100 KB of shared memory an
    # SM allows: an RTX 5090; not measured there): gate + up 7 waves x 32 rows against 5 x 48 and 4 x 64
    assert plans(exe, "170", "1", "1", "1")["ffn_gate_up"]["rows"] == 32
    for bad in (["0", "2", "3", "3"], ["132", "2", "x", "3"], ["132", "2", "3", "3.5"]):
        res = subprocess.run([str(exe), "plan", *bad], capture_output=True, text=True, check=False)
        assert res.returncode == 2 and "usage: mmr_lab plan NSM OCC64 OCC48 OCC32" in res.stderr, bad


def test_the_persistent_decode_products_pieces(compiled_lab):
    """The persistent decode kernel (patch 0031, MC_MMV_PERSIST): each group's rows a piece as the library's
    mc_pmv_choose picks them, without a GPU (mmr_lab pmvplan CTAS STAGE_KB). On an H200's 264 CTAs (2 an
    SM) with 24 KB stages (the defaults): 8-row pieces for
    the GDN and attention inputs (23,040 bytes), 4 for the out projection (K = 6,144: 8 rows would be
    27,648 bytes), 4 for the gated FFN (its gate rows beside the up rows), 2 for ffn_down (9,792 bytes a
    row); the busiest CTA has at most one piece more than the mean. The kernel runs only where it won in
    the mmr lab (mc_pmv_worth: a row on at most two warps, at least 6 pieces a CTA): the GDN and
    attention inputs and the gated FFN, not the out projection (4.8 pieces a CTA) or ffn_down (four
    warps a row). A stage too small for one row of ffn_down is a clear error (the library falls back
    to the dp4a kernel there), as are bad arguments."""
    exe = compiled_lab("mmr")

    def pmv(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([str(exe), "pmvplan", *args], capture_output=True, text=True, check=False)

    res = pmv("264", "24")
    assert res.returncode == 0, res.stderr
    got = {r["group"]: r for r in map(json.loads, res.stdout.splitlines())}
    assert {g: (r["rows_a_piece"], r["pieces"]) for g, r in got.items()} == {
        "gdn_in": (8, 2060),
        "attn_in": (8, 1792),
        "out": (4, 1280),
        "ffn_gate_up": (4, 4352),
        "ffn_down": (2, 2560),
    }
    for r in got.values():
        assert r["busiest"] == -(-r["pieces"] // 264) and r["busiest"] - r["pieces"] / 264 < 1
    assert {g for g, r in got.items() if r["persistent"]} == {"gdn_in", "attn_in", "ffn_gate_up"}
    # the rules relaxed (MC_MMV_PERSIST_MAX_WPR=4: ffn_down's rows on four warps; MIN_PIECES=0: the out
    # projection's 4.8 pieces a CTA), as the graph's variants measure them
    env = {**os.environ, "MC_MMV_PERSIST_MAX_WPR": "4", "MC_MMV_PERSIST_MIN_PIECES": "0"}
    every = subprocess.run(
        [str(exe), "pmvplan", "264", "24"], capture_output=True, text=True, check=False, env=env
    )
    assert all(json.loads(x)["persistent"] for x in every.stdout.splitlines()), every.stdout
    small = pmv("264", "8")
    assert small.returncode == 2 and "no piece shape fits K = 17408" in small.stderr
    for bad in (["x", "24"], ["264", "3"], ["0", "24"], ["264", "65"]):
        res = pmv(*bad)
        assert res.returncode == 2 and "usage: mmr_lab pmvplan CTAS STAGE_KB" in res.stderr, bad


def test_the_persistent_steps_tasks_pieces_and_bytes(compiled_lab):
    """The pstep lab (a decode step's products with no launch boundaries): each group's pieces are the
    library's own plan (mc_pmv_choose, as mmr_lab pmvplan prints it for the same CTAs and stages), and
    the step is the 27B's 64 layers x 4 tasks, its weight bytes those of 48 GDN and 16 attention
    layers' products (Q4_0: 18 bytes a block of 32; the FFN's gate rows beside the up rows), without a
    GPU (pstep_lab plan CTAS STAGE_KB); bad plan arguments and a stage too small are clear errors."""
    exe = compiled_lab("pstep")

    def lines(prog: Path, *args: str) -> list[dict]:
        res = subprocess.run([str(prog), *args], capture_output=True, text=True, check=False)
        assert res.returncode == 0, res.stderr
        return [json.loads(x) for x in res.stdout.splitlines()]

    got = lines(exe, "plan", "132", "24")
    library = {r["group"]: r for r in lines(compiled_lab("mmr"), "pmvplan", "132", "24")}
    plan = {r["group"]: r for r in got if r["kind"] == "plan"}
    assert plan.keys() == library.keys()
    for g, r in plan.items():
        assert (r["rows_a_piece"], r["pieces"]) == (library[g]["rows_a_piece"], library[g]["pieces"]), g

    def q4(rows: int, k: int) -> int:
        return rows * (k // 32) * 18

    gdn = q4(10240 + 6144 + 48 + 48, 5120)
    attn = q4(12288 + 1024 + 1024, 5120)
    rest = q4(5120, 6144) + 2 * q4(17408, 5120) + q4(5120, 17408)
    assert plan["gdn_in"]["bytes"] == gdn and plan["ffn_gate_up"]["bytes"] == 2 * q4(17408, 5120)
    assert got[-1] == {"kind": "steplan", "tasks": 256, "bytes": 48 * gdn + 16 * attn + 64 * rest}
    # 16 warps a CTA (MC_LAB_PSTEP_WARPS=16) in 48 KB stages: 16 rows a piece where a row on one warp
    # holds its blocks (K = 5,120: 160 blocks, a lane's 6 at most: 192), 8 where 16 do not fit a stage
    # (the out projection's 3,456-byte rows; the FFN's gate rows beside the up rows), 4 for ffn_down
    # (544 blocks need 3 warps a row: 4)
    wide = {
        r["group"]: r["rows_a_piece"] for r in lines(exe, "plan", "132", "48", "16") if r["kind"] == "plan"
    }
    assert wide == {"gdn_in": 16, "attn_in": 16, "out": 8, "ffn_gate_up": 8, "ffn_down": 4}
    for bad in (["x", "24"], ["132", "7"], ["0", "24"], ["132", "65"], ["132", "24", "12"]):
        res = subprocess.run([str(exe), "plan", *bad], capture_output=True, text=True, check=False)
        assert res.returncode == 2 and "usage: pstep_lab plan CTAS STAGE_KB" in res.stderr, bad
    small = subprocess.run([str(exe), "plan", "132", "8"], capture_output=True, text=True, check=False)
    assert small.returncode == 2 and "no piece shape fits K = 17408 in 8 KB" in small.stderr


def test_the_pstep_summary_gives_the_rate_from_the_steps_bytes_and_the_reference_difference():
    lab = load()

    def run(step_ms: float, ref: float) -> list[dict]:
        return [
            {"kind": "check", "group": "out", "sum": 1.0, "sumsq": 2.0, "ref_rel": ref},
            {"kind": "check", "group": "ffn_down", "sum": 3.0, "sumsq": 4.0, "ref_rel": ref / 2},
            {"kind": "step", "step_ms": step_ms, "bytes": 13_697_187_840, "tasks": 256},
        ]

    s = lab.mmr_summary({"step": [run(3.5, 1e-6), run(3.7, 3e-6)], "launches": [run(4.2, 2e-6)]})
    assert s["step"]["step_tb_s"] == pytest.approx(13.697_187_84 / 3.6)  # GB / ms = TB/s
    assert s["step"]["step_gb"] == pytest.approx(13.697_187_84)
    assert s["step"]["ref_rel"] == 3e-6 and s["launches"]["ref_rel"] == 2e-6
    text = lab.mmr_table(s)
    assert "ref rel" in text.splitlines()[0] and "3.00e-06" in text and "+16.7%" in text
    # MC_LAB_PSTEP_MATH=2 (the arithmetic alone on whatever the stages hold): the lab prints null for
    # values that are not finite; the summary counts them as infinitely far off, and still times it
    nan_run = [{**r, "sum": None, "ref_rel": None} if r["kind"] == "check" else r for r in run(3.0, 0.0)]
    s = lab.mmr_summary({"step": [run(3.5, 1e-6)], "arith": [nan_run]})
    assert s["arith"]["checksum_rel"] == math.inf and s["arith"]["ref_rel"] == math.inf
    assert s["arith"]["step_ms"]["mean"] == 3.0 and "inf" in lab.mmr_table(s).splitlines()[2]


def test_bad_driver_arguments_are_clear_errors(monkeypatch, tmp_path):
    lab = load()
    for argv, msg in (
        (["gdn", "--json", "x.json", "--tokens", "0"], "--tokens '0'"),
        (["gdn", "--json", "x.json", "--tokens", "1,x"], "--tokens '1,x'"),
        (["gdn", "--json", "x.json", "--repeats", "-1"], "--repeats -1"),
        (["gdn", "--json", "x.json", "--arch", "9x"], "--arch '9x'"),
        (["gdn", "--json", "x.json", "--src", str(tmp_path)], "no ggml/src/ggml-cuda/gated_delta_net.cu"),
        (["gdn", "--json", "x.json", "--sdist", str(tmp_path / "none.tar.gz")], "no such file"),
        (["mmr", "--json", "x.json", "--columns", "8"], "--columns 8: 1 (decode's kernel) or 9..16"),
        (["mmr", "--json", "x.json", "--rounds", "0"], "--rounds 0"),
        (["pstep", "--json", "x.json", "--rounds", "0"], "--rounds 0"),
        (["pstep"], "--json: needed"),
        (["pstep", "--json", "x.json", "--setting", "a=X"], "is not VAR=VALUE"),
        (["mmr", "--json", "x.json", "--setting", "a=", "--setting", "a=X=1"], "'a' twice"),
        (["mmr", "--json", "x.json", "--setting", "a=X"], "is not VAR=VALUE"),
        (["wg", "--json", "x.json", "--wg", "1,3"], "--wg '1,3'"),
    ):
        monkeypatch.setattr("sys.argv", ["kernel_lab.py", *argv])
        with pytest.raises(SystemExit) as e:
            lab.main()
        assert msg in str(e.value)


def test_a_patch_can_be_left_out_of_the_labs_tree(build_script, tmp_path):
    """--without NNNN: the lab's tree is the series less that patch (an A/B of a patch with no setting
    of its own, two calls); the last patch's changes are absent and the others' present; an unknown
    patch is refused with the series' range."""
    lab = load()
    sdist = build_script.fetch_sdist(build_script.cache_root())
    names = [p.name for p in build_script.read_series()]
    last = names[-1]
    number = last.split("-", 1)[0]
    patch = (build_script.PATCH_DIR / "patches" / last).read_text()
    added = next(
        line[1:].strip()
        for line in patch.splitlines()
        if line.startswith("+") and not line.startswith("+++") and len(line.strip()) > 40
    )

    def cuda_sources(tree: Path) -> str:
        # the .cu files and their headers: a patch's first added line may be a declaration
        folder = tree / "ggml/src/ggml-cuda"
        return "\n".join(p.read_text(errors="replace") for p in sorted(folder.glob("*.cu*")))

    source = cuda_sources(lab.patched_tree(sdist, tmp_path / "without", [number]))
    assert added not in source
    before = names[-2]  # the patch before it still applied: a line it adds is there
    prev = (build_script.PATCH_DIR / "patches" / before).read_text()
    kept = next(
        line[1:].strip()
        for line in prev.splitlines()
        if line.startswith("+") and not line.startswith("+++") and len(line.strip()) > 40
    )
    source_all = cuda_sources(lab.patched_tree(sdist, tmp_path / "all"))
    assert added in source_all and kept in source and kept in source_all
    with pytest.raises(SystemExit) as e:
        lab.patched_tree(sdist, tmp_path / "bad", ["9999"])
    assert f"--without 9999: not in the series (it has {names[0]} .. {last})" in str(e.value)


def test_the_high_nibbles_in_place_give_the_same_integer_sums():
    """pstep_lab's MC_LAB_PSTEP_NIB (ps_q4_0_dot): a Q4_0 word's high nibbles left in place (v & 0xF0F0F0F0:
    16 x each, read unsigned by dp4a.u32.s32) against the signed q8_1 activations sum 16 x the products,
    and one arithmetic shift a block gives mc_q4_0_dot's integer sum exactly, negative sums included: on
    every nibble value against the activations' extremes and on random blocks."""
    check_high_nibbles_in_place()
    src = (GPU / "pstep_lab.cu").read_text()
    assert 'asm("dp4a.u32.s32 %0, %1, %2, %3;"' in src
    assert "hi = ps_dp4a_us(v[i] & (int) 0xF0F0F0F0, u[i + 4], hi);" in src
    assert "return d4 * ((lo + (hi >> 4)) * ds.x - 8.0f * ds.y);" in src
