"""cucopy: merge an engine's tiny per-step device copies into one upload and one launch."""

from .errors import CopyError
from .plan import CopyPlan
from .sites import D2D, FILL, H2D, CopySite, Direction

__all__ = ["CopyError", "CopyPlan", "CopySite", "Direction", "H2D", "D2D", "FILL"]
