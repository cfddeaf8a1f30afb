"""Moved to :mod:`phalanx.launch.raytrain`; this path stays for one release (0.2) so that user scripts keep working.

``from phalanx.raytrain import train`` and ``from phalanx.launch.raytrain import train`` name the same function.
"""
from .launch.raybackend import PhalanxConfig
from .launch.raytrain import require_ray, train

__all__ = ["PhalanxConfig", "require_ray", "train"]
