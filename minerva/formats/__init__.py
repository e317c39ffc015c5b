"""File formats: GGUF, SafeTensors, quantization types, tokenizers, chat templates."""
