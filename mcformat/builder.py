"""The weights builder: BF16 checkpoint -> BF16 GGUF -> quantized variants -> evaluation of each
variant and each KV/YaRN setting against the BF16 logits -> mc.* metadata attached ->
manifest.json.

Resumable: `manifest.json` (rewritten atomically after every step) records each finished step
with the size of what it wrote; a rerun skips a step whose record and file still agree. Every
file is written under a temp name and renamed, so an interruption never leaves a corrupt output.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from mcformat import metadata as mc
from mcformat.convert import ConvertError, convert_checkpoint
from mcformat.evaluate import CALIBRATION_FILES, Corpus, calibration_text, evaluate, stdlib_corpus
from mcformat.quantize import DEFAULT_QUANTS, FTYPES, compute_imatrix, quantize, quantize_with_imatrix
from mcformat.safetensors import SafetensorsError, read_header

log = logging.getLogger(__name__)
BUILDER_VERSION = "0.1.0"


class BuildError(RuntimeError):
    """The build cannot go on; the message says which input or step."""


@dataclass(frozen=True)
class BuildPlan:
    source: Path
    out: Path
    quants: tuple[str, ...] = DEFAULT_QUANTS
    kv_types: tuple[str, ...] = ("f16", "q8_0", "q4_0")
    yarn_factors: tuple[float, ...] = (1.0,)
    n_ctx: int = 512
    n_chunks: int = 4
    n_gpu_layers: int = 0
    name: str = field(default="")
    imatrix: bool = False  # quantize with an importance matrix computed on calibration text

    def __post_init__(self) -> None:
        bad = [q for q in self.quants if q not in FTYPES]
        if bad:
            raise BuildError(f"quants: {bad} not among {', '.join(FTYPES)}")
        bad = [k for k in self.kv_types if k not in mc.KV_ORDER]
        if bad:
            raise BuildError(f"kv types: {bad} not among {', '.join(mc.KV_ORDER)}")

    @property
    def model_name(self) -> str:
        return self.name or self.source.name


class Manifest:
    """What has been built: steps -> records, saved atomically after each change."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.is_file() else {"steps": {}}

    def done(self, step: str, output: Path | None = None) -> bool:
        rec = self.data["steps"].get(step)
        if rec is None:
            return False
        return output is None or (output.is_file() and output.stat().st_size == rec.get("bytes"))

    def record(self, step: str, output: Path | None = None, **info) -> None:
        if output is not None:
            info.update(file=output.name, bytes=output.stat().st_size)
        self.data["steps"][step] = info
        self.save()

    def save(self) -> None:
        tmp = self.path.with_name(self.path.name + ".partial")
        tmp.write_text(json.dumps(self.data, indent=2) + "\n")
        tmp.replace(self.path)


def source_checksum(folder: Path) -> str:
    """sha256 over config.json and the safetensors files; checks each file is whole first."""
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors"))]
    if not files[0].is_file() or len(files) == 1:
        raise BuildError(
            f"source {folder}: needs config.json and *.safetensors (a Hugging Face checkpoint folder)"
        )
    for f in files[1:]:
        try:
            read_header(f)
        except SafetensorsError as exc:
            raise BuildError(f"source is corrupt or truncated: {exc}") from None
    digest = hashlib.sha256()
    total = sum(f.stat().st_size for f in files)
    with tqdm(total=total, unit="B", unit_scale=True, desc="checksum", disable=None) as bar:
        for f in files:
            with open(f, "rb") as fh:
                while block := fh.read(8 << 20):
                    digest.update(block)
                    bar.update(len(block))
    return digest.hexdigest()


def build(plan: BuildPlan, corpus: Corpus | None = None) -> dict:
    """Run (or resume) the whole build; returns the manifest data."""
    plan.out.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(plan.out / "manifest.json")
    corpus = corpus or stdlib_corpus()
    if not manifest.done("source"):
        manifest.record("source", path=str(plan.source), sha256=source_checksum(plan.source))
    bf16 = plan.out / f"{plan.model_name}-BF16.gguf"
    if not manifest.done("convert", bf16):
        try:
            convert_checkpoint(plan.source, bf16, "bf16", name=plan.model_name)
        except (ConvertError, SafetensorsError) as exc:
            raise BuildError(f"converting {plan.source}: {exc}") from None
        manifest.record("convert", bf16)
    imatrix = _imatrix(plan, manifest, bf16) if plan.imatrix else None
    variants = {}
    for q in tqdm(plan.quants, desc="quantize", disable=None):
        variants[q] = plan.out / f"{plan.model_name}-{q}.gguf"
        if not manifest.done(f"quantize:{q}", variants[q]):
            if imatrix is not None:
                quantize_with_imatrix(bf16, variants[q], q, imatrix)
            else:
                quantize(bf16, variants[q], q)
            manifest.record(f"quantize:{q}", variants[q], imatrix=imatrix is not None)
    _evaluate_all(plan, manifest, corpus, bf16, variants)
    _attach(plan, manifest, corpus, variants)
    manifest.data["outputs"] = [p.name for p in variants.values()]
    manifest.save()
    return manifest.data


def _imatrix(plan: BuildPlan, manifest: Manifest, bf16: Path) -> Path:
    out = plan.out / f"{plan.model_name}.imatrix.gguf"
    if not manifest.done("imatrix", out):
        text = plan.out / "calibration.txt"
        text.write_text(calibration_text())
        compute_imatrix(bf16, text, out, n_ctx=plan.n_ctx)
        manifest.record("imatrix", out, calibration="python stdlib: " + ", ".join(CALIBRATION_FILES))
    return out


def _settings(plan: BuildPlan, quants) -> list[mc.Setting]:
    return [
        mc.Setting(q, kv, kv, y, plan.n_ctx)
        for q in quants
        for kv in plan.kv_types
        for y in plan.yarn_factors
    ]


def _evaluate_all(plan: BuildPlan, manifest: Manifest, corpus: Corpus, bf16: Path, variants: dict) -> None:
    for s in tqdm(_settings(plan, variants), desc="evaluate", disable=None):
        step = f"eval:{s.weights}:{s.cache_type_k}:{s.cache_type_v}:{s.yarn_factor:g}:{s.context}"
        if manifest.done(step):
            continue
        fig = evaluate(bf16, variants[s.weights], corpus, plan.n_ctx, plan.n_chunks, s.cache_type_k,
                       s.yarn_factor, plan.n_gpu_layers)  # fmt: skip
        manifest.record(step, setting=asdict(s), figures=asdict(fig))


def _attach(plan: BuildPlan, manifest: Manifest, corpus: Corpus, variants: dict) -> None:
    rows = [mc.Row(mc.Setting(**r["setting"]), mc.Figures(**r["figures"]))
            for k, r in manifest.data["steps"].items() if k.startswith("eval:")]  # fmt: skip
    base = mc.McMetadata(
        base_model=plan.model_name,
        source_sha256=manifest.data["steps"]["source"]["sha256"],
        builder_version=BUILDER_VERSION,
        built_date=datetime.date.today().isoformat(),
        corpus_id=corpus.id,
        corpus_tokens=max((r.figures.tokens for r in rows), default=0),
    )
    for q, path in variants.items():
        if manifest.done(f"metadata:{q}", path):
            continue
        mine = [r for r in rows if r.setting.weights == q]
        mc.write(path, base.with_results(mine))
        manifest.data["steps"][f"quantize:{q}"]["bytes"] = path.stat().st_size  # same weights, new header
        manifest.record(f"metadata:{q}", path, rows=len(mine))
