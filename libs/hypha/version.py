"""The installed version of the ``hypha-ml`` distributions.

``hypha`` is a namespace package shared by the core and each role's
distribution, so it has no ``__init__`` to hold a version; the core
distribution's metadata is the one source.
"""

from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "hypha-ml"

try:
    __version__ = version(DISTRIBUTION)
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0.0.0+unknown"
