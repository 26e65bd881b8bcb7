"""Deprecated alias of :mod:`icqs_fast.jobs.ray_actors` (the Ray Data actors moved there).

Kept for code that imported ``icqs_fast.distributed`` (docs/SCALEOUT.md before the layered
package); it will be removed in a later release.
"""

import warnings

from icqs_fast.jobs.ray_actors import *  # noqa: F403
from icqs_fast.jobs.ray_actors import __all__  # noqa: F401

warnings.warn("icqs_fast.distributed is deprecated; import icqs_fast.jobs.ray_actors instead",
              DeprecationWarning, stacklevel=2)
