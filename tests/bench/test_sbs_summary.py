"""bench/gpu/sbs_summary.py turns a side-by-side state folder into the results JSON: run on a folder
shaped like the GPU script's (mc_gpu_bench JSON lines, llama-batched-bench jsonl, test-backend-ops
text, ncu's raw and details CSV), it fills the issue's keys and the per-kernel figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu" / "sbs_summary.py"

RAW_HEADER = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","gpu__time_duration.sum"'
)
DETAIL_HEADER = (
    '"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size",'
    '"Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"'
)


def raw_row(i: int, name: str, ns: str) -> str:
    return f'"{i}","1","b","h","{name}","1","7","{ns}"'


def detail_row(i: int, name: str, metric: str, unit: str, value: str) -> str:
    launch = f'"{i}","1","b","h","{name}","1","7","(128, 1, 1)","(80, 3, 1)","0","9.0"'
    return f'{launch},"S","{metric}","{unit}","{value}"'


def verify_lines(ms: dict[int, float]) -> str:
    rows = [{"kind": "verify", "depth": 512, "seqs": 1, "k": k, "median_ms": v} for k, v in ms.items()]
    return "".join(json.dumps(r) + "\n" for r in rows)


def make_state(st: Path) -> None:
    (st / "bandwidth.out").write_text(
        json.dumps({"kind": "bandwidth", "copy_bw_tb_s": 4.0, "pinned_h2d_gb_s": 50.0, "gpu": "GPU X"}) + "\n"
    )
    (st / "model-bytes.txt").write_text("16000000000\n")
    (st / "env.txt").write_text("2026-11-29T00:00:00Z\ncommit 0123abcd\n")
    for build, tok_s in (("stock", 100.0), ("patched", 120.0)):
        tg = [
            {"kind": "tg", "depth": d, "n": 64, "median_ms": 1000 / tok_s, "tok_s": tok_s}
            for d in (0, 4096, 32768)
        ]
        (st / f"{build}-tg.out").write_text("".join(json.dumps(r) + "\n" for r in tg))
        batched = [{"pl": 12, "speed_tg": 4.4 * tok_s}, {"pl": 1, "speed_tg": tok_s}]
        (st / f"{build}-batched.err").write_text("".join(json.dumps(r) + "\n" for r in batched))
    (st / "stock-verify1.out").write_text(verify_lines({1: 10.0, 16: 24.0}))
    (st / "patched-verify1.out").write_text(verify_lines({1: 8.0, 16: 16.0}))
    (st / "patched-ops-MUL_MAT.out").write_text("  1343/1343 tests passed\n  Backend CUDA0: OK\n")
    (st / "stock-profile-k16.out").write_text(
        "==PROF== noise\n"
        + "\n".join(
            [
                RAW_HEADER,
                raw_row(0, "", "nsecond"),
                raw_row(1, "void mul_mat_q<(ggml_type)2, 16>(int)", "3,000"),
                raw_row(2, "void mul_mat_q<(ggml_type)2, 16>(int)", "1,000"),
                raw_row(3, "void rms_norm_f32<1024>(float)", "1000"),
            ]
        )
        + "\n"
    )
    numa = {"gpu_node": 1, "local": {"bound": True, "pages_by_node": {"1": 256}, "h2d_gb_s": 55.0}}
    (st / "numa.json").write_text(json.dumps(numa))
    name = "void mc_mmq_q4_0<2, 8, false>(const char *, int)"
    (st / "patched-kdetail.out").write_text(
        "\n".join(
            [
                DETAIL_HEADER,
                detail_row(5, name, "Duration", "us", "30.0"),
                detail_row(5, name, "Memory Throughput", "%", "20"),
                detail_row(6, name, "Duration", "us", "40.0"),
                detail_row(6, name, "Memory Throughput", "%", "30"),
                detail_row(6, name, "Block Limit Registers", "block", "n/a"),
                detail_row(6, name, "Memory Throughput", "byte/second", "5e+11"),
                detail_row(
                    5, name, "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio", "", "1.5"
                ),
                detail_row(
                    5,
                    name,
                    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
                    "",
                    "0.5",
                ),
            ]
        )
        + "\n"
    )


STALLED = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def test_summary_fills_the_issue_keys_and_the_kernel_figures(tmp_path):
    st = tmp_path / "state"
    st.mkdir()
    make_state(st)
    out = tmp_path / "summary.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(st), "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())
    assert res["gpu"] == "GPU X" and res["commit"] == "0123abcd"
    assert res["ceiling_tok_s"] == 250.0  # 4.0 TB/s over 16 GB
    assert res["tg_tok_s_stock"] == 100.0 and res["tg_tok_s_patched"] == 120.0
    assert res["patched_over_stock"]["tg_tok_s"] == 1.2
    assert res["agg_tok_s_12_patched"] == 528.0
    assert res["verify16_over_1_stock"] == 2.4 and res["verify16_over_1_patched"] == 2.0
    assert res["builds"]["patched"]["test_backend_ops"] == {"MUL_MAT": {"passed": 1343, "total": 1343}}
    assert res["numa_probe"]["local"]["h2d_gb_s"] == 55.0 and "numa probe:" in run.stdout
    prof = res["builds"]["stock"]["profile_k16"]
    assert prof["kernels"] == 3 and prof["kernel_time_us"] == 5.0
    assert prof["by_kernel"][0] == {"name": "void mul_mat_q", "count": 2, "us": 4.0, "share": 0.8}
    kd = res["builds"]["patched"]["kdetail"]["void mc_mmq_q4_0<2, 8, false>"]
    assert kd["launches"] == 2
    assert kd["metrics"]["Duration"] == {"mean": 35.0, "unit": "us"}
    assert kd["metrics"]["Memory Throughput"]["mean"] == 25.0
    assert "Block Limit Registers" not in kd["metrics"]  # not a number
    # the same name in another unit is kept apart (ncu's MemoryWorkloadAnalysis section)
    assert kd["metrics"]["Memory Throughput (byte/second)"] == {"mean": 5e11, "unit": "byte/second"}
    assert "stalls (warps per issue): barrier 1.5, long_scoreboard 0.5" in run.stdout
    assert "mc_mmq_q4_0<2, 8, false> (2 launches): Duration 35 us, Memory Throughput 25 %" in run.stdout


def test_a_tree_that_differs_from_its_commit_is_said_so(tmp_path):
    """A run whose tree differs from the commit its git names (run BA: the device copy's .git named
    5b548dc while its files were 537300b's) records the changed files git status listed and the patch
    series' hash from the run's log, and the printed header says so; a clean tree adds neither."""
    st = tmp_path / "state"
    st.mkdir()
    make_state(st)
    nvidia = "name, driver_version, compute_cap\nNVIDIA H200, 580.159.04, 9.0\n"
    (st / "env.txt").write_text(
        "2026-12-02T02:15:44Z\ncommit 5b548dcac3\n M ggml-patches/series\n?? drv.sh\n" + nvidia
    )
    (st / "steps.log").write_text(
        "[02:15:44 +1s] === call start\n[02:15:46 +3s] build started (arch 90, series 4253783c13c234c3aa)\n"
        "[02:25:44 +0s] === call start in /r (commit 5b548dcac3), deadline 570s, settings: none\n"
        "[02:35:44 +0s] === call start in /r (commit 5b548dcac3), deadline 570s, settings: MC_GDN_ONE=0 \n"
    )
    out = tmp_path / "summary.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(st), "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())
    assert res["commit"] == "5b548dcac3"
    assert res["tree_changes"] == [" M ggml-patches/series", "?? drv.sh"]
    assert res["series_hash"] == "4253783c13c234c3aa"
    assert res["settings_per_call"] == ["none", "MC_GDN_ONE=0"]  # each call's exported MC_ settings
    assert "commit 5b548dcac3 (+2 changed files: see tree_changes)  series 4253783c13c234c3" in run.stdout
    (st / "env.txt").write_text("2026-12-02T02:15:44Z\ncommit 5b548dcac3\n" + nvidia)
    (st / "steps.log").unlink()
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(st), "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    res = json.loads(out.read_text())
    assert "tree_changes" not in res and "series_hash" not in res
    assert "commit 5b548dcac3  model" in run.stdout


def test_verify_draws_give_the_median_and_each_draws_ratio(tmp_path):
    # MC_SBS_DRAWS processes write their lines one after another into one step output: the figure is
    # the median of the draws, each draw's own 16 / 1 ratio is kept, and one slow draw does not decide it
    st = tmp_path / "state"
    st.mkdir()
    make_state(st)
    draws = [{1: 6.5, 16: 9.6}, {1: 6.6, 16: 10.3}, {1: 6.4, 16: 9.7}]
    (st / "patched-verify1.out").write_text("".join(verify_lines(d) for d in draws))
    (st / "patched-va-verify1.out").write_text(verify_lines({1: 6.0, 16: 9.0}))
    out = tmp_path / "summary.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(st), "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())
    assert res["verify_ms_patched"] == {"1": 6.5, "16": 9.7}
    assert res["builds"]["patched"]["verify1_draws_ms"] == {"1": [6.5, 6.6, 6.4], "16": [9.6, 10.3, 9.7]}
    assert res["verify16_over_1_patched"] == round(9.7 / 6.5, 3)
    each = [round(9.6 / 6.5, 3), round(10.3 / 6.6, 3), round(9.7 / 6.4, 3)]
    assert res["verify16_over_1_draws_patched"] == each
    assert f"verify16_over_1_draws_patched: {res['verify16_over_1_draws_patched']}" in run.stdout
    # one draw: the figure as measured, no draws kept
    assert res["verify_ms_patched-va"] == {"1": 6.0, "16": 9.0}
    # a setting's ratio (calls.sh sbs: vcopies, the engine's repacked copies) beside the defaults'
    assert res["verify16_over_1_patched-va"] == 1.5 and "verify16_over_1_patched-va: 1.5" in run.stdout
    assert "verify1_draws_ms" not in res["builds"]["patched-va"]
    assert "verify16_over_1_draws_patched-va" not in res


def logits_state(tmp_path: Path) -> tuple[Path, str, np.ndarray]:
    """A state folder (make_state), the result line of a logits run of 3 rows x 8 floats, and values for
    such a run."""
    st = tmp_path / "state"
    st.mkdir()
    make_state(st)
    line = json.dumps({"kind": "logits", "rows": 3, "n_vocab": 8}) + "\n"
    return st, line, np.arange(3 * 8, dtype=np.float32) + 1


def test_logits_of_a_run_that_stopped_are_reported_not_compared(tmp_path):
    # a setting's logits run that aborted mid-write (run AP: MC_MMV_PERSIST=1 before its fix) leaves a
    # file cut mid-row and no result line: the summary says so and every other figure is still written;
    # a finished run with the wrong number of rows is an error too, a matching one is compared
    st, line, ref = logits_state(tmp_path)
    n_vocab, rows = 8, 3
    (st / "patched-logits.out").write_text(line)
    ref.tofile(st / "patched-logits.bin")
    (st / "patched-vp-logits.out").write_text("")
    ref[: rows * n_vocab - 3].tofile(st / "patched-vp-logits.bin")
    (st / "patched-vq-logits.out").write_text(line)
    ref[:n_vocab].tofile(st / "patched-vq-logits.bin")
    (st / "patched-vr-logits.out").write_text(line)
    ref.tofile(st / "patched-vr-logits.bin")
    for v in ("vp", "vq", "vr"):
        (st / f"patched-{v}-tg.out").write_text((st / "patched-tg.out").read_text())
    out = tmp_path / "summary.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(st), "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())
    assert res["logits_patched_vp_vs_patched"] == {
        "error": "patched-vp-logits did not finish (no result line in patched-vp-logits.out)"
    }
    assert "holds 8 floats against 24" in res["logits_patched_vq_vs_patched"]["error"]
    assert res["logits_patched_vr_vs_patched"]["argmax_agree"] == rows
    assert res["logits_patched_vr_vs_patched"]["rel_l2_max"] == 0.0
    assert res["logits_patched_vr_vs_patched"]["same_bytes"] is True
    assert res["tg_tok_s_patched"] == 120.0


def test_a_setting_is_also_compared_with_each_setting_it_adds_to(tmp_path):
    # run CJ: 0063 with the copies (vct) against the defaults differed by what the copies change; against
    # the copies alone (vcopies, whose settings are a strict part of vct's) its logits are the same bytes
    st, line, ref = logits_state(tmp_path)
    copies = ref * np.float32(1.001)
    for name, values in (("patched", ref), ("patched-vcopies", copies), ("patched-vct", copies)):
        (st / f"{name}-logits.out").write_text(line)
        values.tofile(st / f"{name}-logits.bin")
    (st / "patched-vo-logits.out").write_text(line)  # the added setting alone: a part of vct, not of vcopies
    ref.tofile(st / "patched-vo-logits.bin")
    with (st / "steps.log").open("a") as log:
        log.write("[20:32:32 +301s] variant vcopies: MC_MMH_REPACK=3\n")
        log.write("[20:32:32 +301s] variant vct: MC_FUSE_CONV_TOKENS=1+MC_MMH_REPACK=3\n")
        log.write("[20:32:40 +309s] variant vo: MC_FUSE_CONV_TOKENS=1\n")
    out = tmp_path / "summary.json"
    run = subprocess.run(
        [sys.executable, str(SCRIPT), str(st), "--out", str(out)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    res = json.loads(out.read_text())
    assert res["logits_patched_vct_vs_patched"]["same_bytes"] is False
    assert res["logits_patched_vct_vs_patched_vcopies"]["same_bytes"] is True
    assert res["logits_patched_vct_vs_patched_vcopies"]["rel_l2_max"] == 0.0
    assert res["logits_patched_vct_vs_patched_vo"]["same_bytes"] is False  # what the copies change
    assert "logits_patched_vct_vs_patched_vct" not in res  # strict parts only
    never = ("vcopies_vs_patched_vct", "vo_vs_patched_vct", "vcopies_vs_patched_vo", "vo_vs_patched_vcopies")
    for key in never:
        assert f"logits_patched_{key}" not in res
    assert "logits_patched_vct_vs_patched_vcopies: " in run.stdout
