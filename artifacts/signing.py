"""Optional Ed25519 signatures of a version's manifest.json (through the `cryptography` package).

The manifest lists every file's sha256 and size and names its version, so signing its bytes signs
the whole version. The signature lives beside it as manifest.sig, a small JSON object:
{"algorithm": "ed25519", "key_id": sha256 hex of the raw public key, "signature": base64}.
Keys are PEM files: PKCS#8 private keys (`kvtc keygen`, or `openssl genpkey -algorithm ed25519`)
and SubjectPublicKeyInfo public keys.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
from pathlib import Path

from kvtc.artifacts.errors import InputError, IntegrityError
from kvtc.artifacts.local_files import write_outputs
from kvtc.artifacts.safe_io import SMALL_FILE, read_limited

ALGORITHM = "ed25519"
_CONTEXT = b"kvtc-manifest-v1\0"  # domain separation: a manifest signature is never valid for anything else


def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature  # noqa: PLC0415 - cryptography is optional (the sign extra)
        from cryptography.hazmat.primitives import serialization  # noqa: PLC0415 - optional, as above
        from cryptography.hazmat.primitives.asymmetric import ed25519  # noqa: PLC0415 - optional, as above
    except ImportError:
        raise InputError("signing needs the `cryptography` package: pip install 'kvtc-calibration[sign]'") from None
    return serialization, ed25519, InvalidSignature


def _read_key_file(path: str | os.PathLike, what: str) -> bytes:
    try:
        return read_limited(None, True, str(Path(path).expanduser()), SMALL_FILE, f"{what} key file", links="in_folder")
    except OSError as exc:
        raise ValueError(f"cannot read the {what} key file {path}: {exc.strerror or exc}") from None


def load_private_key(path: str | os.PathLike):
    serialization, ed25519, _ = _crypto()
    data = _read_key_file(path, "private")
    try:
        key = serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} is not an unencrypted PEM private key ({exc})") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise ValueError(f"{path} holds a {type(key).__name__}; KVTC signatures use Ed25519 keys (`kvtc keygen`)")
    return key


def load_public_key(path: str | os.PathLike):
    serialization, ed25519, _ = _crypto()
    data = _read_key_file(path, "public")
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{path} is not a PEM public key ({exc})") from None
    if not isinstance(key, ed25519.Ed25519PublicKey):
        raise ValueError(f"{path} holds a {type(key).__name__}; KVTC signatures use Ed25519 keys")
    return key


def key_id(public_key) -> str:
    serialization, _, _ = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def sign_manifest(manifest_bytes: bytes, private_key_path: str | os.PathLike) -> bytes:
    """-> the bytes of manifest.sig for these manifest bytes."""
    key = load_private_key(private_key_path)
    signature = key.sign(_CONTEXT + manifest_bytes)
    return (json.dumps({"algorithm": ALGORITHM, "key_id": key_id(key.public_key()),
                        "signature": base64.b64encode(signature).decode()}, sort_keys=True) + "\n").encode()


def verify_signature(manifest_bytes: bytes, signature_file: bytes | None, public_key_path: str | os.PathLike,
                     where: str) -> str:
    """Raise IntegrityError unless `signature_file` is a valid signature of the manifest by this key; -> key id."""
    _, _, invalid = _crypto()
    key = load_public_key(public_key_path)
    if signature_file is None:
        raise IntegrityError(f"{where}: the version is not signed (no manifest.sig); sign it with `kvtc sign`")
    try:
        record = json.loads(signature_file)
        signature = base64.b64decode(record["signature"], validate=True)
        algorithm = record["algorithm"]
    except (ValueError, KeyError, TypeError) as exc:
        raise IntegrityError(f"{where}: manifest.sig is malformed ({type(exc).__name__}); refusing it") from None
    if algorithm != ALGORITHM:
        raise IntegrityError(f"{where}: manifest.sig uses {algorithm!r}; only {ALGORITHM} is accepted")
    try:
        key.verify(signature, _CONTEXT + manifest_bytes)
    except invalid:
        other = record.get("key_id") != key_id(key)
        raise IntegrityError(f"{where}: manifest signature is invalid "
                             f"({'signed by another key' if other else 'manifest or signature tampered'}); "
                             "refusing it") from None
    return key_id(key)


def generate_keypair(prefix: str | os.PathLike) -> tuple[Path, Path]:
    """Write PREFIX.pem (private, mode 0600) and PREFIX.pub.pem (public, process umask); refuse to overwrite."""
    serialization, ed25519, _ = _crypto()
    private_path, public_path = Path(f"{prefix}.pem"), Path(f"{prefix}.pub.pem")
    for path in (private_path, public_path):
        if path.exists():
            raise ValueError(f"{path} already exists; choose another --out prefix (keys are never overwritten)")
    key = ed25519.Ed25519PrivateKey.generate()
    private = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                serialization.NoEncryption())
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    folder = private_path.parent
    write_outputs(folder, {private_path.name: private, public_path.name: public}, overwrite=False,
                  modes={private_path.name: 0o600})  # both or neither, never over a planted file
    return private_path, public_path
