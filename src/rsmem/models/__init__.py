"""Models that run on the recurrent memory."""

from rsmem.models.mamba import MambaConfig, MambaModel
from rsmem.models.mamba2 import Mamba2Config, Mamba2Model
from rsmem.models.protocol import RecurrentModel, StateAccess
from rsmem.models.toy import DecayedSumModel

__all__ = [
    "DecayedSumModel",
    "Mamba2Config",
    "Mamba2Model",
    "MambaConfig",
    "MambaModel",
    "RecurrentModel",
    "StateAccess",
]
