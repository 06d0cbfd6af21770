"""``bootstrap serve``: the OpenAI-compatible server, with the bootstrap running behind it.

The port opens at once; the stages run in the background (``GET /ready`` says where they are).
SIGTERM, SIGINT or SIGHUP: stop accepting connections, let requests in flight finish for
``--shutdown-timeout`` seconds, cancel the rest (streams get a final chunk), shut the executor
down, exit 0; during the bootstrap, the pipeline is cancelled and rolls back. A second SIGINT
skips the grace period: requests in flight are cancelled at once (streams still get their final
chunk), then the same clean shutdown, exit 0, no traceback.

Exit status: 0 after a signal; 2 bad input (before the port opens: the configuration; after it:
a backend or trace file that cannot be used); 1 when ranks fell out of step. ``--tp N``: rank 0
serves, the other ranks follow it (``bootstrap.cli.serve_ranks``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Iterator
from typing import Any

from bootstrap.api import require_engine
from bootstrap.cli.address import check_host
from bootstrap.cli.args import (
    MAX_SECONDS,
    add_build_args,
    add_config_args,
    check_dist_timeout,
    check_kv_tokens,
    check_model_limits,
    check_number,
    config_from_args,
)
from bootstrap.cli.exits import BAD_INPUT, BAD_INPUT_ERRORS, OK, STAGE_FAILED
from bootstrap.cli.serve_ranks import Leading, main_follower
from bootstrap.cli.stops import STOP_SIGNALS, held_stops
from bootstrap.cli.threads_left import report_threads
from bootstrap.cli.tp import (
    await_rank_0,
    check_rank_count,
    check_tp_before_launch,
    launch_ranks,
    leave,
    needs_launch,
    this_rank,
)
from bootstrap.engine.kernels import triton_start
from bootstrap.parallel.rank_env import RankEnv

ENV_API_KEY = "BOOTSTRAP_API_KEY"
FORCE_AFTER_S = 10.0  # past the grace period: how long cancelled streams get to send their final chunk
FORCE_CLOSE_S = 3.0  # after a second SIGINT: how long cut streams get to send their final chunk

log = logging.getLogger("bootstrap.serve")


def add_serve_args(serve: argparse.ArgumentParser) -> None:
    add_config_args(serve, "serve")
    add_build_args(serve)
    add = serve.add_argument
    add("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    add("--port", type=int, default=8000, help="port to bind (0: any free port)")
    add(
        "--api-key",
        help=f"require 'Authorization: Bearer KEY' on every route but /health, /ready and /metrics "
        f"(default: env {ENV_API_KEY})",
    )
    add(
        "--allowed-origins",
        metavar="ORIGINS",
        help="comma-separated browser origins (scheme://host[:port]) the server takes requests from, with CORS "
        "(default: none; other sites get a 403, and on a loopback address foreign Host names too)",
    )
    add(
        "--allow-open-operations",
        action="store_true",
        help="on an address other than loopback without --api-key, let anyone who reaches the port run the live "
        "operations (swap, weights, sleep, wake); without it they answer 403 (logged at start either way)",
    )
    add("--served-model-name", help="the model id clients send (default: --model as given)")
    add("--shutdown-timeout", type=float, default=30.0, help="seconds requests in flight get after a signal")
    add(
        "--drain-timeout",
        type=float,
        default=30.0,
        help="seconds requests in flight get to finish on the old model before a swap, weights update or "
        "sleep releases it (then they end with finish_reason abort and their partial output)",
    )
    add(
        "--engine-timeout",
        type=float,
        default=60.0,
        help="seconds requests may wait on an engine from which no step has answered before /health answers 503 "
        "naming the engine (a step that never ends); an engine's process that leaves a cancelled operation or its "
        "shutdown unanswered this long is killed (exit 1)",
    )
    add(
        "--idle",
        action="store_true",
        help="start without a model: torch imported and the device initialized, /ready 503 (state idle) "
        "until POST /v1/bootstrap/swap gives it one",
    )
    add(
        "--request-trace-ratio",
        type=float,
        default=1.0,
        metavar="R",
        help="with --trace-file or --otlp: the share of requests, in [0, 1], traced when the caller sends no "
        "traceparent (a caller's traceparent decides by its sampled flag; default 1: every request)",
    )
    add(
        "--backend-factory",
        metavar="MODULE:CALLABLE",
        help="build the backend with CALLABLE(config) from MODULE instead of --backend "
        "(e.g. one wrapping the native engine; default: none)",
    )
    add(
        "--engine-in-process",
        action="store_true",
        help="run the engine in the server's process (default: a process of its own, so HTTP, tokens and SSE "
        "never share its GIL; --tp N runs it in each rank's process either way)",
    )
    add("--log-level", default="info", choices=["debug", "info", "warning", "error"], help="server log level")
    add(
        "--access-log",
        action="store_true",
        help="log every HTTP request, one line each (default: off, so readiness probes do not bury the stage lines)",
    )


def serve_options(args: argparse.Namespace, config: Any) -> Any:
    from bootstrap.config import ConfigError
    from bootstrap.serve.state import ServeOptions, parse_origins

    origins = parse_origins(getattr(args, "allowed_origins", None))  # first: the checks below come later
    if config.backend != "native":
        raise ConfigError(
            f"backend: {config.backend!r} is not served yet: the server answers through the native "
            "executor's request API (allowed: native; bootstrap run and plan take trtllm)"
        )
    check_rank_count(config)
    if not 0 <= args.port <= 65535:
        raise ConfigError(f"port: must be in [0, 65535] (got {args.port})")
    check_number("shutdown_timeout", args.shutdown_timeout, 0.0, MAX_SECONDS, unit=" seconds")
    check_dist_timeout(getattr(args, "dist_timeout", 600.0))  # a Namespace made by hand may leave it out
    drain = getattr(args, "drain_timeout", 30.0)  # a Namespace made by hand may leave it out
    check_number("drain_timeout", drain, 0.0, MAX_SECONDS, unit=" seconds")
    engine_timeout = getattr(args, "engine_timeout", 60.0)  # a Namespace made by hand may leave it out
    check_number("engine_timeout", engine_timeout, 0.0, MAX_SECONDS, low_open=True, unit=" seconds")
    ratio = getattr(args, "request_trace_ratio", 1.0)  # a Namespace made by hand may leave it out
    check_number("request_trace_ratio", ratio, 0.0, 1.0)
    host = getattr(args, "host", "127.0.0.1")  # a Namespace made by hand may leave it out
    if this_rank() == 0:  # the only rank that binds it (another host's address, under torchrun)
        check_host(host, args.port)
    check_kv_tokens(config)
    key = args.api_key if args.api_key is not None else os.environ.get(ENV_API_KEY)
    if key is not None and not key.strip():
        source = "--api-key" if args.api_key is not None else ENV_API_KEY
        raise ConfigError(f"api_key: must not be empty (from {source})")
    return ServeOptions(
        model_id=args.served_model_name or config.model,
        api_key=key,
        trace_file=args.trace_file,
        otlp=args.otlp,
        request_trace_ratio=ratio,
        backend_factory=args.backend_factory,
        shutdown_timeout_s=args.shutdown_timeout,
        drain_timeout_s=drain,
        engine_timeout_s=engine_timeout,
        idle=getattr(args, "idle", False),
        host=host,
        allowed_origins=origins,
        allow_open_operations=getattr(args, "allow_open_operations", False),  # a Namespace by hand may lack it
        engine_process=config.tensor_parallel_size == 1 and not getattr(args, "engine_in_process", True),
        log_level=getattr(args, "log_level", "info"),
    )


def main_serve(args: argparse.Namespace) -> int:
    """The server (``--tp N``: rank 0 of N, ``bootstrap.cli.serve_ranks``, or their launcher)."""
    try:
        with args.process.phase("checks"):
            config = config_from_args(args)
            options = serve_options(args, config)
            if options.backend_factory is None:
                if not options.idle:  # an idle server's model comes with its first swap
                    check_model_limits(config)
                require_engine()
            if needs_launch(config):
                check_tp_before_launch(config)
        if not getattr(args, "announced", False):
            announce(config, args)
    except BAD_INPUT_ERRORS as exc:
        if this_rank() == 0:  # every rank finds it alike: rank 0 says so
            print(f"bootstrap: {exc}", file=sys.stderr)
        else:
            with held_stops() as held:
                await_rank_0(held)
        return BAD_INPUT
    early = getattr(args, "early_engine", None)  # bootstrap.cli.entry's; a Namespace made by hand may lack it
    if early is not None and not options.engine_process:  # a server that keeps its engine inside
        early.kill()
    if needs_launch(config):
        return launch_ranks(args, config.tensor_parallel_size, main_serve, signalled=OK)
    try:
        if options.backend_factory is None and not options.engine_process:  # else the engine's process does
            triton_start.begin_for(config.device, config.backend, config.tensor_parallel_size)
        status, signalled = main_follower(config, args) if this_rank() > 0 else _main_rank_0(config, options, args)
    finally:
        leave()
    if signalled and RankEnv.from_env() is not None:
        _exit_now(status)
    return status


def _exit_now(status: int) -> None:
    """A rank stopped by a signal under a launcher exits here, all released: its agent, shutting
    down, reads no rank's result, and a rank that returned (or raised ``SystemExit(0)``, which
    the agent's wrapper turns into a return) would wait for that until it is killed."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _main_rank_0(config: Any, options: Any, args: argparse.Namespace) -> tuple[int, bool]:
    """The server, on its only rank or rank 0 of N: the exit status, and whether a signal stopped it."""
    spawn = None
    try:
        with args.process.phase("server"):  # the HTTP stack's imports; the port opens in _serve
            if options.engine_process:  # first: its imports of torch run beside the server's own
                from bootstrap.serve.startup.spawn import EngineSpawn, begins_triton

                triton = begins_triton(config.device, options.backend_factory)
                spawn = getattr(args, "early_engine", None)  # started by bootstrap.cli.entry, from a glance
                if spawn is not None and spawn.flags != (options.log_level, triton):  # the parser read otherwise
                    spawn.kill()
                    spawn = None
                spawn = spawn or EngineSpawn(options.log_level, triton)
            import fastapi  # noqa: F401
            import httptools  # noqa: F401
            import prometheus_client  # noqa: F401
            import uvicorn  # noqa: F401
            import uvloop

            import bootstrap.serve.app  # noqa: F401
    except ImportError as exc:
        print(
            f"bootstrap: serve needs the serve extra ({exc.name} is missing): pip install -e '.[serve]'",
            file=sys.stderr,
        )
        if spawn is not None:
            spawn.kill()
        return BAD_INPUT, False
    _configure_logging(args.log_level)
    try:
        # uvloop's event loop: every stream's chunk costs the loop's callbacks and a socket write
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            fatal, lost, signalled = runner.run(_serve(config, options, args, spawn))
    except OSError as exc:  # the port is taken, or the address is not this machine's
        print(f"bootstrap: cannot listen on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return BAD_INPUT, False
    finally:
        if spawn is not None:  # stopped by the shutdown; here when the server never served
            spawn.kill()
    report_threads(log)
    if lost is not None:
        print(f"bootstrap: the ranks fell out of step: {lost}", file=sys.stderr)
        return STAGE_FAILED, signalled
    if fatal is not None:  # a start that could not begin (2), or an engine's process that died (1)
        return getattr(fatal, "exit_status", BAD_INPUT), signalled
    return OK, signalled


async def _serve(
    config: Any, options: Any, args: argparse.Namespace, spawn: Any = None
) -> tuple[BaseException | None, str | None, bool]:
    """Serve until stopped: what stopped the start (``state.fatal``), why the ranks fell out
    of step (``--tp N``) if they did, and whether a stop signal came."""
    import uvicorn

    from bootstrap.serve.app import create_app
    from bootstrap.serve.state import ServeState

    state = ServeState(config, options, process=args.process, engine_spawn=spawn)
    servers: list[uvicorn.Server] = []
    app = create_app(state, on_fatal=lambda: _stop(servers))
    servers.append(
        _make_server(
            uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_level=args.log_level,
                access_log=getattr(args, "access_log", False),  # a Namespace made by hand may leave it out
                lifespan="on",
                http="httptools",  # C parsing; uvicorn's default falls back to h11 (pure Python) without it
                timeout_graceful_shutdown=options.shutdown_timeout_s + FORCE_AFTER_S,
            )
        )
    )
    leading = Leading(state, args, lambda: _stop(servers)) if config.tensor_parallel_size > 1 else None
    with _signals(state, servers[0]) as heard:
        try:
            await servers[0].serve()
        except SystemExit as exc:  # uvicorn's answer to a port it cannot bind (logged above)
            raise OSError("the server did not start") from exc
        finally:
            if leading is not None:
                await asyncio.to_thread(leading.close)
    return state.fatal, leading.lost if leading is not None else None, bool(heard)


