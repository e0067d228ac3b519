"""How a decode step runs, apart from its math (:mod:`rsmem.models.ops`): which path a token takes
(``path``), compiled steps (``compiled``), the fused whole-step functions they compile (``fused``,
``hybrid_fused``, ``wkv_fused``, ``wkv_many``), the C++ steps (``native``: the op wrapper and its first-call
check; ``operands``: their operands by name; ``native_forms``: the forms their matrices take), matrix
layouts for few-row products (``packed``, ``small_rows``) and the memo of a step's prepared operands
(``memo``)."""
