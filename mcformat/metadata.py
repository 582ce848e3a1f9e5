"""The `mc.*` metadata of MC weights: typed dataclasses, an instant reader and a safe writer.

Stored as plain GGUF key/values, so stock llama.cpp loads the file and ignores them:

    mc.format_version  uint32        mc.base_model     string     mc.source_sha256  string
    mc.builder_version string        mc.built_date     string     mc.corpus.id      string
    mc.corpus.tokens   uint64
    mc.results.<column>  one array per column of the results table, all of the same length:
        weights, cache_type_k, cache_type_v (strings); yarn_factor (float64); context (uint32);
        kl_mean, kl_median, kl_p99, kl_p999, top1, rms_dp, ppl_ratio (float64); tokens (uint64)

The reader parses only the header (gguf.GGUFReader memory-maps, it loads no tensor), so the
launcher shows the figures of a 15 GB file at once. The writer copies the file with new `mc.*`
values into a temp file beside it, fsyncs and renames: the original is never half-written.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf

FORMAT_VERSION = 1
KV_ORDER = ("f16", "q8_0", "q4_0")  # KV cache types, closest to f16 first
VT = gguf.GGUFValueType


class MetadataError(ValueError):
    """The file has no or malformed mc.* metadata; the message names the key."""


@dataclass(frozen=True)
class Setting:
    """What a user picks: weights, KV cache types, YaRN factor, context length."""

    weights: str  # quant type of the weights, e.g. "Q4_K_M", "BF16"
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    yarn_factor: float = 1.0
    context: int = 2048

    def distance(self, other: Setting) -> float:
        """How far apart two settings are (0: the same), for naming the nearest measured one."""
        d = 0.0 if self.weights == other.weights else 100.0
        for a, b in ((self.cache_type_k, other.cache_type_k), (self.cache_type_v, other.cache_type_v)):
            d += abs(_kv_rank(a) - _kv_rank(b)) * 3.0
        d += abs(math.log2(self.yarn_factor) - math.log2(other.yarn_factor)) * 5.0
        d += abs(math.log2(self.context) - math.log2(other.context))
        return d

    def label(self) -> str:
        yarn = f", YaRN x{self.yarn_factor:g}" if self.yarn_factor != 1.0 else ""
        return f"{self.weights}, KV {self.cache_type_k}/{self.cache_type_v}{yarn}, {self.context} ctx"


def _kv_rank(kind: str) -> int:
    return KV_ORDER.index(kind) if kind in KV_ORDER else len(KV_ORDER)


@dataclass(frozen=True)
class Figures:
    """Quality of one setting against the BF16 original on the evaluation corpus."""

    kl_mean: float
    kl_median: float
    kl_p99: float
    kl_p999: float
    top1: float  # fraction of tokens whose most likely next token is the same ("same top p")
    rms_dp: float  # root mean square of the change in the probability of the actual next token
    ppl_ratio: float  # perplexity / BF16 perplexity
    tokens: int  # tokens evaluated


@dataclass(frozen=True)
class Row:
    setting: Setting
    figures: Figures


@dataclass(frozen=True)
class Answer:
    """What `stats_for` found: the figures, or "not measured" and the nearest measured setting."""

    setting: Setting
    figures: Figures | None
    nearest: Row | None = None

    @property
    def measured(self) -> bool:
        return self.figures is not None

    def message(self) -> str:
        if self.measured:
            return f"{self.setting.label()}: measured"
        if self.nearest is None:
            return f"{self.setting.label()}: not measured (this file has no measurements)"
        return f"{self.setting.label()}: not measured; nearest measured: {self.nearest.setting.label()}"


@dataclass(frozen=True)
class McMetadata:
    base_model: str
    source_sha256: str
    builder_version: str
    built_date: str
    corpus_id: str
    corpus_tokens: int
    results: tuple[Row, ...] = ()
    format_version: int = FORMAT_VERSION

    def stats_for(self, setting: Setting) -> Answer:
        for row in self.results:
            if row.setting == setting:
                return Answer(setting, row.figures)
        nearest = min(self.results, key=lambda r: setting.distance(r.setting), default=None)
        return Answer(setting, None, nearest)

    def with_results(self, rows: list[Row]) -> McMetadata:
        """These results replacing any earlier row of the same setting."""
        keep = {r.setting: r for r in self.results}
        keep.update({r.setting: r for r in rows})
        return dataclasses.replace(self, results=tuple(keep.values()))


_SETTING_COLS = {"weights": VT.STRING, "cache_type_k": VT.STRING, "cache_type_v": VT.STRING,
                 "yarn_factor": VT.FLOAT64, "context": VT.UINT32}  # fmt: skip
_FIGURE_COLS = {
    f.name: (VT.UINT64 if f.name == "tokens" else VT.FLOAT64) for f in dataclasses.fields(Figures)
}
_SCALARS = {"format_version": VT.UINT32, "base_model": VT.STRING, "source_sha256": VT.STRING,
            "builder_version": VT.STRING, "built_date": VT.STRING, "corpus_id": VT.STRING,
            "corpus_tokens": VT.UINT64}  # fmt: skip


def _key(name: str) -> str:
    return "mc." + name.replace("corpus_", "corpus.")


def to_kv(meta: McMetadata) -> list[tuple[str, object, gguf.GGUFValueType, gguf.GGUFValueType | None]]:
    """(key, value, type, array item type) for every mc.* key."""
    kv = [(_key(n), getattr(meta, n), t, None) for n, t in _SCALARS.items()]
    for col, t in _SETTING_COLS.items():
        kv.append((f"mc.results.{col}", [getattr(r.setting, col) for r in meta.results], VT.ARRAY, t))
    for col, t in _FIGURE_COLS.items():
        kv.append((f"mc.results.{col}", [getattr(r.figures, col) for r in meta.results], VT.ARRAY, t))
    return kv


def read(path: str | Path) -> McMetadata | None:
    """The mc.* metadata of a GGUF file, or None if it has none. Loads no tensor.

    Raises MetadataError naming the key when the metadata is there but malformed."""
    fields = gguf.GGUFReader(path).fields
    if "mc.format_version" not in fields:
        return None
    try:
        scalars = {n: fields[_key(n)].contents() for n in _SCALARS}
        cols = {c: fields[f"mc.results.{c}"].contents() for c in [*_SETTING_COLS, *_FIGURE_COLS]}
    except KeyError as exc:
        raise MetadataError(f"{path}: mc metadata lacks key {exc.args[0]}") from None
    if scalars["format_version"] > FORMAT_VERSION:
        raise MetadataError(
            f"{path}: mc.format_version {scalars['format_version']} is newer than {FORMAT_VERSION}"
        )
    lengths = {len(v) for v in cols.values()}
    if len(lengths) > 1:
        raise MetadataError(f"{path}: mc.results columns have different lengths {sorted(lengths)}")
    rows = []
    for i in range(lengths.pop() if lengths else 0):
        setting = Setting(**{c: _cast(cols[c][i], t) for c, t in _SETTING_COLS.items()})
        figures = Figures(**{c: _cast(cols[c][i], t) for c, t in _FIGURE_COLS.items()})
        rows.append(Row(setting, figures))
    return McMetadata(**scalars, results=tuple(rows))


def _cast(value, vtype: gguf.GGUFValueType):
    if vtype == VT.STRING:
        return str(value)
    if vtype == VT.FLOAT64:
        return float(value)
    return int(value)


def write(path: str | Path, meta: McMetadata, out: str | Path | None = None) -> Path:
    """Attach (or replace) `meta` in the GGUF at `path`, in place or as `out`.

    The new file is written under a temp name beside the target, fsynced, then renamed over
    it; on any failure the temp file is removed and the original is untouched."""
    path, out = Path(path), Path(out or path)
    tmp = out.with_name(f".{out.name}.mc-partial-{os.getpid()}")
    reader = gguf.GGUFReader(path)
    arch = reader.fields["general.architecture"].contents()
    try:
        writer = gguf.GGUFWriter(tmp, arch, endianess=reader.endianess)
        for field in reader.fields.values():
            if field.name == "general.architecture" or field.name.startswith(("GGUF.", "mc.")):
                continue
            vtype = field.types[0]
            writer.add_key_value(
                field.name, field.contents(), vtype, sub_type=field.types[-1] if vtype == VT.ARRAY else None
            )
        for key, value, vtype, sub in to_kv(meta):
            writer.add_key_value(key, value, vtype, sub_type=sub)
        for t in reader.tensors:
            writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for t in reader.tensors:
            writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
        writer.close()
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        tmp.replace(out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return out
