"""The socket protocol, sans-IO: bytes in, typed events out, and replies back to bytes.

Owns: newline framing with its caps (``framing``) and the request/reply schema, error codes
and the connection states of both ends (``protocol``). The daemon's server, the CLI's and
the tests' client and the Spark side (``spark_bridge``) all drive these modules.

May import: ``sidecar.model`` (a progress decodes into a checkpoint), ``sidecar.errors``;
no event loop, no socket, no SDK.
"""
