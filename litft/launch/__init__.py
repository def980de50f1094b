"""Starting and watching the processes of a run: which launcher started it and whether its world adds up (``cluster``,
``launchers``), Ray's workers (``ray_launch``, ``ray_worker``), and the threads that watch for stop signals and silent peers
(``watch``).
"""
