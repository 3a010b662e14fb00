"""A replica's grammar compiles: a few compile processes, a queue per tenant, a timeout, cancellation.

Each slot is a thread that owns one compile process (engine.structured_output.compile_worker). Jobs
wait in their tenant's queue; a free slot takes the next job round robin over the tenants that hold
fewer than max_compiles_per_tenant slots, so one tenant's slow grammars never hold every slot. A job
past compile_timeout_s, or cancelled while it runs (every request waiting for it went away), has its
process killed; the slot starts a fresh one (a fork of the fork server: tens of milliseconds).

A compile still running after BACKGROUND_AFTER_S goes on at the nice value compile_nice (the compile
process runs each compile in a thread of its own, and lowers that thread's priority): when the
cores are busy, the engine's steps, which every tenant's tokens wait on, come before one request's
slow grammar, and a tenant who sends grammars that take seconds to compile slows its own requests
rather than everyone's. Ordinary grammars compile well within BACKGROUND_AFTER_S.
"""

from __future__ import annotations

import collections
import json
import logging
import math
import multiprocessing
import threading
import time
from concurrent.futures import Future
from typing import Any

from engine.config import StructuredOutputConfig
from engine.errors import InvalidRequestError
from engine.protocol import ErrorCode

logger = logging.getLogger(__name__)

# How often a slot waiting for its process looks at its job's cancel flag and timeout.
_POLL_S = 0.01
# A compile process that does not start within this long is a broken engine, not a slow grammar.
_START_TIMEOUT_S = 120.0
_WORKER_MODULE = "engine.structured_output.compile_worker"
# Seconds a compile runs at the engine's priority before it goes on at compile_nice.
BACKGROUND_AFTER_S = 0.2


class GrammarCompileError(InvalidRequestError):
    """A grammar the engine refuses to serve: `code` is an ErrorCode (GRAMMAR_COMPILE_TIMEOUT,
    GRAMMAR_TOO_COSTLY, INVALID_REQUEST, or ENGINE_ERROR when its compile process failed)."""

    def __init__(self, message: str, code: ErrorCode) -> None:
        super().__init__(message)
        self.code = code


class CompileJob:
    """One grammar compile; `future` holds the CompiledGrammar or a GrammarCompileError."""

    __slots__ = (
        "key",
        "spec",
        "tenant",
        "deadline",
        "dropped",
        "future",
        "started",
        "cancelled",
        "waiters",
        "nbytes",
        "mask_ms",
    )

    def __init__(self, key: Any, spec: dict[str, Any], tenant: str, deadline: float | None = None) -> None:
        self.key = key
        self.spec = spec
        self.tenant = tenant
        # Unix time after which no request waits for it (the latest of its requests' queue
        # deadlines; inf when one has none): a job still queued then is never started.
        self.deadline = math.inf if deadline is None else deadline
        self.dropped = False  # past its deadline when a slot came to it: it will never run
        self.future: Future = Future()
        self.started = False  # a slot took it: its compile is billed to the requests waiting
        self.cancelled = threading.Event()
        self.waiters = 0  # requests waiting for it (the manager's count)
        self.nbytes = 0  # what its cache entry holds once done
        self.mask_ms = 0.0  # the costliest token mask the probe met (CPU ms), once compiled


def _context() -> Any:
    ctx = multiprocessing.get_context("forkserver")
    # Before the fork server starts (the first compile process of the engine), so every compile
    # process is forked with xgrammar loaded; a no-op for the fork server once it runs.
    ctx.set_forkserver_preload([_WORKER_MODULE])
    return ctx


class CompilePool:
    def __init__(self, tokenizer_info: Any, config: StructuredOutputConfig) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.info = tokenizer_info
        self._info_json = tokenizer_info.serialize_json().encode()
        self.config = config
        self._ctx = _context()
        self._cond = threading.Condition()
        self._queues: collections.OrderedDict[str, collections.deque[CompileJob]] = collections.OrderedDict()
        self._running: collections.Counter[str] = collections.Counter()
        self._closed = False
        self.num_timeouts = 0
        self.num_cancelled = 0
        self.num_background = 0  # compiles that went on at compile_nice (BACKGROUND_AFTER_S)
        self.num_expired = 0  # jobs past their deadline when a slot came to them: never started
        # Seconds per finished compile, newest last (the benchmark reads them).
        self.compile_seconds: collections.deque[float] = collections.deque(maxlen=4096)
        self._slots = [_Slot(self, i) for i in range(config.max_compiles)]
        for slot in self._slots:
            slot.start()

    def submit(
        self, key: Any, spec: dict[str, Any], tenant: str, deadline: float | None = None
    ) -> CompileJob:
        job = CompileJob(key, spec, tenant, deadline)
        with self._cond:
            self._queues.setdefault(tenant, collections.deque()).append(job)
            self._cond.notify()
        return job

    def extend_deadline(self, job: CompileJob, deadline: float | None) -> bool:
        """Another request waits for a job, until `deadline` (None: for as long as it takes). False
        when the job was dropped past its deadline: the request needs a new one."""
        with self._cond:
            if job.dropped:
                return False
            job.deadline = max(job.deadline, math.inf if deadline is None else deadline)
            return True

    def cancel(self, job: CompileJob) -> None:
        """Drop a queued job, or kill the process of a running one: its slot is free within _POLL_S."""
        with self._cond:
            job.cancelled.set()
            queue = self._queues.get(job.tenant)
            if not job.started and queue is not None and job in queue:
                queue.remove(job)
                if not queue:
                    del self._queues[job.tenant]
        self.num_cancelled += 1
        job.future.cancel()  # a queued job's; a running job's future is left to its slot

    @property
    def num_queued(self) -> int:
        with self._cond:
            return sum(len(q) for q in self._queues.values())

    def _take(self) -> CompileJob | None:
        limit = self.config.max_compiles_per_tenant
        with self._cond:
            while True:
                if self._closed:
                    return None
                now = time.time()
                for tenant, queue in list(self._queues.items()):
                    # Past its deadline nobody waits for it: the engine ends its requests unbilled
                    # (queue_timeout), and its compile is never started.
                    while queue and queue[0].deadline <= now:
                        queue.popleft().dropped = True
                        self.num_expired += 1
                    if not queue:
                        del self._queues[tenant]
                        continue
                    if self._running[tenant] < limit:
                        job = queue.popleft()
                        if queue:
                            self._queues.move_to_end(tenant)  # round robin over the tenants
                        else:
                            del self._queues[tenant]
                        self._running[tenant] += 1
                        job.started = True
                        return job
                self._cond.wait()

    def _finished(self, job: CompileJob) -> None:
        with self._cond:
            self._running[job.tenant] -= 1
            if not self._running[job.tenant]:
                del self._running[job.tenant]
            self._cond.notify_all()

    def shutdown(self) -> None:
        with self._cond:
            self._closed = True
            jobs = [job for queue in self._queues.values() for job in queue]
            self._queues.clear()
            self._cond.notify_all()
        for job in jobs:
            job.future.cancel()
        for slot in self._slots:
            slot.stop()


