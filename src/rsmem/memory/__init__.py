"""The recurrent-state memory, its per-batch context, and state save/restore."""

from rsmem.memory.cells import CellTable
from rsmem.memory.context import MemoryStatus, RecurrentMemoryContext
from rsmem.memory.recurrent import RecurrentMemory, StateShape

__all__ = ["CellTable", "MemoryStatus", "RecurrentMemory", "RecurrentMemoryContext", "StateShape"]
