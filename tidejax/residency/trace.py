"""Routing traces from live traffic: the router's picks, with their weights, of sampled steps,
written under state_dir in a bounded set of chunk files (issue 36). Off by default.

Profile keys ([residency]):
    trace_every_steps = 0   # 0: off; N: every N-th step is recorded (its step index % N == 0)
    trace_max_mib = 64      # the chunks' total size bound; the oldest chunks go first
Tracing needs a state_dir (a ConfigError otherwise).

The format (version 1), stable; readers use `read_trace(folder)`:

    <state_dir>/routing/header.json    written atomically when the recorder starts:
        format             "tidejax-routing-trace"
        version            1
        model              the served model's name (model.served_name, else the checkpoint
                           folder's name)
        model_type         config.json's model_type
        n_layers           L: the MoE layers (the rows of the resident map and the counters)
        n_experts          E: routed experts per MoE layer
        top_k              k: picks per token and MoE layer
        trace_every_steps  the sampling period
        resident_slots     the bank's resident slots (budget_experts as resolved; = L * E when
                           every expert is resident)
        residency          the [residency] table the engine ran with (budget, geometry,
                           miss_policy, drain_every, half_life, hysteresis, ...)
    <state_dir>/routing/trace-<first step, 12 digits>.npz    chunks, np.savez (no pickles: read
        with allow_pickle=False), each written atomically (temp file, fsync, os.replace):
        step        int64 [R]       the engine's step index of each recorded step (Residency's
                                    `steps` counter before the step: the numbering of stats())
        tokens      int32 [R]       real tokens the step routed (its prompt chunk's, then its
                                    decoding lanes'; padding left out)
        map_version int64 [R]       the version of the resident map the step ran on
        ids         int16 [N, L, k] picked expert ids, the router's order (best first); N =
                                    tokens.sum(), record r's rows start at tokens[:r].sum()
        weights     float32 [N, L, k]  the router's weights of those picks (what the demand
                                    counters sum: History.demand's unit)
        resident    bool [N, L, k]  whether the pick's expert had a bank slot (resident or ring)
                                    when the step routed it; False: a miss, served by the policy

A header that differs from the running engine's (another model or geometry) sets the old folder
aside as `routing.old-<unix time>` with one warning. A chunk is written when the records it
holds reach a quarter of trace_max_mib (at most CHUNK_BYTES) and at Engine.close(); before a
chunk is written the oldest chunks are removed until the folder stays within trace_max_mib (a
chunk larger than the whole bound, one step of many tokens under a tiny bound, is dropped with a
warning). Steps run with tracing on and the engine's own counters agree: the picks of a trace
recorded at every step, counted per (layer, expert), are the demand counts the engine drained
(tests/server/test_dashboard.py).
"""
