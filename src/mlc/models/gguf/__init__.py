"""GGUF files (llama.cpp's format): reading (`reader`), dequantizing (`dequant`), the tokenizer and each
architecture's config and tensor names, and the conversion into an HF checkpoint dir (`convert`)."""
