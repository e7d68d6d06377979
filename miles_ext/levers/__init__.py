"""The H3 levers: each module one lever, its proof under ``tests/equivalence/``."""
