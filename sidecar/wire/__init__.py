"""The socket protocol, sans-IO: bytes in, typed events out, and replies back to bytes.

Owns: newline framing with its caps (``framing``) and the request/reply schema, error codes
and the connection states of both ends, authentication included (``protocol``), and the TCP
endpoint file, where the TCP listener is and its token (``endpoint``). The daemon's server and
the CLI's and the tests' client drive these modules; the Spark side's copies of the client's
part (``spark_bridge.wire``, the listener's ``Wire.java``) are checked against them.

May import: ``sidecar.model`` (a progress decodes into a checkpoint), ``sidecar.errors``;
no event loop, no socket, no SDK.
"""
