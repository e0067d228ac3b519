"""Models that run on the recurrent memory."""

from rsmem.models.protocol import RecurrentModel, StateAccess
from rsmem.models.toy import DecayedSumModel

__all__ = ["DecayedSumModel", "RecurrentModel", "StateAccess"]
