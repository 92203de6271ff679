"""The daemon's settings: one typed, validated object built from the environment or flags
(``settings``), and the ``--help`` text of each setting (``help``).

May import: ``sidecar.errors`` and ``msgspec``; nothing else of the sidecar.
"""

from sidecar.config.settings import Config, Setting, redact_url

__all__ = ["Config", "Setting", "redact_url"]
