"""How a decode step runs, apart from its math (:mod:`rsmem.models.ops`): compiled steps (``compiled``), the
fused whole-step functions they compile (``fused``, ``hybrid_fused``, ``wkv_fused``, ``wkv_many``), the C++
steps' operand lists (``native``), matrix layouts for few-row products (``packed``, ``small_rows``) and the
memo of a step's prepared operands (``memo``)."""
