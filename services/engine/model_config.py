"""ModelConfig: the few numbers of a decoder-only model, parsed once from an HF config dict.

Both loaders (HF directory and GGUF) end here, so the model code reads one typed object and never
a raw dict. Validation happens in `from_hf_config`: an unsupported architecture, activation,
layer type or RoPE scaling type fails at load with a message that names it. Family-specific
fields (sliding windows, Gemma's scalars) default to "off", so a family reads only its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvmesh.engine.models.registry import MODEL_TYPES as _MODEL_TYPES
from kvmesh.engine.models.registry import MODELS

# HF `architectures[0]` -> our model class (see models/registry.py).
SUPPORTED_ARCHITECTURES = tuple(MODELS)
# NOTE: "rope_freqs" is not an HF type: a GGUF file's per-frequency divisors (llama.cpp's
# rope_freqs tensor, Llama 3.1+), set by the GGUF reader (models/gguf.py)
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "longrope", "rope_freqs")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
_GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM")

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
    rope_theta: float               # RoPE base of full-attention layers (of every layer, but Gemma 3's)
    rope_scaling: dict[str, Any] | None  # None or {"rope_type": ..., "factor": ..., ...} (normalised)
    max_position_embeddings: int    # rows of the RoPE cos/sin cache (x factor for dynamic NTK)
    tie_word_embeddings: bool       # lm_head shares embed_tokens' weight (no lm_head tensor stored)
    attention_bias: bool            # bias on q/k/v projections (Qwen2: True)
    hidden_act: str = "silu"        # gated-MLP activation: silu, or gelu_pytorch_tanh (Gemma)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()  # every id that ends generation (config + generation_config)
    o_proj_bias: bool = False       # Llama's attention_bias also puts a bias on o_proj; Qwen2's does not
    mlp_bias: bool = False          # Llama's mlp_bias (rare)
    # sliding-window attention: layer i attends to the last `sliding_window` positions (the
    # current one included, HF's `kv > q - W`) when layer_types[i] == "sliding_attention"
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()    # one of LAYER_TYPES per layer; () = all full attention
    query_pre_attn_scalar: float | None = None   # Gemma: softmax scale is this ** -0.5, not head_dim's
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(score / cap) in attention
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the output logits
    local_rope_theta: float | None = None  # Gemma 3: RoPE base of sliding layers (rope_local_base_freq)
    moe: MoEConfig | None = None    # the sparse MLP of MoE families (Mixtral, Qwen3-MoE); None: dense
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)  # the raw dict, for debugging

    @property
    def num_queries_per_kv(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], extra_eos_token_ids: tuple[int, ...] = ()) -> "ModelConfig":
        """Parse an HF `config.json` dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        arch = _architecture(cfg)
        gemma = arch in _GEMMA
        # NOTE: Gemma configs carry both; HF Gemma reads hidden_activation (hidden_act may say "gelu").
        act_keys = ("hidden_activation", "hidden_act") if gemma else ("hidden_act", "hidden_activation")
        hidden_act = next((cfg[k] for k in act_keys if cfg.get(k)), "gelu_pytorch_tanh" if gemma else "silu")
        if hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {hidden_act!r} for {arch}; supported: "
                             f"{', '.join(SUPPORTED_ACTIVATIONS)}")
        if cfg.get("use_bidirectional_attention"):
            raise ValueError(f"use_bidirectional_attention ({arch}) is not supported: the engine is causal")
        try:
            hidden = int(cfg["hidden_size"])
            heads = int(cfg["num_attention_heads"])
            kv_heads = int(cfg.get("num_key_value_heads") or heads)
            head_dim = int(cfg.get("head_dim") or (256 if gemma else hidden // heads))
            layers = int(cfg["num_hidden_layers"])
            vocab = int(cfg["vocab_size"])
            inter = int(cfg["intermediate_size"])
        except KeyError as e:
            raise ValueError(f"config is missing required field {e.args[0]!r}") from None
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads ({heads}) must be a multiple of "
                             f"num_key_value_heads ({kv_heads})")
        max_pos = int(cfg.get("max_position_embeddings", 2048))
        rope_theta, rope_scaling, local_theta = _rope(cfg, arch, head_dim)
        window, layer_types = _sliding_window(cfg, arch, layers)
        is_qwen2 = arch == "Qwen2ForCausalLM"
        # NOTE: Qwen2 always has q/k/v bias and no o_proj bias; Llama's attention_bias covers all four.
        attention_bias = True if is_qwen2 else bool(cfg.get("attention_bias", False))
        eos = cfg.get("eos_token_id")
        eos_ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
        gemma2 = arch == "Gemma2ForCausalLM"
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
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", gemma)),
            attention_bias=attention_bias,
            hidden_act=hidden_act,
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=_unique(eos_ids + list(extra_eos_token_ids)),
            o_proj_bias=False if is_qwen2 else attention_bias,
            mlp_bias=False if (is_qwen2 or gemma) else bool(cfg.get("mlp_bias", False)),
            sliding_window=window,
            layer_types=layer_types,
            query_pre_attn_scalar=_positive(cfg, "query_pre_attn_scalar", 256) if gemma else None,
            attn_logit_softcapping=_positive(cfg, "attn_logit_softcapping", 50.0 if gemma2 else None)
            if gemma2 else None,
            final_logit_softcapping=_positive(cfg, "final_logit_softcapping", 30.0 if gemma2 else None)
            if gemma else None,
            local_rope_theta=local_theta,
            moe=MoEConfig.from_hf_config(arch, cfg, layers),
            extra=dict(cfg),
        )


