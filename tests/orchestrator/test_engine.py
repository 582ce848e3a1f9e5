"""The engine serving one task at a time on the real bundled Gemma 3 270M, and its text streaming."""

from __future__ import annotations

import pytest

from orchestrator.engine import TextStream
from orchestrator.llama import ContextParams
from orchestrator.llama_engine import EngineConfig, LlamaEngine
from orchestrator.types import GenerationRequest, InvalidRequest, SamplingParams, StopReason, TokenEvent


@pytest.fixture(scope="module")
def engine(gemma_path):
    ctx = ContextParams(n_ctx=1024, n_batch=128, n_seq_max=1)
    eng = LlamaEngine(str(gemma_path), EngineConfig(context=ctx, max_sessions=0), model_id="gemma3-270m")
    yield eng
    eng.close()


def _greedy(engine, prompt: str, **kw):
    sp = SamplingParams(temperature=0.0, **kw)
    return engine.submit(GenerationRequest(tuple(engine.tokenize(prompt)), sp))


def test_generates_real_text_deterministically(engine):
    a, fa = _greedy(engine, "The capital of France is", max_tokens=12).text()
    b, _ = _greedy(engine, "The capital of France is", max_tokens=12).text()
    assert a == b
    assert "capital" in a  # Gemma 270M's known greedy continuation
    assert fa.reason is StopReason.LENGTH
    assert fa.usage.completion_tokens == 12
    assert fa.usage.prompt_tokens == len(engine.tokenize("The capital of France is"))


def test_stop_string_ends_with_stop_and_is_cut(engine):
    full, _ = _greedy(engine, "The capital of France is", max_tokens=12).text()
    stop = full.strip().split()[2]
    text, finish = _greedy(engine, "The capital of France is", max_tokens=12, stop=(stop,)).text()
    assert finish.reason is StopReason.STOP
    assert stop not in text
    assert full.startswith(text)


def test_sampling_with_a_seed_is_reproducible(engine):
    def run():
        sp = SamplingParams(temperature=1.0, seed=42, max_tokens=16)
        return engine.submit(GenerationRequest(tuple(engine.tokenize("Once upon a time")), sp)).text()[0]

    assert run() == run()


def test_cancel_stops_the_task_and_the_engine_keeps_serving(engine):
    reader = _greedy(engine, "Count from one to a thousand:", max_tokens=500)
    for event in reader:
        if isinstance(event, TokenEvent):
            reader.cancel()
            break
    rest = list(reader)
    assert reader.finish.reason is StopReason.CANCELLED
    assert len(rest) < 500
    text, finish = _greedy(engine, "The capital of France is", max_tokens=4).text()
    assert finish.reason is StopReason.LENGTH and text


def test_prompt_over_the_context_budget_is_refused(engine):
    with pytest.raises(InvalidRequest, match="over the context budget of 1024") as exc:
        engine.submit(GenerationRequest(tuple([100] * 2000)))
    assert exc.value.field == "prompt"


def test_chat_prompt_uses_the_gemma_turn_format(engine):
    prompt = engine.chat_prompt([{"role": "user", "content": "hi"}])
    assert prompt == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n"


class _FakeModel:
    """token id -> bytes, for the text stream alone."""

    def __init__(self, pieces: dict[int, bytes]):
        self.pieces = pieces

    def token_bytes(self, token: int) -> bytes:
        return self.pieces[token]


def test_text_stream_holds_back_a_stop_string_split_across_tokens():
    stream = TextStream(_FakeModel({1: b"hello EN", 2: b"D more"}), ("END",))
    assert stream.push(1) == "hello "
    assert stream.push(2) == ""
    assert stream.stopped


def test_text_stream_releases_a_false_stop_prefix():
    stream = TextStream(_FakeModel({1: b"EN", 2: b"Gland"}), ("END",))
    assert stream.push(1) == ""
    assert stream.push(2) == "ENGland"
    assert not stream.stopped


def test_text_stream_waits_for_complete_utf8():
    euro = "€".encode()
    stream = TextStream(_FakeModel({1: euro[:1], 2: euro[1:]}), ())
    assert stream.push(1) == ""
    assert stream.push(2) == "€"


@pytest.mark.parametrize(
    ("field", "kwargs"),
    [("temperature", {"temperature": -1}), ("top_p", {"top_p": 2}), ("max_tokens", {"max_tokens": 0})],
)
def test_sampling_params_name_the_bad_field(field, kwargs):
    with pytest.raises(InvalidRequest) as exc:
        SamplingParams(**kwargs)
    assert exc.value.field == field
    assert "must be between" in str(exc.value)
