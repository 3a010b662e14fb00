"""``python -m config.web_server``: the web tier, daphne serving config.asgi, drained on SIGTERM.

daphne's own command stops at SIGTERM and drops the streams it is serving. Here the first SIGTERM
(or SIGINT) drains instead: the listening sockets close (no new connections), /ready answers
not_ready (core.draining), every open HTTP request and websocket runs to its end with its
bookkeeping (the ledger row, the quota settlement), and responses started meanwhile close their
connection after them (`Connection: close`); then the process exits 0. The grace period
(--drain-grace-s, default $PAGODA_WEB_DRAIN_GRACE_S or 30 s) bounds the wait; when it ends, open
websockets are sent close code 4503 and what is still open is cut as daphne would. A second signal
cuts it at once. The exit status is 0 either way.
"""

from __future__ import annotations

# daphne.server installs Twisted's asyncio reactor when imported: it must come before anything
# that imports the reactor.
import daphne.server  # isort: skip

import argparse
import logging
import signal
import sys
import time
from collections.abc import Sequence

from asgiref.compatibility import guarantee_single_callable
from daphne.access import AccessLogGenerator
from daphne.endpoints import build_endpoint_description_strings
from daphne.http_protocol import HTTPFactory, WebRequest
from daphne.utils import import_by_path
from daphne.ws_protocol import WebSocketProtocol
from twisted.internet import reactor

from config.env import ImproperlyConfiguredEnv, envfloat
from core.draining import is_draining, mark_draining

logger = logging.getLogger("pagoda.web")

DEFAULT_APPLICATION = "config.asgi:application"
# Connections the kernel queues for accept() (capped by net.core.somaxconn).
DEFAULT_BACKLOG = 1024
# How often a draining server looks for the end of its open connections.
DRAIN_POLL_S = 0.1
# Websocket close code for those still open when the grace period ends: 4000 + the HTTP status, as
# the websocket API's others (4401, 4400); autobahn lets a server send no 1001 ("going away").
WS_CLOSE_SHUTTING_DOWN = 4503
WS_CLOSE_WAIT_S = 1.0
# As daphne's command line sets them.
_LOG_LEVELS = {0: logging.WARNING, 1: logging.INFO, 2: logging.DEBUG, 3: logging.DEBUG}


class RawBodyRequest(WebRequest):
    """daphne's request without Twisted's parsing of form bodies into `request.args`, which daphne
    never reads (the application gets the raw body). That parse answered a malformed multipart body
    with a bare 400 of its own, before the application could answer it in the API's shape, and held
    a second copy of every upload in memory."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, parsePOSTFormSubmission=False, **kwargs)


class RawBodyHTTPFactory(HTTPFactory):
    def buildProtocol(self, addr):
        protocol = super().buildProtocol(addr)
        protocol.requestFactory = RawBodyRequest
        return protocol


class DrainingServer(daphne.server.Server):
    """daphne's Server with a drain on the first stop request and an immediate stop on the second."""

    def __init__(self, application, *, drain_grace_s: float, **kwargs) -> None:
        super().__init__(application, signal_handlers=False, **kwargs)
        self.drain_grace_s = drain_grace_s
        self.ports: list = []
        self.drain_deadline: float | None = None  # monotonic; set when the drain begins
        self._stopped = False

    def run(self) -> None:
        # daphne's run() builds its HTTPFactory by that name and then serves until the process ends.
        daphne.server.HTTPFactory = RawBodyHTTPFactory
        super().run()

    def listen_success(self, port) -> None:
        self.ports.append(port)
        super().listen_success(port)

    def stop(self) -> None:
        # Once: a stopping reactor refuses a second stop (a third signal, or one during the wait
        # for websocket close frames).
        if not self._stopped:
            self._stopped = True
            super().stop()

    def request_stop(self, signum: int, frame: object = None) -> None:
        """A signal handler: the work is done on the reactor, between its events."""
        reactor.callFromThread(self._on_stop_request, signum)

    def _on_stop_request(self, signum: int) -> None:
        if self.drain_deadline is not None:
            logger.warning("%s again: stopping now", signal.Signals(signum).name)
            self.stop()
            return
        mark_draining()
        self.drain_deadline = time.monotonic() + self.drain_grace_s
        for port in self.ports:
            port.stopListening()
        for protocol in self.open_connections():
            self._close_after_response(protocol)
        logger.info(
            "%s: draining %d open connections for up to %.0f s",
            signal.Signals(signum).name,
            len(self.open_connections()),
            self.drain_grace_s,
        )
        self._check_drained()

    def open_connections(self) -> list:
        """HTTP requests and websockets not yet ended, or whose application is still running (a
        stream's bookkeeping runs after its last byte). Idle keep-alive connections are not here:
        daphne tracks requests, and those hold none."""
        open_ = []
        for protocol, details in self.connections.items():
            instance = details.get("application_instance")
            if "disconnected" not in details or (instance is not None and not instance.done()):
                open_.append(protocol)
        return open_

    def _check_drained(self) -> None:
        open_ = self.open_connections()
        if not open_:
            logger.info("drained: every connection ended; stopping")
            self.stop()
            return
        assert self.drain_deadline is not None
        if time.monotonic() >= self.drain_deadline:
            logger.warning("drain grace period over with %d connections open; stopping", len(open_))
            closing = [p for p in open_ if isinstance(p, WebSocketProtocol) and p.state == p.STATE_OPEN]
            for protocol in closing:
                try:
                    protocol.sendClose(code=WS_CLOSE_SHUTTING_DOWN, reason="the server is shutting down")
                except Exception:  # whatever one socket does, the process must stop
                    logger.exception("could not close a websocket")
            # A stopping reactor drops its connections unflushed: the close frames need a moment.
            reactor.callLater(WS_CLOSE_WAIT_S if closing else 0, self.stop)
            return
        reactor.callLater(DRAIN_POLL_S, self._check_drained)

    @staticmethod
    def _close_after_response(protocol) -> None:
        # A connection kept alive would bring this process more requests; without it the client
        # connects again, to a process that is not going away.
        if isinstance(protocol, WebRequest) and protocol.channel is not None:
            protocol.channel.persistent = False

    async def handle_reply(self, protocol, message) -> None:
        if is_draining() and message.get("type") == "http.response.start":
            self._close_after_response(protocol)
            message = {**message, "headers": [*message.get("headers", ()), (b"connection", b"close")]}
        await super().handle_reply(protocol, message)


