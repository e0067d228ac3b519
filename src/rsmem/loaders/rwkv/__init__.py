"""Loading the RWKV family: GGUF configs and model building (``build``, with ``rwkv6``, ``arwkv7``,
``rwkv6qwen2``), llama.cpp's tensor names (``keys``), BlinkDL ``.pth`` files (``convert``), HF folders
(``hf``) and the RWKV world tokenizer (``tokenizer``)."""
