"""``causaldraft serve``: load an engine and serve it over the OpenAI-compatible HTTP API."""

from __future__ import annotations

import argparse
import threading

from causaldraft.flags import add_drafter_flags, add_model_flags, engine_config
from causaldraft.serve.worker import DEFAULT_MAX_BATCH, DEFAULT_MAX_QUEUE

SERVE_DEFAULT_DRAFTER = "auto"  # registry.auto_choice: --heads DIR's drafter, a shipped eagle3 layer, lookup


def register(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    serve = commands.add_parser("serve", help="OpenAI-compatible HTTP server")
    add_model_flags(serve)
    add_drafter_flags(serve, default_drafter=SERVE_DEFAULT_DRAFTER)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--max-queue", type=int, default=DEFAULT_MAX_QUEUE,
                       help="requests allowed to wait for the engine; more get 429")  # fmt: skip
    serve.add_argument("--max-batch", type=int, default=DEFAULT_MAX_BATCH,
                       help="requests decoded together, sharing each target pass (continuous batching)")  # fmt: skip
    serve.add_argument("--model-name", default=None, help="model id clients must send (default: model directory name)")
    serve.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from causaldraft.api import load
    from causaldraft.errors import CausalDraftError
    from causaldraft.serve.app import create_app

    if args.max_queue < 1:
        raise CausalDraftError(f"--max-queue must be >= 1, got {args.max_queue}")
    if args.max_batch < 1:
        raise CausalDraftError(f"--max-batch must be >= 1, got {args.max_batch}")
    if not 0 <= args.port <= 65535:
        raise CausalDraftError(f"--port must be in [0, 65535], got {args.port}")
    engine = load(engine_config(args))
    app = create_app(engine, max_queue=args.max_queue, model_name=args.model_name, max_batch=args.max_batch,
                     engine_thread=False)  # fmt: skip
    served = args.model_name or engine.model.model_dir.name
    print(f"causaldraft: serving {served} (drafter {args.drafter}) on http://{args.host}:{args.port}", flush=True)
    # HTTP on a thread of its own, the engine loop on this one, which loaded the model (Worker.run_while)
    server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level="info"))
    http = threading.Thread(target=server.run, name="causaldraft-http", daemon=True)
    http.start()
    try:
        app.state.worker.run_while(http.is_alive)
    except KeyboardInterrupt:
        pass
    finally:
        server.should_exit = True
        http.join(timeout=10)
    return 0 if server.started else 1  # not started: uvicorn said why (e.g. the port is taken)
