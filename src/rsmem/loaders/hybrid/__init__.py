"""Loading the hybrids (LFM2, Nemotron-H, Qwen3.5): GGUF configs and model building (``build``, Qwen3.5's in
``qwen35``), HF folders (``hf``) and their conversion to GGUF (``convert``)."""
