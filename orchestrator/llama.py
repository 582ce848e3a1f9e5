"""Owned wrappers of llama.cpp objects: model, context, batch, sampler.

Each wrapper owns exactly one native object and frees it in `close()` (also a context manager),
like llama-cpp-python's `_internals.py`. Only the engine thread uses a Context; a Model's
tokenizer functions are read-only and may be called from any thread.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import numpy as np

from orchestrator.backend import BackendError, llama
from orchestrator.types import SamplingParams

KV_TYPES = {"f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "f32": 0}
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}
# llama_token_data: token id, logit, probability
TOKEN_DATA = np.dtype([("id", np.int32), ("logit", np.float32), ("p", np.float32)])
LLAMA_TOKEN_NULL = -1


class _Owned:
    """Base: one native pointer, freed once by `_free`."""

    _ptr = None

    def _free(self, ptr) -> None:
        raise NotImplementedError

    def close(self) -> None:
        if self._ptr is not None:
            ptr, self._ptr = self._ptr, None
            self._free(ptr)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


class Model(_Owned):
    """A loaded GGUF model and its vocabulary."""

    def __init__(self, path: str | Path, n_gpu_layers: int = 0):
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"model file not found: {path}")
        lc = llama()
        params = lc.llama_model_default_params()
        params.n_gpu_layers = n_gpu_layers
        ptr = lc.llama_model_load_from_file(str(path).encode(), params)
        if not ptr:
            raise BackendError(f"llama.cpp could not load {path} (not a GGUF model it supports?)")
        self._ptr = ptr
        self.path = path
        self.vocab = lc.llama_model_get_vocab(ptr)
        self.n_vocab = lc.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = lc.llama_model_n_ctx_train(ptr)

    def _free(self, ptr) -> None:
        llama().llama_model_free(ptr)

    @property
    def ptr(self):
        return self._ptr

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = llama().llama_model_meta_val_str(self._ptr, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if n >= 0 else None

    def description(self) -> str:
        buf = ctypes.create_string_buffer(256)
        llama().llama_model_desc(self._ptr, buf, len(buf))
        return buf.value.decode(errors="replace")

    def chat_template_source(self) -> str | None:
        """The GGUF's Jinja chat template (tokenizer.chat_template), if it has one."""
        raw = llama().llama_model_chat_template(self._ptr, None)
        return raw.decode(errors="replace") if raw else None

    def bos_if_added(self) -> int | None:
        """The BOS token id if tokenizing with add_special puts one first, else None."""
        lc = llama()
        return int(lc.llama_vocab_bos(self.vocab)) if lc.llama_vocab_get_add_bos(self.vocab) else None

    def special_text(self, which: str) -> str:
        """Text of the BOS or EOS token ("bos"/"eos"), "" when the vocabulary has none."""
        if self.meta(f"tokenizer.ggml.{which}_token_id") is None:
            return ""  # llama.cpp would answer a default id the model never set
        lc = llama()
        token = lc.llama_vocab_bos(self.vocab) if which == "bos" else lc.llama_vocab_eos(self.vocab)
        return self.token_bytes(token, special=True).decode(errors="replace") if token >= 0 else ""

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        bos = self.special_text("bos") if add_special and parse_special else ""
        if bos and text.startswith(bos):  # a chat template that writes BOS itself: not twice
            add_special = False
        data = text.encode()
        n_max = len(data) + 16
        buf = (ctypes.c_int32 * n_max)()
        n = llama().llama_tokenize(self.vocab, data, len(data), buf, n_max, add_special, parse_special)
        if n < 0:  # buffer too small: -n is the size needed
            buf = (ctypes.c_int32 * -n)()
            n = llama().llama_tokenize(self.vocab, data, len(data), buf, -n, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama().llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama().llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def is_eog(self, token: int) -> bool:
        return bool(llama().llama_vocab_is_eog(self.vocab, token))

    def apply_chat_template(self, messages: list[dict[str, str]], add_assistant: bool = True) -> str:
        """Format chat messages with llama.cpp's built-in templates (matched from the GGUF's
        template, or by architecture when it has none); orchestrator.chat_template renders the
        GGUF's Jinja template itself and falls back to this.

        Raises ValueError when llama.cpp recognises no template.
        """
        lc = llama()
        tmpl = lc.llama_model_chat_template(self._ptr, None) or self._fallback_template()
        keep = [(m["role"].encode(), m["content"].encode()) for m in messages]
        chat = (lc.llama_chat_message * len(keep))(*[lc.llama_chat_message(r, c) for r, c in keep])
        size = 4096 + 2 * sum(len(c) for _, c in keep)
        buf = ctypes.create_string_buffer(size)
        n = lc.llama_chat_apply_template(tmpl, chat, len(keep), add_assistant, buf, size)
        if n > size:
            buf = ctypes.create_string_buffer(n)
            n = lc.llama_chat_apply_template(tmpl, chat, len(keep), add_assistant, buf, n)
        if n < 0:
            raise ValueError(f"the chat template of {self.path.name} is not supported by llama.cpp")
        return buf.raw[:n].decode(errors="replace")

    @property
    def is_recurrent(self) -> bool:
        """Recurrent or hybrid (qwen35): its per-sequence state cannot be cut back to a shorter prefix."""
        lc = llama()
        return bool(lc.llama_model_is_recurrent(self._ptr) or lc.llama_model_is_hybrid(self._ptr))

    @property
    def n_swa(self) -> int:
        return int(llama().llama_model_n_swa(self._ptr))

    def _fallback_template(self) -> bytes | None:
        """A llama.cpp built-in template by architecture, for GGUFs that carry none
        (the bundled Gemma 3 270M has no tokenizer.chat_template)."""
        arch = self.meta("general.architecture") or ""
        name = next((t for prefix, t in _ARCH_TEMPLATES if arch.startswith(prefix)), None)
        return name.encode() if name else None


_ARCH_TEMPLATES = (("gemma", "gemma"), ("qwen", "chatml"), ("llama", "llama3"))


@dataclass(frozen=True)
class ContextParams:
    """How to create a context: sizes in tokens, KV cache types by name, flash attention mode."""

    n_ctx: int = 4096
    n_batch: int = 512
    n_seq_max: int = 1
    n_threads: int = 2
    flash_attn: str = "auto"
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    kv_unified: bool = True
    yarn_factor: float = 1.0  # > 1: YaRN context extension by this factor over the trained context


class Context(_Owned):
    """A llama.cpp context over a Model: KV cache/recurrent state for up to n_seq_max sequences."""

    def __init__(self, model: Model, params: ContextParams):
        lc = llama()
        cp = lc.llama_context_default_params()
        cp.n_ctx = params.n_ctx
        cp.n_batch = params.n_batch
        cp.n_ubatch = min(params.n_batch, 512)
        cp.n_seq_max = params.n_seq_max
        cp.n_threads = cp.n_threads_batch = params.n_threads
        cp.flash_attn_type = FLASH_ATTN[params.flash_attn]
        cp.type_k = KV_TYPES[params.cache_type_k]
        cp.type_v = KV_TYPES[params.cache_type_v]
        cp.kv_unified = params.kv_unified
        if params.yarn_factor > 1.0:
            cp.rope_scaling_type = 2  # LLAMA_ROPE_SCALING_TYPE_YARN
            cp.rope_freq_scale = 1.0 / params.yarn_factor
            cp.yarn_orig_ctx = model.n_ctx_train
        cp.no_perf = True
        ptr = lc.llama_init_from_model(model.ptr, cp)
        if not ptr:
            raise BackendError(f"llama.cpp could not create a context with {params}")
        self._ptr = ptr
        self.model = model
        self.params = params
        self.n_ctx = lc.llama_n_ctx(ptr)
        self.memory = lc.llama_get_memory(ptr)

    def _free(self, ptr) -> None:
        llama().llama_free(ptr)

    @property
    def ptr(self):
        return self._ptr

    def decode(self, batch: Batch) -> None:
        rc = llama().llama_decode(self._ptr, batch.native)
        if rc != 0:
            raise BackendError(f"llama_decode failed with code {rc} on a batch of {batch.n_tokens} tokens")

    def synchronize(self) -> None:
        """Wait for the device to finish the last decode (llama_decode returns before a GPU is done)."""
        llama().llama_synchronize(self._ptr)

    def logits(self, i: int) -> np.ndarray:
        """Logits of output row i of the last decode, as a float32 view [n_vocab] (copy to keep)."""
        ptr = llama().llama_get_logits_ith(self._ptr, i)
        return np.ctypeslib.as_array(ptr, shape=(self.model.n_vocab,))

    def set_sampler(self, seq_id: int, sampler: _Chain | None) -> bool:
        """Attach a backend sampler chain to `seq_id` (None detaches it); False when llama.cpp cannot
        run it in the graph. Each call makes the next decode reserve the graphs again: attach once."""
        return bool(llama().llama_set_sampler(self._ptr, seq_id, sampler.ptr if sampler else None))

    def set_raw_logits(self, seq_id: int, raw: bool) -> None:
        """Patch 0010: copy `seq_id`'s output rows to the host as raw logits although it has a
        backend sampler (for tasks sampled on the host); changes no graph."""
        if not _raw_logits_fn()(self._ptr, seq_id, raw):
            n = self.params.n_seq_max
            raise BackendError(f"mc_set_raw_logits refused sequence {seq_id} (a context of {n} sequences)")

    def sampled_token(self, i: int) -> int:
        """The token the backend sampler of row i's sequence chose in the last decode."""
        token = int(llama().llama_get_sampled_token_ith(self._ptr, i))
        if token == LLAMA_TOKEN_NULL:
            raise BackendError(f"no backend-sampled token for output row {i}")
        return token

    def clear(self) -> None:
        llama().llama_memory_clear(self.memory, True)

    def seq_rm(self, seq_id: int, p0: int = -1, p1: int = -1) -> bool:
        return bool(llama().llama_memory_seq_rm(self.memory, seq_id, p0, p1))

    def seq_pos_max(self, seq_id: int) -> int:
        """Largest position held for `seq_id`, -1 when empty."""
        return int(llama().llama_memory_seq_pos_max(self.memory, seq_id))

    def state_size(self, seq_id: int) -> int:
        """Bytes of `seq_id`'s state (KV cells and, for recurrent models, the recurrent state)."""
        return int(llama().llama_state_seq_get_size(self._ptr, seq_id))

    def state_save(self, seq_id: int, buf: np.ndarray) -> int:
        """Copy `seq_id`'s state into `buf` (uint8); returns bytes written (0 on failure)."""
        ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        return int(llama().llama_state_seq_get_data(self._ptr, ptr, buf.nbytes, seq_id))

    def state_load(self, seq_id: int, buf: np.ndarray, nbytes: int) -> bool:
        """Restore a saved state into the (empty) sequence `seq_id`; False on failure."""
        ptr = buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        return llama().llama_state_seq_set_data(self._ptr, ptr, nbytes, seq_id) != 0


@cache
def _raw_logits_fn():
    """mc_set_raw_logits (patch 0010) from the loaded libllama."""
    fn = getattr(llama().llama_cpp._lib, "mc_set_raw_logits", None)
    if fn is None:
        raise BackendError("libllama lacks mc_set_raw_logits (patch 0010): run ggml-patches/build.py")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int32, ctypes.c_bool]
    fn.restype = ctypes.c_bool
    return fn


