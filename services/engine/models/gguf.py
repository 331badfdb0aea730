"""GGUF file -> (HF config dict, HF-named weights in the served dtype).

Our lean reader (common/gguf_reader.py) parses, the `gguf` package dequantizes; this module maps
llama.cpp's names and layout back to HF's: tensor names (`blk.N.attn_q` -> `model.layers.N.self_attn.q_proj`,
per architecture where they differ: Phi-3's fused projections, the routers), the experts llama.cpp
stacks into one tensor a projection (split back into HF's per-expert names), the Q/K row
permutation it applies to llama-architecture checkpoints, and the metadata keys of the config
(with the RoPE scalings its converter turns into tensors: Llama 3's rope_freqs, Phi-3's longrope
factors), and Gemma's norm weights, which it stores + 1. The tokenizer is converted from the same file by `kvmesh.prompt.sources`.
"""
from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from kvmesh.common.gguf_reader import open_gguf
from kvmesh.engine.models.gguf_tensors import tensor_in_dtype
from kvmesh.kernels.quant.weight import FORMATS, QuantizedWeight, format_name, is_supported

log = logging.getLogger(__name__)

# GGUF general.architecture -> (HF architecture, whether llama.cpp permuted the Q/K rows)
# (a llama file with experts is Mixtral: `kind` below)
_ARCHITECTURES = {"llama": ("LlamaForCausalLM", True), "qwen2": ("Qwen2ForCausalLM", False),
                  "qwen3": ("Qwen3ForCausalLM", False), "phi3": ("Phi3ForCausalLM", False),
                  "qwen3moe": ("Qwen3MoeForCausalLM", False), "gemma2": ("Gemma2ForCausalLM", False),
                  "gemma3": ("Gemma3ForCausalLM", False)}
# Gemma's RMSNorm multiplies by (1 + w); llama.cpp's converter stores w + 1 (its norm multiplies by w)
_NORM_PLUS_ONE = ("gemma2", "gemma3")
# llama.cpp's Gemma layer counts of the 27B models, whose attention scale is 1 / sqrt(hidden / heads)
# (the others': 1 / sqrt(head_dim)); the metadata does not carry query_pre_attn_scalar
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
# the architectures whose files carry a sliding window (`<arch>.attention.sliding_window`)
_WINDOWED = ("phi3", "gemma2", "gemma3")
_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm",      # Qwen3's per-head norms
    "attn_k_norm": "self_attn.k_norm",
}
# per architecture, the names that differ: Phi-3 keeps HF's fused projections (ffn_up is gate|up)
_GEMMA_NORMS = {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                "post_ffw_norm": "post_feedforward_layernorm"}
_PER_LAYER_ARCH = {"phi3": {"attn_qkv": "self_attn.qkv_proj", "ffn_up": "mlp.gate_up_proj"},
                   "gemma2": _GEMMA_NORMS, "gemma3": _GEMMA_NORMS,
                   "mixtral": {"ffn_gate_inp": "block_sparse_moe.gate"},
                   "qwen3moe": {"ffn_gate_inp": "mlp.gate"}}
# the experts, stacked by llama.cpp into one [experts, N, K] tensor a projection: each expert's
# HF module, and the projection's HF name
_EXPERTS = {"mixtral": ("block_sparse_moe.experts", {"ffn_gate_exps": "w1", "ffn_up_exps": "w3", "ffn_down_exps": "w2"}),
            "qwen3moe": ("mlp.experts", {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                                         "ffn_down_exps": "down_proj"})}
# Phi-3's longrope factors (the 128k models), read into the config, not weights
_ROPE_FACTORS = {"rope_factors_long.weight": "long_factor", "rope_factors_short.weight": "short_factor"}
# llama.cpp's per-frequency RoPE divisors (Llama 3.1+'s llama3 scaling, baked in by its converter):
# read into the config, not a weight
_ROPE_FREQS = "rope_freqs.weight"
_FLOAT_TYPES = (0, 1, 30)       # F32, F16, BF16: loaded as float tensors, never kept as blocks
_BLOCK_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")


