"""The error of a bad run configuration (re-exported by ``dta.config.schema``)."""
from __future__ import annotations


class ConfigError(ValueError):
    """A bad configuration: the message names the offending key."""
