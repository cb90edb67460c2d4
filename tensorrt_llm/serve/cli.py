"""`trtllm-serve`: an OpenAI-compatible HTTP server over one `LLM`.

    trtllm-serve MODEL [--config serve.yaml | --extra_llm_api_options serve.yaml] [--host H] [--port P]

MODEL is the checkpoint folder (the served model id, unless --served_model_name). The YAML is the
TorchLlmArgs file `LLM("serve.yaml")` takes (`model:` in it is overridden by MODEL), so switching
the drafter is one line of it:

    speculative_config: {decoding_type: DSpark, speculative_model: examples/models/smollm2-135m-dspark-mla}

The engine is built before the port is opened: a bad YAML or checkpoint exits with the error, and
once /health answers the server is ready.

Disaggregated serving (docs/serving.md): `--server_role context|generation` adds the worker routes
(`serve/disagg/worker.py`); `trtllm-serve disaggregated -c disagg.yaml` runs the router.
"""
from __future__ import annotations

import argparse
import logging
import sys
from typing import Optional, Sequence

from ..llmapi import LLM, TorchLlmArgs

logger = logging.getLogger("tensorrt_llm")


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="trtllm-serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("model", help="HF checkpoint folder")
    p.add_argument("--config", "--extra_llm_api_options", "--extra-llm-api-options", dest="config", default=None,
                   help="TorchLlmArgs YAML (the file LLM('serve.yaml') takes); MODEL overrides its `model`")
    p.add_argument("--host", default="localhost", help="address to bind")
    p.add_argument("--port", type=int, default=8000, help="port to bind")
    p.add_argument("--served_model_name", "--served-model-name", default=None,
                   help="model id in /v1/models and requests (default: MODEL as given)")
    p.add_argument("--server_role", "--server-role", default=None, choices=["context", "generation"],
                   help="disaggregated worker role (KV moves CTX -> GEN over NIXL); default: aggregated")
    p.add_argument("--kv_hold_timeout", "--kv-hold-timeout", type=float, default=60.0,
                   help="context role: seconds a prefilled request's pages wait for a GEN pull")
    p.add_argument("--log_level", "--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def build_args(model: str, config: Optional[str]) -> TorchLlmArgs:
    if config is None:
        return TorchLlmArgs(model=model)
    return TorchLlmArgs.from_yaml(config, model=model)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Console entry point; serves until interrupted."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["disaggregated"]:
        from .disagg.router import main as router_main
        return router_main(argv[1:])
    parser = make_parser()
    a = parser.parse_args(argv)
    if not 0 <= a.port < 65536:
        parser.error(f"--port must be in [0, 65536), got {a.port}")
    logging.basicConfig(level=a.log_level.upper(), format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    import uvicorn

    from .app import KEEP_ALIVE_S, create_app
    try:
        llm = LLM(args=build_args(a.model, a.config))
    except ValueError as e:
        parser.error(str(e))
    try:
        app = create_app(llm, a.served_model_name or a.model)
        if a.server_role is not None:
            from .disagg.worker import add_disagg_routes
            add_disagg_routes(app, llm, a.server_role, a.kv_hold_timeout)
        uvicorn.run(app, host=a.host, port=a.port, log_level=a.log_level, timeout_graceful_shutdown=5,
                    timeout_keep_alive=KEEP_ALIVE_S)
    finally:
        llm.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
