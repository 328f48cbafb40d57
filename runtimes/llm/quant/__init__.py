"""Quantized weights: llama.cpp's block formats kept as they are (`formats`), and the CPU kernel that multiplies by
them (`cpu`)."""
