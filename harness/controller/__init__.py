"""The controller side: what runs in the process that drives a world (the CLI, the pytest plugin,
or each torchrun process in a joined world).

:mod:`world` starts the rank processes and talks to them over :mod:`shardcheck.harness.wire`
(:mod:`joined` joins a torchrun world instead); :mod:`runner` turns rank results into verdicts
(:mod:`verdict`) and :mod:`report` shows them; :mod:`fuzz`, :mod:`invariance` and
:mod:`bisect` are the commands built on :mod:`runner` and :mod:`world`.
"""
