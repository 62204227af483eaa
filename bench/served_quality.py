"""Served quality: the model's perplexity through every serving path, beside the offline codec's.

    kvtc calibrate --registry REG --name smollm2-mse                           # the default job
    kvtc calibrate --registry REG --name smollm2-attn --objective attention
    python bench/served_quality.py --registry REG --artifacts smollm2-mse@latest smollm2-attn@latest \
        --ratios 8,16,32 --domains stdlib,licenses=/usr/share/common-licenses --out bench/figures

A domain's corpus may be `repeat:CORPUS`: each sequence a passage of CORPUS followed by itself, so the scored
tokens repeat what the prefix holds (a model copying from its context: duplicated documents, retrieved passages).

For each domain (text the calibration did not see) and each of --prefixes, --sequences sequences of that many
prefix tokens (256-token chunks) and --continuation scored tokens: the artifacts' model's bf16 prefix cache goes
through each path, then the continuation is scored against the uncompressed cache (perplexity ratio, KL per
token). Paths:

- offline      `kvtc eval`'s protocol: the whole prefix through KVTCCodec (sinks and the last window raw);
- chunk-coded  the chunk transform coding every token (the chunk path before raw sinks);
- chunk        the chunk transform as served (the defaults: the first chunk's sinks raw as int8, paid from its
               own budget, so every padded chunk is a later chunk's size);
- chunk-extra  the chunk path before: bf16 sinks on top of the first chunk's budget, the bound counting them
               (`"sink_budget": "extra", "sink_format": "cache"`);
- chunk-shared-bf16  shared budget, bf16 sinks; chunk-extra-int8  sinks on top, int8 (what each part brings);
- chunk-no-outliers  the served chunk path without outlier vectors (kernels/codec/outliers.py), at the same bytes;
- chunk+window the served chunk path with the last --window prefix tokens kept raw (what a recent window would add);
- lmcache      `kvtc lmcache-server` started on loopback (filesystem L2, kvtc serde), the prefix stored
               and retrieved through LMCache 0.5.6's own MP client in server-driven mode, L1 cleared between;
- vllm         the vLLM offloading tier (kernels/integrations/vllm_offload.py's KVTCOffloadingSpec, built by vLLM's own
               factory) storing 256-token chunks of GPU-layout pages and loading them back (CPU tensors).

Bytes are the stored bytes against bf16 (the frame and padding of each path included). Prints a table, writes
served_quality.json and served_quality.png under --out. A KL is a mean over sequences that can be far from
alike (at 8K, one copying sequence of four can carry two thirds of the sum), so each row keeps its sequences'
KL (`kl_seqs`) and a 95% bootstrap interval (`kl_ci`), and every later domain's KL is also given as a ratio to
the first domain's at the same artifact, ratio, prefix and path, with its interval (`bench/README.md`: copy /
fresh).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))  # tests/helpers
os.environ.setdefault("LMCACHE_DISABLE_BANNER", "1")

CHUNK = 256
PATHS = ("offline", "chunk-extra", "chunk", "chunk-shared-bf16", "chunk-extra-int8", "chunk-no-outliers", "lmcache",
         "vllm")
OPTIONAL = ("chunk-coded", "chunk+window", "offline-no-outliers")
VARIANTS = {"chunk": {}, "chunk-extra": dict(sink_budget="extra", sink_format="cache", outlier_factor=None),
            "chunk-shared-bf16": dict(sink_format="cache", outlier_factor=None),
            "chunk-extra-int8": dict(sink_budget="extra", outlier_factor=None),
            "chunk-no-outliers": dict(outlier_factor=None)}  # outlier_factor: the codec's, the rest the transform's


def sequences(lm, corpus: str, count: int, length: int) -> list[list[int]]:
    """`count` sequences of `length` tokens of `corpus`, in order. "repeat:CORPUS": each a passage followed by
    itself, so every scored token after the prefix repeats one the prefix holds (the model copies from context)."""
    from kvtc.pipeline.job.corpus import iter_documents

    if corpus.startswith("repeat:"):
        half = length // 2 + 1  # the second copy starts before the prefix ends and runs past the continuation
        return [(ids + ids)[:length] for ids in sequences(lm, corpus[len("repeat:"):], count, half)]

    ids: list[int] = []
    for doc in iter_documents(corpus):
        ids += lm.tokenizer(doc.text).input_ids
        if len(ids) >= count * length:
            break
    if len(ids) < count * length:
        raise SystemExit(f"corpus {corpus} holds {len(ids)} tokens, fewer than {count} x {length}")
    return [ids[i * length:(i + 1) * length] for i in range(count)]


class LiveServer:
    """`kvtc lmcache-server` on loopback for one artifact and ratio, and an MP client of it."""

    def __init__(self, registry: str, ref: str, ratio: float, layers: int, heads: int, dim: int, tokens: int) -> None:
        from helpers.lmcache_client import connect, server_process

        def port() -> int:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                return s.getsockname()[1]

        self.tmp = tempfile.TemporaryDirectory()
        self.l2, rpc = Path(self.tmp.name) / "l2", port()
        self.l2.mkdir()
        serde = {"type": "kvtc", "artifact": ref, "ratio": ratio, "registry": registry}
        args = ["--host", "127.0.0.1", "--port", str(rpc), "--http-host", "127.0.0.1", "--http-port", str(port()),
                "--l1-size-gb", "1", "--eviction-policy", "LRU",
                "--l2-adapter", json.dumps({"type": "fs", "base_path": str(self.l2), "serde": serde})]
        self.log = Path(self.tmp.name) / "server.log"
        self._ctx = server_process(args, self.log)
        self.proc = self._ctx.__enter__()
        self.blocks = list(range(tokens // 16))
        self.client = connect(self.proc, f"tcp://127.0.0.1:{rpc}", "bench", log=self.log, layers=layers,
                              kv_heads=heads, head_dim=dim, tp=1, num_blocks=len(self.blocks) + 16, block_size=16,
                              timeout=1200.0)
        self.n, self._seen = 0, set()

    def round_trip(self, ids: list[int], keys, values):
        c = self.client
        self.n += 1
        c.write(0, self.blocks, keys, values)
        assert all(c.store(f"s{self.n}", ids, self.blocks)), "the server refused a store"
        c.end_session(f"s{self.n}")
        want, t0 = len(ids) // CHUNK, time.perf_counter()
        while len(set(self.l2.glob("*.data")) - self._seen) < want and time.perf_counter() - t0 < 1800:
            if self.proc.poll() is not None:
                raise RuntimeError(self.log.read_text()[-3000:])
            time.sleep(0.05)
        files = set(self.l2.glob("*.data")) - self._seen
        self._seen |= files
        c.clear_l1()
        c.zero(0, self.blocks)
        hits = c.lookup(f"l{self.n}", ids)
        assert hits == want, f"{hits} of {want} chunks found in L2:\n{self.log.read_text()[-3000:]}"
        assert all(c.retrieve(f"l{self.n}", ids, self.blocks, hits))
        c.end_session(f"l{self.n}")
        k, v = c.read(0, self.blocks)
        return k, v, sum(p.stat().st_size for p in files)

    def close(self) -> None:
        self.client.close()
        self._ctx.__exit__(None, None, None)
        self.tmp.cleanup()


class VllmTier:
    """The vLLM offloading tier for one artifact and ratio, built by vLLM's own factory on CPU tensors."""

    def __init__(self, registry: str, ref: str, ratio: float, layers: int, heads: int, dim: int, tokens: int) -> None:
        import torch
        from vllm.v1.kv_offload import base
        from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                               OffloadingModelConfig, OffloadingParallelConfig)
        from vllm.v1.kv_offload.factory import OffloadingSpecFactory

        self.base, block = base, 16
        self.blocks, self.per_chunk, self.heads, self.dim = tokens // block, CHUNK // block, heads, dim
        extra = {"spec_name": "KVTCOffloadingSpec", "spec_module_path": "kvtc.kernels.integrations.vllm_offload",
                 "kvtc_artifact": ref, "kvtc_ratio": ratio, "kvtc_registry": registry, "cpu_bytes_to_use": 1 << 34}
        config = OffloadingConfig(
            groups=(OffloadingGroupConfig(tokens_per_block=block, layer_names=tuple(
                f"model.layers.{i}.self_attn.attn" for i in range(layers)), group_id=0),),
            worker_kv_bytes_per_block=block * heads * 2 * dim * 2 * layers, enable_kv_cache_events=False,
            extra_config=extra, engine_id="bench", model=OffloadingModelConfig(name="m", dtype="bfloat16",
                                                                               max_model_len=1 << 16),
            cache=OffloadingCacheConfig(tokens_per_hash=block, blocks_per_chunk=self.per_chunk),
            parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                              data_parallel_index=0, data_parallel_size=1,
                                              data_parallel_rank_local=None, is_parallelism_agnostic=False),
            kv_cache_layout="LBNHC")
        spec = OffloadingSpecFactory.create_spec(config)
        self.pages = [torch.zeros(2 * self.blocks, block, heads, 2 * dim, dtype=torch.bfloat16) for _ in range(layers)]
        views = [t.view(torch.int8).reshape(2 * self.blocks, -1) for t in self.pages]
        caches = base.CanonicalKVCaches(tensors=[base.CanonicalKVCacheTensor(v, v.shape[1]) for v in views],
                                        group_data_refs=[[base.CanonicalKVCacheRef(i, views[i].shape[1])
                                                          for i in range(layers)]])
        self.worker, self.manager = spec.get_worker(caches), spec.get_manager()
        self.n = 0

    def round_trip(self, keys, values):
        base, B = self.base, self.blocks
        L, H, T, D = keys.shape
        for i, p in enumerate(self.pages):
            p[:B] = torch_cat(keys[i], values[i]).permute(1, 0, 2).reshape(B, -1, H, 2 * D)
        self.n += 1
        ctx = base.ReqContext(req_id=f"r{self.n}")
        chunk_keys = [base.make_offload_key(f"{self.n}-{i}".encode().ljust(8, b"."), 0) for i in range(T // CHUNK)]
        for i, k in enumerate(chunk_keys):
            ctx.set_offload_key_position(k, (i + 1) * CHUNK)
        out = self.manager.prepare_store(chunk_keys, ctx)
        self.worker.submit_store(2 * self.n, base.GPULoadStoreSpec(list(range(B)), [B], [0]), out.store_spec)
        self.worker.wait({2 * self.n})
        self.manager.complete_store(chunk_keys, ctx)
        self.worker.submit_load(2 * self.n + 1, self.manager.prepare_load(chunk_keys, ctx),
                                base.GPULoadStoreSpec(list(range(B, 2 * B)), [B], [0]))
        self.worker.wait({2 * self.n + 1})
        results = self.worker.get_finished()
        assert all(r.success for r in results), results
        stored = sum(len(self.worker.blob(int(s))) for s in out.store_spec.slots)
        got = __import__("torch").stack([p[B:].reshape(T, H, 2 * D).permute(1, 0, 2) for p in self.pages])
        self.manager.complete_load(chunk_keys, ctx)
        return got[..., :D], got[..., D:], stored

    def close(self) -> None:
        self.worker.shutdown()


def torch_cat(k, v):
    import torch

    return torch.cat([k, v], -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--registry", required=True)
    ap.add_argument("--artifacts", nargs="+", required=True)
    ap.add_argument("--ratios", default="8,16,32")
    ap.add_argument("--domains", default="stdlib,licenses=/usr/share/common-licenses",
                    help="NAME=CORPUS or CORPUS, comma separated")
    ap.add_argument("--sequences", default="4", help="sequences per domain, one count or one per prefix")
    ap.add_argument("--prefixes", default="1024", help="prefix tokens (multiples of 256), comma separated")
    ap.add_argument("--continuation", type=int, default=64)
    ap.add_argument("--window", type=int, default=128, help="chunk+window: last prefix tokens kept raw")
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--out", default=None)
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()

    import torch

    from kvtc.pipeline.evaluation.model_quality import continuation_logprobs
    from kvtc.workers.capture import raw_cache
    from kvtc.workers.models import load_model

    if a.threads:
        torch.set_num_threads(a.threads)
    paths = a.paths.split(",")
    unknown = set(paths) - set(PATHS) - set(OPTIONAL)
    if unknown:
        raise SystemExit(f"unknown paths {sorted(unknown)}; known: {PATHS + OPTIONAL}")
    ratios = [float(r) for r in a.ratios.split(",")]
    prefixes = [int(p) for p in a.prefixes.split(",")]
    counts = [int(c) for c in a.sequences.split(",")]
    counts = counts * len(prefixes) if len(counts) == 1 else counts
    if any(p % CHUNK for p in prefixes) or len(counts) != len(prefixes):
        raise SystemExit(f"--prefixes must be multiples of {CHUNK}, --sequences one count or one per prefix")
    from kvtc.artifacts import pull
    lm = load_model(pull(a.artifacts[0], registry=a.registry).manifest["model"]["spec"], device="cpu")  # the model
    n = a.continuation
    t0, rows = time.perf_counter(), []
    for P, count in zip(prefixes, counts):
        data = []  # (domain, ids, keys, values, feed, target, ref_lp, ref_nll)
        for item in a.domains.split(","):
            name, _, corpus = item.partition("=")
            corpus = corpus or name
            for ids in sequences(lm, corpus, count, P + n + 1):
                seq = torch.tensor([ids])
                keys, values = (x.to(torch.bfloat16) for x in raw_cache(lm, seq[:, :P]))
                feed, target = seq[:, P:P + n], seq[0, P + 1:P + n + 1]
                ref_lp = continuation_logprobs(lm.model, keys.float(), values.float(), feed)
                data.append((name, ids[:P], keys, values, feed, target, ref_lp,
                             -ref_lp.gather(1, target[:, None]).sum().item()))
        print(f"prefix {P}: {len(data)} sequences captured at {time.perf_counter() - t0:.0f} s", flush=True)
        rows += run_prefix(a, lm.model, data, P, paths, ratios, t0)
        if a.out:
            out = Path(a.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "served_quality.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{'objective':9} {'CR':>3} {'prefix':>6} {'domain':9} {'path':17} {'x bf16':>6} {'K err':>6} "
          f"{'V err':>6} {'ppl ratio':>9} {'KL':>7} {'95% interval':>17}")
    for r in rows:
        print(f"{r['objective']:9} {r['ratio']:3g} {r['prefix']:6d} {r['domain']:9} {r['path']:17} {r['x_bf16']:6.2f} "
              f"{r['k_err']:6.3f} {r['v_err']:6.3f} {r['ppl_ratio']:9.4f} {r['kl']:7.4f} "
              f"[{r['kl_ci'][0]:.4f}, {r['kl_ci'][1]:.4f}]")
    domain_ratios(rows)
    equal_bytes(rows)
    if a.out:
        (Path(a.out) / "served_quality.json").write_text(json.dumps(rows, indent=1))  # with the domain ratios
        chart(rows, Path(a.out) / "served_quality.png")


def bootstrap(first: list[float], second: list[float] | None = None, draws: int = 4000) -> tuple[float, float]:
    """95% percentile bootstrap interval of mean(first) (or of mean(first) / mean(second)), sequences resampled
    with replacement (a fixed seed: reruns print the same interval)."""
    import numpy as np

    rng = np.random.default_rng(0)
    x = np.asarray(first, dtype=float)
    stats = x[rng.integers(0, len(x), (draws, len(x)))].mean(1)
    if second is not None:
        y = np.asarray(second, dtype=float)
        stats = stats / np.maximum(y[rng.integers(0, len(y), (draws, len(y)))].mean(1), 1e-300)
    lo, hi = np.percentile(stats, [2.5, 97.5])
    return float(lo), float(hi)


def domain_ratios(rows: list[dict]) -> None:
    """Each later domain's KL over the first domain's (same artifact, ratio, prefix, path), with its interval."""
    first = rows[0]["domain"] if rows else None
    lines = []
    for r in rows:
        if r["domain"] == first:
            continue
        base = next((b for b in rows if b["domain"] == first and all(b[k] == r[k] for k in
                                                                      ("artifact", "ratio", "prefix", "path"))), None)
        if base is None or not base["kl"] > 0:
            continue
        lo, hi = bootstrap(r["kl_seqs"], base["kl_seqs"])
        r[f"kl_over_{first}"], r[f"kl_over_{first}_ci"] = r["kl"] / base["kl"], [lo, hi]
        lines.append(f"  {r['artifact']} CR {r['ratio']:g} prefix {r['prefix']} {r['path']}: {r['domain']} / {first} "
                     f"{r['kl'] / base['kl']:.2f} [{lo:.2f}, {hi:.2f}] ({len(r['kl_seqs'])} / {len(base['kl_seqs'])} "
                     "sequences)")
    if lines:
        print(f"\nKL over {first}'s, 95% bootstrap intervals over sequences:")
        print("\n".join(lines))


def equal_bytes(rows: list[dict]) -> None:
    """Each path's KL beside the old chunk path's (chunk-extra) at the same stored bytes: chunk-extra's KL
    interpolated in log-log between its ratios at the path's x bf16 (blank outside its range)."""
    print("\nKL at equal stored bytes (chunk-extra interpolated at the path's x bf16):")
    keys = sorted({(r["objective"], r["prefix"], r["domain"]) for r in rows})
    for objective, prefix, domain in keys:
        mine = [r for r in rows if (r["objective"], r["prefix"], r["domain"]) == (objective, prefix, domain)]
        ref = sorted((r["x_bf16"], r["kl"]) for r in mine if r["path"] == "chunk-extra")
        for r in mine:
            if r["path"] in ("chunk-extra", "offline") or len(ref) < 2:
                continue
            x = r["x_bf16"]
            there = next(((a, b) for a, b in zip(ref, ref[1:]) if a[0] <= x <= b[0]), None)
            if there is None:
                continue
            (x0, k0), (x1, k1) = there
            w = math.log(x / x0) / math.log(x1 / x0)
            kl = math.exp(math.log(k0) + w * (math.log(k1) - math.log(k0)))
            print(f"  {objective:9} {prefix:6d} {domain:9} {r['path']:17} CR {r['ratio']:3g} at {x:5.2f}x: "
                  f"KL {r['kl']:.4f} against chunk-extra's {kl:.4f} ({r['kl'] / kl - 1:+.0%})")


def run_prefix(a, lm_model, data: list, P: int, paths: list[str], ratios: list[float], t0: float) -> list[dict]:
    """Every artifact and ratio through each path for the sequences of one prefix length -> table rows."""
    from kvtc.artifacts import pull
    from kvtc.kernels.codec.chunk_serde import ChunkTransform
    from kvtc.kernels.codec.kvtc_codec import KVTCCodec
    from kvtc.pipeline.evaluation.model_quality import continuation_logprobs
    from kvtc.pipeline.evaluation.served import restore_through

    L, H, _, D = data[0][2].shape
    raw_bytes = 2 * L * H * P * D * 2
    rows = []
    for ref in a.artifacts:
        art = pull(ref, registry=a.registry)
        objective = art.manifest.get("calibration", {}).get("objective", "mse")
        for ratio in ratios:
            codec = KVTCCodec(art, ratio)
            coded = ChunkTransform(KVTCCodec(replace(codec.spec, sinks=0)), positions=True)
            plain = KVTCCodec(art, ratio, outlier_factor=None)
            variants = {p: ChunkTransform(plain if "outlier_factor" in kw else codec, positions=True,
                                          **{k: w for k, w in kw.items() if k != "outlier_factor"})
                        for p, kw in VARIANTS.items() if p in paths}
            served = ChunkTransform(codec, positions=True)
            live = LiveServer(a.registry, ref, ratio, L, H, D, P) if "lmcache" in paths else None
            tier = VllmTier(a.registry, ref, ratio, L, H, D, P) if "vllm" in paths else None
            tally: dict = {}
            try:
                for name, ids, keys, values, feed, target, ref_lp, ref_nll in data:
                    for path in paths:
                        if path in ("offline", "offline-no-outliers"):
                            blob = (codec if path == "offline" else plain).encode(keys, values, start=0)
                            k, v = codec.decode(blob)
                            stored = len(blob)
                        elif path == "chunk-coded":
                            k, v, stored = restore_through(coded, keys, values)
                        elif path in variants:
                            k, v, stored = restore_through(variants[path], keys, values)
                        elif path == "chunk+window":
                            k, v, stored = restore_through(served, keys, values)
                            k, v = k.clone(), v.clone()
                            k[:, :, P - a.window:], v[:, :, P - a.window:] = keys[:, :, P - a.window:], \
                                values[:, :, P - a.window:]
                            stored += 2 * L * H * a.window * D * 2
                        elif path == "lmcache":
                            k, v, stored = live.round_trip(ids, keys, values)
                        else:
                            k, v, stored = tier.round_trip(keys, values)
                        lp = continuation_logprobs(lm_model, k.float(), v.float(), feed)
                        t = tally.setdefault((name, path), dict(nll=0.0, kl=0.0, tokens=0, bytes=0, raw=0, k=0.0,
                                                                kn=0.0, v=0.0, vn=0.0, seqs=[]))
                        t["nll"] += -lp.gather(1, target[:, None]).sum().item() - ref_nll
                        t["seqs"].append(float((ref_lp.exp() * (ref_lp - lp)).sum()) / a.continuation)
                        t["kl"] += t["seqs"][-1] * a.continuation
                        t["tokens"] += a.continuation
                        t["bytes"] += stored
                        t["raw"] += raw_bytes
                        for key, x, xh in (("k", keys, k), ("v", values, v)):
                            t[key] += float((xh.float() - x.float()).pow(2).sum())
                            t[key + "n"] += float(x.float().pow(2).sum())
            finally:
                if live is not None:
                    live.close()
                if tier is not None:
                    tier.close()
            for (name, path), t in tally.items():
                rows.append({"artifact": ref, "objective": objective, "ratio": ratio, "prefix": P, "domain": name,
                             "path": path,
                             "ppl_ratio": math.exp(t["nll"] / t["tokens"]), "kl": t["kl"] / t["tokens"],
                             "x_bf16": t["raw"] / t["bytes"], "k_err": math.sqrt(t["k"] / t["kn"]),
                             "v_err": math.sqrt(t["v"] / t["vn"]), "tokens": t["tokens"],
                             "kl_seqs": t["seqs"], "kl_ci": list(bootstrap(t["seqs"]))})
            print(f"{ref} CR {ratio:g} prefix {P}: done at {time.perf_counter() - t0:.0f} s", flush=True)
    return rows


def chart(rows: list[dict], path: Path) -> None:
    """Per domain (columns) and prefix (rows): the KL per token against the bytes stored (x bf16), one line per
    path: at equal bytes the lower line serves better."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    domains = sorted({r["domain"] for r in rows})
    prefixes = sorted({r["prefix"] for r in rows})
    fig, axes = plt.subplots(len(prefixes), len(domains), figsize=(5.5 * len(domains), 3.8 * len(prefixes)),
                             squeeze=False)
    styles = {"offline": "k:o", "chunk-coded": "r--x", "chunk-extra": "r-s", "chunk": "b-o", "chunk-shared-bf16": "c--^",
              "chunk-extra-int8": "m--v", "chunk+window": "y-.d", "lmcache": "g+", "vllm": "mx"}
    for row, prefix in enumerate(prefixes):
        for col, domain in enumerate(domains):
            ax = axes[row][col]
            for objective in sorted({r["objective"] for r in rows}):
                for route, style in styles.items():
                    pts = sorted((r["x_bf16"], r["kl"]) for r in rows if (r["domain"], r["prefix"], r["objective"],
                                                                           r["path"]) == (domain, prefix, objective, route))
                    if pts:
                        ax.plot(*zip(*pts), style, alpha=1.0 if objective != "mse" else 0.45, ms=6,
                                label=f"{route} ({objective})")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("stored bytes: x below bf16")
            ax.set_ylabel("KL per token (nats)")
            ax.set_title(f"{domain}, {prefix}-token prefix", fontsize=10)
            ax.grid(alpha=0.3, which="both")
    axes[0][0].legend(fontsize=7)
    fig.suptitle("Served quality against stored bytes (points: CR 8 / 16 / 32; lmcache and vllm are the live paths)",
                 fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")


if __name__ == "__main__":
    main()
