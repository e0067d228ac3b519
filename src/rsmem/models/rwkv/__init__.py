"""The RWKV family: RWKV-7 (``rwkv7``), RWKV-6 (``rwkv6``), ARWKV-7 (``arwkv7``: RWKV-7 time mixing with a
Qwen2 body) and QRWKV-6 (``rwkv6qwen2``), on their shared base (``base``)."""
