"""The body of a grammar compile process: compiles one spec per message and measures its mask cost.

Compiles run in processes of their own (forked from a fork server that has xgrammar loaded, so a new
one starts in tens of milliseconds), because xgrammar cannot stop a compile once it has begun: a
compile past its timeout, or whose requests all went away, is ended by killing its process.

Messages are JSON bytes on a multiprocessing connection (never pickled data): first the tokenizer
info (xgrammar's serialize_json), then per job {"spec", "max_mask_ms", "background_after_s", "nice"};
the answer is a header {"ok": true, "mask_ms", "background"} followed by the compiled grammar's
JSON, or {"ok": false, "code", "message", "background"}.

Each job runs in a thread of its own. One still running after background_after_s has that thread's
nice value raised to `nice` (Linux keeps a nice value per thread): the rest of a slow compile yields
the cores to the engine's steps. The process's main thread keeps its priority, and the next job's
thread starts at it again: a priority, once lowered, cannot be raised back without privileges.
"""

from __future__ import annotations

import json
import logging
import os
import random
import threading
import time
from typing import Any

import numpy as np
import xgrammar as xgr

from engine.protocol import ErrorCode
from engine.structured_output.grammar import build_grammar
from engine.structured_output.spec import StructuredOutputsError

logger = logging.getLogger(__name__)

# The mask cost probe: this many walks of this many tokens from the initial state, each token drawn
# (seeded) among those the grammar allows. Cheap for a well-behaved grammar (tens of microseconds per
# mask); the masks of a costly one grow dearer as a walk goes deeper (.{0,4000}: about 1 ms at 16
# tokens, 10 ms and more at 48), and the walk stops as soon as one passes the bound.
PROBE_WALKS = 2
PROBE_STEPS = 48
PROBE_REPEATS = 3


def _fill_ms(matcher: Any, bitmask: Any, budget_ms: float) -> float:
    """The CPU time (ms) of filling this state's mask. A fill past the budget is timed again, up to
    PROBE_REPEATS times, and the cheapest counts: filling does not move the matcher, so the repeats
    time the same work, and a loaded machine (a cold cache, page faults, a busy sibling core) only
    ever adds time. A grammar whose masks are truly costly stays past the budget on every repeat."""
    best = float("inf")
    for _ in range(PROBE_REPEATS):
        started = time.thread_time()
        matcher.fill_next_token_bitmask(bitmask)
        best = min(best, (time.thread_time() - started) * 1000)
        if best <= budget_ms:
            break
    return best


def mask_cost_ms(compiled: Any, info: Any, *, budget_ms: float, seed: int = 0) -> float:
    """The largest CPU time (ms) one token mask took on the probe's walks; stops early past the
    budget. CPU time of this thread, so that a busy machine does not make a grammar look costly."""
    vocab_size = info.vocab_size
    stops = set(info.stop_token_ids)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    rng = random.Random(seed)
    worst = 0.0
    for _ in range(PROBE_WALKS):
        matcher = xgr.GrammarMatcher(compiled)
        for _ in range(PROBE_STEPS):
            worst = max(worst, _fill_ms(matcher, bitmask, budget_ms))
            if worst > budget_ms:
                return worst
            bits = np.unpackbits(bitmask.numpy().view(np.uint8), bitorder="little")[:vocab_size]
            allowed = [t for t in np.flatnonzero(bits).tolist() if t not in stops]
            if not allowed or not matcher.accept_token(rng.choice(allowed)):
                break
    return worst


def compile_one(compiler: Any, info: Any, job: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """One job's answer: its header, and the compiled grammar's JSON when it compiled."""
    try:
        compiled = compiler.compile_grammar(build_grammar(job["spec"]))
    except StructuredOutputsError as exc:
        return {"ok": False, "code": ErrorCode.INVALID_REQUEST, "message": str(exc)}, None
    except Exception as exc:  # xgrammar failing on a grammar it built: that request's error alone
        message = f"The grammar could not be compiled: {type(exc).__name__}"
        return {"ok": False, "code": ErrorCode.INVALID_REQUEST, "message": message}, None
    limit = float(job["max_mask_ms"])
    cost = mask_cost_ms(compiled, info, budget_ms=limit)
    if cost > limit:
        message = (
            f"The structured output grammar is too costly to enforce: one token mask took {cost:.1f} ms"
            f" of CPU time, above this engine's limit of {limit:g} ms (max_mask_ms). Bounded"
            " repetitions of wide character classes (such as .{0,4000}) cost the most."
        )
        return {"ok": False, "code": ErrorCode.GRAMMAR_TOO_COSTLY, "message": message}, None
    return {"ok": True, "mask_ms": cost}, compiled.serialize_json()


def _run_in_thread(compiler: Any, info: Any, job: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    answer: list[tuple[dict[str, Any], str | None]] = []
    worker = threading.Thread(target=lambda: answer.append(compile_one(compiler, info, job)), daemon=True)
    worker.start()
    worker.join(float(job.get("background_after_s", 0.0)))
    background = False
    nice = int(job.get("nice", 0))
    if worker.is_alive() and nice > 0 and worker.native_id is not None:
        try:
            os.setpriority(os.PRIO_PROCESS, worker.native_id, nice)
            background = True
        except OSError:  # it ended meanwhile, or the platform refuses: it runs on as it is
            logger.debug("could not lower a compile thread's priority", exc_info=True)
    worker.join()
    if not answer:  # the thread died without an answer: compile_one catches what a grammar raises
        return {"ok": False, "code": ErrorCode.ENGINE_ERROR, "message": "The grammar compile failed."}, None
    header, text = answer[0]
    header["background"] = background
    return header, text


def serve(conn: Any) -> None:
    """The compile process's loop (the target of its Process)."""
    info = xgr.TokenizerInfo.deserialize_json(conn.recv_bytes().decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send_bytes(b'{"ready": true}')
    while True:
        try:
            job = json.loads(conn.recv_bytes())
        except EOFError:
            return
        header, text = _run_in_thread(compiler, info, job)
        conn.send_bytes(json.dumps(header).encode())
        if text is not None:
            conn.send_bytes(text.encode())