class _Slot(threading.Thread):
    def __init__(self, pool: CompilePool, index: int) -> None:
        super().__init__(name=f"grammar-compile-{index}", daemon=True)
        self.pool = pool
        self._process: Any = None
        self._conn: Any = None
        # stop() comes from another thread (the pool's shutdown) while this one may be killing or
        # starting its process: one of them at a time, and none started after stop().
        self._process_lock = threading.RLock()
        self._stopped = False

    def run(self) -> None:
        while (job := self.pool._take()) is not None:
            try:
                self._compile(job)
            except Exception:  # a broken compile process: this job fails, the next one gets a new one
                logger.exception("grammar compile process failed")
                self._kill()
                _settle(
                    job,
                    exc=GrammarCompileError("The grammar compile process failed.", ErrorCode.ENGINE_ERROR),
                )
            finally:
                self.pool._finished(job)

    def _compile(self, job: CompileJob) -> None:
        if job.cancelled.is_set():
            return
        conn = self._ensure_process()
        config = self.pool.config
        started = time.perf_counter()
        request = {
            "spec": job.spec,
            "max_mask_ms": config.max_mask_ms,
            "background_after_s": BACKGROUND_AFTER_S,
            "nice": config.compile_nice,
        }
        conn.send_bytes(json.dumps(request).encode())
        deadline = time.monotonic() + config.compile_timeout_s
        while not conn.poll(_POLL_S):
            if job.cancelled.is_set():
                self._kill()
                return
            if time.monotonic() >= deadline:
                self._kill()
                self.pool.num_timeouts += 1
                message = (
                    "The structured output grammar took longer than this engine's limit of "
                    f"{config.compile_timeout_s:g} s (compile_timeout_s) to compile and was refused."
                )
                _settle(job, exc=GrammarCompileError(message, ErrorCode.GRAMMAR_COMPILE_TIMEOUT))
                return
        header = json.loads(conn.recv_bytes())
        if header.get("background"):
            self.pool.num_background += 1
        if not header["ok"]:
            _settle(job, exc=GrammarCompileError(header["message"], ErrorCode(header["code"])))
            return
        text = conn.recv_bytes().decode()
        compiled = self.pool._xgr.CompiledGrammar.deserialize_json(text, self.pool.info)
        self.pool.compile_seconds.append(time.perf_counter() - started)
        job.mask_ms = float(header["mask_ms"])
        _settle(job, result=compiled)

    def _ensure_process(self) -> Any:
        with self._process_lock:
            return self._start_process()

    def _start_process(self) -> Any:
        if self._stopped:
            raise RuntimeError("the grammar compile pool is shut down")
        if self._process is not None and self._process.is_alive():
            return self._conn
        self._kill()
        from engine.structured_output import compile_worker

        ours, theirs = self.pool._ctx.Pipe()
        process = self.pool._ctx.Process(target=compile_worker.serve, args=(theirs,), daemon=True)
        process.start()
        theirs.close()
        self._process, self._conn = process, ours
        ours.send_bytes(self.pool._info_json)
        if not ours.poll(_START_TIMEOUT_S):
            raise RuntimeError("the grammar compile process did not start")
        json.loads(ours.recv_bytes())
        return ours

    def _kill(self) -> None:
        with self._process_lock:
            if self._process is not None:
                self._process.kill()
                self._process.join()
                self._conn.close()
            self._process = self._conn = None

    def stop(self) -> None:
        with self._process_lock:
            self._stopped = True
            self._kill()


def _settle(job: CompileJob, *, result: Any = None, exc: BaseException | None = None) -> None:
    if not job.future.set_running_or_notify_cancel():
        return  # cancelled meanwhile: nobody waits for it
    if exc is not None:
        job.future.set_exception(exc)
    else:
        job.future.set_result(result)
