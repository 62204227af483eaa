"""The id of a model: a short hash of its fingerprint (the manifest's "model" section), naming the
model in blobs, shard-store scopes and model checks."""
from __future__ import annotations

import hashlib
import json
from typing import Any

ID_HEX_DIGITS = 16


def model_id(fingerprint: dict[str, Any]) -> str:
    """First 16 hex digits of the sha256 of the fingerprint's canonical JSON (sorted keys, no spaces)."""
    canon = json.dumps(fingerprint, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(canon.encode()).hexdigest()[:ID_HEX_DIGITS]
