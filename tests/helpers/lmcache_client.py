"""A minimal client of a running LMCache MP server (`kvtc lmcache-server`), for the live test and benchmarks
(test code: not part of the installed package; benches put tests/ on sys.path).

It drives the server the way vLLM's `LMCacheMPConnector` does and with LMCache 0.5.6's own client
classes (the ones behind `lmcache bench server`): each tensor-parallel rank is a worker that registers
its paged KV cache, one tensor per layer shaped (2, blocks, block_size, kv_heads, head_dim) (vLLM's
NHD layout), under its own instance id, in LMCache's server-driven transfer mode (`lmcache_driven`:
REGISTER_KV_CACHE, then STORE / RETRIEVE naming block ids; on a CPU the server reaches the tensors
through POSIX shared memory). Keys are `IPCCacheServerKey`s: token ids, the [start, end) token range,
world size, worker id and the request's tenant (`cache_salt`, vLLM's per-request salt; "" for none); the server
hashes them into one `ObjectKey` per chunk.

    client = MPClient("tcp://127.0.0.1:6555", "my-model", layers=30, kv_heads=3, head_dim=64, tp=1)
    client.write(rank, blocks, keys, values)      # (L, H, T, D) into the paged cache
    client.store("req-1", tokens, blocks)         # every rank's STORE
    client.clear_l1()
    client.lookup("req-2", tokens)                # -> chunks found (prefetched into L1 from L2)
    client.retrieve("req-2", tokens, blocks)      # every rank's RETRIEVE
    keys, values = client.read(rank, blocks)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

INSTANCE_ID_BASE = 7000
TRANSFER_MODE = "lmcache_driven"  # server-driven: the mode a vLLM deployment of this path uses


class MPClient:
    """tp workers of one engine. kv_heads: every rank's KV heads (the model's / tp); timeout: seconds any
    one call may take before TimeoutError."""

    def __init__(self, url: str, model_name: str, *, layers: int, kv_heads: int, head_dim: int, tp: int = 1,
                 num_blocks: int = 64, block_size: int = 16, dtype: torch.dtype = torch.bfloat16,
                 timeout: float = 60.0, instance_base: int = INSTANCE_ID_BASE) -> None:
        import zmq
        from lmcache.utils import EngineType
        from lmcache.v1.multiprocess.group_view import EngineGroupInfo
        from lmcache.v1.multiprocess.transfer_context import create_transfer_context
        from lmcache.v1.multiprocess.transport.factory import RequestClientFactory

        self.model_name, self.tp, self.timeout = model_name, tp, timeout
        self.block_size, self.num_blocks = block_size, num_blocks
        self._zmq = zmq.Context()
        self._zmq.setsockopt(zmq.LINGER, 0)
        self.client = RequestClientFactory.create(url, context=self._zmq)
        self.workers: list[tuple[Any, dict[str, torch.Tensor]]] = []
        try:
            self.chunk_size = int(self._result(self.client.get_chunk_size(), "GET_CHUNK_SIZE"))
            if self.chunk_size % block_size:
                raise ValueError(f"the server's chunk size {self.chunk_size} is not a multiple of block_size {block_size}")
            groups = [EngineGroupInfo(engine_group_id=0, layer_indices=tuple(range(layers)), tokens_per_block=block_size)]
            for rank in range(tp):
                kv = {f"model.layers.{i}.self_attn": torch.zeros(2, num_blocks, block_size, kv_heads, head_dim,
                                                                 dtype=dtype) for i in range(layers)}
                ctx = create_transfer_context(kv, mode=TRANSFER_MODE, instance_id=instance_base + rank,
                                              req_client=self.client)
                ctx.register(kv, model_name, tp, self.chunk_size // block_size, timeout,
                             layout_hints={"kv_layout": "NHD"}, engine_group_infos=groups, engine_type=EngineType.VLLM)
                self.workers.append((ctx, kv))
        except BaseException:
            self.close()
            raise

    def _result(self, future: Any, what: str) -> Any:
        try:
            return future.result(timeout=self.timeout)
        except TimeoutError as exc:
            raise TimeoutError(f"LMCache server: {what} did not answer within {self.timeout:g} s") from exc

    def _key(self, request_id: str, tokens: list[int], start: int, end: int, worker: int | None, salt: str = "") -> Any:
        from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey

        return IPCCacheServerKey(model_name=self.model_name, world_size=self.tp, worker_id=worker,
                                 token_ids=tuple(tokens), start=start, end=end, request_id=request_id,
                                 num_kv_readers=1, cache_salt=salt)

    # -- the paged cache

    def write(self, rank: int, blocks: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """keys, values (L, H, T, D), T = len(blocks) x block_size, into rank's blocks `blocks`."""
        _, kv = self.workers[rank]
        for layer, t in enumerate(kv.values()):
            for i, x in enumerate((keys, values)):
                L, H, T, D = x.shape
                t[i, blocks] = x[layer].permute(1, 0, 2).reshape(len(blocks), self.block_size, H, D).to(t.dtype)

    def read(self, rank: int, blocks: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """rank's blocks `blocks` -> keys, values (L, H, T, D)."""
        _, kv = self.workers[rank]
        out = []
        for i in range(2):
            x = torch.stack([t[i, blocks] for t in kv.values()])  # (L, n, bs, H, D)
            L, n, bs, H, D = x.shape
            out.append(x.reshape(L, n * bs, H, D).permute(0, 2, 1, 3).contiguous())
        return out[0], out[1]

    def zero(self, rank: int, blocks: list[int]) -> None:
        for t in self.workers[rank][1].values():
            t[:, blocks] = 0

    # -- requests

    def store(self, request_id: str, tokens: list[int], blocks: list[int], start: int = 0, salt: str = "") -> list[bool]:
        """STORE the complete chunks of tokens[start:] from `blocks` (the request's blocks from token 0), every
        rank, for the tenant `salt` -> per rank, whether the server accepted the store (it reaches L2 later,
        asynchronously)."""
        end = len(tokens) - len(tokens) % self.chunk_size
        ids = [blocks[start // self.block_size:end // self.block_size]]
        out = []
        for rank, (ctx, kv) in enumerate(self.workers):
            event = ctx.create_recorded_event()
            future = ctx.submit_store(request_id, self._key(request_id, tokens, start, end, rank, salt), kv, ids, event,
                                      self.chunk_size // self.block_size)
            out.append(bool(self._result(future, f"STORE rank {rank}")))
        return out

    def lookup(self, request_id: str, tokens: list[int], poll: float = 0.02, salt: str = "") -> int:
        """LOOKUP for the tenant `salt`, then poll its prefetch (L2 -> L1) -> complete chunks found from token 0."""
        end = len(tokens) - len(tokens) % self.chunk_size
        self._result(self.client.lookup(self._key(request_id, tokens, 0, end, None, salt), self.tp), "LOOKUP")
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            hits = self._result(self.client.query_prefetch_status(request_id), "QUERY_PREFETCH_STATUS")
            if hits is not None:
                return int(hits)
            time.sleep(poll)
        raise TimeoutError(f"LMCache server: the prefetch of {request_id} did not finish within {self.timeout:g} s")

    def retrieve(self, request_id: str, tokens: list[int], blocks: list[int], chunks: int | None = None,
                 salt: str = "") -> list[bool]:
        """RETRIEVE the first `chunks` chunks (default: every complete chunk) into `blocks`, every rank, for the
        tenant `salt`."""
        n = (len(tokens) // self.chunk_size) if chunks is None else chunks
        end = n * self.chunk_size
        ids = [blocks[:end // self.block_size]]
        out = []
        for rank, (ctx, kv) in enumerate(self.workers):
            event = ctx.create_recorded_event()
            future = ctx.submit_retrieve(request_id, self._key(request_id, tokens, 0, end, rank, salt), kv, ids, event,
                                         self.chunk_size // self.block_size, skip_first_n_tokens=0)
            out.append(bool(self._result(future, f"RETRIEVE rank {rank}")))
        return out

    def end_session(self, request_id: str) -> None:
        self._result(self.client.end_session(request_id), "END_SESSION")

    def clear_l1(self, force: bool = True) -> None:
        """Drop every object of the server's L1 (host memory) tier; L2 keeps its copies."""
        self._result(self.client.clear(force), "CLEAR")

    def close(self) -> None:
        for ctx, _ in self.workers:
            try:
                ctx.flush_inflight_stores()
                future = ctx.unregister()
                if future is not None:
                    future.result(timeout=min(self.timeout, 10.0))
            except Exception:  # the server may be gone already
                pass
            finally:
                ctx.close()
        self.workers = []
        try:
            self.client.close()
        finally:
            self._zmq.term()


def launcher() -> list[str]:
    """The command that runs `kvtc lmcache-server`: the installed script beside this Python, else the module."""
    kvtc = Path(sys.executable).with_name("kvtc")
    return [str(kvtc), "lmcache-server"] if kvtc.exists() else [sys.executable, "-m", "kvtc.pipeline.cli", "lmcache-server"]


@contextmanager
def server_process(args: list[str], log: Path, stop_timeout: float = 20.0) -> Iterator[subprocess.Popen]:
    """`kvtc lmcache-server ARGS` in its own process group, output to `log`; stopped on exit (SIGTERM to
    the group, SIGKILL after `stop_timeout` seconds)."""
    with open(log, "wb") as out:
        proc = subprocess.Popen([*launcher(), *args], stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "LMCACHE_DISABLE_BANNER": "1"}, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=stop_timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=stop_timeout)


def connect(proc: subprocess.Popen, url: str, model_name: str, *, start_timeout: float = 240.0, log: Path | None = None,
            **options: Any) -> MPClient:
    """An MPClient of the server `proc` runs, retried until it answers; RuntimeError (with the end of its log)
    if the server exits, TimeoutError after `start_timeout` seconds."""
    deadline = time.monotonic() + start_timeout
    while True:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-4000:] if log is not None else ""
            raise RuntimeError(f"the LMCache server exited ({proc.returncode}) before answering:\n{tail}")
        try:
            return MPClient(url, model_name, **{"timeout": 30.0, **options})
        except TimeoutError:
            if time.monotonic() > deadline:
                raise
