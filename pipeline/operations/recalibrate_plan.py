"""What a recalibration would compute, and whether that exists already.

The parent's calibration record gives the default settings; the `kvtc calibrate` options the user
gave override them (`dataclasses.replace`). A recalibration is redundant when its settings and its planned shards
(train, held-out and eval ids, in order) are exactly those of the parent or of an earlier
recalibration of the same parent: it would publish the same bases and allocations again.
"""
from __future__ import annotations

from dataclasses import fields, replace

from kvtc.pipeline.job.calibrate import CalibrateConfig, config_from_manifest, config_values, shard_plan
from kvtc.pipeline.job.shards import plan_shards

# settings that say where and how fast a job runs, not what it computes
RUNTIME_FIELDS = ("registry", "store", "address", "workers", "threads_per_worker", "cache_dir", "name", "parent",
                  "extra_manifest")
PARENT_DESTS = ("model", "corpus", "eval_corpus", "ratios", "tokens", "eval_tokens", "seq_len", "seqs_per_shard", "sinks",
                "window", "groups", "sample", "seed", "block_sizes", "types", "error_model", "holdout_fraction",
                "heldout_rows", "text_column", "dtype", "keys", "basis_budget", "max_components")


def build_configs(manifest: dict, given: dict, parent: str | None) -> tuple[CalibrateConfig, CalibrateConfig]:
    """(config to run, config that would repeat the parent): the parent's recorded settings, then the
    `kvtc calibrate` options the user gave (argparse dests and values)."""
    if given.get("name") not in (None, manifest["name"]):
        raise ValueError(f"recalibrate publishes under the parent's name {manifest['name']!r}; drop --name "
                         "(or use `kvtc calibrate --name ...` for a new artifact)")
    repeat = config_from_manifest(manifest, name=manifest["name"], parent=parent)
    return replace(repeat, **config_values({k: v for k, v in given.items() if k != "name"})), repeat


def planned_shards(cfg: CalibrateConfig, tokenizer, max_positions: int) -> dict[str, list[str]]:
    """Shard ids per role that `calibrate.run(cfg)` would fold (train, heldout) and evaluate (eval)."""
    roles: dict[str, list[str]] = {"train": [], "heldout": [], "eval": []}
    for role, shard in plan_shards(shard_plan(cfg, cfg.tokens), tokenizer, max_positions):
        roles[role].append(shard.id)
    return roles


def unchanged(cfg: CalibrateConfig, manifest: dict, planned: dict[str, list[str]]) -> bool:
    """True when `cfg` would recompute the version of `manifest`: same settings, same shards in each role."""
    repeat = config_from_manifest(manifest)
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
