"""The gateway's view of the engine replicas: one ``Engine`` (tier "gpu") over all of them.

``ReplicaPool`` follows membership (``RayMembership`` reads the replica directory the replicas
keep in Ray; tests pass their own), holds one ``EngineClient`` connection per replica, and
routes each request:

- **prefix** (default): to the replica already holding the longest cached prefix of the
  prompt, found by the chained block hashes the engine's block manager uses (remembered per
  replica for what this gateway sent there, prompts and outputs, LRU-bounded), unless that
  replica is overloaded (``overload_queue`` waiting or ``overload_kv_use``); else, and for a
  prompt no replica holds, the least loaded replica;
- **least_loaded**: by requests running and waiting (the larger of the core's count and this
  gateway's own in-flight count, which moves before the core's next report), then KV use;
- **round_robin**: for comparison in ``bench/cluster.py``.

A request that fails before its first token because its replica died or refused it is retried
on another replica (``retries``), invisibly to the client; once a token was sent, it ends with
``reason="error"`` at once (the connection loss fails every live stream of that replica). A
replica that leaves membership gets no new requests and keeps its connection until what it runs
for us has finished.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine_cluster.config import ClusterConfig
from engine_gpu.block_manager import block_hashes, extend_block_hashes, salt_seed
from engine_gpu.client import EngineClient
from llm_shared import errors
from llm_shared.contract import FinishEvent, Priority, SamplingParams, StreamEvent, TokenEvent
from llm_shared.tokenizer import Tokenizer

log = logging.getLogger("engine_cluster.pool")

CONNECT_TIMEOUT_S = 10.0
PROBE_TIMEOUT_S = 5.0
MAX_MEMBER_CHARS = 256  # replica ids and core addresses read from the directory
SUMMED_STATS = ("waiting", "running", "kv_blocks_in_use", "kv_blocks_cached", "kv_blocks_free", "kv_blocks_total",
                "prefix_cache_queries", "prefix_cache_hits", "preemptions", "generated_tokens")


class Membership(Protocol):
    async def members(self) -> dict[str, str]:
        """Replica id -> engine-core address of every replica serving now."""


@dataclass(eq=False)
class Replica:
    replica_id: str
    address: str
    client: EngineClient
    hashes: OrderedDict[bytes, None] = field(default_factory=OrderedDict)
    in_flight: int = 0  # requests this gateway sent here that have not finished
    routed: int = 0  # requests this gateway ever sent here (spreads ties)
    leaving: bool = False  # no longer a member: no new requests

    @property
    def block_size(self) -> int:
        return int(self.client.info.get("block_size", 16))

    def load(self) -> tuple[float, float]:
        stats = self.client.stats()
        busy = max(float(self.in_flight), stats.get("running", 0.0) + stats.get("waiting", 0.0))
        return busy, self.kv_use()

    def kv_use(self) -> float:
        return self.client.kv_use()

    def matched_blocks(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if h not in self.hashes:
                break
            n += 1
        return n

    def remember(self, hashes: Sequence[bytes], limit: int) -> None:
        for h in hashes:
            self.hashes[h] = None
            self.hashes.move_to_end(h)
        while len(self.hashes) > limit:
            self.hashes.popitem(last=False)


class ReplicaPool:
    tier = "gpu"

    def __init__(self, cfg: ClusterConfig, tokenizer: Tokenizer, membership: Membership, *, secret: str,
                 connect: Callable[..., Awaitable[EngineClient]] = EngineClient.connect) -> None:
        self.cfg = cfg
        self._tokenizer = tokenizer
        self._membership = membership
        self._secret = secret
        self._connect = connect
        self.replicas: dict[str, Replica] = {}
        self._streams: dict[str, _PoolStream] = {}
        self._rr = itertools.count()
        self._drops: set[asyncio.Task[None]] = set()  # closing connections of replicas that left
        self._sync_task: asyncio.Task[None] | None = None
        self._closed = False
        self._failed_addresses: set[str] = set()  # logged once each
        self.routed: dict[str, int] = {"affine": 0, "least_loaded": 0, "round_robin": 0, "overloaded": 0,
                                       "retried": 0}

    # --- membership ---------------------------------------------------------------------------

    async def start(self, *, wait_s: float = 0.0) -> ReplicaPool:
        """Read membership once (waiting up to ``wait_s`` for a first replica), then follow it."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        await self.sync()
        while not self.ready and loop.time() < deadline:
            await asyncio.sleep(self.cfg.membership_poll_s)
            await self.sync()
        self._sync_task = asyncio.create_task(self._sync_loop(), name="replica-membership")
        return self

    async def _sync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.membership_poll_s)
            try:
                await self.sync()
            except Exception:  # one bad poll must not end membership for good
                log.exception("applying replica membership failed")

    async def sync(self) -> None:
        """Apply the current membership: connect new replicas, retire the ones gone."""
        try:
            members = await asyncio.wait_for(self._membership.members(), max(5.0, 4 * self.cfg.membership_poll_s))
        except Exception as e:  # keep routing to the replicas we know; try again next poll
            log.warning("reading replica membership failed: %s", e)
            return
        for replica_id, replica in list(self.replicas.items()):
            gone = members.get(replica_id) != replica.address
            if gone or not replica.client.ready:
                replica.leaving = True
                if replica.in_flight == 0 or not replica.client.ready:
                    await self._drop(replica)
        new = {r: a for r, a in members.items() if r not in self.replicas}
        if new:
            await asyncio.gather(*(self._add(r, a) for r, a in new.items()))

    async def _add(self, replica_id: str, address: str) -> None:
        try:
            client = await self._connect(address, secret=self._secret, tokenizer=self._tokenizer,
                                         timeout=CONNECT_TIMEOUT_S)
        except (errors.EngineUnavailableError, errors.ConfigError) as e:  # unreachable, or not an address
            if address not in self._failed_addresses:
                self._failed_addresses.add(address)
                log.warning("replica %s at %s: %s", replica_id, address, e)
            return
        self._failed_addresses.discard(address)
        self.replicas[replica_id] = Replica(replica_id, address, client)
        log.info("replica %s joined (%s); %d serving", replica_id, address, len(self.live()))

    async def _drop(self, replica: Replica) -> None:
        if self.replicas.get(replica.replica_id) is replica:
            del self.replicas[replica.replica_id]
            log.info("replica %s left; %d serving", replica.replica_id, len(self.live()))
        await replica.client.close()

    def live(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.client.ready and not r.leaving]

    # --- routing ------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """The replicas' KV block size (one engine config serves them all; 16 before any joined)."""
        return next((r.block_size for r in self.replicas.values()), 16)

    def choose(self, hashes: Sequence[bytes], exclude: frozenset[str] = frozenset()) -> tuple[Replica, str] | None:
        """The replica for a prompt with these block hashes (``block_hashes`` at ``block_size``),
        and why ("affine", "least_loaded", "round_robin", "overloaded": the affine replica was
        skipped)."""
        candidates = [r for r in self.live() if r.replica_id not in exclude]
        if not candidates:
            return None
        if self.cfg.route == "round_robin":
            return candidates[next(self._rr) % len(candidates)], "round_robin"
        least = min(candidates, key=lambda r: (r.load(), r.routed))
        if self.cfg.route == "least_loaded":
            return least, "least_loaded"
        best = max(candidates, key=lambda r: (r.matched_blocks(hashes), tuple(-x for x in r.load())))
        if best.matched_blocks(hashes) == 0:
            return least, "least_loaded"
        if self._overloaded(best):
            return (least, "overloaded") if least is not best else (best, "affine")
        return best, "affine"

    def _overloaded(self, replica: Replica) -> bool:
        return (replica.client.stats().get("waiting", 0.0) >= self.cfg.overload_queue
                or replica.kv_use() >= self.cfg.overload_kv_use)

    def _dispatched(self, replica: Replica, hashes: Sequence[bytes]) -> None:
        replica.in_flight += 1
        replica.routed += 1
        replica.remember(hashes, self.cfg.affinity_blocks)

    def _finished(self, replica: Replica, hashes: Sequence[bytes] = ()) -> None:
        """``hashes``: the blocks the replica now caches for the request (prompt and output)."""
        replica.in_flight -= 1
        replica.remember(hashes, self.cfg.affinity_blocks)
        if replica.leaving and replica.in_flight == 0:
            task = asyncio.get_running_loop().create_task(self._drop(replica))
            self._drops.add(task)
            task.add_done_callback(self._drops.discard)

    # --- Engine protocol ----------------------------------------------------------------------

    @property
    def tokenizer(self) -> Tokenizer:
        return self._tokenizer

    @property
    def ready(self) -> bool:
        return not self._closed and bool(self.live())

    @property
    def max_model_len(self) -> int:
        """The smallest context of the serving replicas (0 while none serves): what the gateway
        checks a prompt against before tokenizing it."""
        lens = [r.client.max_model_len for r in self.live() if r.client.max_model_len > 0]
        return min(lens, default=0)

    def generate(self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams,
                 priority: Priority = Priority.INTERACTIVE, session_id: str = "",
                 draft_ids: Sequence[int] = (), cache_salt: str = "") -> _PoolStream:
        return _PoolStream(self, request_id, list(prompt_ids), params, priority, list(draft_ids), cache_salt)

    async def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            await stream.abort()

    async def probe(self) -> None:
        live = self.live()
        if not live:
            raise errors.EngineUnavailableError("no engine replica is serving")
        results = await asyncio.gather(*(asyncio.wait_for(r.client.probe(), PROBE_TIMEOUT_S) for r in live),
                                       return_exceptions=True)
        if all(isinstance(x, BaseException) for x in results):
            raise errors.EngineUnavailableError(f"no engine replica answered ({results[0]})")

    async def end_session(self, session_id: str) -> None:
        """Replicas keep nothing per session (their prefix caches are found by block hashes)."""

    def stats(self) -> dict[str, float]:
        out = dict.fromkeys(SUMMED_STATS, 0.0)
        live = self.live()
        for replica in live:
            stats = replica.client.stats()
            for key in SUMMED_STATS:
                out[key] += float(stats.get(key, 0.0))
        out["replicas"] = float(len(live))
        # How requests were routed (exported with the other stats as engine_routed_*{tier="gpu"}).
        out.update({f"routed_{why}": float(n) for why, n in self.routed.items()})
        return out

    async def close(self) -> None:
        """Disconnect from every replica (their cores keep running: Ray owns them)."""
        self._closed = True
        if self._sync_task is not None:
            self._sync_task.cancel()
            await asyncio.gather(self._sync_task, return_exceptions=True)
        await asyncio.gather(*(r.client.close() for r in self.replicas.values()), return_exceptions=True)
        self.replicas.clear()


