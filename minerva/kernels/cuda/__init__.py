"""Triton kernels for NVIDIA GPUs: packed GGML weights decoded in registers.

The weights stay in the GGUF bytes on the device, as the CPU kernels keep them; a kernel
reads each block's bytes and scales, decodes them to floats in registers and multiplies
with `tl.dot`. Every kernel here also runs under Triton's interpreter
(`TRITON_INTERPRET=1`), where the tests check it on the CPU against the reference
dequantization (`minerva.formats.quant`) and a float64 matmul.
"""