def announce(config: Any, args: argparse.Namespace) -> None:
    """The first line, before the server's and the engine's imports."""
    trace = f"; trace: {args.trace_file}" if args.trace_file else ""
    model = "idle (no model until POST /v1/bootstrap/swap)" if getattr(args, "idle", False) else config.model
    print(
        f"bootstrap serve: {model} on {config.device}, http://{args.host}:{args.port}{trace}",
        file=sys.stderr,
        flush=True,
    )


def _make_server(config: Any) -> Any:
    """A ``uvicorn.Server`` whose signals are the serve command's (``_signals``): uvicorn's own
    handling re-raises the signal after shutdown, which would end a clean SIGTERM with -15."""
    import uvicorn

    class Server(uvicorn.Server):
        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            yield

    return Server(config)


def _stop(servers: list[Any]) -> None:
    for server in servers:
        server.should_exit = True


@contextlib.contextmanager
def _signals(state: Any, server: Any) -> Iterator[list[signal.Signals]]:
    """The stop signals' handlers while the server runs; yields the signals heard."""
    loop = asyncio.get_running_loop()
    heard: list[signal.Signals] = []

    def on_signal(sig: signal.Signals) -> None:
        heard.append(sig)
        if server.should_exit and sig == signal.SIGINT:
            _force(state, server, loop)
            return
        log.warning("%s: shutting down (again with SIGINT: cut requests short and exit)", sig.name)
        server.should_exit = True
        state.begin_shutdown()

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, on_signal, sig)
    try:
        yield heard
    finally:
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)


def _force(state: Any, server: Any, loop: asyncio.AbstractEventLoop) -> None:
    """The second SIGINT: skip the grace period. Requests in flight are cancelled in the executor,
    so each handler ends by itself (streams send ``cancelled`` and ``[DONE]``) and the shutdown goes
    on as after the grace period: exit 0, everything released. Not uvicorn's ``force_exit``, which
    skips the lifespan's shutdown and leaves the handlers to be cancelled mid-send (a traceback
    each). A connection still open ``FORCE_CLOSE_S`` later is closed under its handler."""
    count = state.cut_short()
    log.warning("SIGINT again: cancelled %d request(s) in flight; exiting without the grace period", count)
    loop.call_later(FORCE_CLOSE_S, _close_connections, server)


def _close_connections(server: Any) -> None:
    """Close what a second SIGINT left open: its handler then sees the client gone and ends."""
    connections = list(server.server_state.connections)
    if connections:
        log.warning("SIGINT again: closing %d connection(s) still open after %.0f s", len(connections), FORCE_CLOSE_S)
    for connection in connections:
        connection.transport.close()


def _configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(levelname)s:     %(message)s", stream=sys.stderr)
