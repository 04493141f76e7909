"""beton_wire: the wire protocol shared by the daemon and its clients.

Holds the ``.proto`` files, their generated code (committed, never edited by hand) and the layout
of shared-memory slots. Depends only on protobuf and grpcio.
"""