class _PoolStream:
    """One request's stream: opened on the chosen replica at the first ``__anext__``, re-opened on
    another replica while no token has been produced and that replica died or refused it."""

    def __init__(self, pool: ReplicaPool, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 priority: Priority, draft_ids: list[int], cache_salt: str) -> None:
        self._pool = pool
        self._request_id = request_id
        self._prompt_ids = prompt_ids
        self._params = params
        self._priority = priority
        self._draft_ids = draft_ids
        self._cache_salt = cache_salt
        self._hashes: list[bytes] | None = None  # the prompt's block chain, computed once
        self._replica: Replica | None = None
        self._inner: Any = None
        self._tried: set[str] = set()
        self._tokens: list[int] = []
        self._done = False
        self._aborted = False

    def __aiter__(self) -> _PoolStream:
        return self

    async def __anext__(self) -> StreamEvent:
        if self._done:
            raise StopAsyncIteration
        if self._aborted and self._inner is None:
            self._done = True
            return FinishEvent("abort", len(self._prompt_ids), 0, tier=ReplicaPool.tier)
        while True:
            try:
                if self._inner is None:
                    self._open()
                event = await self._inner.__anext__()
            except (errors.EngineUnavailableError, errors.OverloadedError) as e:
                if self._retry(str(e)):
                    continue
                self._finish()
                raise
            if (isinstance(event, FinishEvent) and event.reason == "error" and not self._tokens
                    and self._replica is not None and not self._replica.client.ready and self._retry(event.message)):
                continue  # its replica died before the first token: start over elsewhere
            if isinstance(event, TokenEvent):
                self._tokens.append(event.token_id)
            elif isinstance(event, FinishEvent):
                self._finish()
            return event

    def _open(self) -> None:
        pool = self._pool
        if self._hashes is None:
            self._hashes = block_hashes(self._prompt_ids, pool.block_size, self._cache_salt)
        choice = pool.choose(self._hashes, frozenset(self._tried))
        if choice is None:
            raise errors.EngineUnavailableError("no engine replica is available")
        replica, why = choice
        pool.routed[why] += 1
        self._replica = replica
        self._tried.add(replica.replica_id)
        pool._streams[self._request_id] = self
        pool._dispatched(replica, self._hashes)
        self._inner = replica.client.generate(self._request_id, self._prompt_ids, self._params, self._priority,
                                              draft_ids=self._draft_ids, cache_salt=self._cache_salt)

    def _retry(self, why: str) -> bool:
        """Give up the current replica; True when another attempt may start."""
        pool = self._pool
        if self._replica is None:
            return False  # no replica could take it at all
        pool._finished(self._replica)
        self._replica = None
        self._inner = None
        if self._aborted or len(self._tried) > pool.cfg.retries:
            return False
        log.info("request %s: retrying on another replica (%s)", self._request_id, why)
        pool.routed["retried"] += 1
        return True

    def _finish(self) -> None:
        self._done = True
        if self._replica is not None and self._hashes is not None:
            # The output's full blocks continue the prompt's chain (no rehashing of the prompt).
            hashes = list(self._hashes)
            extend_block_hashes(hashes, self._prompt_ids + self._tokens, self._pool.block_size,
                                (len(self._prompt_ids) + len(self._tokens)) // self._pool.block_size,
                                salt_seed(self._cache_salt))
            self._pool._finished(self._replica, hashes)
            self._replica = None
        if self._pool._streams.get(self._request_id) is self:
            del self._pool._streams[self._request_id]

    async def abort(self) -> None:
        self._aborted = True
        if self._replica is not None:
            await self._replica.client.abort(self._request_id)

    async def aclose(self) -> None:
        if self._inner is not None and not self._done:
            await self._inner.aclose()
            self._finish()


