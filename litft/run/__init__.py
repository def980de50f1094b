"""One run, from its checked flags to its exported model: what a job asked for (``spec``), what the run is, decided once
(``plan``), the model built for it (``build``), the trainer that owns its parts (``trainer``), THE training loop (``loop``),
validation and scoring (``evaluation``), and what a run shows (``metrics``, ``logs``, ``trackers``, ``plot``, ``profiling``).
"""
