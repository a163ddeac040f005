"""Quantized linear layers (stage 22): int8 weights, and int8 activations, for the Llama family.

int8.py                the math in plain PyTorch: quantize, the int32 GEMM, the float epilogue (references)
int8_linear.py         Int8Linear, the layer the model runs, and its fast paths (torch._int_mm; Triton on CUDA)
triton_int8.py         the CUDA path: per-token int8 quantization and the int8 GEMM with its scales, in Triton
compressed_tensors.py  which checkpoints load (config.json's quantization_config) and how
"""
