"""A zoo of Hugging Face transformers models: every model type of the auto mappings, built tiny with random weights.

Nothing here downloads anything: configs are the library's own config classes with their sizes shrunk
(:func:`tiny_config`), models are built from them (``_from_config``, eager attention) and seeded, inputs
are random tensors shaped from the config (:func:`make_inputs`). Importing this module imports torch
only (transformers is imported by the functions that need it) and builds nothing.

    >>> entry = zoo_entry("llama")                    # the classes a model type maps to
    >>> model = build(entry)                          # LlamaForCausalLM, 2 layers, hidden 32, eager attention
    >>> recipe, errors = find_recipe(model)           # which inputs its forward takes, found by trying
    >>> inputs = make_inputs(model, recipe, padding="left")
    >>> count_attention(model, inputs).attention      # softmaxes whose probabilities feed a product
    2

Shrinking is generic, by config field name (:data:`SIZES`, :func:`_shrink_value`): layers to 2 (more where
a per-layer list such as ``layer_types`` holds more kinds: one layer of each kind is kept), widths to 32
with 4 heads of 8 (MHA stays MHA, MQA stays MQA, GQA gets 2 key/value heads), feed-forward 64, 4 experts
choosing 2, vocabulary 99, positions 64, sliding windows 4, images 32x32 in 8x8 patches (hierarchical
vision models keep their patch size and get one block and 2 heads per stage), 2 video frames; every
dropout, layer-drop and feature-masking probability 0; special token ids moved inside the vocabulary and
out of the range input ids are drawn from; nested configs (``text_config``, ``vision_config``, ...) shrunk
alike. :data:`OVERRIDES` holds the per-family exceptions.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.overrides import TorchFunctionMode

__all__ = ["AttentionCount", "Recipe", "ZooEntry", "build", "count_attention", "find_recipe", "forward_is_random",
           "make_inputs", "model_types", "output_tensors", "tiny_config", "zoo_entry"]

LAYERS = 2
HIDDEN = 32
HEADS = 4
KV_HEADS = 2
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 64
VOCAB = 99
POSITIONS = 64
IMAGE = 32
PATCH = 8
#: input ids are drawn from [ID_LOW, ID_HIGH); special token ids are moved above ID_HIGH
ID_LOW, ID_HIGH = 4, 80

#: config field name -> its tiny value (applied where the default is a number of the same kind)
SIZES: dict[str, int] = {
    **dict.fromkeys(("num_hidden_layers", "num_layers", "n_layer", "n_layers", "num_decoder_layers",
                     "encoder_layers", "decoder_layers", "num_encoder_layers", "num_text_layers",
                     "num_vision_layers", "text_layers", "vision_layers", "depth", "num_blocks"), LAYERS),
    **dict.fromkeys(("hidden_size", "d_model", "n_embd", "embed_dim", "dim", "hidden_dim", "word_embed_proj_dim",
                     "embedding_size", "projection_dim", "projection_size", "n_embed", "model_dim", "text_hidden_size",
                     "vision_hidden_size", "encoder_hidden_size", "decoder_hidden_size"), HIDDEN),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "encoder_attention_heads",
                     "decoder_attention_heads", "num_heads", "attention_heads", "num_attention_head",
                     "encoder_num_attention_heads", "decoder_num_attention_heads"), HEADS),
    **dict.fromkeys(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num",
                     "n_head_kv", "num_kv_head"), KV_HEADS),
    **dict.fromkeys(("head_dim", "kv_channels", "attention_head_dim", "d_kv", "qk_nope_head_dim",
                     "qk_rope_head_dim", "v_head_dim", "global_head_dim"), HEAD_DIM),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "encoder_ffn_dim", "decoder_ffn_dim", "d_ff", "n_inner",
                     "dim_feedforward", "ffn_hidden_size", "encoder_intermediate_size",
                     "decoder_intermediate_size", "mlp_dim", "hidden_dim_ffn", "inner_hidden_size",
                     "feed_forward_size", "intermediate_dim"), INTERMEDIATE),
    **dict.fromkeys(("moe_intermediate_size", "shared_expert_intermediate_size", "expert_intermediate_size",
                     "moe_ffn_hidden_size"), HIDDEN),
    **dict.fromkeys(("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts",
                     "num_routed_experts"), 4),
    **dict.fromkeys(("num_experts_per_tok", "moe_topk", "moe_k", "num_selected_experts", "top_k_experts"), 2),
    **dict.fromkeys(("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"), 1),
    **dict.fromkeys(("kv_lora_rank", "q_lora_rank"), 16),
    **dict.fromkeys(("vocab_size", "text_vocab_size"), VOCAB),
    **dict.fromkeys(("max_position_embeddings", "n_positions", "max_target_positions", "n_ctx",
                     "max_sequence_length", "max_seq_len", "seq_length", "max_length", "block_size"), POSITIONS),
    "image_size": IMAGE,
    "patch_size": PATCH,
}

#: per-family config values, applied after the generic shrinking (nested: {"vision_config": {...}})
OVERRIDES: dict[str, dict[str, Any]] = {
    "gpt_neo": {"attention_types": [[["global", "local"], 1]], "window_size": 4},
    "bamba": {"attn_layer_indices": [1]},
    **dict.fromkeys(("swin", "donut-swin", "maskformer-swin", "swinv2", "swin2sr"),
                    {"image_size": 32, "patch_size": 2, "embed_dim": 16, "depths": [1, 2, 1], "num_heads": [2, 2, 4],
                     "window_size": 2, "out_features": None, "out_indices": None,
                     "pretrained_window_sizes": [0, 0, 0]}),
}

#: config fields that hold a probability of randomly dropping or masking something in training
_RANDOM_WORDS = ("dropout", "pdrop", "drop_path", "layerdrop", "drop_prob", "drop_rate", "mask_time_prob",
                 "mask_feature_prob", "layer_drop", "attn_drop", "proj_drop", "dropout_rate")


@dataclass(frozen=True)
class ZooEntry:
    """One model type and the class the sweep builds for it."""

    model_type: str
    config_class: str
    model_class: str  # the *ForCausalLM class where the type is a decoder-only causal LM, else AutoModel's
    base_class: str  # AutoModel's class for the type
    causal_lm: bool  # model_class is a decoder-only causal LM (left padding applies)


def model_types() -> list[str]:
    """Every model type that has an AutoModel class, in the mapping's order."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    return [t for t in MODEL_MAPPING_NAMES if t in CONFIG_MAPPING_NAMES]


