"""The int4 kernel configs ``benchmarks/int4_matmul.py`` times besides each kernel's own pick,
as Int4GemvConfig / HopperInt4Config keyword arguments (plain data: no JAX at import)."""

# (label, Int4GemvConfig kwargs) tried by --gemv-sweep besides the default (gemv_config: FMAs
# below 4 tokens, the dot from 4); "dot" variants only from 4 tokens. The FMA loop is the
# denormal one (1 LOP3 + 1 FFMA a weight) unless "magic" (the 2^23 loop it replaced): a thread
# owns block_n / (32 num_warps) columns.
GEMV_SWEEP = [
    ("n128 w1", dict(block_n=128, num_warps=1)),
    ("n256 w1", dict(block_n=256, num_warps=1)),
    ("n256 w2", dict(block_n=256, num_warps=2)),
    ("n256 w2 k8", dict(block_n=256, num_warps=2, block_words=8)),
    ("n256 w2 k8 prefetch", dict(block_n=256, num_warps=2, block_words=8, prefetch=True)),
    ("n256 w1 k8 prefetch", dict(block_n=256, num_warps=1, block_words=8, prefetch=True)),
    ("n256 w1 t1024", dict(block_n=256, num_warps=1, target_programs=1024, max_splits=64)),
    ("n512 w2", dict(block_n=512, num_warps=2)),
    ("n512 w4", dict(block_n=512, num_warps=4)),
    ("n256 w2 shift", dict(block_n=256, num_warps=2, byte_permute=False)),
    ("n256 w2 evict", dict(block_n=256, num_warps=2, evict_first=True)),
    ("n256 w2 stages 1", dict(block_n=256, num_warps=2, num_stages=1)),
    ("magic", dict(denormal=False)),
    ("magic n256 w8", dict(block_n=256, num_warps=8, denormal=False)),
    ("dot", dict(dot=True)),
    ("dot n64", dict(dot=True, block_n=64)),
    ("dot n256 w8", dict(dot=True, block_n=256, num_warps=8)),
]
# --gemv-modes: the default config with x read and scaled by the kernel (x_in_kernel) and
# with the split-K partials summed in the kernel (atomic adds, or the last split of a column
# block summing them in order) instead of by an XLA fusion after the call, with each step's
# weight loads issued together (loads_first), and with each program letting the next kernel
# be launched at its start (trigger_dependents: programmatic dependent launch).
GEMV_MODES = [
    ("x in kernel", dict(x_in_kernel=True)),
    ("splits atomic", dict(splits_sum="atomic")),
    ("splits last", dict(splits_sum="last")),
    ("loads first", dict(loads_first=True)),
    ("trigger dependents", dict(trigger_dependents=True)),
]
# Candidate GEMV tables (Int4GemvConfig kwargs by (tokens, K, N)), timed by --gemv-modes and
# put in the engine by step_profile's and step_timeline's ``--gemv-overrides table=NAME``.
# "loads_first": every 8B projection at one token loading each step's words before its first
# FMA (GEMV_TABLE since 2026-12-06 but for gate_up, slower so on the H100), picked from the
# sm_90 SASS (Triton 3.6; RESULTS 2026-12-05, 21:08- UTC): qkv, o and
# gate_up as GEMV_TABLE's; down moves to the denormal loop (2.54 instructions a weight against
# the 2^23 loop's 6.14) at 8 word rows a step with the next step's words prefetched (two
# bursts of 8 16-byte loads a thread, 56 registers; at 16 rows a step only 256 programs).
GEMV_CANDIDATE_TABLES = {"loads_first": {
    (1, 4096, 6144): dict(block_n=256, num_warps=2, loads_first=True),
    (1, 4096, 4096): dict(block_n=256, num_warps=2, loads_first=True),
    (1, 4096, 28672): dict(block_n=512, num_warps=2, loads_first=True),
    (1, 14336, 4096): dict(block_n=256, num_warps=2, block_words=8, prefetch=True,
                           loads_first=True),
},
    # gate_up (47% of the GEMVs' time in the H100's batch-1 step, 75% of the copy rate) with
    # its loads first at 96 registers, the other projections as GEMV_TABLE's; in XLA's compile
    # (kernel_sass --compiler xla) 2.52 / 2.51 instructions a weight, 12 / 13 loads issued
    # together, 896 programs of 4 / 2 steps (the table's: 2.38, 3 loads, 64 registers)
    "gate_up_256": {(1, 4096, 28672): dict(block_n=256, num_warps=2, loads_first=True)},
    "gate_up_4warps": {(1, 4096, 28672): dict(block_n=512, num_warps=4, loads_first=True)},
    # gate_up and down (together 72% of the GEMVs' device time in the H100's fused step,
    # 2026-12-06; 66% and 56% of the copy rate there): more programs of fewer steps, down's
    # prefetched 8-row steps for gate_up, and the cache told to drop the weights first
    "gate_up_256_k8_prefetch": {(1, 4096, 28672): dict(block_n=256, num_warps=2, block_words=8,
                                                        prefetch=True, loads_first=True)},
    "gate_up_512_k8_prefetch": {(1, 4096, 28672): dict(block_n=512, num_warps=2, block_words=8,
                                                        prefetch=True)},
    "gate_up_256_one_step": {(1, 4096, 28672): dict(block_n=256, num_warps=2, loads_first=True,
                                                     target_programs=4096, max_splits=32)},
    "gate_up_512_evict": {(1, 4096, 28672): dict(block_n=512, num_warps=2, evict_first=True)},
    # (down's 224 steps of 8 word rows allow at most 32 splits: more programs take narrower
    # column blocks)
    "down_128_1warp": {(1, 14336, 4096): dict(block_n=128, num_warps=1, block_words=8,
                                               prefetch=True, loads_first=True,
                                               target_programs=1024)},
    # kt's two fastest by device time (H100, 2026-12-06): the cache told to drop both
    "evict": {(1, 4096, 28672): dict(block_n=512, num_warps=2, evict_first=True),
              (1, 14336, 4096): dict(block_n=256, num_warps=2, block_words=8, prefetch=True,
                                     loads_first=True, evict_first=True)},
    "down_evict": {(1, 14336, 4096): dict(block_n=256, num_warps=2, block_words=8,
                                           prefetch=True, loads_first=True, evict_first=True)},
}
# The Hopper kernel's pipeline depth and step size against config_for's (at a few tokens a
# program's [128, 128] int4 weight tile is 8 KB a step: how many bytes each SM keeps in flight)
HOPPER_SWEEP = [
    ("6 stages", dict(max_concurrent_steps=6)),
    ("8 stages", dict(max_concurrent_steps=8)),
    ("k64, 8 stages", dict(tile_k=64, max_concurrent_steps=8)),
]
# --nk-sweep (with --hopper): the N-major GEMV's configs beside its pick (nk_gemv_config). Its
# one-row engine step was ~32% slower than the packed one's on an H100: these vary what
# GEMV_TABLE varies for the packed GEMV (warps, columns a program, splits) and its options.
# Timed on an H100 (RESULTS.md, 2026-12-07): the best of each projection 89.0 us a layer
# against the packed GEMV's 67.5.
NK_GEMV_SWEEP = [
    ("2 warps", dict(num_warps=2)),
    ("8 warps", dict(num_warps=8)),
    ("block_n 128", dict(block_n=128)),
    ("block_n 512", dict(block_n=512)),
    ("256 programs", dict(target_programs=256)),
    ("1024 programs", dict(target_programs=1024)),
    ("x in kernel", dict(x_in_kernel=True)),
    ("2 warps, x in kernel", dict(num_warps=2, x_in_kernel=True)),
    ("x sums before", dict(x_sums_before=True)),
    ("x sums before, block_n 512", dict(x_sums_before=True, block_n=512)),
    ("x sums before, x in kernel", dict(x_sums_before=True, x_in_kernel=True)),
    # fewer columns than threads: Triton loads the group scales again in the tile's layout
    # instead of converting them through shared memory, so with the sums before the call the
    # main loop has no barrier (sm_90 SASS, RESULTS.md 2026-12-07), at ~3.3 instructions a
    # weight against 2.8; the first one also reads each weight row whole (no split of K)
    ("rows whole, block_n 32, 2 warps, x sums before",
     dict(block_n=32, num_splits=1, num_warps=2, x_sums_before=True)),
    ("block_n 64, x sums before", dict(block_n=64, x_sums_before=True)),
    ("block_n 128, 8 warps, x sums before", dict(block_n=128, num_warps=8, x_sums_before=True)),
    # several steps an iteration, their loads first: a weight row's next groups read beside
    # this one (128-256-byte runs of a row instead of 64); at 256 columns and 4 warps, 4 steps
    # spill (sm_90: 255 registers and a stack), so 4 steps take fewer columns a program
    ("unroll 2", dict(unroll_steps=2)),
    ("unroll 2, x sums before", dict(unroll_steps=2, x_sums_before=True)),
    ("block_n 64, unroll 4, x sums before", dict(block_n=64, unroll_steps=4, x_sums_before=True)),
    ("block_n 128, 8 warps, unroll 4, x sums before",
     dict(block_n=128, num_warps=8, unroll_steps=4, x_sums_before=True)),
]
# --gemv-before: the config each Llama-3-8B projection ran at one token before the denormal
# loop (GEMV_TABLE of 2026-12-02, timed then: 13.3, 15.1, 47.4, 24.1 us), with its 2^23 loop.
GEMV_BEFORE = {
    (1, 4096, 6144): dict(block_n=256, num_warps=8),
    (1, 4096, 4096): dict(num_warps=2),
    (1, 4096, 28672): dict(max_acc_registers=64),
    (1, 14336, 4096): dict(block_words=8),
}
