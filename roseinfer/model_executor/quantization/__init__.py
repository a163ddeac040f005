"""Quantized linear layers (stage 22): int8 weights, and int8 activations, for the Llama family.

int8.py                the math in plain PyTorch: quantize, the int32 GEMM, the float epilogue (references)
int8_linear.py         Int8Linear, the layer the model runs, and its fast path (torch._int_mm)
compressed_tensors.py  which checkpoints load (config.json's quantization_config) and how
"""
