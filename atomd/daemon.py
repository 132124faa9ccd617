"""The daemon: one asyncio process per host, everything it runs in one TaskGroup.

Owned tasks: the control API server, the peer-plane server (both uvicorn, in-process), the job
manager and the systemd watchdog. Training runs on the job manager's trainer thread, never on
the loop. SIGTERM/SIGINT: stop accepting jobs, stop the current job at a step boundary (it writes
a checkpoint), close the servers, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI

from atomd import systemd
from atomd.aio import unless_set
from atomd.config import Settings
from atomd.datadir import take_data_dir
from atomd.db import migrate, repo
from atomd.db.connection import make_engine, make_sessionmaker
from atomd.db.health import DatabaseFile, refuse_lost_database, until_unlocked
from atomd.errors import AtomdError, ConfigError
from atomd.jobs import JobManager, load_training_modules
from atomd.logs import Repeated, get_logger
from atomd.p2p.client import SERVER_KEEPALIVE_S
from atomd.p2p.congestion import tune
from atomd.p2p.identity import Identity
from atomd.p2p.node import SwarmNode
from atomd.sync.exchange import DeltaExchange
from atomd.telemetry import Telemetry
from atomd_api.control import ControlContext, create_control_app
from atomd_api.peer import create_peer_app

log = get_logger(__name__)

DATABASE_CHECK_S = 5.0  # how often the database file is checked (a stat and 16 bytes)


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the daemon owns SIGTERM and SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _bind(host_port: tuple[str, int], what: str) -> socket.socket:
    host, port = host_port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this: small responses are not held back by Nagle's
    # algorithm waiting for the client's delayed ACK (40 ms per keep-alive request otherwise).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port} for the {what}: {e.strerror}") from None
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _server(
    app: FastAPI, log_level: str, tls: ssl.SSLContext | None = None, keep_alive_s: float = 5
) -> _Server:
    config = uvicorn.Config(
        app,
        timeout_keep_alive=int(keep_alive_s),
        log_level=log_level.lower(),
        access_log=False,
        lifespan="off",
        timeout_graceful_shutdown=5,
        log_config=None,  # uvicorn's lines go through atomd's one format (atomd.logs)
        # The peer plane's TLS context (``atomd.p2p.tls``), made from the identity key.
        ssl_context_factory=None if tls is None else (lambda _config, _default: tls),
    )
    return _Server(config)


class Daemon:
    """``await Daemon(settings).run()`` serves until SIGTERM/SIGINT or ``request_shutdown()``."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.telemetry = Telemetry()
        self._shutdown = asyncio.Event()
        self._db_ready = False

    def request_shutdown(self, reason: str = "requested") -> None:
        if self._shutdown.is_set():
            log.info("already shutting down")
            return
        log.info("shutting down (%s): stopping the job at a step boundary", reason)
        self._shutdown.set()

    def readiness(self, jobs: JobManager, control: Any, peer: Any) -> dict[str, bool]:
        """``GET /readyz``'s checks: each part's readiness (``control`` and ``peer``: the
        servers, with uvicorn's ``started`` flag)."""
        return {
            "database": self._db_ready,
            # Before it, a job a SIGKILL interrupted still reads "running".
            "jobs": jobs.started,
            "control": control.started,
            "peer": peer.started,
            # False from SIGTERM on: the job checkpoints, then the daemon exits (seconds to
            # minutes), and a balancer or a launcher should send nothing new meanwhile.
            "accepting": not self._shutdown.is_set(),
        }

    async def run(self) -> None:
        s = self.settings
        s.data_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # SIGTERM's handler comes later: until then a signal ends the process, holding nothing.
        lock = await take_data_dir(s.data_dir, "run")
        try:
            await self._run()
        finally:
            os.close(lock)  # after everything that used the data directory has stopped

    async def _run(self) -> None:
        s = self.settings
        s.jobs_dir.mkdir(parents=True, exist_ok=True)
        control_sock = _bind(s.control_host_port, "control API")
        peer_sock = _bind(s.listen_host_port, "peer plane")
        refuse_lost_database(s.data_dir, s.db_path)
        await until_unlocked(
            "the database's migration", lambda: asyncio.to_thread(migrate.upgrade, s.db_path)
        )
        self._db_ready = True
        database = DatabaseFile(s.db_path)
        identity = Identity.load_or_create(s.data_dir)
        engine = make_engine(s.db_path)
        sessions = make_sessionmaker(engine)

        async def record_node() -> None:
            async with sessions() as session, session.begin():
                await repo.get_or_create_node(
                    session, peer_id=identity.peer_id, public_key=identity.public_key_hex
                )

        await until_unlocked("recording this node", record_node)
        log.info("peer id %s, swarm %r", identity.peer_id, s.swarm)
        jobs = JobManager(
            jobs_dir=s.jobs_dir,
            sessions=sessions,
            telemetry=self.telemetry,
            device=s.device,
            peer_id=identity.peer_id,
            trainer_nice=s.trainer_nice,
            progress_keep=s.progress_keep,
        )
        node = SwarmNode(
            settings=s, identity=identity, sessions=sessions, telemetry=self.telemetry, jobs=jobs
        )
        # The peer plane's connections, both ways, use the chosen congestion control: the
        # client's by its socket options, the server's accepted ones from its listening socket.
        tune(peer_sock, node.client.congestion.options)
        exchange = DeltaExchange(
            identity=identity,
            client=node.client,
            peers=node,
            sessions=sessions,
            telemetry=self.telemetry,
        )
        exchange.jobs = jobs
        node.on_excluded = exchange.drop_sender  # a quarantined member's waiting deltas go
        jobs.swarm = node
        jobs.data_names = dict(s.data_names)
        jobs.exchange = exchange
        control = _server(
            create_control_app(
                ControlContext(
                    settings=s,
                    jobs=jobs,
                    telemetry=self.telemetry,
                    sessions=sessions,
                    readiness=lambda: self.readiness(jobs, control, peer),
                    started_at=time.monotonic(),
                    swarm=node,
                    database=database,
                )
            ),
            s.log_level,
        )
        if s.peer_tls:
            from atomd.p2p.tls import server_context

            tls: ssl.SSLContext | None = server_context(identity, s.data_dir)
        else:
            tls = None
            log.warning(
                "peer plane without TLS (--no-peer-tls / ATOMD_PEER_TLS=false): deltas, job "
                "specs and checkpoints cross the network readable by anyone, and answers are "
                "not authenticated; use only on loopback or for debugging"
            )
        peer = _server(
            create_peer_app(node, exchange), s.log_level, tls, keep_alive_s=SERVER_KEEPALIVE_S
        )
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_shutdown, signal.Signals(sig).name)
        try:
            await node.load_records()  # refused from the peer plane's first answer
            async with asyncio.TaskGroup() as tg:
                # First: a resumed job's plugin hands it rounds as soon as it trains.
                exchange_task = tg.create_task(exchange.run(), name="delta-exchange")
                jobs_task = tg.create_task(jobs.run(), name="jobs")
                tg.create_task(control.serve(sockets=[control_sock]), name="control-server")
                tg.create_task(peer.serve(sockets=[peer_sock]), name="peer-server")
                watchdog = tg.create_task(self._watchdog(), name="watchdog")
                parent = tg.create_task(self._watch_parent(s.parent_pid), name="parent")
                db_watch = tg.create_task(self._watch_database(database), name="database")
                await self._until_ready(control, peer, jobs, node)
                node_task = tg.create_task(node.run(), name="swarm")
                preload = tg.create_task(self._preload(), name="preload")
                lan = await self._lan_discovery(node) if s.zeroconf else None
                await self._shutdown.wait()
                systemd.stopping()
                extend = tg.create_task(self._extend_stop_timeout(), name="extend-stop")
                # Tell the swarm first (peers stop counting on us within a second), then let
                # the job finish its step and checkpoint.
                leaving = tg.create_task(node.leave(), name="leave")
                await jobs.shutdown()
                await jobs_task  # the trainer has checkpointed and the job is recorded
                await leaving
                node_task.cancel()
                exchange_task.cancel()
                if lan is not None:
                    await lan.aclose()
                control.should_exit = peer.should_exit = True
                watchdog.cancel()
                parent.cancel()
                preload.cancel()
                db_watch.cancel()
                extend.cancel()
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            await engine.dispose()
            database.close()  # after the last connection: closing it earlier drops their locks
        log.info("stopped")

    async def _until_ready(
        self, control: _Server, peer: _Server, jobs: JobManager, node: SwarmNode
    ) -> None:
        # uvicorn exposes only a flag for "listening"; poll it briefly at start-up.
        while not (control.started and peer.started):  # noqa: ASYNC110
            await asyncio.sleep(0.02)
        # A SIGTERM while the jobs wait to be taken up (another process holds the database)
        # goes on to the shutdown, which makes the job manager give the wait up.
        started, _ = await unless_set(self._shutdown, jobs.wait_started())
        if not started:
            return
        s = self.settings
        log.info(
            "ready: control http://%s, peer plane %s (%s, %s, advertised %s), data %s",
            s.control,
            s.listen,
            "TLS" if s.peer_tls else "plain HTTP",
            node.client.congestion.note,
            s.advertise_url,
            s.data_dir,
        )
        systemd.ready()
        systemd.status("ready")

    async def _lan_discovery(self, node: SwarmNode) -> Any:
        """LAN discovery, or None with the reason logged: the daemon goes on without it (seeds
        and remembered peers still work) rather than crash and restart-loop under systemd."""
        from atomd.p2p.discovery import LanDiscovery

        try:
            return await LanDiscovery.create(
                swarm=self.settings.swarm,
                peer_id=node.peer_id,
                url=self.settings.advertise_url,
                on_found=node.lan_found,
            )
        except AtomdError as e:
            log.error("%s; going on without LAN discovery (--zeroconf)", e)
            return None

    async def _extend_stop_timeout(self) -> None:
        """While the job finishes its step and checkpoints, keep systemd from killing us."""
        while True:
            systemd.extend_timeout(30)
            await asyncio.sleep(10)

    async def _preload(self) -> None:
        """Load torch and the training code once ready, off the loop, so that a job (one
        started here or one a peer announces) starts training in a second, not after the
        seconds an import of torch takes on a busy machine. Readiness does not wait for it."""
        t0 = time.monotonic()
        await asyncio.to_thread(load_training_modules)
        log.debug("training code loaded in %.1f s", time.monotonic() - t0)

    async def _watch_database(self, database: DatabaseFile) -> None:
        """Log, as an error and then at a backoff, a database file that vanished or changed
        (``/readyz`` fails with the same reason meanwhile)."""
        repeated = Repeated(log, first=DATABASE_CHECK_S, longest=300.0)
        while True:
            await asyncio.sleep(DATABASE_CHECK_S)
            problem = await asyncio.to_thread(database.problem)
            if problem is None:
                repeated.clear("database")
            else:
                repeated.log("database", logging.ERROR, "%s", problem)

    async def _watch_parent(self, pid: int | None) -> None:
        """Shut down when the launcher that started us exits (``--parent-pid``)."""
        if pid is None:
            return
        ours = os.getppid() == pid  # its child: a new parent means it died
        while True:
            await asyncio.sleep(1.0)
            if (os.getppid() != pid) if ours else not _alive(pid):
                self.request_shutdown(f"its launcher, pid {pid}, has exited")
                return

    async def _watchdog(self) -> None:
        """WATCHDOG=1 at half the systemd timeout, from the loop: a stuck loop stops the pings."""
        interval = systemd.watchdog_interval()
        if interval is None:
            return
        while True:
            systemd.watchdog()
            await asyncio.sleep(interval)
