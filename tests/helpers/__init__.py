"""Fixtures shared by the tests and the benches (synthetic codec specs and caches, toy artifacts, the LMCache MP
client that drives `kvtc lmcache-server`): test code, not part of the installed package. Tests import
`helpers.*` (pytest puts tests/ on sys.path); benches put tests/ on sys.path first."""