class GGUFFile:
    """An opened GGUF file: metadata, the HF config it implies, and its tensors under HF names."""

    def __init__(self, path: Path):
        self.path = path
        self.reader = open_gguf(path)
        self.arch = self.field("general.architecture")
        if self.arch not in _ARCHITECTURES:
            raise ValueError(f"unsupported architecture {self.arch!r} in GGUF file {path}; "
                             f"supported: {', '.join(_ARCHITECTURES)}")
        self.tensor_names = {t.name for t in self.reader.tensors}
        # the name set the tensors follow: the architecture, or "mixtral" for a llama file with experts
        self.kind = "mixtral" if self.arch == "llama" and self.field("llama.expert_count") else self.arch

    def field(self, key: str, default: Any = None) -> Any:
        return self.reader.get(key, default)

    # ----------------------------------------------------------------------------- config

    def hf_config(self) -> dict[str, Any]:
        """The metadata as an HF config.json dict (ModelConfig.from_hf_config parses it)."""
        a = self.arch

        def need(key: str) -> Any:
            value = self.field(f"{a}.{key}")
            if value is None:
                raise ValueError(f"GGUF file {self.path} lacks metadata key '{a}.{key}'")
            return value

        hidden, heads = int(need("embedding_length")), int(need("attention.head_count"))
        head_dim = int(self.field(f"{a}.attention.key_length") or hidden // heads)
        rope_dim = self.field(f"{a}.rope.dimension_count")
        if rope_dim is not None and int(rope_dim) != head_dim:
            raise ValueError(f"GGUF file {self.path}: partial rotary embeddings (rope dims {rope_dim} "
                             f"< head_dim {head_dim}) are not supported")
        vocab = self.field(f"{a}.vocab_size") or self.reader.array_len("tokenizer.ggml.tokens") or 0
        eos = [self.field(k) for k in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")]
        cfg: dict[str, Any] = {
            "architectures": ["MixtralForCausalLM" if self.kind == "mixtral" else _ARCHITECTURES[a][0]],
            "hidden_size": hidden,
            "intermediate_size": int(self.field(f"{a}.feed_forward_length")
                                     or need("expert_feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(self.field(f"{a}.attention.head_count_kv") or heads),
            "head_dim": head_dim,
            "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(self.field(f"{a}.rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self.field(f"{a}.context_length", 2048)),
            "vocab_size": int(vocab),
            "tie_word_embeddings": "output.weight" not in self.tensor_names,
            "hidden_act": "silu",
            "bos_token_id": self.field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": [int(e) for e in eos if e is not None],
        }
        scaling = self.field(f"{a}.rope.scaling.type")
        if scaling not in (None, "none"):
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": self.field(f"{a}.rope.scaling.factor")}
            orig = self.field(f"{a}.rope.scaling.original_context_length")
            if orig is not None:
                cfg["rope_scaling"]["original_max_position_embeddings"] = int(orig)
        if _ROPE_FREQS in self.tensor_names:
            # NOTE: llama.cpp divides frequency i by factor i: the divisors of HF's llama3 scaling,
            # computed by its converter from the checkpoint's rope_scaling (model_config's "rope_freqs")
            if scaling not in (None, "none"):
                raise ValueError(f"GGUF file {self.path} has both RoPE scaling {scaling!r} and a rope_freqs "
                                 "tensor; one of them is supported at a time")
            cfg["rope_scaling"] = {"rope_type": "rope_freqs", "freq_factors": self._floats(_ROPE_FREQS)}
        if a in _WINDOWED:
            window = int(self.field(f"{a}.attention.sliding_window") or 0)
            if window > 0:          # Phi-4's files say 0: no window
                cfg["sliding_window"] = window
        if a == "phi3":
            self._phi3(cfg)
        if self.kind in _EXPERTS:
            self._experts_config(cfg, int(need("expert_count")), int(need("expert_used_count")))
        if a in _NORM_PLUS_ONE:
            self._gemma(cfg, hidden // heads, head_dim)
        return cfg

    def _gemma(self, cfg: dict[str, Any], hidden_per_head: int, head_dim: int) -> None:
        """Gemma 2 / 3: Gemma 2's soft-capping and the attention scale as llama.cpp sets it (the
        defaults of HF's configs cover the rest: GeGLU, Gemma 2's alternating and Gemma 3's 5:1
        sliding layers, Gemma 3's local RoPE base 10000)."""
        a = self.arch
        cfg["hidden_activation"] = "gelu_pytorch_tanh"
        big = cfg["num_hidden_layers"] == _GEMMA_27B_LAYERS[a]
        cfg["query_pre_attn_scalar"] = hidden_per_head if big else head_dim
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = self.field(f"{a}.{key}")
            cfg[key] = None if value is None else float(value)

    def _experts_config(self, cfg: dict[str, Any], experts: int, used: int) -> None:
        cfg["num_experts_per_tok"] = used
        if self.kind == "mixtral":
            cfg["num_local_experts"] = experts
            return
        # NOTE: Qwen3-MoE: every layer sparse in llama.cpp's files; the top-k weights renormalised
        # (llama.cpp's qwen3moe graph always does; newer files say so in expert_weights_norm)
        cfg["num_experts"] = experts
        cfg["moe_intermediate_size"] = int(self.field(f"{self.arch}.expert_feed_forward_length")
                                           or cfg["intermediate_size"])
        cfg["norm_topk_prob"] = bool(self.field(f"{self.arch}.expert_weights_norm", True))

    def _floats(self, tensor_name: str) -> list[float]:
        t = next(t for t in self.reader.tensors if t.name == tensor_name)
        return [float(v) for v in np.asarray(t.data, dtype=np.float32).ravel()]

    def _phi3(self, cfg: dict[str, Any]) -> None:
        """Phi-3's longrope (the 128k models: two factor tensors and the attention factor llama.cpp's
        converter computed)."""
        orig = self.field("phi3.rope.scaling.original_context_length")
        if orig is not None:
            cfg["original_max_position_embeddings"] = int(orig)
        have = [name for name in _ROPE_FACTORS if name in self.tensor_names]
        if not have:
            return
        if len(have) != len(_ROPE_FACTORS):
            raise ValueError(f"GGUF file {self.path} has {have[0]} without its pair: longrope needs "
                             f"{' and '.join(_ROPE_FACTORS)}")
        cfg["rope_scaling"] = {"rope_type": "longrope", **{key: self._floats(name) for name, key in _ROPE_FACTORS.items()}}
        attn_factor = self.field("phi3.rope.scaling.attn_factor")
        if attn_factor is not None:
            cfg["rope_scaling"]["attention_factor"] = float(attn_factor)

    # ---------------------------------------------------------------------------- weights

    def weights(self, num_heads: int, num_kv_heads: int, keep_quantized: bool = False,
                activations: str = "int8", dtype: torch.dtype = torch.float32,
                ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """(HF name, tensor in `dtype`) for every tensor, dequantized and un-permuted (straight
        into `dtype`: see gguf_tensors); with `keep_quantized`, 2-D tensors in a format the
        quantized kernels read come as QuantizedWeight (their blocks, rows un-permuted), the
        others dequantized with a log line per format."""
        from gguf.quants import dequantize  # noqa: PLC0415

        permuted = _ARCHITECTURES[self.arch][1]
        fallback: set[int] = set()
        for t in self.reader.tensors:
            if t.name == _ROPE_FREQS or t.name in _ROPE_FACTORS:
                continue        # in the config (hf_config)
            names = self._hf_names(t)
            if not names:
                log.warning("ignoring unknown GGUF tensor %s in %s", t.name, self.path)
                continue
            name, experts = names[0], (names if len(t.shape) == 3 else None)
            if keep_quantized and _block_matrix(t):
                if is_supported(t.ggml_type):
                    if experts:     # each expert's rows of the stacked blocks
                        for e, expert in enumerate(experts):
                            data = torch.from_numpy(np.array(t.data[e], copy=True))
                            yield expert, QuantizedWeight(data, t.ggml_type, t.shape[1:], activations)
                    else:
                        yield name, self._quantized(t, name, num_heads, num_kv_heads, activations)
                    continue
                if t.ggml_type not in fallback:
                    fallback.add(t.ggml_type)
                    log.warning("GGUF %s: tensors in format %s (first: %s) are served dequantized "
                                "(%s): the quantized kernels read %s", self.path.name,
                                format_name(t.ggml_type), t.name, str(dtype).removeprefix("torch."),
                                ", ".join(format_name(f) for f in FORMATS))
            try:
                tensor = tensor_in_dtype(t, dtype, dequantize)
            except Exception as e:
                raise ValueError(f"cannot dequantize GGUF tensor {t.name} (ggml type {t.ggml_type}) "
                                 f"in {self.path}: {e}") from None
            if experts:
                yield from zip(experts, tensor.unbind(0))
                continue
            if self.arch in _NORM_PLUS_ONE and t.name.endswith("norm.weight"):
                tensor = tensor - 1.0       # llama.cpp stored Gemma's w + 1
            # NOTE: unpermute_rows on a torch tensor copies into a contiguous one, in `dtype`
            if permuted and ".self_attn.q_proj." in name:
                tensor = unpermute_rows(tensor, num_heads)
            elif permuted and ".self_attn.k_proj." in name:
                tensor = unpermute_rows(tensor, num_kv_heads)
            yield name, tensor

    def block_tensors(self) -> Iterator[tuple[str, int]]:
        """(HF name, ggml type) of each tensor `weights(keep_quantized=True)` yields as blocks."""
        for t in self.reader.tensors:
            if _block_matrix(t) and is_supported(t.ggml_type):
                for name in self._hf_names(t):
                    yield name, t.ggml_type

    def _hf_names(self, t) -> list[str]:
        """The HF name(s) tensor `t` loads as: one, each expert's of a stacked expert tensor, or
        none for a name the reader does not know."""
        if len(t.shape) == 3:
            return expert_names(t.name, self.kind, t.shape[0]) or []
        name = hf_tensor_name(t.name, self.kind)
        return [] if name is None else [name]

    def _quantized(self, t, name: str, num_heads: int, num_kv_heads: int,
                   activations: str) -> QuantizedWeight:
        # NOTE: a copy in process memory, not a view of the mmap: the file may be replaced while
        # served, and a page-cache-backed weight would not show in the process's RSS.
        data = torch.from_numpy(np.array(t.data, copy=True))
        weight = QuantizedWeight(data, t.ggml_type, (t.shape[0], t.shape[1]), activations)
        permuted = _ARCHITECTURES[self.arch][1]
        heads = (num_heads if ".self_attn.q_proj." in name else
                 num_kv_heads if ".self_attn.k_proj." in name else 0)
        if permuted and heads:
            # the same row order as unpermute_rows gives the float matrix; blocks stay whole
            order = unpermute_rows(np.arange(t.shape[0]), heads)
            weight = weight.rows(torch.from_numpy(np.ascontiguousarray(order)))
        return weight


def _block_matrix(t) -> bool:
    """Whether a GGUF tensor is a matrix (or a stack of experts' matrices) in a block format
    (a candidate to stay blocks)."""
    return t.ggml_type not in _FLOAT_TYPES and len(t.shape) in (2, 3)


def expert_names(gguf_name: str, kind: str, experts: int) -> list[str] | None:
    """`blk.3.ffn_gate_exps.weight` (stacked experts) -> each expert's HF name (Mixtral:
    `model.layers.3.block_sparse_moe.experts.E.w1.weight`); None for other tensors."""
    m = _BLOCK_NAME.match(gguf_name)
    if not m or kind not in _EXPERTS or m.group(2) not in _EXPERTS[kind][1]:
        return None
    module, names = _EXPERTS[kind]
    layer, proj, suffix = m.group(1), names[m.group(2)], m.group(3)
    return [f"model.layers.{layer}.{module}.{e}.{proj}.{suffix}" for e in range(experts)]


def hf_tensor_name(gguf_name: str, arch: str = "llama") -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight` (the names of `arch`'s
    HF model); None if unknown."""
    m = _BLOCK_NAME.match(gguf_name)
    if m:
        layer, kind, suffix = m.groups()
        names = {**_PER_LAYER, **_PER_LAYER_ARCH.get(arch, {})}
        if kind not in names:
            return None
        return f"model.layers.{layer}.{names[kind]}.{suffix}"
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_LEVEL and suffix in ("weight", "bias"):
        return f"{_TOP_LEVEL[base]}.{suffix}"
    return None


def unpermute_rows(w, n_head: int):
    """Undo llama.cpp's Q/K permutation (convert_hf_to_gguf `permute`).

    llama.cpp rotates interleaved pairs (GPT-J style); to use it for HF's rotate-half layout its
    converter reorders each head's rows from [half0 | half1] to interleaved. This is the inverse:
    per head, rows (pair, 2) -> (2, pair). `w`: a numpy array or a torch tensor.
    """
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
