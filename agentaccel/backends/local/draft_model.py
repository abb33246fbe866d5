"""A draft model cut from its target: the target's first `layers` decoder layers with its
embeddings, final norm and head, written as a plain HF folder (what vLLM's `draft_model` method
and `bench drafter-predictions --drafter-model` read). Nothing is trained: the cut model predicts
through the target's own head from an earlier layer's state (an early exit), so it shares the
target's tokenizer and vocabulary by construction and costs its layers plus the head per pass.

    agentaccel bench drafter-predictions --drafter-model cut:6 ...   (the default model, cut to 6 layers)

`drafter_folder("cut:N")` makes the default model's cut once and keeps it in the cache beside the
converted model; "eagle" is the head scripts/train_eagle_head.py trained there (eagle_head.py);
any other spec is a folder of the user's."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from agentaccel.backends.local.model import default_model_folder, model_folder

WEIGHTS = "model.safetensors"
CARRIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")  # copied as they are
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def cut_model(source: Path, layers: int, out: Path) -> Path:
    """`out`: the model in `source` (a Llama-style HF folder, weights in one safetensors file) keeping
    its first `layers` decoder layers. Written beside `out` first and renamed, so a crash never
    leaves half a model where a later run would take it for whole."""
    from safetensors.torch import load_file, save_file

    config_path = source / "config.json"
    if not config_path.is_file() or not (source / WEIGHTS).is_file():
        raise ValueError(f"{source}: not a model folder with {WEIGHTS} and config.json")
    config = json.loads(config_path.read_text())
    total = config.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= layers <= total:
        raise ValueError(f"{source}: cannot keep {layers} of its {total} layers")
    weights = load_file(str(source / WEIGHTS))
    if not any(_LAYER.match(name) for name in weights):
        raise ValueError(f"{source}: no model.layers.N weights (not a Llama-style model)")
    kept = {name: tensor for name, tensor in weights.items()
            if (m := _LAYER.match(name)) is None or int(m.group(1)) < layers}
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(kept, str(tmp / WEIGHTS), metadata={"format": "pt"})
    config["num_hidden_layers"] = layers
    config["agentaccel_cut_from"] = {"model": source.name, "layers": total}  # what the folder is
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    for name in CARRIED:
        if (source / name).is_file():
            shutil.copy2(source / name, tmp / name)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def default_cut(layers: int) -> Path:
    """The default model cut to `layers` layers, made once into the cache."""
    target = default_model_folder()
    out = target.with_name(f"{target.name}-cut{layers}")
    if (out / "config.json").is_file():
        return out
    return cut_model(target, layers, out)


def default_eagle() -> Path:
    """The default model's EAGLE head, once scripts/train_eagle_head.py has trained it."""
    target = default_model_folder()
    out = target.with_name(f"{target.name}-eagle")
    if not (out / "config.json").is_file():
        raise ValueError(f"no EAGLE head for {target.name} yet ({out}): train one with "
                         "`python scripts/train_eagle_head.py --store TRACES.db`")
    return out


def drafter_folder(spec: str | Path) -> Path:
    """A drafter's folder from its spec: "cut:N" (the default model's first N layers), "eagle" (its
    trained EAGLE head), else a folder of the user's (a draft model or an EAGLE head)."""
    text = str(spec)
    if text == "eagle":
        return default_eagle()
    if text.startswith("cut:"):
        try:
            layers = int(text.removeprefix("cut:"))
        except ValueError:
            raise ValueError(f"{text!r}: write cut:N, N the layers to keep") from None
        return default_cut(layers)
    return model_folder(text)
