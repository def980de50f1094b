"""Parallelism in one place: the device mesh every split reads (``mesh``), the strategies that shard and step the model
(``strategies``: one process, DDP, FSDP2, DeepSpeed), and the splits on the mesh: context (``context``, each sequence over
ranks), tensor (``tensor``, each block over ranks) and expert (``expert``, each MoE layer's experts over ranks).

Nothing is imported here: the splits are read by attention, the loop and the estimate, which need none of the strategies'
libraries.
"""
