"""LlamaEngine: many tasks in one llama.cpp context with one unified KV budget.

One thread owns the context. Each step:
    plan = schedule(views)          # orchestrator.scheduler: who pauses, resumes, decodes, prefills
    apply pauses/resumes/admits     # SwapPool <-> llama_state_seq_get/set_data
    one llama_decode                # the next token of every decoding task + prompt chunks
    sample, stream, loop guard      # per task
Finished conversations stay as cached sessions (resident, then swapped or dropped under
pressure), so a next turn that extends one prefills only its new tokens.
"""

from __future__ import annotations

import logging
import os
import queue
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from orchestrator import events as ev
from orchestrator.backend import BackendError, check_backend
from orchestrator.chat_template import ChatTemplate
from orchestrator.engine import Engine, ModelInfo, TaskReader, TextStream
from orchestrator.llama import Batch, Context, ContextParams, DeviceGreedy, DeviceSampler, Model, Sampler
from orchestrator.loop_guard import LoopGuard, LoopGuardConfig
from orchestrator.residency import Residency
from orchestrator.scheduler import Budget, Phase, schedule
from orchestrator.swap import SwapFull, SwapPool
from orchestrator.task import Task, top_logprobs
from orchestrator.types import (
    FinishEvent,
    GenerationRequest,
    InvalidRequest,
    StopReason,
    TaskState,
    TokenEvent,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    context: ContextParams = field(default_factory=ContextParams)  # n_seq_max = slots, n_ctx = budget
    chunk: int = 256  # most prompt tokens of one task per step
    age_bound_s: float = 2.0
    quantum_s: float = 0.5
    swap_ram_bytes: int = 8 << 30
    swap_dir: Path | None = None
    swap_prealloc_bytes: int = 0  # host memory reserved at start for paused states (SwapPool arena)
    max_sessions: int = 32  # finished conversations kept for reuse
    loop_guard: LoopGuardConfig = field(default_factory=LoopGuardConfig)
    max_queue: int = 256  # open tasks beyond which submit() refuses (HTTP 503)
    # greedy tasks' argmax in the graph (llama.cpp backend sampling, patch 0010): only token ids
    # come back instead of every row's logits; None: on when the layers run on a GPU
    device_sampling: bool | None = None
    # what runs in the graph: "greedy" (llama.cpp's argmax chain: greedy tasks only) or "mc" (patch
    # 0012: greedy tasks and sampled ones with top-k 1..64 and no penalties). H200, 27B, 12 tasks
    # (bench/results/2026-11-30-h200-repacked.json): sampled tasks 560.0 tok/s with "mc" against
    # 520.1 with their chains on the host, but greedy tasks 572.1 against the argmax chain's 731.6
    # (its in-graph top-k over 248,320 logits adds ~2.2 ms a step): so "greedy" stays the default
    device_sampler: str = "greedy"
    # threads that run several tasks' sampler chains at once (llama.cpp's calls and numpy's large
    # loops release the GIL). H200 host (32 cores), 12 sampled tasks: 4.53 against 5.11 ms of host
    # work a step in one run, 7.43 against 5.43 (slower) in another; a 2-core CPU: 5.7 against 5.0 ms
    # (slower). 0: min(slots, CPU cores) with at least 4 cores, else 1; 1: one after the other on
    # the engine thread
    sampling_threads: int = 0
    # patch 0015: the 4-16-column products on a copy of the Q4_0 weights laid out for the tensor
    # cores; as much GPU memory again as those weights. "auto" (MC_MMH_REPACK=3): each copy only
    # while a quarter of the GPU's memory stays free after it; "on" (1): while 1/16 does; "off" (0).
    # H200, 27B, 12 tasks: 745.4 tok/s off, 934.9 auto (bench/results/2026-11-30-h200-auto.json). The
    # library reads the setting at its first graph evaluation in the process, so it acts only if set
    # before that
    repacked_weights: str = "auto"


# EngineConfig.repacked_weights -> the library's MC_MMH_REPACK (patch 0015)
REPACK_MODES = {"auto": "3", "on": "1", "off": "0"}


def context_from_settings(settings) -> ContextParams:
    """The llama.cpp context the settings ask for (orchestrator.settings.Settings)."""
    return ContextParams(
        n_ctx=settings.ctx,
        n_batch=settings.batch,
        n_seq_max=settings.slots,
        n_threads=settings.threads,
        flash_attn=settings.flash_attn,
        cache_type_k=settings.cache_type_k,
        cache_type_v=settings.cache_type_v,
        yarn_factor=settings.yarn_factor,
    )


def config_from_settings(settings) -> EngineConfig:
    """EngineConfig from the settings schema (orchestrator.settings.Settings)."""
    import psutil

    from orchestrator.models import cache_dir

    swap_ram = settings.swap_ram_mb << 20 or psutil.virtual_memory().available // 2
    swap_dir = None if settings.swap_dir == "none" else Path(settings.swap_dir or cache_dir() / "swap")
    context = context_from_settings(settings)
    guard = LoopGuardConfig(
        settings.loop_guard,
        settings.loop_window,
        settings.loop_min_period,
        settings.loop_repeats,
        settings.loop_penalty_step,
        settings.loop_penalty_cap,
    )
    return EngineConfig(
        context,
        chunk=min(settings.chunk, settings.batch),
        age_bound_s=settings.age_bound_s,
        quantum_s=settings.quantum_s,
        swap_ram_bytes=swap_ram,
        swap_dir=swap_dir,
        swap_prealloc_bytes=min(settings.swap_prealloc_mb << 20, swap_ram),
        max_sessions=settings.max_sessions,
        loop_guard=guard,
        max_queue=settings.max_queue,
        repacked_weights=settings.repacked_weights,
    )


def _want_pinned(n_gpu_layers: int) -> bool:
    """Page-locked swap buffers when the model runs on a CUDA GPU and torch can pin memory."""
    from orchestrator.backend import build_info

    if n_gpu_layers == 0 or build_info().backend != "cuda":
        return False
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False


@dataclass
class EngineStats:
    """Running counters (engine thread writes; readers take a copy)."""

    steps: int = 0
    decoded_tokens: int = 0  # generated tokens fed back (decode rows)
    prefilled_tokens: int = 0  # prompt tokens decoded
    reused_tokens: int = 0  # prompt tokens taken from cached sessions instead
    pauses: int = 0
    resumes: int = 0
    loop_actions: int = 0
    device_sampled: int = 0  # tokens chosen by the backend sampler in the graph


class EngineBusy(InvalidRequest):
    def __init__(self, message: str):
        super().__init__("engine", message, status=503)


class LlamaEngine(Engine):
    def __init__(self, model_path: str, config: EngineConfig, n_gpu_layers: int = 0, model_id: str = ""):
        if config.device_sampler not in ("greedy", "mc"):
            raise ValueError(f"device_sampler: must be 'greedy' or 'mc' (got {config.device_sampler!r})")
        if config.sampling_threads < 0:
            raise ValueError(f"sampling_threads: must be >= 0 (got {config.sampling_threads})")
        if config.repacked_weights not in REPACK_MODES:
            allowed = ", ".join(REPACK_MODES)
            raise ValueError(f"repacked_weights: must be one of {allowed} (got {config.repacked_weights!r})")
        check_backend()
        self.cfg = config
        # before the first graph evaluation (the library reads it once; a CPU build ignores it)
        os.environ["MC_MMH_REPACK"] = REPACK_MODES[config.repacked_weights]
        self.model = Model(model_path, n_gpu_layers)
        self.ctx = Context(self.model, config.context)
        self.batch = Batch(config.context.n_batch)
        self._chat = ChatTemplate(self.model)
        self.swap = SwapPool(
            config.swap_ram_bytes,
            config.swap_dir,
            pinned=_want_pinned(n_gpu_layers),
            prealloc_bytes=config.swap_prealloc_bytes,
        )
        self._events = ev.EventBus()
        self.stats = EngineStats()
        slots = config.context.n_seq_max
        self.budget = Budget(slots, self.ctx.n_ctx, config.context.n_batch, config.chunk,
                             config.age_bound_s, config.quantum_s)  # fmt: skip
        self._info = ModelInfo(model_id or self.model.path.stem, str(model_path), self.ctx.n_ctx,
                               self.model.n_vocab, int(time.time()))  # fmt: skip
        self.res = Residency(self.ctx, self.swap, self.events, slots, config.max_sessions)
        self._tasks: dict[int, Task] = {}
        self._inbox: queue.Queue = queue.Queue()
        self._n_open = 0
        self._lock = threading.Lock()
        self._running = True
        self._window = (time.monotonic(), 0, 0)
        # a step's events for the readers; with layers on a GPU they are handed over once the next
        # step's decode is queued on the device: waking a reader thread costs the engine thread the
        # interpreter lock for a while, which then overlaps the device's work instead of delaying
        # the next decode
        self._outbox: list[tuple[TaskReader, TokenEvent | FinishEvent]] = []
        self._defer_events = n_gpu_layers != 0  # on the CPU llama_decode computes the step itself
        self._slot_view: list[dict] = []
        self._chains: list[DeviceGreedy | DeviceSampler] = []  # a backend chain per sequence, attached once
        self._raw: dict[int, bool] = {}  # sequence -> its rows come back as raw logits (patch 0010)
        self._holder: dict[int, int] = {}  # sequence -> the task whose parameters its DeviceSampler has
        self._mc = config.device_sampler == "mc"
        use_device = config.device_sampling if config.device_sampling is not None else n_gpu_layers != 0
        if use_device:
            self._attach_device_chains(slots)
        cores = os.cpu_count() or 1
        n_pick = config.sampling_threads or (min(slots, cores) if cores >= 4 else 1)
        self._pick_pool = ThreadPoolExecutor(n_pick, thread_name_prefix="mc-sample") if n_pick > 1 else None
        self._last_throughput: dict = {}
        self._thread = threading.Thread(target=self._loop, name="mc-engine", daemon=True)
        self._thread.start()
        log.info("engine: %d slots, %d KV cells, batch %d, chunk %d", slots, self.ctx.n_ctx,
                 config.context.n_batch, config.chunk)  # fmt: skip

    # ---- the Engine interface (any thread) -------------------------------------------------

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def events(self) -> ev.EventBus:
        return self._events

    def metrics(self) -> dict[str, float]:
        with self._lock:
            slots, last = list(self._slot_view), dict(self._last_throughput)
        where = [s["where"] for s in slots]
        st = self.stats
        return {
            "mc_generated_tokens_total": st.decoded_tokens,
            "mc_prefilled_tokens_total": st.prefilled_tokens,
            "mc_reused_prompt_tokens_total": st.reused_tokens,
            "mc_steps_total": st.steps,
            "mc_pauses_total": st.pauses,
            "mc_resumes_total": st.resumes,
            "mc_loop_guard_actions_total": st.loop_actions,
            "mc_device_sampled_tokens_total": st.device_sampled,
            "mc_tokens_per_second": last.get("tok_s", 0.0),
            "mc_prefill_tokens_per_second": last.get("prefill_tok_s", 0.0),
            "mc_tasks_running": where.count("resident"),
            "mc_tasks_waiting": where.count("waiting"),
            "mc_tasks_paused": where.count("swapped"),
            "mc_slots_total": self.budget.n_slots,
            "mc_kv_cells_total": self.budget.n_cells,
            "mc_kv_cells_used": sum(s["cells"] for s in slots),
            "mc_swap_bytes": self.swap.ram_bytes + self.swap.disk_bytes,
            "mc_swap_disk_bytes": self.swap.disk_bytes,
            "mc_swap_arena_bytes": self.swap.arena_bytes,
            "mc_swap_allocations_total": self.swap.grown,
            "mc_cached_sessions": len(self.res.sessions),
        }

    def tokenize(self, text: str) -> list[int]:
        return self.model.tokenize(text)

    def token_text(self, token: int) -> str:
        return self.model.token_bytes(token, special=True).decode("utf-8", errors="replace")

    def chat_prompt(self, messages: list[dict[str, str]]) -> str:
        return self._chat.render(messages)

    def submit(self, request: GenerationRequest) -> TaskReader:
        if len(request.prompt_tokens) + 1 > self.ctx.n_ctx:
            raise InvalidRequest(
                "prompt",
                f"is {len(request.prompt_tokens)} tokens, over the context budget of {self.ctx.n_ctx}",
            )
        with self._lock:
            if self._n_open >= self.cfg.max_queue:
                raise EngineBusy(f"{self._n_open} tasks are open, the most this engine queues")
            self._n_open += 1
        reader = TaskReader(request.task_id, self)
        self._inbox.put(("submit", request, reader))
        return reader

    def cancel(self, task_id: int) -> None:
        self._inbox.put(("cancel", task_id, None))

    def pause(self, task_id: int) -> None:
        """Swap a resident task out at the next step (for agents parked on purpose, and for tests);
        the scheduler resumes it like any paused task."""
        self._inbox.put(("pause", task_id, None))

    def close(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(("stop", None, None))
            self._thread.join()
        if self._pick_pool is not None:
            self._pick_pool.shutdown(wait=True)
        self.swap.close()
        self.batch.close()
        self.ctx.close()
        for chain in self._chains:  # after the context that used them
            chain.close()
        self.model.close()

    def slots(self) -> list[dict]:
        """Every open task: id, state, tokens, resident or swapped, seconds since it last changed."""
        with self._lock:
            return list(self._slot_view)

    # ---- the engine thread -----------------------------------------------------------------

    def _loop(self) -> None:
        while self._running:
            self._drain_inbox(block=not self._tasks)
            if self._tasks:
                try:
                    self._step()
                except Exception:  # a bug in the step itself: fail what was running, keep serving
                    log.exception("engine step failed")
                    for task in [t for t in self._tasks.values() if t.phase is Phase.RESIDENT]:
                        self._finish(task, StopReason.ERROR, "engine step failed (see server log)")
            if not self._tasks:  # no next step to wait for
                self._flush_outbox()
            self._publish_views()
        self._flush_outbox()

    def _drain_inbox(self, block: bool) -> None:
        try:
            item = self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, a, b = item
            if kind == "submit":
                self._add_task(a, b)
            elif kind == "cancel" and a in self._tasks:
                self._finish(self._tasks[a], StopReason.CANCELLED)
            elif kind == "pause" and a in self._tasks and self._tasks[a].phase is Phase.RESIDENT:
                self._pause(a, time.monotonic())
            elif kind == "stop":
                self._running = False
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _add_task(self, request: GenerationRequest, reader: TaskReader) -> None:
        now = time.monotonic()
        stream = TextStream(self.model, request.sampling.stop)
        seed = request.sampling.seed
        task = Task(
            request,
            reader,
            list(request.prompt_tokens),
            stream,
            LoopGuard(self.cfg.loop_guard),
            now,
            created=now,
            device_seed=seed if seed is not None else random.getrandbits(32),
        )
        self._tasks[task.id] = task
        self.events.publish(ev.TaskStateChanged(task.id, TaskState.WAITING.value))

    def _step(self) -> None:
        now = time.monotonic()
        for task in [t for t in self._tasks.values() if t.n_past + 1 + t.prefill_left > self.ctx.n_ctx]:
            self._finish(task, StopReason.LENGTH)
        views = [t.view() for t in self._tasks.values()] + [s.view() for s in self.res.resident_sessions()]
        plan = schedule(views, self.budget, now)
        if plan.pause or plan.resume:  # swaps take tens of ms: hand the last step's tokens over first
            self._flush_outbox()
        for tid in plan.pause:
            self._pause(tid, now)
        for tid in plan.resume:
            self._resume(self._tasks[tid], now)
        for tid in plan.admit:
            self._admit(self._tasks[tid], now)
        rows = self._fill_batch(plan)
        if self.batch.n_tokens == 0:
            self._flush_outbox()
            return
        if not self._defer_events:
            self._flush_outbox()
        try:
            self.ctx.decode(self.batch)
        except Exception as exc:  # fails only the tasks of this batch
            in_batch = [self._tasks[tid] for tid in [*plan.decode, *plan.prefill] if tid in self._tasks]
            log.exception("llama_decode failed for tasks %s", [t.id for t in in_batch])
            for task in in_batch:
                self._finish(task, StopReason.ERROR, f"decode failed: {exc}")
            self._flush_outbox()
            return
        self._flush_outbox()  # the last step's tokens, while the device runs this one
        self.stats.steps += 1
        self._after_decode(rows)
        self._maybe_throughput()

    def _attach_device_chains(self, slots: int) -> None:
        """A backend chain on every sequence, once (each attach reserves the graphs again): the argmax
        (DeviceGreedy) or patch 0012's sampler (DeviceSampler, its parameters set per task); tasks
        sampled on the host ask for raw logits per step (Context.set_raw_logits)."""
        for seq in range(slots):
            chain = DeviceSampler() if self._mc else DeviceGreedy()
            self._chains.append(chain)
            if not self.ctx.set_sampler(seq, chain):
                log.warning("no backend sampling (sequence %d): every token is chosen on the host", seq)
                for s in range(seq + 1):
                    self.ctx.set_sampler(s, None)
                for c in self._chains:
                    c.close()
                self._chains = []
                return
            self._raw[seq] = False
        log.info("tokens chosen in the graph (%s, %d sequences)", "mc" if self._mc else "argmax", slots)

    def _on_device(self, task: Task) -> bool:
        """Whether this step's token of `task` is chosen in the graph (the argmax, or with
        device_sampler "mc" a draw); else its row comes back as raw logits (sampling on the host,
        logprobs, or a loop-guard penalty to apply first)."""
        if not self._chains:
            return False
        sp = task.request.sampling
        takes = DeviceSampler.takes(sp) if self._mc else sp.is_greedy
        on_device = takes and sp.logprobs is None and not task.guard.penalizing()
        if on_device and self._mc and self._holder.get(task.seq) != task.id:
            try:
                self._chains[task.seq].set(sp, task.device_seed, task.n_generated)
                self._holder[task.seq] = task.id
            except BackendError:  # takes() and mc_sample_set disagree: sample on the host instead
                log.exception("task %d: sampling on the host", task.id)
                self._holder.pop(task.seq, None)
                on_device = False
        if self._raw[task.seq] == on_device:
            self.ctx.set_raw_logits(task.seq, not on_device)
            self._raw[task.seq] = not on_device
        return on_device

    def _fill_batch(self, plan) -> list[tuple[Task, int, bool]]:
        self.batch.clear()
        rows = []
        for tid in plan.decode:
            task = self._tasks[tid]
            row = self.batch.add(task.tokens[task.n_past], task.n_past, task.seq, True)
            rows.append((task, row, self._on_device(task)))
            task.n_past += 1
            self.stats.decoded_tokens += 1
        for tid, n in plan.prefill.items():
            task = self._tasks[tid]
            n = min(n, task.prefill_left)  # admission may have taken over a cached session's prefix
            for pos in range(task.n_past, task.n_past + n):
                last = pos == task.n_prompt - 1
                row = self.batch.add(task.tokens[pos], pos, task.seq, last)
                if last:
                    rows.append((task, row, self._on_device(task)))
            task.n_past += n
            self.stats.prefilled_tokens += n
            self._set_state(task, TaskState.PREFILLING)
        return rows

    def _after_decode(self, rows: list[tuple[Task, int, bool]]) -> None:
        """Each output row's token, then each task takes its own in batch order. A token comes from
        the graph (greedy on the device), an argmax on the host, or the task's sampler chain; the
        chains of two or more tasks run at once on the sampling threads. The logits rows are fetched
        here first (llama_get_logits_ith is not thread-safe); they stay valid until the next decode."""
        picks: dict[int, tuple[int, dict | None] | Exception] = {}
        chained: list[tuple[Task, np.ndarray]] = []
        for task, row, on_device in rows:
            if task.id not in self._tasks:
                continue
            try:
                if on_device:  # the argmax ran in the graph
                    picks[task.id] = (self.ctx.sampled_token(row), None)
                    self.stats.device_sampled += 1
                    continue
                logits = self.ctx.logits(row)
                sp = task.request.sampling
                if sp.is_greedy:  # an argmax: cheaper here than a thread's hand-over
                    picks[task.id] = self._pick(task, logits)
                    continue
                if task.sampler is None:
                    task.sampler = Sampler(sp, self.model.n_vocab)
                chained.append((task, logits))
            except Exception as exc:
                picks[task.id] = exc
        if self._pick_pool is not None and len(chained) > 1:
            futures = [(task, self._pick_pool.submit(self._pick, task, logits)) for task, logits in chained]
            for task, fut in futures:
                picks[task.id] = fut.result()
        else:
            for task, logits in chained:
                picks[task.id] = self._pick(task, logits)
        for task, _, _ in rows:
            if task.id in picks and task.id in self._tasks:
                self._take(task, picks[task.id])

    @staticmethod
    def _pick(task: Task, logits: np.ndarray) -> tuple[int, dict | None] | Exception:
        """A host-sampled task's token (and logprobs) from its logits row; any thread, one task each."""
        try:
            sp = task.request.sampling
            raw = logits.copy() if sp.logprobs is not None else None  # logprobs of the model itself
            task.guard.apply(logits)
            # greedy: an argmax here (llama.cpp's greedy chain would sort the whole vocabulary)
            token = int(logits.argmax()) if sp.is_greedy else task.sampler.sample(logits)
            return token, (top_logprobs(raw, token, sp.logprobs) if raw is not None else None)
        except Exception as exc:
            return exc

    def _take(self, task: Task, pick: tuple[int, dict | None] | Exception) -> None:
        try:
            if isinstance(pick, Exception):
                raise pick
            token, logprob = pick
            sp = task.request.sampling
            task.tokens.append(token)
            task.n_generated += 1
            self._set_state(task, TaskState.DECODING)
            if self.model.is_eog(token):
                return self._finish(task, StopReason.STOP)
            text = task.stream.push(token)
            self._outbox.append((task.reader, TokenEvent(task.id, token, text, logprob)))
            action = task.guard.observe(token, text)
            if action is not None:
                self.stats.loop_actions += 1
                self.events.publish(ev.LoopGuardAction(task.id, action.action, action.period, action.penalty))
                if action.action == "stop":
                    return self._finish(task, StopReason.LOOP)
            if task.stream.stopped:
                return self._finish(task, StopReason.STOP)
            if task.n_generated >= sp.max_tokens:
                return self._finish(task, StopReason.LENGTH)
        except Exception as exc:
            log.exception("task %d failed after its step", task.id)
            self._finish(task, StopReason.ERROR, str(exc))
        return None

    # ---- residency: admit, pause, resume, finish --------------------------------------------

    def _admit(self, task: Task, now: float) -> None:
        self.stats.reused_tokens += self.res.admit(task, now)
        self._set_state(task, TaskState.PREFILLING)

    def _pause(self, tid: int, now: float) -> None:
        holder = self._tasks.get(tid) or self.res.session(tid)
        try:
            self.res.pause(holder, now)
        except SwapFull as exc:  # only for tasks: sessions are dropped instead
            log.error("cannot pause task %d: %s", tid, exc)
            self._finish(holder, StopReason.ERROR, f"cannot pause: {exc}")
            return
        self.stats.pauses += 1
        if holder.reader is not None:
            self._set_state(holder, TaskState.PAUSED)

    def _resume(self, task: Task, now: float) -> None:
        if not self.res.resume(task, now):
            self._finish(task, StopReason.ERROR, "restoring its saved state failed")
            return
        self.stats.resumes += 1
        self._set_state(task, TaskState.DECODING if task.prefill_left == 0 else TaskState.PREFILLING)

    def _finish(self, task: Task, reason: StopReason, error: str | None = None) -> None:
        tail = task.stream.flush()
        if tail and reason is not StopReason.CANCELLED:
            self._outbox.append((task.reader, TokenEvent(task.id, -1, tail)))
        reader, finish = task.reader, FinishEvent(task.id, reason, task.usage(), error)
        del self._tasks[task.id]
        with self._lock:
            self._n_open -= 1
        if reason in (StopReason.STOP, StopReason.LENGTH, StopReason.LOOP):
            self.res.keep_session(task)
        else:
            self.res.drop(task)
        self._set_state(task, TaskState.DONE, reason)
        self._outbox.append((reader, finish))  # last: the task's cells are free when its reader sees the end

    def _flush_outbox(self) -> None:
        out, self._outbox = self._outbox, []
        for reader, event in out:
            reader.put(event)

    # ---- events and views ------------------------------------------------------------------

    def _set_state(self, task: Task, state: TaskState, reason: StopReason | None = None) -> None:
        if task.state is not state:
            task.state = state
            self.events.publish(ev.TaskStateChanged(task.id, state.value, reason.value if reason else None))

    def _maybe_throughput(self) -> None:
        t0, dec0, pre0 = self._window
        now = time.monotonic()
        if now - t0 < 1.0:
            return
        tasks = list(self._tasks.values())
        count = {p: sum(t.phase is p for t in tasks) for p in Phase}
        event = ev.Throughput(
            (self.stats.decoded_tokens - dec0) / (now - t0),
            (self.stats.prefilled_tokens - pre0) / (now - t0),
            count[Phase.RESIDENT],
            count[Phase.WAITING],
            count[Phase.PAUSED],
            self.swap.ram_bytes + self.swap.disk_bytes,
        )
        self.events.publish(event)
        with self._lock:
            self._last_throughput = {"tok_s": event.tok_s, "prefill_tok_s": event.prefill_tok_s}
        self._window = (now, self.stats.decoded_tokens, self.stats.prefilled_tokens)

    def _publish_views(self) -> None:
        now = time.monotonic()
        view = [
            {
                "task_id": t.id,
                "state": t.state.value,
                "prompt_tokens": t.n_prompt,
                "generated_tokens": t.n_generated,
                "cells": t.n_past if t.phase is Phase.RESIDENT else 0,
                "where": {Phase.RESIDENT: "resident", Phase.PAUSED: "swapped"}.get(t.phase, "waiting"),
                "seq": t.seq,
                "age_s": round(now - t.created, 3),
            }
            for t in self._tasks.values()
        ]
        with self._lock:
            self._slot_view = view
