"""The `megacapybara` command: serve, bench, build-weights, compare, download, launch.

User-facing errors are one line on stderr and a non-zero exit code: 2 for bad usage or
settings, 1 for a failure at run time (missing model file, port in use, backend problem).
"""

from __future__ import annotations

import argparse
import logging
import sys

from mcformat.quantize import DEFAULT_QUANTS
from orchestrator import settings as settings_mod

PLANNED = {
    "launch": "open the Tkinter launcher (the launcher issue)",
}


class CliError(Exception):
    """A run-time failure to report in one line (exit code 1)."""


class OneLineParser(argparse.ArgumentParser):
    """argparse, but usage errors are a single line instead of usage text plus the error."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="megacapybara", description="MegaCapybara local inference engine.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    serve = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    settings_mod.add_flags(serve)
    serve.add_argument(
        "--print-command",
        choices=["sh", "bat"],
        default=None,
        help="print these settings as one serve line for sh or a .bat file, and exit",
    )
    serve.add_argument("--print-config", action="store_true", help="print these settings as TOML, and exit")
    bench = sub.add_parser("bench", help="measure prefill and decode speed of a model on this machine")
    settings_mod.add_flags(bench)
    bench.add_argument("--prompt-tokens", type=int, default=256, help="prompt length to prefill")
    bench.add_argument("--gen-tokens", type=int, default=64, help="tokens to decode")
    bench.add_argument(
        "--json", dest="json_out", default=None, help="also write the figures to this JSON file"
    )
    bw = sub.add_parser(
        "build-weights", help="build MC weights (quants + measured quality) from a BF16 checkpoint"
    )
    bw.add_argument(
        "source", help="Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json)"
    )
    bw.add_argument("--out", required=True, help="output folder (rerun with the same folder to resume)")
    bw.add_argument("--quants", default=",".join(DEFAULT_QUANTS), help="comma-separated quant types")
    bw.add_argument("--kv", default="f16,q8_0,q4_0", help="KV cache types to evaluate")
    bw.add_argument("--yarn", default="1", help="YaRN factors to evaluate, e.g. 1,2,4")
    bw.add_argument("--ctx", type=int, default=512, help="evaluation chunk length in tokens")
    bw.add_argument("--chunks", type=int, default=4, help="chunks of the corpus to evaluate")
    bw.add_argument("--name", default="", help="model name in the files (default: the source folder's)")
    bw.add_argument("--gpu-layers", type=int, default=0)
    bw.add_argument(
        "--imatrix", action="store_true", help="quantize with an importance matrix (llama-imatrix)"
    )
    dl = sub.add_parser("download", help="list or download MC weights from a Hugging Face repository")
    dl.add_argument("repo", nargs="?", default="megacapybara/Qwen3.8-27B-MC-GGUF", help="owner/name")
    dl.add_argument("file", nargs="?", help="the .gguf file to download (without it: list them)")
    cmp_ = sub.add_parser("compare", help="compare GGUF files of one model side by side against the BF16 one")
    cmp_.add_argument("files", nargs="+", help="the GGUF files to compare")
    cmp_.add_argument("--reference", required=True, help="the BF16 GGUF of the same model")
    cmp_.add_argument(
        "--out", default="compare-out", help="folder for compare.csv, compare.json and the plots"
    )
    cmp_.add_argument("--ctx", type=int, default=512, help="evaluation chunk length in tokens")
    cmp_.add_argument("--chunks", type=int, default=4, help="chunks of the corpus to evaluate")
    cmp_.add_argument("--gpu-layers", type=int, default=0)
    cmp_.add_argument("--no-speed", action="store_true", help="skip the decode tok/s measurement")
    for name, text in PLANNED.items():
        p = sub.add_parser(name, help=f"{text} [not available yet]")
        p.add_argument("rest", nargs=argparse.REMAINDER)
    return parser


def _setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if level != "debug":
        logging.getLogger("werkzeug").setLevel(logging.WARNING)


def _resolve_model(settings: settings_mod.Settings):
    from orchestrator.backend import build_info
    from orchestrator.models import ModelNotFound, resolve

    try:
        resolved = resolve(settings.model, gpu=build_info().backend == "cuda", offline=settings.offline)
    except ModelNotFound as exc:
        raise CliError(str(exc)) from None
    if resolved.note:
        logging.getLogger("orchestrator.models").warning("%s", resolved.note)
    return resolved


def _engine(settings: settings_mod.Settings, resolved):
    from orchestrator.llama_engine import LlamaEngine, config_from_settings

    try:
        config = config_from_settings(settings)
    except ValueError as exc:
        raise CliError(str(exc)) from None
    return LlamaEngine(str(resolved.path), config, settings.gpu_layers, model_id=resolved.name)


def cmd_serve(settings: settings_mod.Settings) -> int:
    from orchestrator.server import bind_server, create_app

    resolved = _resolve_model(settings)
    try:  # bind before the (slow) model load, so a taken port fails at once
        server = bind_server(settings.host, settings.port)
    except OSError as exc:
        raise CliError(f"port: cannot listen on {settings.host}:{settings.port} ({exc.strerror})") from None
    engine = None
    try:
        engine = _engine(settings, resolved)
        server.app = create_app(engine, settings.api_key, settings.sampling_defaults())
        print(f"MegaCapybara serving {resolved.name} at http://{settings.host}:{server.port}/v1", flush=True)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        if engine is not None:
            engine.close()
    return 0


def cmd_bench(settings: settings_mod.Settings, args: argparse.Namespace) -> int:
    from orchestrator.bench import run_bench

    resolved = _resolve_model(settings)
    run_bench(settings, resolved, args.prompt_tokens, args.gen_tokens, args.json_out)
    return 0


def cmd_build_weights(args: argparse.Namespace) -> int:
    from pathlib import Path

    from mcformat.builder import BuildError, BuildPlan, build
    from mcformat.quantize import QuantizeError

    _setup_logging("warning")
    try:
        plan = BuildPlan(
            Path(args.source),
            Path(args.out),
            quants=tuple(q for q in args.quants.split(",") if q),
            kv_types=tuple(k for k in args.kv.split(",") if k),
            yarn_factors=tuple(float(y) for y in args.yarn.split(",") if y),
            n_ctx=args.ctx,
            n_chunks=args.chunks,
            n_gpu_layers=args.gpu_layers,
            name=args.name,
            imatrix=args.imatrix,
        )
        data = build(plan)
    except (BuildError, QuantizeError, ValueError) as exc:
        print(f"megacapybara build-weights: error: {exc}", file=sys.stderr)
        return 1
    print(f"built {', '.join(data['outputs'])} in {args.out} (manifest.json)")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from pathlib import Path

    from compare.compare import compare, table, write_outputs

    _setup_logging("warning")
    paths = [Path(p) for p in [*args.files, args.reference]]
    missing = [str(p) for p in paths if not p.is_file()]
    if missing:
        print(f"megacapybara compare: error: no such file: {', '.join(missing)}", file=sys.stderr)
        return 1
    entries = compare(paths[:-1], paths[-1], None, args.ctx, args.chunks, args.gpu_layers, not args.no_speed)
    print(table(entries))
    for path in write_outputs(entries, Path(args.out)):
        print(f"wrote {path}")
    return 0


def cmd_download(args: argparse.Namespace) -> int:
    from mcformat import metadata
    from mcformat.download import DownloadError, download, list_weights
    from orchestrator.models import models_dir

    _setup_logging("warning")
    try:
        if not args.file:
            for f in list_weights(args.repo):
                print(f"{f.path}  {f.size / 1e9:.2f} GB")
            return 0
        path = download(args.repo, args.file, models_dir())
    except DownloadError as exc:
        print(f"megacapybara download: error: {exc}", file=sys.stderr)
        return 1
    meta = metadata.read(path)
    what = f"MC weights, {len(meta.results)} measured settings" if meta else "no MC metadata"
    print(f"{path}  ({what})")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    prog = f"megacapybara {args.command}"
    if args.command in PLANNED:
        print(f"{prog}: error: not available yet in this version: {PLANNED[args.command]}", file=sys.stderr)
        return 2
    if args.command == "build-weights":
        return cmd_build_weights(args)
    if args.command == "download":
        return cmd_download(args)
    if args.command == "compare":
        return cmd_compare(args)
    try:
        settings = settings_mod.from_args(args)
    except settings_mod.SettingsError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    if args.command == "serve" and (args.print_command or args.print_config):
        from orchestrator import commands

        out = commands.command_line(settings, args.print_command) if args.print_command else None
        print(out if out is not None else commands.to_toml(settings), end="\n" if out else "")
        return 0
    _setup_logging(settings.log_level)
    try:
        if args.command == "serve":
            return cmd_serve(settings)
        return cmd_bench(settings, args)
    except (CliError, FileNotFoundError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        from orchestrator.backend import BackendError

        if isinstance(exc, BackendError):
            print(f"{prog}: error: {exc}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
