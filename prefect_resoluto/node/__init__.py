"""The node engine: one unit of work in one sandbox, from spec to outcome. Never imports Prefect.

:mod:`.spec` is what a node is (:class:`~.spec.NodeSpec`) and the launch it becomes;
:mod:`.drive` runs it on a runtime; :mod:`.tail` reads its event chunks as they land;
:mod:`.outcome` and :mod:`.verdict` say what happened; :mod:`.observer` is how a caller
(the task runner, the worker, the CLI) watches; :mod:`.bounded`, :mod:`.result_files` and
:mod:`.terminal` read what a sandbox left as an attacker's input.
"""
