"""Patch 0072 (MC_FATTN_MMA_COLS; 0: stock's choice, the default until measured; 8, 16 or 32): a few
tokens of one sequence (a verify step: at most 16) over a short KV (MC_FATTN_MMA_COLS_KV cells, default
4,096) run the MMA attention kernel with at most that many query columns a block. Stock takes the fewest
columns that hold all the tokens, 64 for the 27B's 16-token step (8 tokens x 8 packed heads), so a
layer's 8 blocks are spread by stream-K one small K / V tile each, every one writing a 64-column partial
for the fix-up (H200, run CL: 18.4 + 4.6 us a layer at depth 512). Each capped form is one of stock's
own instances, so the arithmetic is stock's; checked here: the rule's place and conditions, an
emulation of the choice for every packing and token count (never more columns than stock, never an
instance that is not built), the test cases the GPU run compares with the CPU backend, and that
fattn.cu compiles for sm_120 (sm_90: test_cuda_kernels.py)."""

from __future__ import annotations

from tests.ggml_patches.test_cuda_kernels import FATTN_FLAGS, c_body, compile_cuda

SWITCH = "static void ggml_cuda_flash_attn_ext_mma_f16_switch_ncols1("


def _stock_cols(ncols2: int, tokens: int) -> int:
    """Stock's columns a block (ncols1 x ncols2) for `tokens` queries a head on an NVIDIA GPU from Turing
    on (past the sparse gather): the first of 8, 16, 32 columns whose rows hold them, else 64."""
    for cols, allowed in ((8, ncols2 <= 8), (16, ncols2 <= 16), (32, True)):
        if allowed and tokens <= cols // ncols2:
            return cols
    return 64


def _choice(ncols2: int, tokens: int, cap: int, kv: int, kv_max: int = 4096) -> int:
    """The patched choice, as fattn.cu states it."""
    mc = cap if cap != 0 and tokens <= 16 and kv <= kv_max else 0
    fits = mc >= ncols2 and tokens > mc // ncols2  # stock would take more than mc columns
    if fits and ((mc == 8 and ncols2 <= 8) or (mc == 16 and ncols2 <= 16) or mc == 32):
        return mc
    return _stock_cols(ncols2, tokens)


def test_the_setting_is_read_once_with_its_values_named(patched):
    fattn = (patched / "ggml/src/ggml-cuda/fattn.cu").read_text()
    rule = c_body(fattn, "static int mc_fattn_mma_cols(const ggml_tensor * Q, const ggml_tensor * K) {")
    assert fattn.count('"MC_FATTN_MMA_COLS"') == 1 and fattn.count('"MC_FATTN_MMA_COLS_KV"') == 1
    assert 'ggml_cuda_mc_env_int("MC_FATTN_MMA_COLS", 0, 32, 0)' in rule  # default: stock's choice
    assert 'ggml_cuda_mc_env_int("MC_FATTN_MMA_COLS_KV", 1, 1 << 24, 4096)' in rule
    assert "static const int cols = [] {" in rule and "static const int kv_max =" in rule  # read once
    # a value in range but not a form: named with the allowed ones, and stock runs
    assert "if (v != 0 && v != 8 && v != 16 && v != 32) {" in rule
    assert "expected 0 (stock's choice), 8, 16 or 32; stock's choice runs" in rule
    assert "return cols != 0 && Q->ne[1] <= 16 && K->ne[1] <= kv_max ? cols : 0;" in rule


def test_the_rule_runs_after_the_sparse_gather_and_before_stocks_choice_on_stocks_instances(patched):
    fattn = (patched / "ggml/src/ggml-cuda/fattn.cu").read_text()
    body = c_body(fattn, SWITCH)
    sparse = body.index("ggml_cuda_flash_attn_ext_mma_f16_case<DKQ, DV, 1, ncols2>(ctx, dst);")
    rule = body.index("const int mc_cols = mc_fattn_mma_cols(Q, dst->src[1]);")
    stock = body.index("if (turing_mma_available(cc) && Q->ne[1] <= 8/ncols2) {")
    assert sparse < rule < stock
    capped = body[rule:stock]
    assert "if (mc_cols >= ncols2 && Q->ne[1] > mc_cols/ncols2) {" in capped
    # each capped form is a call stock's own choice makes in this function, under the same guard, so no
    # instance is asked for that stock does not build
    calls = [
        f"ggml_cuda_flash_attn_ext_mma_f16_case<DKQ, DV, {c}/ncols2, ncols2>(ctx, dst);" for c in (8, 16, 32)
    ]
    for call in calls:
        assert capped.count(call) == 1 and body[stock:].count(call) == 1, call
    at = [
        capped.index(x) for x in ("if constexpr (ncols2 <= 8) {", calls[0], "if constexpr (ncols2 <= 16) {")
    ]
    assert at == sorted(at) and at[2] < capped.index(calls[1]) < capped.index(calls[2])
    assert "if (mc_cols == 8 && turing_mma_available(cc)) {" in capped


def test_the_choice_never_takes_more_columns_than_stock_nor_an_instance_not_built(patched):
    instances = {p.name for p in (patched / "ggml/src/ggml-cuda/template-instances").glob("fattn-mma-f16-*")}
    changed = 0
    for ncols2 in (1, 2, 4, 8, 16, 32):
        for tokens in range(1, 40):
            for kv in (512, 4096, 4352):
                stock = _stock_cols(ncols2, tokens)
                assert _choice(ncols2, tokens, 0, kv) == stock  # the default is stock's
                for cap in (8, 16, 32):
                    cols = _choice(ncols2, tokens, cap, kv)
                    assert cols <= stock
                    if cols != stock:
                        changed += 1
                        assert tokens <= 16 and kv <= 4096 and cols == cap and cols >= ncols2
                        assert (
                            f"fattn-mma-f16-instance-ncols1_{cols // ncols2}-ncols2_{ncols2}.cu" in instances
                        )
    assert changed > 0
    # the 27B's 16-token verify step (6 query heads a K / V head: stock packs 8): 64 columns, 8 / 16 / 32
    assert [_choice(8, 16, cap, 768) for cap in (0, 8, 16, 32)] == [64, 8, 16, 32]
    assert _choice(8, 16, 16, 8192) == 64 and _choice(8, 17, 16, 768) == 64  # past the KV, the tokens


def test_the_gpu_check_has_verify_steps_at_the_27bs_heads_and_each_packing(patched):
    tests = (patched / "tests/test-backend-ops.cpp").read_text()
    assert 'return "MC_FATTN_FEW";' in tests
    assert ": test_flash_attn_ext(hs, hs, nh, { gqa, 1 }, kv, nb) {}" in tests
    assert "for (int64_t kv : { 256, 512, 4096, 8192 }) {  // patch 0072" in tests  # 8192: past the limit
    assert "for (int64_t nb : { 2, 5, 8, 12, 16, 17 }) {" in tests  # 17: past the tokens
    assert "test_cases.emplace_back(new test_mc_fattn_few(256, 4, 6, kv, nb));" in tests
    assert "for (int64_t gqa : { 1, 2, 4, 8 }) {" in tests
    assert "test_cases.emplace_back(new test_mc_fattn_few(128, 4, gqa, 512, nb));" in tests


def test_fattn_compiles_for_the_rtx_5090(patched, tmp_path):
    out = compile_cuda(patched, "fattn.cu", "120", tmp_path, *FATTN_FLAGS)
    assert out.returncode == 0, out.stderr[-3000:]