@cache
def _mc_sample_fns() -> dict:
    """mc_sample_init / mc_sample_set / mc_sample_max_k (patch 0012) from the loaded libllama."""
    lib = llama().llama_cpp._lib
    if getattr(lib, "mc_sample_init", None) is None:
        raise BackendError("libllama lacks mc_sample_init (patch 0012): run ggml-patches/build.py")
    smpl_p = llama().llama_sampler_p_ctypes  # llama_cpp's struct llama_sampler *
    lib.mc_sample_init.argtypes, lib.mc_sample_init.restype = [ctypes.c_uint32], smpl_p
    lib.mc_sample_max_k.argtypes, lib.mc_sample_max_k.restype = [], ctypes.c_int32
    f32 = ctypes.c_float
    u32 = ctypes.c_uint32
    lib.mc_sample_set.argtypes = [smpl_p, f32, ctypes.c_int32, f32, f32, u32, u32]
    lib.mc_sample_set.restype = ctypes.c_bool
    return {"init": lib.mc_sample_init, "max_k": lib.mc_sample_max_k, "set": lib.mc_sample_set}


@cache
def _mc_sample_max_k() -> int:
    """The largest top-k patch 0012's sampler takes (a constant of the build; asked once, not per step)."""
    return int(_mc_sample_fns()["max_k"]())


