"""Held-out text of a published artifact: the token sequences its calibration held out (rebuilt from its
recorded corpus and shard plan, matched by id), or the first sequences of another corpus."""
from __future__ import annotations

from kvtc.pipeline.job.shards import make_shards, plan_shards, shard_plan
from kvtc.pipeline.settings import settings_from_manifest


def heldout_sequences(artifact, tokenizer, spec: str | None, count: int, max_seq_len: int | None = None,
                      length: int | None = None):
    """Up to `count` (T,) token arrays of held-out text (see the module docstring). length: tokens per sequence
    (None: the calibration's --seq-len); longer than that, the artifact's held-out sequences are joined in plan
    order and cut into windows of `length` (another corpus is read in windows of `length`). ValueError naming
    both figures where the text holds no window of `length` tokens."""
    if length is not None:
        return _windows(artifact, tokenizer, spec, count, max_seq_len, length)
    corpus = artifact.manifest.get("corpus", {})
    own = spec is None or spec == corpus.get("spec")
    spec = spec or corpus.get("spec")
    if not spec:
        raise ValueError("the artifact names no corpus; pass --corpus")
    cfg = settings_from_manifest(artifact.manifest).replace(corpus=spec, eval_corpus=None)
    seq_len = cfg.plan.seq_len
    out = []
    if own:
        held = set(corpus.get("heldout_shards") or [])
        plan = shard_plan(cfg, cfg.plan.tokens or count * seq_len, (corpus.get("mixture") or {}).get("pkgdocs"))
        for role, shard in plan_shards(plan, tokenizer, max_seq_len):
            if role == "heldout" and shard.id in held:
                out.extend(shard.input_ids[: count - len(out)])
            if len(out) >= count:
                break
        if not out:
            raise ValueError(f"could not rebuild the held-out shards of {artifact.name}@{artifact.version} from "
                             f"corpus {spec!r}; pass another --corpus (its text is all held out)")
        return out
    for shard in make_shards(spec, tokenizer, seq_len=seq_len, seqs_per_shard=1, max_tokens=count * seq_len,
                             seed=0, holdout_fraction=0.0, min_holdout_shards=0, max_seq_len=max_seq_len):
        out.extend(shard.input_ids)
    return out[:count]


def heldout_tokens(artifact, tokenizer, max_seq_len: int | None, limit: int) -> list[int]:
    """The artifact's held-out sequences joined in plan order, up to `limit` tokens (fewer where it holds fewer)."""
    seq_len = settings_from_manifest(artifact.manifest).plan.seq_len
    held = heldout_sequences(artifact, tokenizer, None, -(-limit // seq_len), max_seq_len)
    return [int(t) for seq in held for t in seq][:limit]


def _windows(artifact, tokenizer, spec: str | None, count: int, max_seq_len: int | None, length: int):
    own = spec is None or spec == artifact.manifest.get("corpus", {}).get("spec")
    seq_len = settings_from_manifest(artifact.manifest).plan.seq_len
    if own and length > seq_len:
        flat = heldout_tokens(artifact, tokenizer, max_seq_len, count * length)
        where = f"the held-out text of {artifact.name}@{artifact.version}"
    elif own:
        return [seq[:length] for seq in heldout_sequences(artifact, tokenizer, spec, count, max_seq_len)]
    else:
        flat = []
        for shard in make_shards(spec, tokenizer, seq_len=length, seqs_per_shard=1, max_tokens=count * length,
                                 seed=0, holdout_fraction=0.0, min_holdout_shards=0, max_seq_len=max_seq_len):
            flat.extend(int(t) for seq in shard.input_ids for t in seq)
        where = f"corpus {spec!r}"
    out = [flat[i * length:(i + 1) * length] for i in range(min(count, len(flat) // length))]
    if not out:
        raise ValueError(f"{where} holds {len(flat)} tokens, fewer than one window of {length} (the prefix, the "
                         "continuation and one token): lower --prefix or pass a longer --corpus")
    return out