class RayMembership:
    """Membership from the replica directory in Ray (``engine_cluster.replica.EngineDirectory``).
    Joins the cluster on first use; Ray is imported only here."""

    def __init__(self, cfg: ClusterConfig) -> None:
        self.cfg = cfg
        self._directory: Any = None

    def _read(self) -> dict[str, str]:
        import ray

        from engine_cluster.replica import directory_handle

        if not ray.is_initialized():
            ray.init(address=self.cfg.ray_address, namespace=self.cfg.namespace, log_to_driver=False)
        if self._directory is None:
            self._directory = directory_handle(self.cfg.namespace, self.cfg.app_name)
        members = ray.get(self._directory.members.remote(self.cfg.membership_ttl_s), timeout=10.0)
        return valid_members(members)

    async def members(self) -> dict[str, str]:
        return await asyncio.to_thread(self._read)


def valid_members(members: object) -> dict[str, str]:
    """Replica id -> address from the directory's answer; entries that are not a short id with a
    ``tcp:``/``unix:`` address are left out (and logged) rather than trusted."""
    out: dict[str, str] = {}
    if not isinstance(members, dict):
        log.warning("the replica directory answered %s, not a mapping", type(members).__name__)
        return out
    for replica_id, member in members.items():
        address = member.get("address") if isinstance(member, dict) else None
        if (isinstance(replica_id, str) and 0 < len(replica_id) <= MAX_MEMBER_CHARS and isinstance(address, str)
                and len(address) <= MAX_MEMBER_CHARS and address.startswith(("tcp:", "unix:"))):
            out[replica_id] = address
        else:
            log.warning("ignoring a malformed replica directory entry %.100r", (replica_id, member))
    return out


def cluster_secret(secret_env: str) -> str:
    secret = os.environ.get(secret_env, "")
    if not secret:
        raise errors.ConfigError(f"[cluster] enabled: ${secret_env} must hold the engine replicas' shared secret")
    return secret
