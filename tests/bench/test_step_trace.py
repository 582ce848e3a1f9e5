"""bench/gpu/step_trace.py: the CUPTI tracer library builds against this machine's CUDA toolkit and
exports the driver's injection entry; the report's increments, sums and step selection on a CSV
whose figures are known; the toolkit search names where it looked."""

from __future__ import annotations

import ctypes
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "step_trace.py"


def load():
    spec = importlib.util.spec_from_file_location("step_trace", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


HEADER = "correlation,graph,node,start_ns,end_ns,grid,block,cluster,name\n"


def write_csv(path: Path, steps: list[list[tuple[str, int, int]]], extra: str = "") -> None:
    """Each step a graph launch (its own correlation id) of (name, start, end) kernels."""
    lines = [HEADER]
    for c, kernels in enumerate(steps, start=10):
        for node, (name, start, end) in enumerate(kernels):
            lines.append(f'{c},7,{node},{start},{end},1.1.1,128.1.1,0.0.0,"{name}"\n')
    path.write_text("".join(lines) + extra)


def chain(t0: int) -> list[tuple[str, int, int]]:
    """A step of four kernels: a product that runs 10 us, a norm launched early (PDL) that ends 3 us
    later, a quantization 1 us later, a product 20 us later."""
    return [("_Z4prodv", t0, t0 + 10_000), ("_Z4normv", t0 + 2_000, t0 + 13_000),
            ("_Z5quantv", t0 + 12_000, t0 + 14_000), ("_Z4prodv", t0 + 13_500, t0 + 34_000)]  # fmt: skip


def test_the_increments_add_up_to_the_span_and_are_summed_by_kernel_and_boundary(tmp_path):
    st = load()
    csv = tmp_path / "t.csv"
    # two warm-up steps (skipped), three measured; a non-graph kernel and a small graph launch ignored
    steps = [chain(t) for t in (0, 100_000, 200_000, 300_000, 400_000)]
    write_csv(
        csv, steps, extra="99,0,0,5,9,1.1.1,1.1.1,0.0.0,_Z4prodv\n50,7,0,1,2,1.1.1,1.1.1,0.0.0,_Z4tinyv\n"
    )
    rep = st.report(st.read_steps(csv, min_kernels=3), skip=2)
    assert rep["steps"] == 5 and rep["steps_used"] == 3 and rep["steps_differing"] == 0
    assert rep["kernels_per_step"] == 4
    assert rep["span_us_median"] == 34.0 and rep["sum_of_increments_us"] == 34.0
    assert [p["inc_us"] for p in rep["positions"]] == [10.0, 3.0, 1.0, 20.0]
    assert [p["dur_us"] for p in rep["positions"]] == [10.0, 11.0, 2.0, 20.5]
    names = {r["key"]: r for r in rep["by_name"]}
    assert set(names) <= {"_Z4prodv", "_Z4normv", "_Z5quantv", "prod", "norm", "quant"}
    prod = names.get("prod") or names["_Z4prodv"]
    assert prod["count"] == 2 and prod["inc_us"] == 30.0 and prod["inc_us_each"] == 15.0
    assert rep["by_name"][0]["inc_us"] == 30.0  # ranked by their sum
    pairs = [r["key"] for r in rep["by_pair"]]
    assert len(pairs) == 4 and pairs[0].startswith(("quant", "_Z5quantv")) and "->" in pairs[0]


def test_a_stretch_of_the_step_around_a_kernel_and_names_with_commas(tmp_path):
    st = load()
    csv = tmp_path / "t.csv"
    steps = [chain(t) for t in (0, 100_000, 200_000)]
    steps = [[("void f<1, 2>(int, float)" if n == "_Z4normv" else n, a, b) for n, a, b in ks] for ks in steps]
    write_csv(csv, steps)
    rep = st.report(st.read_steps(csv, min_kernels=4), skip=1)
    assert rep["positions"][1]["name"] == "f<1, 2>"  # the quoted name kept whole, its signature dropped
    stretch = st.around(rep, r"^f<", nth=0, width=1)
    assert [p["i"] for p in stretch] == [0, 1, 2]
    assert st.around(rep, "nothing") == []
    assert [p["i"] for p in st.around(rep, "quant", nth=9, width=0)] == [2]


def test_a_step_with_other_kernels_is_counted_and_left_out(tmp_path):
    st = load()
    csv = tmp_path / "t.csv"
    odd = chain(300_000)
    odd[2] = ("_Z5otherv", *odd[2][1:])
    write_csv(csv, [chain(0), chain(100_000), chain(200_000), odd])
    rep = st.report(st.read_steps(csv, min_kernels=4), skip=1)
    assert rep["steps_used"] == 2 and rep["steps_differing"] == 1
    with pytest.raises(SystemExit, match="none left after skipping 4"):
        st.report(st.read_steps(csv, min_kernels=4), skip=4)
    with pytest.raises(
        SystemExit, match=r"no graph launch of at least 9 kernels .* the largest of \[4, 4, 4, 4\]"
    ):
        st.read_steps(csv, min_kernels=9)


def test_short_names_keep_template_arguments_and_drop_the_signature():
    st = load()
    assert st.short_name("void mc_pmv_q4_0<true, (bool)0, 3>(mc_pmv_args)") == "mc_pmv_q4_0<true, (bool)0, 3>"
    assert st.short_name("quantize_q8_1(float const*, void*, long)") == "quantize_q8_1"
    assert st.short_name("_Z4prodv") == "_Z4prodv"


def test_the_toolkit_search_looks_beside_the_toolkit_and_names_where_it_looked(tmp_path):
    st = load()
    base = tmp_path / "cuda" / "extras" / "CUPTI"
    (base / "include").mkdir(parents=True)
    (base / "include" / "cupti.h").write_text("")
    (base / "lib64").mkdir()
    (base / "lib64" / "libcupti.so.13").write_text("")
    assert st.find_cupti([tmp_path / "none", tmp_path / "cuda"]) == (base / "include", base / "lib64")
    with pytest.raises(SystemExit, match=r"not found under: .*none"):
        st.find_cupti([tmp_path / "none"])


def test_the_tracer_builds_against_this_machines_toolkit_and_exports_the_injection_entry(tmp_path):
    """The library the GPU machine injects: compiled here against the CUDA toolkit's CUPTI, loaded,
    and it has the entry the driver calls (InitializeInjection); not called here (no GPU)."""
    st = load()
    so = st.build(tmp_path / "step_trace.so")
    lib = ctypes.CDLL(str(so))
    assert hasattr(lib, "InitializeInjection")
    syms = subprocess.run(["nm", "-D", "--defined-only", str(so)], capture_output=True, text=True).stdout
    assert " T InitializeInjection" in syms


def test_the_command_line_asks_for_the_program_and_for_valid_settings(tmp_path):
    out = subprocess.run([sys.executable, str(SCRIPT), "run", "--so", "x.so", "--csv", "x.csv"],
                         capture_output=True, text=True)  # fmt: skip
    assert out.returncode != 0 and "the program to run goes after --" in out.stderr
    argv = [
        sys.executable,
        str(SCRIPT),
        "trace",
        "--json",
        str(tmp_path / "j"),
        "--bench",
        "b",
        "--model",
        "m",
    ]
    out = subprocess.run([*argv, "--setting", "NOVALUE"], capture_output=True, text=True)
    assert out.returncode != 0 and "--setting 'NOVALUE': expected VAR=VALUE" in out.stderr


def test_the_report_command_writes_its_json_and_prints_the_sums(tmp_path):
    csv, out = tmp_path / "t.csv", tmp_path / "r.json"
    write_csv(csv, [chain(t) for t in (0, 100_000, 200_000, 300_000)])
    argv = [sys.executable, str(SCRIPT), "report", "--csv", str(csv), "--json", str(out)]
    res = subprocess.run([*argv, "--min-kernels", "4", "--around", "quant"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    rep = json.loads(out.read_text())
    assert rep["steps_used"] == 2 and rep["span_us_median"] == 34.0
    assert "span 34.0 us" in res.stdout and "by boundary (previous -> kernel)" in res.stdout
    assert "around a kernel matching 'quant'" in res.stdout


def test_compare_lines_up_the_steps_and_names_where_the_left_out_kernels_time_went(tmp_path):
    st = load()
    a_csv, b_csv = tmp_path / "a.csv", tmp_path / "b.csv"
    write_csv(a_csv, [chain(t) for t in (0, 100_000, 200_000)])
    # B leaves the norm out: the quantization ends where the norm did plus 1 us, the product as before
    no_norm = [[k for k in chain(t) if k[0] != "_Z4normv"] for t in (0, 100_000, 200_000)]
    no_norm = [[(n, s, e + (-2_000 if n == "_Z4prodv" and s > t else 0)) for n, s, e in ks]
               for t, ks in zip((0, 100_000, 200_000), no_norm, strict=True)]  # fmt: skip
    write_csv(b_csv, no_norm)
    a = st.report(st.read_steps(a_csv, min_kernels=3), skip=1)
    b = st.report(st.read_steps(b_csv, min_kernels=3), skip=1)
    c = st.compare(a, b)
    assert c["matched"] == 3 and c["span_delta_us"] == -2.0
    only = {r["key"]: r for r in c["only"]}
    assert set(only) == {"A: norm"} or set(only) == {"A: _Z4normv"}
    assert next(iter(only.values()))["inc_us"] == 3.0
    delta = {r["key"].lstrip("_Z45"): r["inc_us"] for r in c["delta_by_name"]}
    # the quantization's increment now counts from the first product's end: 1 + 3 = 4 (was 1)
    assert delta.get("quant", delta.get("quantv")) == 3.0
    assert delta.get("prod", delta.get("prodv")) == -2.0
    out = tmp_path / "c.json"
    a_json, b_json = tmp_path / "a.json", tmp_path / "b.json"
    a_json.write_text(json.dumps(a))
    b_json.write_text(json.dumps(b))
    cmd = [sys.executable, str(SCRIPT), "compare", str(a_json), str(b_json), "--json", str(out)]
    res = subprocess.run(cmd, capture_output=True, text=True, check=True)
    assert "kernels only one runs" in res.stdout and json.loads(out.read_text())["span_delta_us"] == -2.0


def test_the_traced_program_is_decode_steps_or_one_sequences_verify_steps(tmp_path):
    program_argv = load().program_argv
    assert program_argv(Path("b"), Path("m"), 0, 64, 1) == ["b", "tg", "m", "0", "64"]
    assert program_argv(Path("b"), Path("m"), 512, 64, 16) == ["b", "verify", "m", "512", "1", "16"]
    with pytest.raises(SystemExit, match="--k 0, --depth 0, --tokens 64: need k >= 1"):
        program_argv(Path("b"), Path("m"), 0, 64, 0)
    # a bad --k is refused before anything is built or run
    so = tmp_path / "none.so"
    argv = [sys.executable, str(SCRIPT), "trace", "--json", str(tmp_path / "j"), "--bench", "b", "--model"]
    out = subprocess.run([*argv, "m", "--k", "-2", "--so", str(so)], capture_output=True, text=True)
    assert out.returncode != 0 and "--k -2" in out.stderr and not so.exists()
