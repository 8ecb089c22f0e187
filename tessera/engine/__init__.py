"""The engine layer: the save (:mod:`.saving`) and the load (:mod:`.loading`), which mirror each
other and never import each other, beside what both use: :mod:`.commit` (the commit protocol),
:mod:`.dist` (collectives), :mod:`.inflight` (the save in flight), :mod:`.flat_state` (flattening
user state), :mod:`.file_checks` (checking data files against the manifest), :mod:`.timing`.

Imports storage, format and the vocabulary below it; :mod:`tessera.api` and everything above build
on it (see docs/architecture.md).
"""
