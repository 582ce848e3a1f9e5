"""The many-slot engine on real llama.cpp with real models (Gemma 3 270M, tiny qwen35)."""

from __future__ import annotations

import pytest

from orchestrator.events import Swapped, TaskStateChanged
from orchestrator.llama import ContextParams
from orchestrator.llama_engine import EngineConfig, LlamaEngine
from orchestrator.types import (
    FinishEvent,
    GenerationRequest,
    InvalidRequest,
    SamplingParams,
    StopReason,
    TokenEvent,
)

PROMPTS = ["The capital of France is", "Once upon a time", "def fib(n):", "The best way to cook rice is"]


def make_engine(path, n_ctx=2048, slots=4, **kw) -> LlamaEngine:
    ctx = ContextParams(n_ctx=n_ctx, n_batch=256, n_seq_max=slots, n_threads=2, flash_attn="on")
    return LlamaEngine(str(path), EngineConfig(context=ctx, chunk=kw.pop("chunk", 128), **kw))


def greedy(engine, prompt, n=24, **kw) -> GenerationRequest:
    """A request of n tokens; greedy unless `kw` sets a temperature."""
    tokens = engine.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
    kw.setdefault("temperature", 0.0)
    return GenerationRequest(tuple(tokens), SamplingParams(max_tokens=n, **kw))


def run_tokens(reader) -> list[int]:
    return [e.token for e in reader if isinstance(e, TokenEvent) and e.token >= 0]


@pytest.fixture(scope="module")
def gemma_engine(gemma_path):
    engine = make_engine(gemma_path)
    yield engine
    engine.close()


def test_concurrent_tasks_each_get_their_own_text(gemma_engine):
    # Batch composition changes CPU numerics (LLAMA-NOTES), so runs are not compared token for
    # token here; each task's text must follow its own prompt.
    readers = [gemma_engine.submit(greedy(gemma_engine, p, 20)) for p in PROMPTS]
    results = [r.text() for r in readers]
    texts = [t for t, _ in results]
    assert len(set(texts)) == len(texts)
    assert "France" in texts[0]
    assert "return" in texts[2] or "fib" in texts[2]
    assert "rice" in texts[3]
    assert all(f.reason is StopReason.LENGTH and f.usage.completion_tokens == 20 for _, f in results)


def _exact_after_swap(path, prompt: str, n: int, pause_after: int) -> tuple[list[int], list[int], list]:
    """Greedy tokens of one task run alone, uninterrupted and with a pause/resume in the middle."""
    engine = make_engine(path, max_sessions=0)
    try:
        plain = run_tokens(engine.submit(greedy(engine, prompt, n)))
        events = engine.events.subscribe()
        reader = engine.submit(greedy(engine, prompt, n))
        swapped = []
        for event in reader:
            if isinstance(event, TokenEvent) and len(swapped) == pause_after - 1:
                engine.pause(reader.task_id)
            if isinstance(event, TokenEvent):
                swapped.append(event.token)
        swaps = []
        while not events.queue.empty():
            e = events.get()
            if isinstance(e, Swapped):
                swaps.append(e)
        return plain, [t for t in swapped if t >= 0], swaps
    finally:
        engine.close()


def test_swap_restore_is_exact_on_gemma(gemma_path):
    plain, swapped, swaps = _exact_after_swap(gemma_path, "Once upon a time", 40, pause_after=12)
    assert [s.direction for s in swaps] == ["pause", "resume"]
    assert swaps[0].bytes == swaps[1].bytes > 0
    assert swapped == plain


def test_swap_restore_is_exact_on_tiny_qwen35_recurrent_state(tiny_qwen35_path):
    plain, swapped, swaps = _exact_after_swap(tiny_qwen35_path, "def fibonacci(n):", 40, pause_after=10)
    assert [s.direction for s in swaps] == ["pause", "resume"]
    assert swaps[0].bytes > 3 * 128 * 128 * 4  # the three DeltaNet layers' states travel too
    assert swapped == plain