def zoo_entry(model_type: str) -> ZooEntry:
    """The classes a model type maps to (no import of its modeling code)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, MODEL_MAPPING_NAMES

    base = MODEL_MAPPING_NAMES[model_type]
    base = base[0] if isinstance(base, (tuple, list)) else base
    causal = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    causal = causal[0] if isinstance(causal, (tuple, list)) else causal
    # a decoder-only causal LM, not an encoder family's decoder head (BERT-like configs carry
    # ``is_decoder``, enc-dec ones ``is_encoder_decoder``: those are built as their base model)
    use_causal = bool(causal) and not _encoder_family(CONFIG_MAPPING_NAMES[model_type])
    return ZooEntry(model_type, CONFIG_MAPPING_NAMES[model_type], causal if use_causal else base, base, use_causal)


def _encoder_family(config_class: str) -> bool:
    import transformers

    cls = getattr(transformers, config_class, None)
    if cls is None or not dataclasses.is_dataclass(cls):
        return False
    names = {f.name: f for f in dataclasses.fields(cls)}
    try:
        default = cls()
    except Exception:  # noqa: BLE001 - a config that needs arguments: judged by its fields alone
        return "is_decoder" in names
    return bool(getattr(default, "is_encoder_decoder", False)) or "is_decoder" in names


# ----------------------------------------------------------------------------- configs

def _is_config(x: Any) -> bool:
    from transformers import PreTrainedConfig

    return isinstance(x, PreTrainedConfig)


def _shrink_value(name: str, value: Any, ctx: dict[str, Any]) -> Any:
    """The tiny value of config field ``name`` (currently ``value``), or ``value`` unchanged.

    ``ctx`` holds the default config's layer and head counts, which some fields are judged by.
    """
    if isinstance(value, bool):
        return value
    lname = name.lower()
    if isinstance(value, (int, float)) and any(w in lname for w in _RANDOM_WORDS):
        return 0.0 if isinstance(value, float) else 0
    if name in _KV_HEADS:
        heads = ctx.get("heads")
        if value is None or value == heads:
            return HEADS
        return 1 if value == 1 else KV_HEADS
    if value is None and name in _NONE_FAILS:  # a default of None the model cannot build with
        return _NONE_FAILS[name]
    if name == "patch_size" and ctx.get("hierarchical"):
        return value  # Swin/ConvNeXt-like stages halve the resolution: 32 pixels leave room for the stem only
    if name in SIZES and isinstance(value, int) and value > 0:
        return min(value, SIZES[name]) if name in _AT_MOST else SIZES[name]
    if name in SIZES and isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
        if name in ("image_size", "patch_size"):
            return type(value)([SIZES[name]] * len(value))
    if name in _STAGE_LISTS and isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value):
        return type(value)([_STAGE_LISTS[name]] * len(value))
    if name in _INDEX_PAIRS and isinstance(value, int):
        return _INDEX_PAIRS[name]
    if name in ("out_features", "out_indices") and value is not None and ctx.get("layers"):
        return None  # the backbone's last stage; stage names follow the shrunk depth
    if name == "rope_parameters" and isinstance(value, dict) and value.get("mrope_section"):
        return {**value, "mrope_section": _split(HEAD_DIM // 2, len(value["mrope_section"]))}
    if name.endswith(("_token_id", "_token_index", "_token_ids")) and value is not None:
        return _token_ids(value)
    if name == "sliding_window" and isinstance(value, int) and value > 0:
        return 4
    layers = ctx.get("layers")
    if (layers and isinstance(value, (list, tuple)) and value and all(isinstance(v, int) for v in value)
            and "layer" in lname and any(w in lname for w in ("ids", "indices", "idx", "idxs"))
            and max(value) >= LAYERS):
        return type(value)([LAYERS - 1])  # layers placed by index (Zamba2's hybrid layers): the last one
    if layers and isinstance(value, (list, tuple)) and len(value) == layers and layers > LAYERS:
        return type(value)(_layer_subset(list(value)))
    return value


#: key/value head counts: MHA stays MHA (HEADS), MQA stays MQA (1), GQA becomes KV_HEADS
_KV_HEADS = frozenset(("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "n_head_kv",
                       "num_kv_head"))
_AT_MOST = frozenset(("num_experts_per_tok", "moe_topk", "moe_k", "num_selected_experts", "top_k_experts"))
#: per-stage lists of hierarchical vision models (Swin, PVT, Segformer, ...): one value for every stage
_STAGE_LISTS = {"depths": 1, "num_heads": 2, "num_attention_heads": 2, "heads": 2, "num_layers": 1}
#: fields whose default None the model cannot be built with once the sizes are shrunk
_NONE_FAILS = {"head_dim": HEAD_DIM, "num_experts_per_tok": 2}
#: fields that place layers by period/offset (Jamba, Zamba, MoE routers): one of each kind in 2 layers
_INDEX_PAIRS = {"attn_layer_period": 2, "attn_layer_offset": 1, "expert_layer_period": 2, "expert_layer_offset": 1,
                "n_group": 1, "topk_group": 1, "num_expert_group": 1, "topk_groups": 1, "rotary_dim": HEAD_DIM // 2,
                "first_k_dense_replace": 1, "num_queries": 8, "mamba_n_heads": 4, "mamba_d_head": 16,
                "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_chunk_size": 8, "chunk_size": 8,
                "num_frames": 2, "max_source_positions": 16, "window_size": 2, "global_head_dim": 2 * HEAD_DIM}


def _split(total: int, parts: int) -> list[int]:
    base = [total // parts] * parts
    for i in range(total - sum(base)):
        base[i] += 1
    return base


def _layer_subset(values: list[Any]) -> list[Any]:
    """A per-layer list cut to LAYERS entries that still holds every distinct kind (first of each, in order)."""
    firsts = sorted({repr(v): i for i, v in reversed(list(enumerate(values)))}.values())
    picked = firsts[:max(LAYERS, len(firsts))]
    for i in range(len(values)):
        if len(picked) >= LAYERS:
            break
        if i not in picked:
            picked = sorted([*picked, i])
    return [values[i] for i in picked]


def _token_ids(value: Any) -> Any:
    if isinstance(value, int):
        return value if value < ID_LOW else ID_HIGH + value % (VOCAB - ID_HIGH)
    if isinstance(value, (list, tuple)):
        return type(value)(_token_ids(v) for v in value)
    return value


def _config_fields(cls: type) -> list[str]:
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "kwargs")]


#: a nested config's own values that are not carried over (they describe the layers before shrinking)
_NOT_KEPT = frozenset(("per_layer_config", "transformers_version", "architectures", "id2label", "label2id"))
_LAYER_FIELDS = ("num_hidden_layers", "num_layers", "n_layer", "n_layers", "decoder_layers", "encoder_layers")
_HEAD_FIELDS = ("num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads")


def _read(config: Any, name: str) -> Any:
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - a property that needs other fields: not shrunk
        return None


def _shrunk_kwargs(default: Any, overrides: dict[str, Any]) -> dict[str, Any]:
    """Fields of config instance ``default`` whose tiny value differs from it, nested configs as dicts."""
    try:  # heterogeneous (per-layer) configs refuse to show their global values unless asked
        default.allow_global_per_layer_attribute_access = True
    except Exception:  # noqa: BLE001
        pass
    names = _config_fields(type(default))
    layers = next((v for v in (_read(default, n) for n in _LAYER_FIELDS) if isinstance(v, int)), None)
    heads = next((v for v in (_read(default, n) for n in _HEAD_FIELDS) if isinstance(v, int)), None)
    ctx = {"layers": layers, "heads": heads, "hierarchical": isinstance(_read(default, "depths"), (list, tuple))}
    out: dict[str, Any] = {}
    for name in names:
        if name in ("transformers_version", "architectures", "dtype", "id2label", "label2id"):
            continue
        value = _read(default, name)
        if _is_config(value):
            sub = _shrunk_kwargs(value, overrides.get(name, {}))
            diff = {k: v for k, v in value.to_diff_dict().items() if k not in _NOT_KEPT}
            out[name] = {"model_type": value.model_type, **diff, **sub}
            continue
        if isinstance(value, dict) and name.endswith("_config") and "model_type" in value:
            continue  # a sub-config kept as a dict: left to its defaults
        new = _shrink_value(name, value, ctx)
        if new is not value and new != value:
            out[name] = new
    for name, value in overrides.items():
        if not isinstance(value, dict) or not _is_config(_read(default, name)):
            out[name] = value
    _layers_for_kinds(out, layers)
    return out


def _layers_for_kinds(out: dict[str, Any], layers: int | None) -> None:
    """Where a per-layer list kept more than LAYERS kinds, the layer count grows to match it."""
    if not layers:
        return
    longest = max((len(v) for k, v in out.items() if isinstance(v, (list, tuple)) and k.endswith("layer_types")),
                  default=0)
    if longest > LAYERS:
        for n in _LAYER_FIELDS:
            if n in out:
                out[n] = longest


def tiny_config(entry: ZooEntry) -> Any:
    """The type's config class with its sizes shrunk (see the module docstring), in eager attention."""
    import transformers

    cls = getattr(transformers, entry.config_class)
    default = cls()
    kwargs = _shrunk_kwargs(default, OVERRIDES.get(entry.model_type, {}))
    if _uses_mrope(entry.model_type):  # multimodal rotary sections must add up to half the head size
        _with_mrope(kwargs, default)
    for _ in range(8):
        try:
            config = cls(**kwargs)
            break
        except Exception as e:  # noqa: BLE001 - a field whose tiny value its type refuses keeps its default
            bad = re.search(r"Validation error for field '(\w+)'", str(e))
            if bad is None or bad.group(1) not in kwargs:
                raise
            kwargs.pop(bad.group(1))
    _eager(config)
    return config


