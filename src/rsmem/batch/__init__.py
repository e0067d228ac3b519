"""Batches: what users submit (:class:`Batch`), how it is checked and split (:class:`BatchAllocator`),
and what a model forward sees (:class:`UBatch`)."""

from rsmem.batch.allocator import BatchAllocator, SequencePositions
from rsmem.batch.batch import Batch, UBatch

__all__ = ["Batch", "BatchAllocator", "SequencePositions", "UBatch"]