def test_tight_budget_pauses_tasks_and_all_finish(gemma_path):
    engine = make_engine(gemma_path, n_ctx=256, slots=4, age_bound_s=0.3, quantum_s=0.05)
    try:
        readers = [engine.submit(greedy(engine, p, 60)) for p in PROMPTS * 2]
        results = [r.text() for r in readers]
        assert all(f.reason is StopReason.LENGTH and f.usage.completion_tokens == 60 for _, f in results)
        assert engine.stats.pauses > 0 and engine.stats.resumes > 0
    finally:
        engine.close()


def test_a_preallocated_swap_arena_serves_every_pause(gemma_path):
    engine = make_engine(gemma_path, n_ctx=256, slots=4, age_bound_s=0.3, quantum_s=0.05,
                         swap_prealloc_bytes=64 << 20)  # fmt: skip
    try:
        readers = [engine.submit(greedy(engine, p, 60)) for p in PROMPTS * 2]
        results = [r.text() for r in readers]
        assert all(f.reason is StopReason.LENGTH and f.usage.completion_tokens == 60 for _, f in results)
        assert engine.stats.pauses > 0 and engine.stats.resumes > 0
        metrics = engine.metrics()
        assert metrics["mc_swap_arena_bytes"] == 64 << 20 and metrics["mc_swap_allocations_total"] == 0
    finally:
        engine.close()


def test_more_tasks_than_slots_all_finish(gemma_path):
    engine = make_engine(gemma_path, slots=2)
    try:
        readers = [engine.submit(greedy(engine, f"Number {i} is", 6)) for i in range(12)]
        assert all(r.text()[1].usage.completion_tokens == 6 for r in readers)
    finally:
        engine.close()


def test_second_turn_prefills_only_the_new_tokens(gemma_engine):
    turn1 = gemma_engine.tokenize("The three primary colors are")
    gen = run_tokens(gemma_engine.submit(greedy(gemma_engine, turn1, 16)))
    follow = gemma_engine.model.tokenize(" Name one more:", add_special=False)
    turn2 = turn1 + gen + follow
    before = gemma_engine.stats.prefilled_tokens
    reader = gemma_engine.submit(greedy(gemma_engine, turn2, 8))
    _, finish = reader.text()
    cached = len(turn1) + len(gen) - 1  # the last sampled token was never fed
    assert finish.usage.cached_tokens == cached
    assert gemma_engine.stats.prefilled_tokens - before == len(turn2) - cached


def test_session_reuse_after_the_session_was_swapped_out(gemma_path):
    engine = make_engine(gemma_path, slots=2)
    try:
        turn1 = engine.tokenize("My favourite animal is the capybara because")
        gen = run_tokens(engine.submit(greedy(engine, turn1, 10)))
        events = engine.events.subscribe()
        for r in [engine.submit(greedy(engine, p, 4)) for p in PROMPTS[:2]]:  # push the session out
            r.text()
        turn2 = turn1 + gen + engine.model.tokenize(" Also,", add_special=False)
        _, finish = engine.submit(greedy(engine, turn2, 4)).text()
        assert finish.usage.cached_tokens == len(turn1) + len(gen) - 1
        swaps = [e for e in iter(lambda: None if events.queue.empty() else events.get(), None)]
        assert any(isinstance(e, Swapped) and e.direction == "resume" for e in swaps)
    finally:
        engine.close()


def test_cancel_frees_the_task_sequence_at_once(gemma_path):
    engine = make_engine(gemma_path, max_sessions=0)
    try:
        reader = engine.submit(greedy(engine, "Count to one thousand: 1, 2, 3,", 400))
        for event in reader:
            if isinstance(event, TokenEvent):
                reader.cancel()
                break
        rest = list(reader)
        assert reader.finish.reason is StopReason.CANCELLED and len(rest) < 400
        _, finish = engine.submit(greedy(engine, "Hello", 3)).text()  # the engine goes on
        assert finish.reason is StopReason.LENGTH
        assert sorted(engine.res.free_seqs) == [0, 1, 2, 3]
    finally:
        engine.close()


