"""Models that run on the recurrent memory."""

from rsmem.models.mamba.mamba1 import MambaConfig, MambaModel
from rsmem.models.mamba.mamba2 import Mamba2Config, Mamba2Model
from rsmem.models.protocol import RecurrentModel, StateAccess
from rsmem.models.rwkv.rwkv6 import Rwkv6Config, Rwkv6Model
from rsmem.models.rwkv.rwkv7 import Rwkv7Config, Rwkv7Model
from rsmem.models.toy import DecayedSumModel

__all__ = [
    "DecayedSumModel",
    "Mamba2Config",
    "Mamba2Model",
    "MambaConfig",
    "MambaModel",
    "RecurrentModel",
    "Rwkv6Config",
    "Rwkv6Model",
    "Rwkv7Config",
    "Rwkv7Model",
    "StateAccess",
]
