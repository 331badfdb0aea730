"""ModelConfig: the few numbers of a Llama-family decoder, parsed once from an HF config dict.

Both loaders (HF directory and GGUF) end here, so the model code reads one typed object and never
a raw dict. Validation happens in `from_hf_config`: an unsupported architecture, activation or
RoPE scaling type fails at load with a message that names it.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# HF `architectures[0]` -> our model class name (see models/__init__.py).
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM")
# HF `model_type` -> architecture, for configs without an `architectures` list.
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "smollm": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic")
_MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True, slots=True)
class MoEConfig:
    num_experts: int                # experts per MoE layer (HF num_local_experts / num_experts)
    top_k: int                      # experts per token (num_experts_per_tok)
    intermediate_size: int          # one expert's MLP width (Qwen3-MoE: moe_intermediate_size)
    renormalize: bool               # rescale the top-k weights to sum 1 (Mixtral: always; Qwen3-MoE: norm_topk_prob)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the MoE block; the others are dense

    @classmethod
    def from_hf_config(cls, arch: str, cfg: dict[str, Any], num_layers: int) -> "MoEConfig | None":
        if arch not in _MOE_ARCHITECTURES:
            return None
        try:
            num_experts = int(cfg["num_local_experts"] if "num_local_experts" in cfg else cfg["num_experts"])
            top_k = int(cfg["num_experts_per_tok"])
        except KeyError as e:
            raise ValueError(f"{arch} config is missing required field {e.args[0]!r}") from None
        step = int(cfg.get("decoder_sparse_step") or 1)
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)
        if arch == "Qwen3MoeForCausalLM" and num_experts == 0:
            sparse = ()                     # HF: no experts, every layer dense
        elif not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be between 1 and the number of "
                             f"experts ({num_experts})")
        if arch == "MixtralForCausalLM":
            return cls(num_experts, top_k, int(cfg["intermediate_size"]), True, tuple(range(num_layers)))
        # NOTE: HF Qwen3-MoE: layer i is sparse unless listed in mlp_only_layers, and only if
        # (i + 1) % decoder_sparse_step == 0; the dense layers use intermediate_size.
        inter = int(cfg.get("moe_intermediate_size") or cfg["intermediate_size"])
        return cls(num_experts, top_k, inter, bool(cfg.get("norm_topk_prob", False)), sparse)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str               # one of SUPPORTED_ARCHITECTURES; picks the model class
    vocab_size: int                 # rows of embed_tokens / lm_head
    hidden_size: int
    intermediate_size: int          # MLP width (gate/up out, down in)
    num_hidden_layers: int
    num_attention_heads: int        # query heads
    num_key_value_heads: int        # KV heads (< query heads: GQA; 1: MQA); sizes the paged cache
    head_dim: int                   # usually hidden_size // num_attention_heads; explicit in some configs
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # None or {"rope_type": ..., "factor": ..., ...} (normalised)
    max_position_embeddings: int    # rows of the RoPE cos/sin cache (x factor for dynamic NTK)
    tie_word_embeddings: bool       # lm_head shares embed_tokens' weight (no lm_head tensor stored)
    attention_bias: bool            # bias on q/k/v projections (Qwen2: True)
    hidden_act: str = "silu"        # only SiLU-gated MLPs are supported
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (config + generation_config)
    o_proj_bias: bool = False       # Llama's attention_bias also puts a bias on o_proj; Qwen2's does not
    mlp_bias: bool = False          # Llama's mlp_bias (rare)
    moe: MoEConfig | None = None    # the sparse MLP of MoE families (Mixtral, Qwen3-MoE); None: dense
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the raw dict, for debugging

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], extra_eos_token_ids: tuple[int, ...] = ()) -> "ModelConfig":
        """Parse an HF `config.json` dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        arch = _architecture(cfg)
        hidden_act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r} for {arch}; only 'silu' is supported")
        if cfg.get("use_sliding_window", False) or "sliding_attention" in (cfg.get("layer_types") or []):
            raise ValueError(f"sliding-window attention ({arch}) is not supported; "
                             "set use_sliding_window=false in config.json")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or hidden // heads)
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"config is missing required field {e.args[0]!r}") from None
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        window = cfg.get("sliding_window")
        if arch == "MixtralForCausalLM" and window is not None and int(window) < int(
                cfg.get("max_position_embeddings", 2048)):
            raise ValueError(f"sliding-window attention ({arch}, sliding_window={window}) is not supported; "
                             "set sliding_window to null in config.json")
        rope_theta, rope_scaling = _rope(cfg)
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        is_qwen2 = arch == "Qwen2ForCausalLM"
        # NOTE: Qwen2 always has q/k/v bias and no o_proj bias; Llama's attention_bias covers all four.
        attention_bias = True if is_qwen2 else bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=inter,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=max_pos,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            hidden_act=hidden_act,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_unique(eos_ids + list(extra_eos_token_ids)),
            o_proj_bias=False if is_qwen2 else attention_bias,
            mlp_bias=False if is_qwen2 else bool(cfg.get("mlp_bias", False)),
            moe=MoEConfig.from_hf_config(arch, cfg, layers),
            extra=dict(cfg),
        )


def _unique(ids: list[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids))


def _architecture(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    if archs:
        arch = archs[0]
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    else:
        model_type = cfg.get("model_type")
        if model_type in _MODEL_TYPES:
            return _MODEL_TYPES[model_type]
        arch = model_type or "<none: config has neither 'architectures' nor 'model_type'>"
    raise ValueError(f"unsupported architecture {arch!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
                     f"(model_type {', '.join(sorted(_MODEL_TYPES))})")


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling) from either `rope_theta` + `rope_scaling` (4.x) or `rope_parameters` (5.x)."""
    params = dict(cfg.get("rope_parameters") or {})
    scaling = dict(cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", scaling.get("rope_theta", cfg.get("rope_theta", 10000.0))))
    merged = {**params, **scaling}
    merged.pop("rope_theta", None)
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    if merged.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        return theta, None
    required = {"linear": ("factor",), "dynamic": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
    for key in required[rope_type]:
        if key not in merged:
            raise ValueError(f"rope scaling {rope_type!r} needs {key!r} in rope_scaling / rope_parameters")
    return theta, {"rope_type": rope_type, **merged}