def test_task_state_events_in_order(gemma_engine):
    sub = gemma_engine.events.subscribe()
    reader = gemma_engine.submit(greedy(gemma_engine, "Hello there", 3))
    reader.text()
    states = []
    while not sub.queue.empty():
        e = sub.get()
        if isinstance(e, TaskStateChanged) and e.task_id == reader.task_id:
            states.append(e.state)
    sub.close()
    assert states == ["waiting", "prefilling", "decoding", "done"]


def test_prompt_over_the_budget_is_refused(gemma_engine):
    with pytest.raises(InvalidRequest, match="over the context budget"):
        gemma_engine.submit(GenerationRequest(tuple([100] * 5000)))


def test_logprobs_top_n(gemma_engine):
    reader = gemma_engine.submit(greedy(gemma_engine, "The capital of France is", 3, logprobs=3))
    events = [e for e in reader if isinstance(e, TokenEvent) and e.token >= 0]
    for e in events:
        top = e.logprob["top"]
        assert len(top) == 3 and top[0][1] >= top[1][1] >= top[2][1]
        assert e.logprob["token"] == e.token == top[0][0]  # greedy picks the top token
        assert e.logprob["logprob"] <= 0.0


def test_a_failing_step_fails_only_its_tasks(gemma_path, monkeypatch):
    engine = make_engine(gemma_path)
    try:
        real = engine.ctx.decode
        calls = {"n": 0}

        def flaky(batch):
            calls["n"] += 1
            if calls["n"] == 3:
                raise RuntimeError("injected failure")
            return real(batch)

        monkeypatch.setattr(engine.ctx, "decode", flaky)
        _, finish = engine.submit(greedy(engine, "Hello", 10)).text()
        assert finish.reason is StopReason.ERROR and "injected failure" in finish.error
        _, finish = engine.submit(greedy(engine, "Hello", 5)).text()
        assert finish.reason is StopReason.LENGTH
    finally:
        engine.close()


def test_events_handed_over_after_the_next_decode_arrive_whole_and_in_order(gemma_path):
    """With layers offloaded (n_gpu_layers != 0; this CPU build keeps them on the CPU) a step's token
    and finish events reach the readers once the next step's decode is queued: every task still
    gets all its tokens, then its finish, the same tokens as the engine that hands them over at
    once, and pauses, cancels and more tasks than slots lose nothing."""
    ctx = ContextParams(n_ctx=256, n_batch=256, n_seq_max=4, n_threads=2, flash_attn="on")
    cfg = dict(context=ctx, chunk=128, age_bound_s=0.3, quantum_s=0.05)
    alone = {}
    for layers in (0, 99):
        engine = LlamaEngine(str(gemma_path), EngineConfig(**cfg), n_gpu_layers=layers)
        try:
            assert engine._defer_events is (layers != 0)
            alone[layers] = run_tokens(engine.submit(greedy(engine, "Once upon a time", 30)))
            if layers:
                readers = [engine.submit(greedy(engine, p, 60)) for p in PROMPTS * 2]
                doomed = engine.submit(greedy(engine, "The sea", 200))
                engine.cancel(doomed.task_id)
                for reader in readers:
                    events = list(reader)
                    assert isinstance(events[-1], FinishEvent) and all(
                        isinstance(e, TokenEvent) for e in events[:-1]
                    )
                    assert events[-1].reason is StopReason.LENGTH and len(run_tokens(iter(events))) == 60
                assert list(doomed)[-1].reason is StopReason.CANCELLED
                assert engine.stats.pauses > 0 and engine.stats.resumes > 0
        finally:
            engine.close()
    assert alone[0] == alone[99] and len(alone[0]) == 30