def _uses_mrope(model_type: str) -> bool:
    import importlib

    from transformers.models.auto.configuration_auto import model_type_to_module_name

    name = model_type_to_module_name(model_type)
    try:
        module = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
        return "mrope_section" in inspect.getsource(module)
    except Exception:  # noqa: BLE001 - no such module (a sub-type): no sections
        return False


def _with_mrope(kwargs: dict[str, Any], default: Any) -> None:
    for holder, config in [(kwargs, default), *((kwargs[n], _read(default, n)) for n in list(kwargs)
                                                if isinstance(kwargs[n], dict) and "model_type" in kwargs[n])]:
        rope = holder.get("rope_parameters", _read(config, "rope_parameters"))
        if isinstance(rope, dict) and "rope_type" in rope:
            holder["rope_parameters"] = {**rope, "mrope_section": _split(HEAD_DIM // 2, 3)}


def _eager(config: Any) -> None:
    config._attn_implementation = "eager"
    for name in _config_fields(type(config)):
        sub = _read(config, name)
        if _is_config(sub):
            _eager(sub)


def build(entry: ZooEntry, seed: int = 0) -> torch.nn.Module:
    """The entry's model class from :func:`tiny_config`, weights drawn with ``seed``, eager attention, eval mode.

    A causal LM class that does not take the composite config (``Llama4ForCausalLM`` of ``Llama4Config``)
    is built from its text config; failing that, the type's AutoModel class is built.
    """
    import transformers

    config = tiny_config(entry)
    tries = [(entry.model_class, config)]
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    if text is not config:
        tries.append((entry.model_class, text))
    if entry.base_class != entry.model_class:
        tries.append((entry.base_class, config))
    first: Exception | None = None
    for name, cfg in tries:
        cls = getattr(transformers, name)
        torch.manual_seed(seed)
        try:
            model = cls._from_config(cfg, attn_implementation="eager")
        except Exception as e:  # noqa: BLE001 - the next way to build it may work
            first = first or e
            continue
        return model.eval()
    assert first is not None
    raise first


# ----------------------------------------------------------------------------- inputs

@dataclass(frozen=True)
class Recipe:
    """Which inputs a model's forward takes: names and, for features, their layout."""

    main: str  # input_ids, pixel_values, input_features or input_values
    extra: tuple[str, ...] = ()  # further inputs (decoder_input_ids, pixel_values next to input_ids, ...)
    features_last: bool = False  # input_features laid out (B, frames, features) rather than (B, features, frames)
    mask: str | None = None  # the name of the padding mask the forward takes, if any
    samples: int = 0  # audio length for input_values
    channel_dim: bool = False  # input_values as (B, 1, samples); pixel_values as video (B, frames, C, H, W)
    frames: int = 0  # input_features frames (0: twice the config's max_source_positions, else 32)


def _sub(config: Any, *names: str) -> Any:
    """The first of config's nested configs ``names`` that exists, else config."""
    for n in names:
        sub = getattr(config, n, None)
        if _is_config(sub):
            return sub
    return config


def _first(config: Any, names: tuple[str, ...], default: Any) -> Any:
    for n in names:
        v = getattr(config, n, None)
        if v is not None and not isinstance(v, bool):
            return v
    return default


def _special_ids(config: Any) -> set[int]:
    ids: set[int] = set()
    todo = [config]
    while todo:
        c = todo.pop()
        for name in _config_fields(type(c)):
            v = _read(c, name)
            if _is_config(v):
                todo.append(v)
            elif name.endswith(("_token_id", "_token_index", "_token_ids")):
                for x in v if isinstance(v, (list, tuple)) else [v]:
                    if isinstance(x, int):
                        ids.add(x)
    return ids


def _ids(config: Any, batch: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    text = _sub(config, "text_config", "decoder", "language_config")
    vocab = _first(text, ("vocab_size",), VOCAB) or VOCAB
    high = min(ID_HIGH, int(vocab))
    ids = torch.randint(ID_LOW, high, (batch, seq), generator=gen)
    for s in _special_ids(config):
        if ID_LOW <= s < high:
            ids[ids == s] = ID_LOW if s != ID_LOW else ID_LOW + 1
    return ids


def _pixels(config: Any, batch: int, recipe: Recipe, gen: torch.Generator) -> torch.Tensor:
    vision = _sub(config, "vision_config", "backbone_config", "image_config")
    size = _first(vision, ("image_size", "img_size", "input_size"), IMAGE)
    h, w = (size, size) if isinstance(size, int) else tuple(size)[-2:]
    channels = _first(vision, ("num_channels", "in_channels", "in_chans", "input_channels"), 3)
    if recipe.channel_dim:  # video
        frames = _first(vision, ("num_frames", "frames_per_clip"), 2)
        return torch.randn(batch, frames, channels, h, w, generator=gen)
    return torch.randn(batch, channels, h, w, generator=gen)


def _features(config: Any, batch: int, recipe: Recipe, gen: torch.Generator) -> torch.Tensor:
    audio = _sub(config, "audio_config", "encoder_config", "encoder")
    bins = _first(audio, ("num_mel_bins", "feature_size", "input_feat_per_channel", "n_mels", "num_mel_bins"), 16)
    bins *= _first(audio, ("input_channels",), 1) if recipe.features_last else 1
    frames = recipe.frames or 2 * _first(audio, ("max_source_positions",), 16)
    shape = (batch, frames, bins) if recipe.features_last else (batch, bins, frames)
    return torch.randn(shape, generator=gen)


def make_inputs(model: torch.nn.Module, recipe: Recipe, batch: int = 2, seq: int = 8, padding: str | None = None,
                seed: int = 0) -> dict[str, Any]:
    """Random inputs for ``model`` after ``recipe``; ``padding`` ``"right"``/``"left"`` adds a padding mask
    (the second sequence's last / first ``seq // 3`` positions hidden) where the recipe has one."""
    config = model.config
    gen = torch.Generator().manual_seed(seed)
    inputs: dict[str, Any] = {}
    length = seq
    for name in (recipe.main, *recipe.extra):
        if name in ("input_ids", "decoder_input_ids"):
            inputs[name] = _ids(config, batch, seq, gen)
        elif name in ("pixel_values", "pixel_values_videos"):
            inputs[name] = _pixels(config, batch, dataclasses.replace(recipe, channel_dim=recipe.channel_dim
                                                                      or name == "pixel_values_videos"), gen)
        elif name == "input_features":
            inputs[name] = _features(config, batch, recipe, gen)
            length = inputs[name].shape[1 if recipe.features_last else 2]
        elif name == "input_values":
            shape = (batch, 1, recipe.samples) if recipe.channel_dim else (batch, recipe.samples)
            inputs[name] = torch.randn(shape, generator=gen)
            length = recipe.samples
        else:
            raise ValueError(f"no inputs known for {name!r}")
    if padding is not None:
        if recipe.mask is None:
            raise ValueError(f"{type(model).__name__} takes no padding mask")
        mask = torch.ones(batch, length, dtype=torch.long)
        hide = max(1, length // 3)
        if padding == "right":
            mask[-1, length - hide:] = 0
        elif padding == "left":
            mask[-1, :hide] = 0
        else:
            raise ValueError(f"padding must be 'right' or 'left', got {padding!r}")
        inputs[recipe.mask] = mask
    return inputs


def _candidate_recipes(model: torch.nn.Module) -> list[Recipe]:
    params = inspect.signature(model.forward).parameters
    main = getattr(model, "main_input_name", "input_ids")
    known = ("input_ids", "pixel_values", "input_features", "input_values", "pixel_values_videos")
    if main not in known or main not in params:
        main = next((n for n in known if n in params), main)
    mask = "attention_mask" if "attention_mask" in params and main != "pixel_values" else None
    extra: list[str] = []
    if "decoder_input_ids" in params and main != "decoder_input_ids":
        extra.append("decoder_input_ids")
    base = Recipe(main, tuple(extra), mask=mask)
    options = [base]
    if main == "input_features":
        options = [dataclasses.replace(base, features_last=last, frames=n) for n in (0, 128) for last in (False, True)]
    if main == "input_values":
        options = [dataclasses.replace(base, samples=n, channel_dim=c) for c in (False, True) for n in (1024, 4000)]
    if main == "pixel_values":
        options.append(dataclasses.replace(base, channel_dim=True))
    for other in ("pixel_values", "input_ids", "input_features"):
        if other in params and other != main:
            options += [dataclasses.replace(r, extra=(*r.extra, other)) for r in list(options)]
    return options


def find_recipe(model: torch.nn.Module, batch: int = 2, seq: int = 8) -> tuple[Recipe | None, list[str]]:
    """The first input recipe the model's eager forward accepts, and the errors of the ones it did not."""
    errors = []
    for recipe in _candidate_recipes(model):
        try:
            with torch.no_grad():
                model(**make_inputs(model, recipe, batch=batch, seq=seq))
            return recipe, errors
        except Exception as e:  # noqa: BLE001 - the next recipe may fit
            errors.append(f"{recipe}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:400])
    return None, errors


# ----------------------------------------------------------------------------- what the forward computes

def output_tensors(out: Any) -> list[torch.Tensor]:
    """The floating tensors of a model output (``ModelOutput``, tuple, tensor), caches excluded."""
    if hasattr(out, "to_tuple"):
        out = out.to_tuple()
    leaves = pytree.tree_leaves(out)
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]


_PRODUCTS = frozenset(("matmul", "__matmul__", "__rmatmul__", "bmm", "baddbmm", "einsum", "mm", "addmm", "addbmm"))
_SOFTMAX = frozenset(("softmax", "_softmax", "_safe_softmax", "softmax_"))
#: ops through which scores or probabilities stay what they are although their element count changes
#: (a sink column concatenated and sliced off again, chunked layouts padded and strided)
_REGROUPS = frozenset(("__getitem__", "narrow", "cat", "concat", "concatenate", "pad", "as_strided", "unfold",
                       "select", "index_select", "expand", "expand_as", "repeat", "repeat_interleave"))
SCORES, PROBS = "scores", "probs"


@dataclass
class AttentionCount:
    """What :func:`count_attention` saw: softmax calls, and those that are attention.

    A softmax is attention when it normalises over the last axis, its input derives from a product of two
    activations (``q @ k^T``: matmul, bmm, baddbmm or einsum, no parameter among the operands; then scaled,
    masked, biased, soft-capped) and its probabilities (cast, dropped out, viewed) are an operand of another
    product (``P @ V``).
    """

    softmax: int = 0
    attention: int = 0
    shapes: list[tuple[int, ...]] = field(default_factory=list)  # the probabilities' shapes, per attention call


def _over_last_axis(args: tuple, kwargs: dict, out: torch.Tensor) -> bool:
    """The softmax normalises over the last axis (the keys); GroupViT's assignment normalises over the
    queries (``dim=-2``), which no attention kernel computes."""
    dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
    if out.dim() == 0:
        return False
    if dim is None:  # F.softmax's legacy implicit axis
        dim = 0 if out.dim() in (0, 1, 3) else 1
    return isinstance(dim, int) and dim % out.dim() == out.dim() - 1


class _Counter(TorchFunctionMode):
    """Marks products of activations as scores, softmaxes of scores as probabilities, counts products of those."""

    def __init__(self, count: AttentionCount):
        super().__init__()
        self.count = count
        self.live: dict[int, tuple[Any, str, tuple[int, ...]]] = {}  # id -> (weakref, kind, probabilities' shape)

    def _mark_of(self, t: Any) -> tuple[str, tuple[int, ...]] | None:
        if not isinstance(t, torch.Tensor):
            return None
        hit = self.live.get(id(t))
        return (hit[1], hit[2]) if hit is not None and hit[0]() is t else None

    def _mark(self, t: Any, kind: str, shape: tuple[int, ...]) -> None:
        import weakref

        if isinstance(t, torch.Tensor):
            self.live[id(t)] = (weakref.ref(t), kind, shape)

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        leaves = pytree.tree_leaves((args, kwargs))
        marks = [(t, m) for t, m in ((t, self._mark_of(t)) for t in leaves) if m is not None]
        if name in _SOFTMAX:
            self.count.softmax += 1
            if isinstance(out, torch.Tensor) and any(m[0] == SCORES for _, m in marks) and _over_last_axis(
                    args, kwargs, out):
                self._mark(out, PROBS, tuple(out.shape))
            return out
        if name in _PRODUCTS:
            probs = [m for _, m in marks if m[0] == PROBS]
            if probs:
                self.count.attention += 1
                self.count.shapes.append(probs[0][1])
            else:
                operands = [t for t in leaves if isinstance(t, torch.Tensor) and t.dim() >= 2]
                if len(operands) >= 2 and not any(isinstance(t, torch.nn.Parameter) for t in operands):
                    self._mark(out, SCORES, ())
            return out
        if marks and isinstance(out, torch.Tensor):
            kind = PROBS if any(m[0] == PROBS for _, m in marks) else SCORES
            t, m = next((t, m) for t, m in marks if m[0] == kind)
            if out.numel() == t.numel() or name in _REGROUPS or (kind == SCORES and out.numel() >= t.numel()):
                self._mark(out, kind, m[1])  # scaled, masked, cast, dropped out, viewed: still the same
        return out


def count_attention(model: torch.nn.Module, inputs: dict[str, Any]) -> AttentionCount:
    """Softmax calls of one eager no-grad forward, and how many of them feed a matmul/bmm/einsum (attention)."""
    count = AttentionCount()
    with torch.no_grad(), _Counter(count):
        model(**inputs)
    return count


def forward_is_random(model: torch.nn.Module, inputs: dict[str, Any]) -> bool:
    """Two eager no-grad forwards in a row (the random state advancing between them) differ."""
    with torch.no_grad():
        a = output_tensors(model(**inputs))
        b = output_tensors(model(**inputs))
    return len(a) != len(b) or any(x.shape != y.shape or not torch.allclose(x, y, rtol=0, atol=0, equal_nan=True)
                                   for x, y in zip(a, b))
