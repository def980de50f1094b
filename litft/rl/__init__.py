"""Online RL's moving parts beside its loss (litft.objectives.grpo): the engines that sample completions (``engine``), the
rollouts a step trains on, sampled, scored and kept (``rollouts``), and the reward functions (``rewards``).
"""