def _tokens_alone(path, device: bool, requests) -> tuple[list[list[int]], list, int]:
    """Each request run alone (so every engine decodes the same batches), in an engine that samples
    greedy tasks in the graph (device) or on the host; the tokens, finishes and device-sampled count."""
    engine = make_engine(path, device_sampling=device)
    try:
        assert bool(engine._chains) is device
        runs, finishes = [], []
        for make in requests:
            reader = engine.submit(make(engine))
            runs.append(run_tokens(reader))
            finishes.append(reader.finish)
        return runs, finishes, engine.stats.device_sampled
    finally:
        engine.close()


def test_greedy_tokens_chosen_in_the_graph_are_the_host_argmax(gemma_path):
    """Backend sampling (patch 0010): a greedy task's argmax runs in the graph and only its token
    comes back. The tokens equal the host's argmax of the copied logits, for a prompt and for a
    greedy loop whose guard penalty steps go back to the host (raw logits) and return; a seeded
    sampled task and a logprobs task are sampled on the host from their raw logits in both engines."""
    loop = dict(n=400)  # gemma's greedy loop on this prompt (test_loop_guard): penalty steps, then a stop
    requests = [
        lambda e: greedy(e, "Once upon a time", 40),
        lambda e: greedy(e, "The capital of France is", **loop),
        lambda e: greedy(e, "def fib(n):", 12, temperature=1.5, seed=7),
        lambda e: greedy(e, "The best way to cook rice is", 8, logprobs=2),
    ]
    host, host_fin, host_dev = _tokens_alone(gemma_path, False, requests)
    dev, dev_fin, dev_sampled = _tokens_alone(gemma_path, True, requests)
    assert dev == host and [f.reason for f in dev_fin] == [f.reason for f in host_fin]
    assert host_dev == 0
    assert host[1] != host[0] and len(host[2]) == 12 and len(host[3]) == 8
    # every token of the two plain greedy runs but the loop's penalty steps came from the graph
    greedy_tokens = len(dev[0]) + len(dev[1]) + (dev_fin[1].reason is not StopReason.LENGTH)
    assert 40 < dev_sampled < greedy_tokens, (dev_sampled, greedy_tokens)


def test_device_and_host_sampled_tasks_share_a_batch(gemma_path):
    """Greedy tasks sampled in the graph beside tasks that need raw logits (sampling, logprobs) in
    the same steps: each gets its own kind of token, and only the greedy ones count as device-sampled."""
    engine = make_engine(gemma_path, device_sampling=True)
    try:
        readers = [
            engine.submit(greedy(engine, PROMPTS[0], 20)),
            engine.submit(greedy(engine, PROMPTS[1], 20, temperature=1.0, seed=3)),
            engine.submit(greedy(engine, PROMPTS[2], 20, logprobs=1)),
            engine.submit(greedy(engine, PROMPTS[3], 20)),
        ]
        events = [list(r) for r in readers]
        for evs in events:
            assert evs[-1].reason is StopReason.LENGTH and len(run_tokens(iter(evs))) == 20
        assert all(e.logprob is not None for e in events[2] if isinstance(e, TokenEvent))
        assert engine.stats.device_sampled == 40
        assert engine.metrics()["mc_device_sampled_tokens_total"] == 40
    finally:
        engine.close()


def test_penalties_and_top_k_free_chains_sample(gemma_engine):
    """A chain with repetition / presence penalties (llama.cpp's penalties sampler, whose signature
    here starts with the vocabulary size) and one without top-k both generate their tokens."""
    penalties = dict(repeat_penalty=1.3, presence_penalty=0.5, seed=1)
    penalized = gemma_engine.submit(greedy(gemma_engine, PROMPTS[1], 16, temperature=0.7, **penalties))
    no_top_k = gemma_engine.submit(greedy(gemma_engine, PROMPTS[0], 16, temperature=0.7, top_k=0, seed=2))
    for reader in (penalized, no_top_k):
        events = list(reader)
        assert events[-1].reason is StopReason.LENGTH and len(run_tokens(iter(events))) == 16


