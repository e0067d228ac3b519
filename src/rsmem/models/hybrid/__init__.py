"""The hybrids: recurrent layers beside attention layers over a KV cache. LFM2 (``lfm2``: short
convolutions), Nemotron-H (``nemotron_h``: Mamba-2 mixers) and Qwen3.5 (``qwen35``: gated delta nets), with
their shared layers (``layers``), compiled decode chains (``chains``, ``qwen35_decode``) and C++ steps
(``native``)."""
