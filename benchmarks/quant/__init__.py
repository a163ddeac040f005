"""Accuracy benchmarks of quantized and lower-precision configurations (stage 22): benchmarks/quant/accuracy.py."""
