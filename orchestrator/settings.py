"""One settings schema: every setting declared once with type, default, allowed values and help.

The CLI flags, the `MC_*` environment variables and the TOML config file are read through
`Settings`' fields; "copy as command" text and TOML are written from them (orchestrator.commands),
and the launcher builds its widgets and "?" help from the same declarations.
Environment variables are read here and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

ENV_PREFIX = "MC_"


class SettingsError(ValueError):
    """A setting has a bad value; the message names the setting and the allowed values."""


def setting(default, help: str, *, lo=None, hi=None, choices=None, secret: bool = False):
    """Declare one setting: its default, help paragraph and allowed range or choices."""
    meta = {"help": help, "lo": lo, "hi": hi, "choices": choices, "secret": secret}
    return field(default=default, metadata=meta)


KV_CACHE_TYPES = ("f16", "bf16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1")


@dataclass(frozen=True)
class Settings:
    model: str = setting(
        "auto",
        "Which model to serve: a path to a .gguf file, or a registry name (gemma3-270m, qwen3.8-27b-mc-q4_0, "
        "qwen3.8-27b-mc (Q4_K_M), qwen3.8-27b-mc-q8_0, tiny-qwen35). 'auto' picks the Qwen3.8 27B MC weights "
        "at Q4_0 on a CUDA build with a GPU (the format the patched GPU kernels run; Q4_K_M is closer to "
        "BF16 but runs llama.cpp's stock kernels), and the bundled Gemma 3 270M otherwise.",
    )
    ctx: int = setting(
        8192,
        "The context budget in tokens: room for the prompt and the answer of a request. "
        "More needs more memory (about 64 KiB per token for Qwen3.8 27B at f16 KV).",
        lo=256,
        hi=16_777_216,
    )
    slots: int = setting(
        12,
        "How many tasks run at once in the shared context (llama.cpp sequences). More tasks can be "
        "open: the rest wait, or wait paused in RAM, and are rotated in fairly.",
        lo=1,
        hi=256,
    )
    chunk: int = setting(
        256,
        "Most prompt tokens of one task processed per step, so a long prompt never freezes the "
        "tasks that are already answering.",
        lo=1,
        hi=65_536,
    )
    batch: int = setting(
        512,
        "How many prompt tokens are processed in one step. Larger is faster for long prompts "
        "and uses more memory for the step's buffers.",
        lo=16,
        hi=65_536,
    )
    threads: int = setting(
        os.cpu_count() or 2,
        "CPU threads for the parts of the model computed on the CPU (all of it without a GPU).",
        lo=1,
        hi=1024,
    )
    gpu_layers: int = setting(
        999,
        "How many layers to put on the GPU; 999 means all of them. Ignored on a CPU build.",
        lo=0,
        hi=999,
    )
    repacked_weights: str = setting(
        "auto",
        "GPU only: a second copy of the Q4_0 weights laid out for the tensor cores, which runs the "
        "steps of 4-16 tokens (many tasks at once, draft verification) faster (H200, Qwen3.8 27B: 12 "
        "tasks +25% tokens/s, a 16-token verify 27% shorter). Costs as much GPU memory again as those "
        "weights (about 14.4 GB for the 27B). 'auto': a matrix is copied only while a quarter of the "
        "GPU memory stays free after it (all of them on a 141 GB H200, few or none on a 32 GB card); "
        "'on': while 1/16 of it (at least 1 GiB) stays free; 'off': no copies. Read once per process.",
        choices=("auto", "on", "off"),
    )
    flash_attn: str = setting(
        "auto",
        "Flash attention: 'on' is faster and needed for quantized V cache; 'auto' lets llama.cpp decide.",
        choices=("auto", "on", "off"),
    )
    cache_type_k: str = setting(
        "f16",
        "Number format of the attention keys kept for every token. q8_0 halves the memory with "
        "almost no quality loss; q4_0 quarters it with some loss.",
        choices=KV_CACHE_TYPES,
    )
    cache_type_v: str = setting(
        "f16",
        "Number format of the attention values kept for every token (quantized types need flash attention).",
        choices=KV_CACHE_TYPES,
    )
    yarn_factor: float = setting(
        1.0,
        "Stretch the model's trained context with YaRN by this factor (Qwen3.8 27B: 262,144 tokens "
        "native, 4 gives about 1M). 1 turns it off. Costs a little quality on short prompts; the MC "
        "weights' metadata shows how much for each factor.",
        lo=1.0,
        hi=8.0,
    )
    temperature: float = setting(
        0.7,
        "Default sampling temperature for requests that do not set one: 0 always picks the most "
        "likely token, higher is more varied.",
        lo=0.0,
        hi=5.0,
    )
    top_p: float = setting(
        0.95,
        "Default nucleus sampling: keep the likeliest tokens up to this total probability.",
        lo=0.0,
        hi=1.0,
    )
    top_k: int = setting(
        40, "Default: sample among this many likeliest tokens only (0: all).", lo=0, hi=1_000_000
    )
    min_p: float = setting(
        0.05, "Default: drop tokens less likely than this fraction of the likeliest one.", lo=0.0, hi=1.0
    )
    repeat_penalty: float = setting(
        1.0,
        "Default repetition penalty on recent tokens (1: none; the loop guard acts on its own).",
        lo=0.0,
        hi=10.0,
    )
    max_tokens: int = setting(
        512, "Default most tokens of an answer for requests that do not set max_tokens.", lo=1, hi=10_000_000
    )
    speculative: str = setting(
        "none",
        "[placeholder: speculative decoding is not built yet; only 'none' is accepted] How the engine "
        "drafts tokens ahead to verify in one step (n-gram lookup, the MTP head, DFlash drafters).",
        choices=("none",),
    )
    swap_ram_mb: int = setting(
        0,
        "Most host RAM, in MiB, for the states of paused tasks (their KV cache and recurrent state). "
        "0 means half of the memory free at start. Past it, states spill to swap_dir.",
        lo=0,
        hi=16_777_216,
    )
    swap_prealloc_mb: int = setting(
        0,
        "Host memory, in MiB, reserved at start for paused tasks' states (page-locked with a GPU), so "
        "a pause never allocates: allocating costs far more than the copy (about 0.65 s per GiB with "
        "a GPU; a 32k-token 27B task with f16 KV is 2.2 GiB). 0 allocates on the first pause of each "
        "size instead. At most swap_ram_mb.",
        lo=0,
        hi=16_777_216,
    )
    swap_dir: str = setting(
        "",
        "Folder where paused tasks' states go when the RAM limit is reached. Empty: a 'swap' folder "
        "in MegaCapybara's cache. 'none' turns spilling off.",
    )
    age_bound_s: float = setting(
        2.0,
        "Fairness: a task that has waited this many seconds is served before any other, even if "
        "that lowers total throughput. Lower is fairer, higher is faster overall.",
        lo=0.0,
        hi=3600.0,
    )
    quantum_s: float = setting(
        0.5,
        "A task brought in to run keeps its place at least this long before it can be paused again.",
        lo=0.0,
        hi=600.0,
    )
    max_sessions: int = setting(
        32,
        "Finished conversations kept (in the context, then in RAM) so that their next turn only "
        "processes the new tokens. 0 turns session reuse off.",
        lo=0,
        hi=4096,
    )
    loop_guard: bool = setting(
        True,
        "Watch every generation for loops: first penalise the repeating tokens, then stop the task "
        "with finish_reason 'loop' if it keeps repeating.",
    )
    loop_window: int = setting(256, "How many recent tokens the loop guard looks at.", lo=8, hi=8192)
    loop_min_period: int = setting(
        4,
        "Shortest repeating unit, in tokens, that counts as a loop; shorter repetitions such as "
        "'0, 0, 0' or '-----' are treated as content.",
        lo=1,
        hi=1024,
    )
    loop_repeats: int = setting(
        4, "How many copies of the unit in a row (or identical tool calls) make a loop.", lo=2, hi=64
    )
    loop_penalty_step: float = setting(
        0.1,
        "How much the repetition penalty on looping tokens rises per further copy of the loop.",
        lo=0.01,
        hi=1.0,
    )
    loop_penalty_cap: float = setting(
        2.0, "The highest penalty; a loop that survives it stops the task.", lo=1.01, hi=10.0
    )
    max_queue: int = setting(
        256,
        "Open tasks beyond which new requests are refused with HTTP 503 and Retry-After.",
        lo=1,
        hi=1_000_000,
    )
    host: str = setting(
        "127.0.0.1", "Address the HTTP server listens on. 0.0.0.0 makes it reachable from other machines."
    )
    port: int = setting(
        8080, "TCP port of the HTTP server; 0 picks a free one (printed at start).", lo=0, hi=65_535
    )
    api_key: str = setting(
        "",
        "If set, every HTTP request must carry 'Authorization: Bearer <key>'. Empty: no key needed.",
        secret=True,
    )
    offline: bool = setting(
        False,
        "Never contact Hugging Face: use only models already on this machine (the bundled one at least).",
    )
    log_level: str = setting(
        "info",
        "How much the server logs: debug shows llama.cpp's own messages too.",
        choices=("debug", "info", "warning", "error"),
    )

    def sampling_defaults(self):
        """The SamplingParams a request starts from (its own fields override these)."""
        from orchestrator.types import SamplingParams

        return SamplingParams(
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            max_tokens=self.max_tokens,
        )

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value, meta = getattr(self, f.name), f.metadata
            if meta["choices"] is not None and value not in meta["choices"]:
                allowed = ", ".join(meta["choices"])
                raise SettingsError(f"{f.name}: must be one of {allowed} (got {value!r})")
            if meta["lo"] is not None and not (meta["lo"] <= value <= meta["hi"]):
                raise SettingsError(f"{f.name}: must be between {meta['lo']} and {meta['hi']} (got {value})")

    @classmethod
    def load(
        cls,
        cli: Mapping[str, object] | None = None,
        env: Mapping[str, str] | None = None,
        config: str | Path | None = None,
    ) -> Settings:
        """Defaults, overridden by the TOML config file, then MC_* environment variables, then CLI
        values. The config file may also be named by MC_CONFIG."""
        env = os.environ if env is None else env
        config = config or env.get(ENV_PREFIX + "CONFIG")
        values = load_config(config) if config else {}
        for f in dataclasses.fields(cls):
            raw = env.get(env_name(f.name))
            if raw is not None:
                values[f.name] = parse_value(f, raw, source=env_name(f.name))
        values.update({k: v for k, v in (cli or {}).items() if v is not None})
        return cls(**values)


def load_config(path: str | Path) -> dict:
    """Setting values from a TOML file of `name = value` lines (names as in the settings).

    Raises SettingsError naming the file and the key for an unknown key or a wrong type."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError:
        raise SettingsError(f"config: no such file {path}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise SettingsError(f"config: {path} is not valid TOML ({exc})") from None
    fields = {f.name: f for f in dataclasses.fields(Settings)}
    values = {}
    for key, value in data.get("megacapybara", data).items():
        f = fields.get(key)
        if f is None:
            raise SettingsError(f"config: {path}: unknown setting {key!r}")
        kind = _kind(f)
        ok = isinstance(value, kind) and not (kind is not bool and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value, ok = float(value), True
        if not ok:
            raise SettingsError(f"config: {path}: {key} must be {kind.__name__} (got {value!r})")
        values[key] = value
    return values


def _kind(f: dataclasses.Field) -> type:
    return (
        f.type if isinstance(f.type, type) else {"int": int, "str": str, "bool": bool, "float": float}[f.type]
    )


def env_name(name: str) -> str:
    return ENV_PREFIX + name.upper()


def flag_name(name: str) -> str:
    return "--" + name.replace("_", "-")


def parse_value(f: dataclasses.Field, raw: str, source: str):
    """Convert text (an env var or flag) to the field's type; SettingsError names the source."""
    kind = _kind(f)
    if kind is bool:
        low = raw.strip().lower()
        if low not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
            raise SettingsError(f"{source}: must be true or false (got {raw!r})")
        return low in ("1", "true", "yes", "on")
    try:
        return kind(raw)
    except ValueError:
        raise SettingsError(
            f"{source}: must be {'a number' if kind is float else kind.__name__} (got {raw!r})"
        ) from None


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Add one flag per setting, and --config; unset flags stay None so env/config/defaults apply."""
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE.toml",
        help="Read settings from this TOML file (name = value).",
    )
    for f in dataclasses.fields(Settings):
        meta = f.metadata
        extra = f" Allowed: {', '.join(meta['choices'])}." if meta["choices"] else ""
        if meta["lo"] is not None:
            extra = f" Allowed: {meta['lo']}..{meta['hi']}."
        help_text = f"{meta['help']}{extra} Default: {f.default!r}. Env: {env_name(f.name)}."
        if f.type in (bool, "bool"):
            parser.add_argument(
                flag_name(f.name), dest=f.name, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            parser.add_argument(
                flag_name(f.name),
                dest=f.name,
                type=lambda raw, f=f: _flag_value(f, raw),
                default=None,
                metavar=f.name.upper(),
                help=help_text,
            )


def _flag_value(f: dataclasses.Field, raw: str):
    try:
        return parse_value(f, raw, source=flag_name(f.name))
    except SettingsError as exc:  # argparse words it as "argument --flag: <message>"
        raise argparse.ArgumentTypeError(str(exc).split(": ", 1)[1]) from None


def from_args(ns: argparse.Namespace) -> Settings:
    cli = {f.name: getattr(ns, f.name, None) for f in dataclasses.fields(Settings)}
    return Settings.load(cli, config=getattr(ns, "config", None))
