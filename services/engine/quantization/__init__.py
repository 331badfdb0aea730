"""Hugging Face quantized checkpoints (compressed-tensors, AWQ, GPTQ, FP8): reading them into the
canonical weights of `kvmesh.kernels.quant.hf_weight` (docs/KERNELS.md).

    hf_config.py    quantization_config -> HFQuantConfig (what is supported, refused by name)
    hf_convert.py   a module's checkpoint tensors -> its canonical weight (AWQ / GPTQ unpacking)
    hf_load.py      the safetensors stream -> (name, canonical weight or float tensor)
    serving.py      --quantization and the checkpoint -> served quantized here, or dequantized (why)
"""
