"""Building blocks shared by the model families in `kvmesh.engine.models` (vLLM's `layers/`).

    rope.py       cos/sin caches: default, linear, llama3, dynamic NTK, longrope (Phi-3)
    norm.py       RMSNorm (Llama rounding, through the kernels) and GemmaRMSNorm ((1 + w), fp32)
    linear.py     q/k/v and gate/up fused into one matmul without changing HF parameter names
    attention.py  projection -> optional per-head q/k norm -> RoPE -> paged cache -> o_proj
    mlp.py        gated MLP (SiLU or tanh-GELU), separate or fused gate_up weights
    moe.py        sparse mixture-of-experts MLP: router -> top-k -> fused experts (Mixtral, Qwen3-MoE)
    causal_lm.py  the skeleton every family shares: embed -> layers -> norm -> logits
"""
