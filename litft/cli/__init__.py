"""The command line: every flag declared once (``flags``), the three jobs' signatures (``jobs``), ``--help`` (``help``), and
the commands beside the jobs (``chat``, ``download``, ``envreport``, ``selfcheck``); ``litft/__main__.py`` is their table.
"""
