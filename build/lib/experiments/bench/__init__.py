"""Memory/throughput benchmark of the training modes on τ²-shaped batches.

``modes``  the training modes (padded, microbatch, treemask, dfs-retain, dfs-recompute) behind
           a registry, all exact against one-sequence-at-a-time training;
``flops``  the FLOPs each mode executes (by kind: body, attention, head) and the ideal
           speed-up of the tree;
``worker`` one measured run (one mode, one repeat) in a fresh process;
``config`` the settings (BenchConfig), ``cli`` their command-line options;
``inputs`` the user's own batch (``--input``: vocabulary check, cut by groups and episodes)
           and model (``--model PATH``);
``run``    the harness: interleaved runs, medians, gradient errors, JSON / Markdown / plots;
``chain``  the N-turn chain (step-time growth against FLOPs, copy share);
``profile`` one profiled step per mode: time by kind of work beside its FLOPs;
``gpu.sh`` the same on the lent GPU, Qwen3-0.6B/1.7B-shaped models in bf16.
"""
