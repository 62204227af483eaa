"""What a recalibration would compute, and whether that exists already.

The parent's manifest gives the default settings (as `kvtc calibrate` option values); options the
user gave override them. A recalibration is redundant when its settings and its planned shards
(train, held-out and eval ids, in order) are exactly those of the parent or of an earlier
recalibration of the same parent: it would publish the same bases and allocations again.
"""
from __future__ import annotations

import argparse
from dataclasses import fields

from kvtc.pipeline.job.calibrate import add_arguments, config_from_args, shard_plan
from kvtc.pipeline.job.shards import plan_shards

# settings that say where and how fast a job runs, not what it computes
RUNTIME_FIELDS = ("registry", "store", "address", "workers", "threads_per_worker", "cache_dir", "name", "parent",
                  "extra_manifest")
PARENT_DESTS = ("model", "corpus", "eval_corpus", "ratios", "tokens", "eval_tokens", "seq_len", "seqs_per_shard", "sinks",
                "window", "groups", "sample", "seed", "block_sizes", "types", "error_model", "holdout_fraction",
                "heldout_rows", "text_column", "dtype")


def parent_arguments(manifest: dict) -> dict:
    """The parent's calibration as `kvtc calibrate` option values (argparse dests)."""
    from kvtc.pipeline.operations.drift_meter import seqs_per_shard

    cal, corpus, alloc = manifest["calibration"], manifest["corpus"], manifest["calibration"]["allocator"]
    tokens = corpus.get("tokens", {})
    eval_tokens = cal.get("eval_tokens") or sum(int(tokens.get(i, 0)) for i in corpus.get("eval_shards", [])) or None
    out = dict(model=manifest["model"]["spec"], corpus=corpus["spec"], eval_corpus=corpus.get("eval_spec") or "none",
               ratios=",".join(f"{r:g}" for r in cal["ratios"]), tokens=cal.get("tokens_requested", cal["tokens"]),
               eval_tokens=eval_tokens, seq_len=cal["seq_len"], seqs_per_shard=seqs_per_shard(manifest),
               sinks=cal["sinks"], window=cal["window"], groups=cal.get("group_spec", "model"),
               sample=cal.get("sample", 1.0), seed=cal["seed"], block_sizes=",".join(map(str, alloc["block_sizes"])),
               types=",".join(alloc["types"]), error_model=alloc["error_model"])
    for key, dest in (("holdout_fraction", "holdout_fraction"), ("heldout_rows_cap", "heldout_rows"),
                      ("text_column", "text_column"), ("dtype", "dtype")):
        if key in cal:
            out[dest] = cal[key]
    return out


def build_configs(manifest: dict, given: dict, parent: str):
    """(config to run, config that would repeat the parent) from the parent and the options given."""
    base = argparse.ArgumentParser()
    add_arguments(base)
    derived = {**vars(base.parse_args([])), **parent_arguments(manifest)}
    if given.get("name") not in (None, manifest["name"]):
        raise ValueError(f"recalibrate publishes under the parent's name {manifest['name']!r}; drop --name "
                         "(or use `kvtc calibrate --name ...` for a new artifact)")
    common = dict(name=manifest["name"], parent=parent)
    return (config_from_args(argparse.Namespace(**{**derived, **given}), **common),
            config_from_args(argparse.Namespace(**derived), **common))


def planned_shards(cfg, tokenizer, max_positions: int) -> dict[str, list[str]]:
    """Shard ids per role that `calibrate.run(cfg)` would fold (train, heldout) and evaluate (eval)."""
    roles: dict[str, list[str]] = {"train": [], "heldout": [], "eval": []}
    for role, shard in plan_shards(shard_plan(cfg, cfg.tokens), tokenizer, max_positions):
        roles[role].append(shard.id)
    return roles


def unchanged(cfg, manifest: dict, planned: dict[str, list[str]]) -> bool:
    """True when `cfg` would recompute the version of `manifest`: same settings, same shards in each role."""
    repeat = build_configs(manifest, {}, None)[1]
    content = [f.name for f in fields(cfg) if f.name not in RUNTIME_FIELDS]
    corpus = manifest["corpus"]
    return (all(getattr(cfg, k) == getattr(repeat, k) for k in content)
            and all(planned[r] == list(corpus.get(f"{r}_shards", [])) for r in planned))


def same_run(registry, parent, cfg, planned: dict[str, list[str]]) -> str | None:
    """The parent, or an earlier recalibration of it, that `cfg` would repeat exactly; else None."""
    if unchanged(cfg, parent.manifest, planned):
        return parent.version
    for version in registry.versions(parent.name):
        if version > parent.version:
            manifest = registry.read_manifest(parent.name, version)
            if manifest.get("parent") == parent.version and unchanged(cfg, manifest, planned):
                return version
    return None
