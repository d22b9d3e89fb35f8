"""shardcheck: checks sharded log-prob and entropy extraction against a float64 reference."""

from shardcheck.errors import BadInput, ShardcheckError, WorldError

__version__ = "0.1.0"

__all__ = ["BadInput", "ShardcheckError", "WorldError", "__version__"]
