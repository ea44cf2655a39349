"""``kvtier route --workers N``: N router processes on one port, each a whole router of its own.

Each worker binds the port with ``SO_REUSEPORT`` (the kernel spreads new connections across them), loads the
tokenizer, probes the replicas and follows their events itself: nothing is shared between workers, so they
scale with cores and a worker that dies takes only its own connections. With several routers, a session's
requests reach different ones, so their placement must not depend on what one router remembers:
``--sessions rendezvous`` (the default with more than one worker) sends a session to its rendezvous home
among the replicas within the load bound (kvtier.fleet.sessions), which every router computes alike. The
same holds for several ``kvtier route`` instances behind a load balancer, on one host or many.

The parent process only supervises: SIGTERM or SIGINT stops every worker; a worker that exits stops the rest,
and the parent exits with its status (a supervisor restarts the whole router).
"""

from __future__ import annotations

import argparse
import multiprocessing
import signal
from collections.abc import Callable
from multiprocessing.connection import wait

from kvtier.web.accept import listening_socket, paced_server
from kvtier.web.startup import favour_event_loop, freeze_startup_objects


def serve(args: argparse.Namespace, config, tokenizer) -> None:
    """Run one router (this process) on ``args.host:args.port`` until it is stopped."""
    from kvtier.apps.route.app import server_config
    from kvtier.apps.route.config import parse_replica
    from kvtier.apps.route.pd import PDRouter
    from kvtier.apps.route.service import Router

    decode = getattr(args, "decode", None)  # --prefill/--decode: prefill/decode disaggregation (pd.py)
    router = (PDRouter(config, tuple(parse_replica(item) for item in decode), tokenizer) if decode
              else Router(config, tokenizer))
    sock = listening_socket(args.host, args.port, reuse_port=True)  # each worker binds it; the kernel spreads
    # the tokenizer, uvicorn's protocol modules and what the lifespan made, out of the cyclic GC once loaded: no
    # 0.4 s collections under load (frozen before the server was built, the modules uvicorn loads inside run()
    # stayed for every full collection to walk)
    server = paced_server(server_config(router, args.host, args.port, args.log_level), sock,
                          on_started=freeze_startup_objects)
    favour_event_loop()  # snapshots are prepared in a worker thread: the loop gets the GIL back within 1 ms
    server.run()


def _worker(args: argparse.Namespace, router_config: Callable[[argparse.Namespace], object]) -> None:
    import logging

    from kvtier.apps.route.model import tokenizer_for

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    config = router_config(args)
    serve(args, config, tokenizer_for(args.model, [r.url for r in config.replicas], args.prompt_cache_entries))


def supervise(args: argparse.Namespace, router_config: Callable[[argparse.Namespace], object]) -> int:
    """Start ``args.workers`` router processes (``args.model`` already resolved; ``router_config`` builds each
    one's RouterConfig from ``args``, a module-level function) and wait for them."""
    context = multiprocessing.get_context("spawn")  # a fresh interpreter each: no forked loop, sockets or threads
    workers = [context.Process(target=_worker, args=(args, router_config), name=f"kvtier-route-{i}")
               for i in range(args.workers)]
    stopping = False

    def stop(signum, _frame) -> None:
        nonlocal stopping
        stopping = True
        for worker in workers:
            if worker.is_alive():
                worker.terminate()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    for worker in workers:
        worker.start()
    wait([worker.sentinel for worker in workers])
    first = next((w.exitcode for w in workers if w.exitcode is not None), 0)
    stop(signal.SIGTERM, None)
    for worker in workers:
        worker.join(timeout=30)
        if worker.is_alive():
            worker.kill()
            worker.join()
    return 0 if stopping and first in (0, -signal.SIGTERM) else 1 if first else 0