def test_patch_0012_samples_greedy_and_sampled_tasks_in_the_graph(gemma_path):
    """device_sampler="mc": greedy tasks get the host argmax's tokens, a seeded sampled task (top-k
    40) is drawn in the graph and replays with its seed, and tasks the sampler cannot take (logprobs,
    penalties, no top-k) go to the host beside them."""
    sampled = dict(temperature=0.9, seed=21)
    requests = [
        lambda e: greedy(e, "Once upon a time", 24),
        lambda e: greedy(e, "def fib(n):", 16, **sampled),
    ]
    host, _, _ = _tokens_alone(gemma_path, False, requests)
    engine = make_engine(gemma_path, device_sampling=True, device_sampler="mc")
    try:
        dev = [run_tokens(engine.submit(make(engine))) for make in requests]
        again = run_tokens(engine.submit(requests[1](engine)))
        assert engine.stats.device_sampled == 24 + 16 + 16
        assert dev[0] == host[0] and len(dev[1]) == 16 and again == dev[1]
        mixed = [
            engine.submit(greedy(engine, PROMPTS[0], 12, logprobs=1)),
            engine.submit(greedy(engine, PROMPTS[1], 12, temperature=0.7, repeat_penalty=1.2, seed=2)),
            engine.submit(greedy(engine, PROMPTS[2], 12, temperature=0.7, top_k=0, seed=3)),
            engine.submit(greedy(engine, PROMPTS[3], 12, **sampled)),
            engine.submit(greedy(engine, PROMPTS[0], 12, top_k=500, top_p=0.0, min_p=1.0)),  # greedy: any
        ]
        for reader in mixed:
            events = list(reader)
            assert events[-1].reason is StopReason.LENGTH and len(run_tokens(iter(events))) == 12
        assert engine.stats.device_sampled == 24 + 16 + 16 + 12 + 12
    finally:
        engine.close()
    with pytest.raises(ValueError, match="device_sampler: must be 'greedy' or 'mc'"):
        make_engine(gemma_path, device_sampler="gpu")


def test_the_repacked_weights_setting_reaches_the_library(gemma_path, monkeypatch):
    """--repacked-weights auto|on|off: the engine config carries it from the settings ("auto" by
    default), and the engine sets the library's MC_MMH_REPACK (3 / 1 / 0) before its model is loaded
    (the library reads it at its first graph evaluation; on this CPU build the CUDA path is absent
    and the same tokens come out). Anything else is refused, naming the field and the values."""
    import os

    from orchestrator.llama_engine import config_from_settings
    from orchestrator.settings import Settings, SettingsError

    assert config_from_settings(Settings(repacked_weights="on")).repacked_weights == "on"
    assert config_from_settings(Settings()).repacked_weights == "auto"
    with pytest.raises(SettingsError, match=r"repacked_weights: must be one of auto, on, off \(got 'yes'\)"):
        Settings.load(env={"MC_REPACKED_WEIGHTS": "yes"})
    monkeypatch.setenv("MC_MMH_REPACK", "0")  # recorded, so the engine's value is undone after the test
    tokens = {}
    for mode, value in (("on", "1"), ("auto", "3"), ("off", "0")):
        engine = make_engine(gemma_path, repacked_weights=mode)
        try:
            assert os.environ.get("MC_MMH_REPACK") == value
            tokens[mode] = run_tokens(engine.submit(greedy(engine, PROMPTS[0], 8)))
        finally:
            engine.close()
    assert tokens["on"] == tokens["auto"] == tokens["off"] and len(tokens["on"]) == 8
    with pytest.raises(ValueError, match="repacked_weights: must be one of auto, on, off"):
        make_engine(gemma_path, repacked_weights=True)
