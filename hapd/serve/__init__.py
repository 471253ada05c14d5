"""The daemon and everything that talks to it: drop folder, plan cache, rank jobs,
wire protocol, client, keys.

Importable without torch (the launcher and light clients use it); the daemon loads the
compiler only when it first compiles.
"""
