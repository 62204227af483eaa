"""What a recalibration would compute, and whether that exists already.

The parent's recorded settings (kvtc.pipeline.settings.settings_from_manifest) are the defaults;
the `kvtc calibrate` options the user gave override them. A recalibration is redundant when its settings and its planned shards
(train, held-out and eval ids, in order) are exactly those of the parent or of an earlier
recalibration of the same parent: it would publish the same bases and allocations again.
"""
from __future__ import annotations

from kvtc.pipeline.job.shards import shard_plan
from kvtc.pipeline.job.shards import plan_shards
from kvtc.pipeline.settings import JobSettings, settings_from_manifest



def build_configs(manifest: dict, given: dict, parent: str | None) -> tuple[JobSettings, JobSettings]:
    """(settings to run, settings that would repeat the parent): the parent's recorded settings, then
    the `kvtc calibrate` options the user gave ({flat field name: value or option word})."""
    if given.get("name") not in (None, manifest["name"]):
        raise ValueError(f"recalibrate publishes under the parent's name {manifest['name']!r}; drop --name "
                         "(or use `kvtc calibrate --name ...` for a new artifact)")
    repeat = settings_from_manifest(manifest).with_runtime(name=manifest["name"], parent=parent)
    return repeat.replace(**{k: v for k, v in given.items() if k != "name"}), repeat


def planned_shards(cfg: JobSettings, tokenizer, max_positions: int) -> dict[str, list[str]]:
    """Shard ids per role that `calibrate.run(cfg)` would fold (train, heldout) and evaluate (eval)."""
    roles: dict[str, list[str]] = {"train": [], "heldout": [], "eval": []}
    for role, shard in plan_shards(shard_plan(cfg, cfg.plan.tokens), tokenizer, max_positions):
        roles[role].append(shard.id)
    return roles


def unchanged(cfg: JobSettings, manifest: dict, planned: dict[str, list[str]]) -> bool:
    """True when `cfg` would recompute the version of `manifest`: same settings, same shards in each role."""
    corpus = manifest["corpus"]
    return (cfg.computational() == settings_from_manifest(manifest).computational()
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
