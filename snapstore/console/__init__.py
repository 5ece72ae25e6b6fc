"""What every ``snapstore`` command runs on: its output (text or ``--json``), exit codes, usage errors
and progress meters. The CLI (:mod:`snapstore.cli`) and the integrations' own commands
(``snapstore.engine.<runtime>.cli``) share it, so a command reads and reports the same wherever it lives.
"""