class Batch(_Owned):
    """A llama_batch of up to `capacity` tokens, each for one sequence."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._ptr = llama().llama_batch_init(capacity, 0, 1)  # a struct value owning its arrays
        self.n_tokens = 0

    def _free(self, ptr) -> None:
        llama().llama_batch_free(ptr)

    @property
    def native(self):
        return self._ptr

    def clear(self) -> None:
        self.n_tokens = 0
        self.native.n_tokens = 0

    def add(self, token: int, pos: int, seq_id: int, want_logits: bool) -> int:
        """Append one token; returns its row index in the batch."""
        i = self.n_tokens
        if i >= self.capacity:
            raise IndexError(f"batch is full ({self.capacity} tokens)")
        b = self.native
        b.token[i] = token
        b.pos[i] = pos
        b.n_seq_id[i] = 1
        b.seq_id[i][0] = seq_id
        b.logits[i] = want_logits
        self.n_tokens = b.n_tokens = i + 1
        return i


class _Chain(_Owned):
    """Base: an owned llama.cpp sampler chain."""

    def _free(self, ptr) -> None:
        llama().llama_sampler_free(ptr)

    @property
    def ptr(self):
        return self._ptr


class Sampler(_Chain):
    """A llama.cpp sampler chain built from SamplingParams."""

    def __init__(self, params: SamplingParams, n_vocab: int):
        lc = llama()
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        add = lambda s: lc.llama_sampler_chain_add(chain, s)  # noqa: E731
        if params.has_penalties:
            add(
                lc.llama_sampler_init_penalties(
                    n_vocab,  # this llama.cpp's signature starts with the vocabulary size
                    params.repeat_last_n,
                    params.repeat_penalty,
                    params.frequency_penalty,
                    params.presence_penalty,
                )
            )
        if params.temperature <= 0.0:
            add(lc.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:  # none: no sort of the whole vocabulary (25 ms a token at 262k)
                add(lc.llama_sampler_init_top_k(params.top_k))
            add(lc.llama_sampler_init_top_p(params.top_p, 1))
            add(lc.llama_sampler_init_min_p(params.min_p, 1))
            add(lc.llama_sampler_init_temp(params.temperature))
            add(lc.llama_sampler_init_dist(params.seed if params.seed is not None else 0xFFFFFFFF))
        self._ptr = chain
        self._cand: np.ndarray | None = None  # the candidates array handed to the chain, reused
        self._ids: np.ndarray | None = None
        # the chain starts with top-k (no penalties before it, which may raise a logit): it then
        # needs only the logits of a superset of the top k, found by a threshold below the maximum
        self.top_k_first = params.temperature > 0.0 and params.top_k > 0 and not params.has_penalties
        self._k = params.top_k

    def sample(self, logits: np.ndarray) -> int:
        """Sample (and accept) the next token from `logits` [n_vocab] (an output row of the last
        decode, after the loop guard's penalty). llama_sampler_apply on these logits rather than
        llama_sampler_sample: with backend samplers attached that one returns the device's token."""
        lc = llama()
        ids = self._top_k_superset(logits) if self.top_k_first else None
        if ids is not None:  # a few hundred candidates instead of the vocabulary
            n = ids.shape[0]
            cand = np.empty(n, dtype=TOKEN_DATA)
            cand["id"] = ids
            cand["logit"] = logits[ids]
        else:
            n = logits.shape[0]
            if self._cand is None or self._cand.shape[0] != n:
                self._cand = np.zeros(n, dtype=TOKEN_DATA)
                self._ids = np.arange(n, dtype=np.int32)
            cand = self._cand
            cand["id"] = self._ids
            cand["logit"] = logits
        cand["p"] = 0.0
        arr = lc.llama_token_data_array(
            cand.ctypes.data_as(ctypes.POINTER(lc.llama_token_data)), n, -1, False
        )
        lc.llama_sampler_apply(self._ptr, ctypes.byref(arr))
        if not 0 <= arr.selected < arr.size:
            raise BackendError(f"the sampler chain selected no token (index {arr.selected} of {arr.size})")
        token = int(arr.data[arr.selected].id)
        lc.llama_sampler_accept(self._ptr, token)
        return token

    def _top_k_superset(self, logits: np.ndarray) -> np.ndarray | None:
        """Token ids (ascending) of every logit >= t, where t is the k-th largest of the maxima of
        n groups of 256 logits (group j: j, j + n, j + 2n, ...; one vectorized maximum over 256 rows
        of n): k groups reach t, so at least k logits do, and the top k of these is the top k of
        all (up to ties at the k-th logit): the chain's result is the same. None (the whole
        vocabulary) when there are fewer groups than k, a group holds a NaN, or t is -inf."""
        k, n = self._k, logits.shape[0] // 256
        if n < k:
            return None
        group_max = logits[: n * 256].reshape(256, n).max(axis=0)
        if np.isnan(group_max).any():  # NaN sorts above every number: no k groups are known to reach t
            return None
        t = float(np.partition(group_max, n - k)[n - k])
        if not np.isfinite(t):
            return None
        return np.flatnonzero(logits >= t).astype(np.int32)


class DeviceSampler(_Chain):
    """Patch 0012's backend sampler (mc_sample) in a chain, attached to a sequence for good: top-k
    (at most `max_k()`), top-p, min-p, temperature and the draw run in the graph, with the parameters
    of whichever task holds the sequence set between decodes (`set`); temperature 0 is the argmax."""

    def __init__(self, seed: int = 0):
        lc, fn = llama(), _mc_sample_fns()
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(chain, fn["init"](seed))
        self._ptr = chain
        self._inner = lc.llama_sampler_chain_get(chain, 0)

    @staticmethod
    def max_k() -> int:
        return _mc_sample_max_k()

    @classmethod
    def takes(cls, params: SamplingParams) -> bool:
        """Whether these parameters can be sampled in the graph (no penalties: they need the
        task's history on the host; top-k between 1 and max_k(), or greedy)."""
        if params.has_penalties:
            return False
        return params.temperature <= 0.0 or 1 <= params.top_k <= cls.max_k()

    def set(self, params: SamplingParams, seed: int, skip: int = 0) -> None:
        """The parameters of the task that now holds the sequence; its draws restart from `seed` with
        `skip` draws already taken (a task back on a sequence after a swap continues its stream)."""
        p, set_ = params, _mc_sample_fns()["set"]
        greedy = p.temperature <= 0.0  # the argmax: k 1, whatever top-k, top-p and min-p say
        k, top_p, min_p = (1, 1.0, 0.0) if greedy else (p.top_k, p.top_p, p.min_p)
        if not set_(self._inner, max(p.temperature, 0.0), k, top_p, min_p, seed, skip):
            raise BackendError(f"mc_sample_set refused {params} (top_k 1..{self.max_k()} when sampling)")


class DeviceGreedy(_Chain):
    """A chain of llama.cpp's greedy sampler, attached to a sequence of a Context for backend
    sampling: the argmax of that sequence's logits runs in the graph (on the GPU with layers
    there), and only the token id comes back (Context.sampled_token)."""

    def __init__(self):
        lc = llama()
        chain = lc.llama_sampler_chain_init(lc.llama_sampler_chain_default_params())
        lc.llama_sampler_chain_add(chain, lc.llama_sampler_init_greedy())
        self._ptr = chain
