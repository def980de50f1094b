"""The model a run trains, as transformers computes it: finding and loading it (``loading``), its skeleton and block-by-block
fill (``weights``, ``hub_layout``), the module the loop trains (``causal_lm``), LoRA and QLoRA (``lora``), and the fast paths
that must give what the model's own eager forward gives: attention on packed rows (``attention``, ``varlen``), the head and
loss on target tokens (``loss``), grouped experts (``experts``), layers that carry state (``recurrent``), compile, FP8 and
fused kernels (``compiling``, ``fp8``, ``kernels``); its FLOPs (``flops``, ``peaks``), generation on it (``generation``), and
litft-tiny (``tiny``). Nothing here knows of ranks, strategies or objectives.
"""