def _unique(ids: list[int]) -> tuple[int, ...]:
    return tuple(dict.fromkeys(int(i) for i in ids))


def _positive(cfg: dict[str, Any], key: str, default: float | None) -> float | None:
    value = cfg.get(key, default)
    if value is None:
        return None
    if float(value) <= 0:
        raise ValueError(f"{key} must be positive or null, got {value!r}")
    return float(value)


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


def _sliding_window(cfg: dict[str, Any], arch: str, layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(window, layer types) as HF's modeling code applies them; ((None, ()) without windows."""
    window = cfg.get("sliding_window")
    if (arch in _QWEN or arch == "Qwen3MoeForCausalLM") and not cfg.get("use_sliding_window", False):
        window = None           # NOTE: HF Qwen2/3/3-MoE ignore sliding_window unless use_sliding_window
    types = cfg.get("layer_types")
    if types is None:
        if arch in _QWEN:
            first = int(cfg.get("max_window_layers", layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
        elif arch == "Gemma2ForCausalLM":
            types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
        elif arch == "Gemma3ForCausalLM":
            pattern = int(cfg.get("sliding_window_pattern", 6))
            types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
        else:                   # Mistral, Phi-3, Mixtral, Qwen3-MoE: a sliding_window applies to every layer
            types = ["sliding_attention"] * layers
    types = list(types)
    if len(types) != layers:
        raise ValueError(f"layer_types has {len(types)} entries for {layers} layers")
    bad = sorted(set(types) - set(LAYER_TYPES))
    if bad:
        raise ValueError(f"unsupported layer type(s) {', '.join(map(repr, bad))} for {arch}; "
                         f"supported: {', '.join(LAYER_TYPES)}")
    if window is None or "sliding_attention" not in types:
        return None, ()
    if int(window) < 1:
        raise ValueError(f"sliding_window must be a positive number of tokens, got {window!r}")
    return int(window), tuple(types)


def _rope(cfg: dict[str, Any], arch: str, head_dim: int) -> tuple[float, dict[str, Any] | None, float | None]:
    """(theta, scaling, local theta) from `rope_theta` + `rope_scaling` (4.x) or `rope_parameters`
    (5.x, nested per layer type for Gemma 3). The local theta is Gemma 3's, else None."""
    params = dict(cfg.get("rope_parameters") or {})
    local_theta = None
    if arch == "Gemma3ForCausalLM":
        if isinstance(params.get("full_attention"), dict) or isinstance(params.get("sliding_attention"), dict):
            local = dict(params.get("sliding_attention") or {})
            params = dict(params.get("full_attention") or {})
            local_type = local.get("rope_type", local.get("type", "default"))
            if local_type != "default":
                raise ValueError(f"RoPE scaling {local_type!r} on sliding-window layers is not supported")
            local_theta = float(local.get("rope_theta", cfg.get("rope_local_base_freq", 10000.0)))
        else:
            local_theta = float(cfg.get("rope_local_base_freq", 10000.0))
    scaling = dict(cfg.get("rope_scaling") or {})
    default_theta = 1_000_000.0 if arch == "Gemma3ForCausalLM" else 10000.0
    theta = float(params.get("rope_theta", scaling.get("rope_theta", cfg.get("rope_theta", default_theta))))
    merged = {**params, **scaling}
    merged.pop("rope_theta", None)
    rope_type = merged.pop("rope_type", None) or merged.pop("type", None) or "default"
    merged.pop("type", None)
    if arch == "Phi3ForCausalLM" and rope_type in ("su", "yarn"):
        rope_type = "longrope"      # NOTE: HF Phi-3 reads its old names "su" and "yarn" as longrope
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling type {rope_type!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    partial = merged.pop("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    if partial is not None and float(partial) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor != 1) are not supported")
    if rope_type == "default":
        return theta, None, local_theta
    if rope_type == "longrope":
        # NOTE: Phi-3 keeps original_max_position_embeddings beside rope_scaling; HF prefers it.
        original = cfg.get("original_max_position_embeddings") or merged.get("original_max_position_embeddings")
        merged["original_max_position_embeddings"] = int(original or cfg.get("max_position_embeddings", 2048))
    required = {"linear": ("factor",), "dynamic": ("factor",),
                "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
                "longrope": ("short_factor", "long_factor"), "rope_freqs": ("freq_factors",)}
    for key in required[rope_type]:
        if key not in merged:
            raise ValueError(f"rope scaling {rope_type!r} needs {key!r} in rope_scaling / rope_parameters")
    if rope_type == "rope_freqs" and len(merged["freq_factors"]) != head_dim // 2:
        raise ValueError(f"rope scaling 'rope_freqs': {len(merged['freq_factors'])} factors, head_dim "
                         f"{head_dim} needs {head_dim // 2}")
    if rope_type == "longrope":
        for key in ("short_factor", "long_factor"):
            if len(merged[key]) != head_dim // 2:
                raise ValueError(f"rope scaling 'longrope': {key} has {len(merged[key])} entries, "
                                 f"head_dim {head_dim} needs {head_dim // 2}")
    return theta, {"rope_type": rope_type, **merged}, local_theta
