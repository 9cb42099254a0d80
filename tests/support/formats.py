"""Which built-in formats are the extended matrix (marker `matrix`) and which `make test` serves."""

# `make test` serves one format of each path (the kernels' 4-bit, 8-bit, bf16, a hybrid, and
# mxfp8 for jit); these jit formats and the bf16-scaled 4-bit are the extended matrix.
EXTENDED = {"qwen3-tiny-4bit-bf16", "qwen3-tiny-3bit", "qwen3-tiny-mxfp4", "qwen3-tiny-nvfp4",
            "qwen3-tiny-fp16"}
