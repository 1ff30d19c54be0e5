"""`python -m engine_core.entrypoints.openai --model M [--port P --host H] [engine args]`.

Every EngineConfig field is an option with vLLM's dashed name (`--max-num-seqs 8`,
`--num-gpu-blocks 256`, `--enable-prefix-caching`); the server's own are `--served-model-name`,
`--chat-template`, `--max-waiting-requests`. Loopback (127.0.0.1) unless told otherwise.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from engine_core.config import EngineConfig

_TYPES = {"int": int, "float": float, "str": str}


def engine_options(parser: argparse.ArgumentParser) -> list[str]:
    """An option per EngineConfig field of a plain type (bools as --x / --no-x); the field names."""
    names = []
    for f in dataclasses.fields(EngineConfig):
        kind = str(f.type).replace(" | None", "").strip()
        if f.name == "model" or (kind != "bool" and kind not in _TYPES):
            continue
        flag = f"--{f.name.replace('_', '-')}"
        if kind == "bool":
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None)
        else:
            parser.add_argument(flag, type=_TYPES[kind], default=None)
        names.append(f.name)
    return names


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m engine_core.entrypoints.openai", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-llama", help="a checkpoint folder or a preset name")
    parser.add_argument("--served-model-name", default=None, help="the name clients use (default: --model)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--chat-template", default=None, help="a Jinja chat template file (else the tokenizer's)")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="requests waiting for admission beyond which new ones get a 503")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                        help="PEFT adapter folders served under NAME (a request's model), with --enable-lora")
    names = engine_options(parser)
    args = parser.parse_args(argv)
    engine_args: dict[str, Any] = {n: getattr(args, n) for n in names if getattr(args, n) is not None}

    import uvicorn

    from engine_core.entrypoints.async_llm import AsyncLLM
    from engine_core.entrypoints.openai.api_server import build_app

    template = Path(args.chat_template).read_text() if args.chat_template else None
    lora_modules = lora_module_requests(parser, args.lora_modules, engine_args)
    try:
        llm = AsyncLLM.from_kwargs(args.model, max_waiting_requests=args.max_waiting_requests, **engine_args)
    except ValueError as e:  # an engine argument or the model folder: say which, no traceback
        parser.error(str(e))
    app = build_app(llm, args.served_model_name or args.model, template, lora_modules)
    try:
        # streams still open at Ctrl-C get 5 s, then go (their requests are aborted below)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        llm.shutdown(timeout=5.0, abort=True)


def lora_module_requests(parser: argparse.ArgumentParser, specs: list[str], engine_args: dict[str, Any]) -> dict:
    """`--lora-modules NAME=PATH ...` -> {NAME: LoRARequest} (ids from 1, in order); parser errors name the flag.
    The folders are read and checked against the model at each adapter's first request (lab 09)."""
    from engine_core.lora.request import LoRARequest

    if specs and not engine_args.get("enable_lora"):
        parser.error("--lora-modules needs --enable-lora")
    found: dict[str, LoRARequest] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path or name in found or not Path(path).is_dir():
            parser.error(f"--lora-modules takes NAME=PATH with a unique NAME and an existing folder, got {spec!r}")
        found[name] = LoRARequest(name, len(found) + 1, path)
    return found


if __name__ == "__main__":
    main()
