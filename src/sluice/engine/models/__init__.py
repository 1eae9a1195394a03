"""Model definitions (Llama family) and weight loaders (Hugging Face safetensors, GGUF)."""
