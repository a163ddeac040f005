"""Quantized linear layers (stage 22): int8 weights, and int8 activations, for the Llama family and GPT-2.

int8.py                the math in plain PyTorch: quantize, the int32 GEMM, the float epilogue, the
                       dequantized W8A16 linear (references)
int8_linear.py         the layers the model runs, Int8Linear (W8A8: torch._int_mm; Triton on CUDA) and
                       Int8WeightOnlyLinear (W8A16: aten._weight_int8pack_mm or dequantize + F.linear)
triton_int8.py         the CUDA path: per-token int8 quantization and the int8 GEMM with its scales, in Triton
compressed_tensors.py  which checkpoints load (config.json's quantization_config), how W8A16's packed int32
                       weights unpack, and how the tensors become layers
"""
