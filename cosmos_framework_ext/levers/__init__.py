"""The Cosmos levers: each module one lever, its proof ``tests/equivalence/test_<lever>.py``."""
