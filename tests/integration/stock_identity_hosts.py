"""Hosts one side of the flag-off identity test (`test_stock_vllm_identity.py`); runs in the worker venv.

`ours MODEL_DIR GEN_JSON READY_FILE`: our vLLM worker (`VllmGenerationWorker`, the class the Ray
actor wraps) with token capture off, on 127.0.0.1 and an OS-picked port. Only the Ray actor
shell is left out: no request crosses Ray, so the HTTP path is the production one.

`stock MODEL_DIR GEN_JSON READY_FILE`: vLLM's own OpenAI-compatible server, through the entry
functions `vllm.entrypoints.openai.api_server` runs (`setup_server`, `run_server_worker`; the
`vllm serve` console script is broken in the CPU build). Its engine arguments are set from our
`engine_args(model_dir, cfg)` one by one, so both engines are configured alike by construction;
its tool-call parser is our `generation.tool_call_parser`. The only thing this adds to vLLM's
own start-up is reading the port the OS picked for the socket vLLM bound.

Both write `{"base_url": ...}` to READY_FILE (atomically) once they serve, and stop on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from pathlib import Path

from nemo_rl.models.generation.vllm.config import GenerationConfig
from nemo_rl.models.generation.vllm.lifecycle import engine_args

HOST = "127.0.0.1"
CONTROL_TOKEN = "identity-test-control-token-0123456789"


def _ready(path: Path, base_url: str) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"base_url": base_url}))
    os.replace(tmp, path)


async def _serve_ours(model_dir: str, gen: GenerationConfig, ready: Path) -> None:
    from nemo_rl.models.generation.vllm.worker import VllmGenerationWorker
    from nemo_rl.token_capture.config import TokenCaptureConfig

    worker = VllmGenerationWorker(model_dir, gen.model_dump(), TokenCaptureConfig(enabled=False).model_dump(), None)
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    try:
        await worker.bind(CONTROL_TOKEN)
        await worker.start_engine()
        _ready(ready, await worker.serve())
        await stop.wait()
    finally:
        await worker.shutdown()


def stock_argv(model_dir: str, gen: GenerationConfig) -> list[str]:
    """vLLM server flags that are not engine arguments (those are copied from `engine_args`)."""
    return [
        "--model", model_dir,
        "--served-model-name", gen.model_name,
        "--host", HOST,
        "--port", "0",
        "--enable-auto-tool-choice",
        "--tool-call-parser", gen.tool_call_parser,
    ]


def _serve_stock(model_dir: str, gen: GenerationConfig, ready: Path) -> None:
    import uvloop
    from vllm.entrypoints.launchers.api_server.entry import run_server_worker
    from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
    from vllm.entrypoints.launchers.launcher import setup_server
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(stock_argv(model_dir, gen))
    for key, value in engine_args(Path(model_dir), gen.vllm).items():
        if not hasattr(args, key):
            raise SystemExit(f"vLLM's server has no engine argument {key!r}; update stock_identity_hosts.py")
        setattr(args, key, value)
    validate_parsed_serve_args(args)
    listen_address, sock = setup_server(args, reuse_port=False)
    port = sock.getsockname()[1]

    async def serve() -> None:
        server = asyncio.ensure_future(run_server_worker(listen_address, sock, args))
        while not server.done():  # the port is bound before the engine starts: ready once it answers
            if await _answers(port):
                _ready(ready, f"http://{HOST}:{port}/v1")
                break
            await asyncio.sleep(0.5)
        await server

    uvloop.run(serve())


async def _answers(port: int) -> bool:
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 2.0)
    except (OSError, TimeoutError):
        return False
    try:
        writer.write(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        await writer.drain()
        status = await asyncio.wait_for(reader.readline(), 5.0)
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()
    return status.startswith(b"HTTP/1.1 200")


def main(argv: list[str]) -> None:
    side, model_dir, gen_json, ready = argv
    gen = GenerationConfig.model_validate_json(gen_json)
    if side == "ours":
        asyncio.run(_serve_ours(model_dir, gen, Path(ready)))
    elif side == "stock":
        _serve_stock(model_dir, gen, Path(ready))
    else:
        raise SystemExit(f"side must be ours or stock, got {side!r}")


if __name__ == "__main__":  # vLLM spawns its engine core, which re-imports this module
    main(sys.argv[1:])
