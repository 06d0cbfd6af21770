"""Reading a Hugging Face ``config.json`` into a ``ModelShape``: the supported families, their
defaults, and a parser whose every getter names the field and ``model_type`` on bad input
(``ModelConfigError``). The normalization rules are listed in ``bootstrap.capacity.shape``."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

from bootstrap.capacity.quantization import QuantizationError, parse_quantization
from bootstrap.capacity.shape import ATTENTION, RECURRENT, ModelConfigError, ModelShape
from bootstrap.config import is_int

# model_type -> (tie_word_embeddings default, norms per layer, qkv bias, qk norm)
_FAMILIES: dict[str, tuple[bool, int, bool, bool]] = {
    "llama": (False, 2, False, False),
    "mistral": (False, 2, False, False),
    "mixtral": (False, 2, False, False),
    "qwen2": (False, 2, True, False),
    "qwen3": (False, 2, False, True),
    "gemma": (True, 2, False, False),
    "gemma2": (True, 4, False, False),
    "deepseek_v2": (False, 2, False, False),
    "deepseek_v3": (False, 2, False, False),
    "jamba": (False, 2, False, False),
}
SUPPORTED_MODEL_TYPES = tuple(sorted(_FAMILIES))
_DEFAULT_POSITIONS = {"jamba": 262144}  # Jamba has no positional embedding; transformers' default


LAYER_TYPES = ("full_attention", "sliding_attention")  # what a supported family's layer_types may hold
TORCH_DTYPES = ("float32", "float16", "bfloat16", "float64")  # a checkpoint's stored weight dtype
MAX_CONFIG_INT = 1 << 31  # far above any real model's sizes; keeps a typo from exhausting memory
MAX_LAYERS = 1 << 14  # per-layer tuples are built, so the layer count gets a tighter bound
# numbers the model code divides by, takes the log of or raises to a power: each > 0 where given
POSITIVE = ("rms_norm_eps", "rope_theta", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping")
ROPE_POSITIVE = (
    "factor",
    "low_freq_factor",
    "high_freq_factor",
    "attention_factor",
    "beta_fast",
    "beta_slow",
    "rope_theta",
)
ROPE_NEEDS = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}


TOKEN = re.compile(r"[A-Za-z0-9_.-]{1,40}")  # a value quoted back as it is; anything else by its kind


def shown(value: Any) -> str:
    """A value read from a config file as an error may quote it: a short number or a token-like
    string as it is, anything else by its kind and size only (a file's content is not echoed)."""
    if value is None or isinstance(value, bool | int | float):
        try:
            text = json.dumps(value)
        except ValueError:  # an int of more digits than Python prints
            text = ""
        return text if 0 < len(text) <= 40 else f"a number of {len(text) or 'many'} characters"
    if isinstance(value, str):
        return repr(value) if TOKEN.fullmatch(value) else f"a string of {len(value)} characters"
    kind = {dict: "an object", list: "an array"}.get(type(value), type(value).__name__)
    return f"{kind} of {len(value)} items" if isinstance(value, dict | list) else kind


def shape_from_path(path: str | Path) -> ModelShape:
    """The shape of a config.json file, or of the config.json inside a checkpoint directory."""
    file = Path(path).expanduser()
    if file.is_dir():
        file = file / "config.json"
    if not file.is_file():
        raise ModelConfigError(f"no config.json at {file}")
    try:
        cfg = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(f"cannot read {file}: {exc}") from None
    return parse_config(cfg)


def parse_config(cfg: dict[str, Any]) -> ModelShape:
    """Normalize a parsed config.json; raise ``ModelConfigError`` naming the bad field."""
    if not isinstance(cfg, dict):
        raise ModelConfigError(f"config must be a JSON object, got {type(cfg).__name__}")
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or model_type not in _FAMILIES:
        raise ModelConfigError(
            f"config.json: field 'model_type' must be one of {', '.join(SUPPORTED_MODEL_TYPES)}, "
            f"got {shown(model_type)}"
        )
    return _Parser(cfg, model_type).shape()


class _Parser:
    """Reads one config dict; every getter names the field and model_type on failure."""

    def __init__(self, cfg: dict[str, Any], model_type: str) -> None:
        self.cfg, self.model_type = cfg, model_type

    def get_int(self, key: str, default: int | None = None, *, minimum: int = 1, maximum: int = MAX_CONFIG_INT) -> int:
        value = self.cfg.get(key, default)
        if value is None:
            raise ModelConfigError(f"{self.model_type} config.json: missing required field {key!r}")
        if not is_int(value) or not minimum <= value <= maximum:
            raise ModelConfigError(
                f"{self.model_type} config.json: field {key!r} must be an integer in [{minimum}, {maximum}], "
                f"got {shown(value)}"
            )
        return value

    def get_opt_int(self, key: str) -> int | None:
        return None if self.cfg.get(key) is None else self.get_int(key)

    def get_flag(self, key: str, default: bool) -> bool:
        value = self.cfg.get(key, default)
        if not isinstance(value, bool):
            raise ModelConfigError(
                f"{self.model_type} config.json: field {key!r} must be true/false, got {shown(value)}"
            )
        return value

    def check_positive(self, key: str, value: Any) -> None:
        if value is not None and not (
            isinstance(value, int | float) and not isinstance(value, bool) and 0 < value < math.inf
        ):
            raise ModelConfigError(
                f"{self.model_type} config.json: field {key!r} must be a finite number > 0, got {shown(value)}"
            )

    def check_numbers(self) -> None:
        """The float fields and each rope scaling's (``rope_scaling`` or transformers 5's ``rope_parameters``)."""
        for key in POSITIVE:
            self.check_positive(key, self.cfg.get(key))
        for key in ("rope_scaling", "rope_parameters"):
            scaling = self.cfg.get(key)
            if scaling is not None and not isinstance(scaling, dict):
                raise ModelConfigError(f"{self.model_type} config.json: field {key!r} must be an object or null")
            if not scaling or any(isinstance(v, dict) for v in scaling.values()):  # none, or per layer type
                continue
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            for field in ROPE_NEEDS.get(kind, ()):
                if scaling.get(field) is None:
                    raise ModelConfigError(
                        f"{self.model_type} config.json: field '{key}.{field}' is required for rope_type {kind!r}"
                    )
            for field in ROPE_POSITIVE:
                self.check_positive(f"{key}.{field}", scaling.get(field))
            if kind == "llama3" and scaling["high_freq_factor"] <= scaling["low_freq_factor"]:
                raise ModelConfigError(
                    f"{self.model_type} config.json: field '{key}.high_freq_factor' must be greater than "
                    f"low_freq_factor ({scaling['low_freq_factor']}), got {scaling['high_freq_factor']}"
                )

    def shape(self) -> ModelShape:
        tie_default, norms, qkv_bias, qk_norm = _FAMILIES[self.model_type]
        self.check_numbers()
        layers, heads = self.get_int("num_hidden_layers", maximum=MAX_LAYERS), self.get_int("num_attention_heads")
        hidden = self.get_int("hidden_size")
        kv_heads = self.get_int("num_key_value_heads", heads)
        if heads % kv_heads:
            raise ModelConfigError(
                f"{self.model_type} config.json: num_attention_heads ({heads}) is not a multiple of "
                f"num_key_value_heads ({kv_heads})"
            )
        kinds = self._layer_kinds(layers)
        fields: dict[str, Any] = dict(
            architecture=self._architecture(),
            model_type=self.model_type,
            vocab_size=self.get_int("vocab_size"),
            hidden_size=hidden,
            intermediate_size=self.get_int("intermediate_size"),
            num_layers=layers,
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=self._head_dim(hidden, heads),
            max_position_embeddings=self.get_int("max_position_embeddings", _DEFAULT_POSITIONS.get(self.model_type)),
            tie_word_embeddings=self.get_flag("tie_word_embeddings", tie_default),
            torch_dtype=self._torch_dtype(),
            layer_kinds=kinds,
            attention_bias=self.get_flag("attention_bias", False),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            mlp_bias=self.get_flag("mlp_bias", False),
            norms_per_layer=norms,
        )
        fields["layer_windows"] = self._windows(kinds, fields["max_position_embeddings"])
        fields.update(self._mla())
        fields.update(self._moe(layers))
        fields.update(self._mamba(hidden))
        try:
            fields["quantization"] = parse_quantization(self.cfg)
        except QuantizationError as exc:
            raise ModelConfigError(f"{self.model_type} config.json: {exc}") from None
        return ModelShape(**fields)

    def _torch_dtype(self) -> str | None:
        key = "torch_dtype" if "torch_dtype" in self.cfg else "dtype"
        value = self.cfg.get(key)
        if value is not None and value not in TORCH_DTYPES:
            raise ModelConfigError(
                f"{self.model_type} config.json: field {key!r} must be one of {', '.join(TORCH_DTYPES)}, "
                f"got {shown(value)}"
            )
        return value

    def _architecture(self) -> str:
        archs = self.cfg.get("architectures")
        if archs is None:
            return self.model_type
        if not isinstance(archs, list) or not archs or not all(isinstance(a, str) for a in archs):
            raise ModelConfigError(f"{self.model_type} config.json: field 'architectures' must be a list of names")
        return archs[0]

    def _head_dim(self, hidden: int, heads: int) -> int:
        if self.cfg.get("head_dim") is not None:
            return self.get_int("head_dim")
        if hidden % heads:
            raise ModelConfigError(
                f"{self.model_type} config.json: no 'head_dim' and hidden_size ({hidden}) is not a multiple of "
                f"num_attention_heads ({heads})"
            )
        return hidden // heads

    def _layer_kinds(self, layers: int) -> tuple[str, ...]:
        if self.model_type != "jamba":
            return (ATTENTION,) * layers
        period, offset = self.get_int("attn_layer_period", 8), self.get_int("attn_layer_offset", 4, minimum=0)
        return tuple(ATTENTION if i % period == offset else RECURRENT for i in range(layers))

    def _windows(self, kinds: tuple[str, ...], max_pos: int) -> tuple[int | None, ...]:
        sliding = self._sliding_layers(len(kinds))
        window = self.get_opt_int("sliding_window") if any(sliding) else None
        if window is not None and window >= max_pos:
            window = None
        return tuple(window if s and k == ATTENTION else None for s, k in zip(sliding, kinds))

    def _sliding_layers(self, layers: int) -> list[bool]:
        types = self.cfg.get("layer_types")
        if types is not None:
            if not isinstance(types, list) or len(types) != layers:
                raise ModelConfigError(
                    f"{self.model_type} config.json: field 'layer_types' must list one entry per layer ({layers})"
                )
            unknown = sorted({repr(t) for t in types} - {repr(t) for t in LAYER_TYPES})
            if unknown:
                raise ModelConfigError(
                    f"{self.model_type} config.json: field 'layer_types' has {', '.join(unknown)}; "
                    f"allowed: {', '.join(LAYER_TYPES)}"
                )
            return [t == "sliding_attention" for t in types]
        if self.model_type in ("mistral", "mixtral"):
            return [True] * layers
        if self.model_type in ("qwen2", "qwen3"):
            start = self.get_int("max_window_layers", layers, minimum=0)
            return [self.get_flag("use_sliding_window", False) and i >= start for i in range(layers)]
        if self.model_type == "gemma2":
            return [i % 2 == 0 for i in range(layers)]
        return [False] * layers

    def _mla(self) -> dict[str, Any]:
        if not self.model_type.startswith("deepseek"):
            return {}
        return dict(
            kv_lora_rank=self.get_int("kv_lora_rank"),
            q_lora_rank=self.get_opt_int("q_lora_rank"),
            qk_rope_head_dim=self.get_int("qk_rope_head_dim"),
            qk_nope_head_dim=self.get_int("qk_nope_head_dim"),
            v_head_dim=self.get_int("v_head_dim"),
        )

    def _moe(self, layers: int) -> dict[str, Any]:
        if self.model_type.startswith("deepseek") and self.cfg.get("n_routed_experts"):
            first_dense, freq = self.get_int("first_k_dense_replace", 0, minimum=0), self.get_int("moe_layer_freq", 1)
            inner, shared = self.get_int("moe_intermediate_size"), self.get_int("n_shared_experts", 0, minimum=0)
            return dict(
                moe_layers=tuple(i >= first_dense and i % freq == 0 for i in range(layers)),
                num_experts=self.get_int("n_routed_experts"),
                experts_per_token=self.get_int("num_experts_per_tok"),
                moe_intermediate_size=inner,
                num_shared_experts=shared,
                shared_expert_intermediate_size=inner * shared,
                expert_score_bias=self.cfg.get("topk_method") == "noaux_tc",
            )
        if self.model_type in ("mixtral", "jamba"):
            experts = self.get_int("num_local_experts" if self.model_type == "mixtral" else "num_experts", 16)
            period, offset = (1, 0) if self.model_type == "mixtral" else self._expert_period()
            return dict(
                moe_layers=tuple(experts > 1 and i % period == offset for i in range(layers)),
                num_experts=experts if experts > 1 else 0,
                experts_per_token=self.get_int("num_experts_per_tok", 2),
                moe_intermediate_size=self.get_int("intermediate_size"),
            )
        return dict(moe_layers=(False,) * layers)

    def _expert_period(self) -> tuple[int, int]:
        return self.get_int("expert_layer_period", 2), self.get_int("expert_layer_offset", 1, minimum=0)

    def _mamba(self, hidden: int) -> dict[str, Any]:
        if self.model_type != "jamba":
            return {}
        d_inner = self.get_int("mamba_expand", 2) * hidden
        d_state, d_conv = self.get_int("mamba_d_state", 16), self.get_int("mamba_d_conv", 4)
        rank = self.cfg.get("mamba_dt_rank", "auto")
        rank = math.ceil(hidden / 16) if rank == "auto" else self.get_int("mamba_dt_rank")
        return dict(
            recurrent_state_elements=d_inner * (d_conv - 1) + d_inner * d_state,
            mamba_d_inner=d_inner,
            mamba_d_state=d_state,
            mamba_d_conv=d_conv,
            mamba_dt_rank=rank,
            mamba_conv_bias=self.get_flag("mamba_conv_bias", True),
            mamba_proj_bias=self.get_flag("mamba_proj_bias", False),
        )