def listening_endpoints(args: argparse.Namespace) -> list[str]:
    """Twisted's endpoint descriptions of where to listen. Its listen backlog is 50 by default: a
    burst of clients connecting at once (a few hundred streams starting together) overflows it,
    and the kernel drops their connections before the server sees them."""
    endpoints = build_endpoint_description_strings(
        host=args.host, port=args.port, unix_socket=args.unix_socket, file_descriptor=args.fd
    )
    return [e if e.startswith("fd:") else f"{e}:backlog={args.backlog}" for e in endpoints]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m config.web_server",
        description="The web tier: daphne serving config.asgi, drained on SIGTERM.",
    )
    parser.add_argument("application", nargs="?", default=DEFAULT_APPLICATION, help="module:attribute")
    parser.add_argument("-b", "--bind", dest="host", default=None, help="address (default 127.0.0.1)")
    parser.add_argument("-p", "--port", type=int, default=None, help="TCP port (default 8000)")
    parser.add_argument("-u", "--unix-socket", default=None, help="listen on a unix socket instead")
    parser.add_argument("--fd", type=int, default=None, help="listen on an inherited file descriptor instead")
    parser.add_argument(
        "--backlog",
        type=int,
        default=DEFAULT_BACKLOG,
        help=f"connections the kernel queues before they are accepted (default {DEFAULT_BACKLOG})",
    )
    parser.add_argument(
        "--drain-grace-s",
        type=float,
        default=None,
        help="seconds a draining process waits for its open connections (default: "
        "$PAGODA_WEB_DRAIN_GRACE_S or 30)",
    )
    parser.add_argument("--access-log", default=None, help="file, or - for stdout (default at verbosity 1)")
    parser.add_argument("-v", "--verbosity", type=int, choices=(0, 1, 2, 3), default=1)
    parser.add_argument(
        "--proxy-headers",
        action="store_true",
        help="take the client's address and scheme from X-Forwarded-For, -Port and -Proto",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=_LOG_LEVELS[args.verbosity], format="%(asctime)-15s %(levelname)-8s %(message)s"
    )
    try:
        grace = args.drain_grace_s
        if grace is None:
            grace = envfloat("PAGODA_WEB_DRAIN_GRACE_S", 30.0)
    except ImproperlyConfiguredEnv as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if grace < 0:
        print(f"error: the drain grace period must be >= 0, got {grace}", file=sys.stderr)
        return 2
    if args.access_log == "-" or (args.access_log is None and args.verbosity >= 1):
        access_log = sys.stdout
    else:
        access_log = open(args.access_log, "a", 1) if args.access_log else None  # noqa: SIM115 - lives with the process
    if args.unix_socket is None and args.fd is None:
        args.host = args.host or "127.0.0.1"
        args.port = 8000 if args.port is None else args.port
    endpoints = listening_endpoints(args)
    application = guarantee_single_callable(import_by_path(args.application))
    # This process owns the requests it admits, and settles those that a dead one left behind.
    from inference.services.settler import settler_start
    from inference.services.warm import web_warm_start

    settler_start()
    # /ready says not ready until the models' tokenizers are loaded: the first requests would wait.
    web_warm_start()
    server = DrainingServer(
        application,
        drain_grace_s=grace,
        endpoints=endpoints,
        action_logger=AccessLogGenerator(access_log) if access_log else None,
        verbosity=args.verbosity,
        # daphne's command line defaults, where they differ from its Server's
        websocket_connect_timeout=5,
        websocket_handshake_timeout=5,
        proxy_forwarded_address_header="X-Forwarded-For" if args.proxy_headers else None,
        proxy_forwarded_port_header="X-Forwarded-Port" if args.proxy_headers else None,
        proxy_forwarded_proto_header="X-Forwarded-Proto" if args.proxy_headers else None,
    )
    # Installed before the reactor runs (Twisted installs none: signal_handlers=False).
    signal.signal(signal.SIGTERM, server.request_stop)
    signal.signal(signal.SIGINT, server.request_stop)
    logger.info("serving %s at %s", args.application, ", ".join(endpoints))
    server.run()
    # Stopped: a late signal (one more Ctrl-C) must not turn the exit status into a kill's.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    return 1 if server.abort_start else 0


if __name__ == "__main__":
    sys.exit(main())
