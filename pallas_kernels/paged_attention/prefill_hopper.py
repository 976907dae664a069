"""Paged prefill attention for Hopper in Pallas' Mosaic GPU backend (TMA, wgmma, warpgroups).

Same contract as :func:`paged_attention_prefill` (no sliding window, 2-byte pools). A work
item is one query head and 2 x block_q consecutive tokens of one sequence (a query block of
:func:`query_blocks`); one program per SM stays resident and takes items in turn, the blocks
with the most keys first, and three warpgroups run each item:

    wg 0, 1   compute: rows [w block_q, (w + 1) block_q) of the block; S = Q K^T and O += P V
              with wgmma, online softmax in registers, the two warpgroups' products taking
              the tensor cores in turn (one's softmax runs beside the other's products); keys
              below every row's position unmasked, the rest under the causal mask
    wg 2      memory: each step's block_kv keys as block_kv / page_size page copies (TMA) per
              K and V into rings of max_concurrent_steps (K) and v_concurrent_steps (V)
              slots, a slot refilled once both compute warpgroups have consumed it; the rings
              run on across items, so the next item's first keys load while this one's last
              are used (and with prefetch_q, the next item's q)

q is read in place (a block's box past its end reads zeros) and each warpgroup stores only
its sequence's rows, in boxes of 2^i rows (a chunk's last block is ragged), so another
sequence's rows are never written and memory stays proportional to the tokens. Blocks of no
query (a sequence slot without one, a decode left to the decode kernel) are no item: as
programs of a (heads, blocks) grid they cost the mixed step more than the kernel saved.

Status (tests/test_prefill_hopper.py): run against the reference by JAX's GPU interpreter on
CPU (warpgroups, barriers and page copies as written, the two products as register dots) and
on an H200; the engine's default prefill kernel on Hopper (attention backend "pallas_mosaic").
On the H200 (benchmarks/RESULTS.md, 2026-12-04, prefill_anatomy) its own device time on 2k
chunks over 0 / 2k / 8k cached tokens: 73.6 / 189.1 / 561.2 us = 467 / 545 / 551 TFLOP/s,
68-80% of the matmul rate measured beside it; a step is bound by each warpgroup's softmax
(the profile's scopes: ~1,550 cycles a step against ~1,300 for its two products).
Pages and page tails past a sequence's length must hold finite values (whole pages are read;
masked keys have p = 0, but 0 x NaN is NaN): the engine's pools are zeroed, then written K/V.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from . import common
from .prefill import query_blocks
from .prefill_hopper_config import HopperPrefillConfig, resident_programs, unsupported


def _kernel(meta_ref, tables_ref, items_ref, q_ref, k_ref, v_ref, out_ref, scoped, *,
            scale_log2: float, block_q: int, block_kv: int, block_size: int,
            k_in_flight: int, v_in_flight: int, group: int, num_q_heads: int, num_programs: int,
            table_width: int, prefetch_q: bool, interpret: bool):
    program = lax.axis_index("programs")
    wg = lax.axis_index("wg")
    (qo_smem2, k_smem, v_smem), (k_ready, v_ready, q_ready), (k_free, v_free), turn = scoped
    pages_per_step = block_kv // block_size
    head_dim = k_ref.shape[-1]
    dtype = q_ref.dtype

    # Work items (query block, head), heads fastest, the heaviest blocks first: round r gives
    # the programs items [r P, (r + 1) P), every other round in reverse order, so that the
    # sums of items' steps the programs get stay close (the items are sorted by cost).
    num_items = items_ref[0]
    full_rounds = lax.div(num_items, jnp.int32(num_programs))
    lane = lambda r: jnp.where(lax.rem(r, 2) == 0, program, num_programs - 1 - program)
    rounds = full_rounds + (lane(full_rounds) < num_items - full_rounds * num_programs)

    def item(r):  # (block, head, the block's K/V steps)
        i = r * num_programs + lane(r)
        blk = lax.div(i, jnp.int32(num_q_heads))
        return blk, lax.rem(i, jnp.int32(num_q_heads)), pl.cdiv(meta_ref[blk, 2],
                                                                jnp.int32(block_kv))

    def k_slot(step):  # the ring slots a K/V step fills (steps counted over all items)
        return lax.rem(step, jnp.int32(k_in_flight))

    def v_slot(step):
        return lax.rem(step, jnp.int32(v_in_flight))

    def take_turn():  # the two compute warpgroups take the tensor cores in turn
        plgpu.barrier_arrive(turn)
        plgpu.barrier_wait(turn)

    @pl.when(wg < 2)
    def _compute():
        plgpu.set_max_registers(232, action="increase")
        row0 = wg * block_q  # the warpgroup's first row within the block

        def q_buffer(buf):  # (smem rows, their barrier)
            if not prefetch_q:
                return qo_smem2.at[wg], q_ready.at[wg]
            return qo_smem2.at[wg, buf], q_ready.at[2 * wg + buf]

        def load_q(blk, head, buf):
            # Into untiled shared memory (a tiled one needs the block's first token a multiple
            # of 8), then registers: wgmma's A operand.
            rows = q_ref.at[pl.ds(meta_ref[blk, 0] + row0, block_q),
                            pl.ds(head * head_dim, head_dim)]  # q is [T, Hq D]
            plgpu.copy_gmem_to_smem(rows, *q_buffer(buf))

        def one_item(r, first_step):
            blk, head, block_steps = item(r)
            t0 = meta_ref[blk, 0]  # the block's first token
            pos0 = meta_ref[blk, 1]  # its position
            kv_len = meta_ref[blk, 2]  # keys its last row sees (0: padding, whose rows are 0)
            num_rows = meta_ref[blk, 3]  # its tokens
            columns = pl.ds(head * head_dim, head_dim)  # the output is [T, Hq D]
            buf = lax.rem(r, 2) if prefetch_q else 0
            q_smem, q_arrived = q_buffer(buf)  # q, then the output
            if not prefetch_q:
                load_q(blk, head, buf)
            with jax.named_scope("q_wait"):
                plgpu.barrier_wait(q_arrived)
                q = plgpu.load(q_smem, layout=plgpu.Layout.WGMMA)
            if prefetch_q:
                @pl.when(r + 1 < rounds)
                def _():
                    # The other buffer holds the previous item's output: read before reuse.
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                    next_blk, next_head, _ = item(r + 1)
                    load_q(next_blk, next_head, 1 - buf)
            # Keys this warpgroup's rows see: up to its last row's position, within the
            # block's.
            wg_keys = jnp.minimum(kv_len, pos0 + row0 + block_q)
            steps = jnp.where(kv_len > 0, pl.cdiv(wg_keys, jnp.int32(block_kv)), 0)
            # Keys every row sees (at or below its first row's position) need no mask.
            unmasked = jnp.minimum(lax.div(pos0 + row0 + 1, jnp.int32(block_kv)), steps)

            m_i = plgpu.layout_cast(jnp.full((block_q,), -jnp.inf, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            l_i = plgpu.layout_cast(jnp.full((block_q,), 0.0, jnp.float32),
                                    plgpu.Layout.WGMMA.reduce(1))
            acc = plgpu.layout_cast(jnp.full((block_q, head_dim), 0.0, jnp.float32),
                                    plgpu.Layout.WGMMA)

            @pl.when(wg == 1)
            @jax.named_scope("item_turn")
            def _():
                take_turn()

            def kv_step(step, carry, masked: bool):
                acc, m_i, l_i = carry
                slot = k_slot(first_step + step)
                with jax.named_scope("k_wait"):
                    plgpu.barrier_wait(k_ready.at[slot])

                def qk(acc_ref):
                    plgpu.wgmma(acc_ref, q, k_smem.at[slot].transpose((1, 0)))
                    take_turn()
                    return acc_ref[...]

                if interpret:  # JAX's GPU interpreter has no wgmma: the product in registers
                    s = jnp.dot(q, k_smem.at[slot][...].T,
                                preferred_element_type=jnp.float32)
                    take_turn()
                else:
                    with jax.named_scope("qk_turn"):
                        s = pl.run_scoped(qk, plgpu.ACC((block_q, block_kv), jnp.float32))
                plgpu.barrier_arrive(k_free.at[slot])
                with jax.named_scope("softmax_masked" if masked else "softmax"):
                    if masked:
                        rows = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 0,
                                                      layout=plgpu.Layout.WGMMA)
                        keys = plgpu.broadcasted_iota(jnp.int32, (block_q, block_kv), 1,
                                                      layout=plgpu.Layout.WGMMA)
                        s = jnp.where(keys + step * block_kv <= rows + (pos0 + row0), s,
                                      -jnp.inf)
                    # m is kept scaled (scale > 0), so that p's exponent is one FMA an entry.
                    m_new = jnp.maximum(m_i, s.max(axis=1) * scale_log2)
                    alpha = jnp.exp2(m_i - m_new)
                    p = jnp.exp2(s * scale_log2 - lax.broadcast_in_dim(m_new, s.shape, [0]))
                    acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
                    l_i = l_i * alpha + p.sum(axis=1)
                    p16 = p.astype(dtype)
                    # Finished here, before the turn below: not moved past it by the compiler.
                    acc, l_i, m_new, p16 = lax.optimization_barrier((acc, l_i, m_new, p16))
                slot = v_slot(first_step + step)
                # Two turns a step: this warpgroup's P V waits until the other's product is
                # issued, so that the tensor cores alternate products while each warpgroup's
                # softmax runs beside the other's.
                plgpu.barrier_arrive(turn)
                with jax.named_scope("v_wait"):
                    plgpu.barrier_wait(v_ready.at[slot])
                with jax.named_scope("pv_turn"):
                    plgpu.barrier_wait(turn)

                def pv(acc_ref):
                    plgpu.wgmma(acc_ref, p16, v_smem.at[slot])

                if interpret:
                    acc = acc + jnp.dot(p16, v_smem.at[slot][...],
                                        preferred_element_type=jnp.float32)
                else:
                    with jax.named_scope("pv"):
                        acc = pl.run_state(pv)(plgpu.ACC.init(acc))
                plgpu.barrier_arrive(v_free.at[slot])
                return acc, m_new, l_i

            carry = lax.fori_loop(0, unmasked, functools.partial(kv_step, masked=False),
                                  (acc, m_i, l_i))
            acc, m_i, l_i = lax.fori_loop(unmasked, steps,
                                          functools.partial(kv_step, masked=True), carry)

            def drain(step, _):
                # Steps only the other warpgroup needs, each waited for before its release (a
                # release counted towards an earlier fill would let a read slot be refilled).
                k, v = k_slot(first_step + step), v_slot(first_step + step)
                plgpu.barrier_wait(k_ready.at[k])
                plgpu.barrier_arrive(k_free.at[k])
                plgpu.barrier_wait(v_ready.at[v])
                plgpu.barrier_arrive(v_free.at[v])
                take_turn()
                take_turn()

            with jax.named_scope("drain"):
                lax.fori_loop(steps, block_steps, drain, None)

            @pl.when(wg == 0)
            @jax.named_scope("item_turn")
            def _():
                take_turn()

            with jax.named_scope("epilogue"):
                # Rows without keys (padding) have l = 0: they write 0, not 0 / 0.
                inv = jnp.where(l_i > 0, 1.0 / jnp.maximum(l_i, 1e-30), 0.0)
                acc = acc * lax.broadcast_in_dim(inv, acc.shape, [0])
                q_smem[...] = acc.astype(dtype)  # untiled: stores start anywhere
                plgpu.commit_smem()
            # This warpgroup's rows of the sequence, in boxes of 2^i rows (one per set bit).
            rows = jnp.clip(num_rows - row0, 0, block_q)
            start = rows & 0  # traced (a constant start fails to lower with the traced ones)
            size = 1 << (block_q.bit_length() - 1)
            while size:
                @pl.when(rows & size != 0)
                def _(size=size, start=start):
                    plgpu.copy_smem_to_gmem(q_smem.at[pl.ds(start, size)],
                                            out_ref.at[pl.ds(t0 + row0 + start, size), columns])
                start = start + (rows & size)
                size //= 2
            if not prefetch_q:
                # Read, not written: the next item's q may overwrite the rows, and its load
                # need not wait for the store to reach memory.
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            return first_step + block_steps

        if prefetch_q:
            pl.when(rounds > 0)(lambda: load_q(*item(0)[:2], 0))
        lax.fori_loop(0, rounds, one_item, jnp.int32(0))
        plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 2)
    def _memory():
        plgpu.set_max_registers(40, action="decrease")

        @jax.named_scope("k_released")
        def k_released(step):  # both compute warpgroups are done with this step's K slot
            plgpu.barrier_wait(k_free.at[k_slot(step)])

        @jax.named_scope("v_released")
        def v_released(step):
            plgpu.barrier_wait(v_free.at[v_slot(step)])

        def one_item(r, first_step):
            blk, head, block_steps = item(r)
            kv_head = lax.div(head, jnp.int32(group))

            @pl.loop(0, block_steps)
            def _(step):
                fill = first_step + step
                with jax.named_scope("tables"):
                    pages = [tables_ref[blk, jnp.minimum(step * pages_per_step + i,
                                                         table_width - 1)]
                             for i in range(pages_per_step)]
                # Each slot's previous fill, possibly an earlier item's: released first.
                for pool, smem, ready, depth, slot, released in (
                        (k_ref, k_smem, k_ready, k_in_flight, k_slot(fill), k_released),
                        (v_ref, v_smem, v_ready, v_in_flight, v_slot(fill), v_released)):
                    pl.when(fill >= depth)(lambda r=released, d=depth: r(fill - d))
                    for i, page in enumerate(pages):
                        rows = pl.ds(i * block_size, block_size)
                        plgpu.copy_gmem_to_smem(pool.at[page, :, kv_head], smem.at[slot, rows],
                                                ready.at[slot])

            return first_step + block_steps

        fills = lax.fori_loop(0, rounds, one_item, jnp.int32(0))
        # The last fills' releases too: a barrier left with phases its waiter never saw is
        # what JAX's GPU interpreter refuses at its deallocation.
        pl.loop(jnp.maximum(fills - k_in_flight, 0), fills)(k_released)
        pl.loop(jnp.maximum(fills - v_in_flight, 0), fills)(v_released)


def paged_attention_prefill_hopper(
    q: jax.Array,  # [T, Hq, D]
    k_pool: jax.Array,  # [L, num_blocks, block_size, Hkv, D]
    v_pool: jax.Array,  # [L, num_blocks, block_size, Hkv, D]
    layer: jax.Array | int,  # i32[]
    block_tables: jax.Array,  # i32[S, W]
    seq_lens: jax.Array,  # i32[S]
    query_start_loc: jax.Array,  # i32[S + 1]
    positions: jax.Array,  # i32[T]
    *,
    scale: float,
    sliding_window: int | None = None,
    config: HopperPrefillConfig | None = None,
    interpret: bool | plgpu.InterpretGPUParams = False,
    skip_single_token_seqs: bool = False,
    profile: tuple[str, int] | None = None,
) -> jax.Array:  # [T, Hq, D] in q.dtype
    """Same contract as :func:`paged_attention_reference` for prefill chunks (a decode token
    is a chunk of one); raises ValueError for operands :func:`unsupported` names.
    ``skip_single_token_seqs`` leaves one-token sequences' rows unwritten (undefined), as
    :func:`paged_attention_prefill` does for the mixed step's decode kernel.
    ``interpret`` (True, or the interpreter's params, e.g. with its race detector): JAX's GPU
    interpreter (CPU) runs the warpgroups, barriers and page copies as written, the two
    products as register dots (it has no wgmma). ``profile`` (directory, ranges a warpgroup):
    Mosaic GPU's on-device profiler records the named scopes in the shared memory the config
    leaves and writes each call's trace there (benchmarks/prefill_anatomy.py)."""
    common.check_shapes(q, k_pool, v_pool)
    config = config or HopperPrefillConfig()
    reason = unsupported(q, k_pool, sliding_window, config)
    if reason is not None:
        raise ValueError(reason)
    num_tokens, num_q_heads, head_dim = q.shape
    layers, num_pages, block_size, num_kv_heads, _ = k_pool.shape
    num_seqs, table_width = block_tables.shape
    rows = 2 * config.block_q
    bseq, bt0, bt1 = query_blocks(query_start_loc, num_tokens, rows, skip_single_token_seqs)
    num_programs = min(config.num_programs or resident_programs(interpret),
                       bseq.shape[0] * num_q_heads)
    first = jnp.clip(bt0, 0, num_tokens - 1)
    pos0 = positions[first]
    num_rows = jnp.maximum(bt1 - bt0, 0)
    seq = jnp.minimum(bseq, num_seqs - 1)
    # Keys the block's last row sees; 0 for the padding tail's blocks (pseudo-sequence S).
    kv_len = jnp.where((bseq < num_seqs) & (num_rows > 0),
                       jnp.minimum(seq_lens[seq], pos0 + num_rows), 0)
    # The blocks with rows to store, the most keys first (see the kernel's rounds); the rest
    # (skipped decodes, unused bounds) are no program's items.
    busy = num_rows > 0
    order = jnp.argsort(jnp.where(busy, -1 - kv_len, 0), stable=True)
    meta = jnp.stack([first, pos0, kv_len, num_rows], axis=1).astype(jnp.int32)[order]  # [QB, 4]
    num_items = (jnp.sum(busy) * num_q_heads).astype(jnp.int32).reshape(1)  # [1]
    layer = jnp.asarray(layer, jnp.int32)
    # [QB, W] flat page ids
    tables = block_tables[seq[order]].astype(jnp.int32) + layer * num_pages
    flat = lambda pool: pool.reshape(layers * num_pages, block_size, num_kv_heads, head_dim)
    # [T, Hq D]: rows as 2-D boxes (a squeezed head axis with a traced row start fails JAX
    # 0.11.2's layout inference). A block's box may leave q at its end: TMA fills those rows
    # with zeros. JAX's GPU interpreter clamps such a box instead (shifting its rows), so
    # there q is padded by one block's rows (on the device, a pass over q: 12 us a 2k-token
    # call on the H200, 2.5 ms of an 8k-token mixed step's 194).
    q_flat = (jnp.pad(q, ((0, rows), (0, 0), (0, 0))) if interpret else q).reshape(
        -1, num_q_heads * head_dim)

    k_in_flight, v_in_flight = config.max_concurrent_steps, config.v_steps
    q_rows = (2, config.block_q, head_dim)  # per compute warpgroup
    if config.prefetch_q:
        q_rows = (2, 2, config.block_q, head_dim)  # and buffer
    pages_per_step = config.block_kv // block_size
    tiling = (plgpu.TilingTransform((8, 64)), plgpu.SwizzleTransform(128))

    def entry(meta_ref, tables_ref, items_ref, q_ref, k_ref, v_ref, out_ref):
        buffers = (
            plgpu.SMEM(q_rows, q.dtype),  # q, then the output; untiled
            plgpu.SMEM((k_in_flight, config.block_kv, head_dim), q.dtype,
                       transforms=tiling),
            plgpu.SMEM((v_in_flight, config.block_kv, head_dim), q.dtype,
                       transforms=tiling),
        )
        ready = (plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=k_in_flight),
                 plgpu.Barrier(num_arrivals=pages_per_step, num_barriers=v_in_flight),
                 plgpu.Barrier(num_barriers=2 * config.q_buffers))
        free = (plgpu.Barrier(num_arrivals=2, num_barriers=k_in_flight),
                plgpu.Barrier(num_arrivals=2, num_barriers=v_in_flight))
        pl.run_scoped(
            lambda *scoped: _kernel(
                meta_ref, tables_ref, items_ref, q_ref, k_ref, v_ref, out_ref, scoped,
                scale_log2=scale * common.LOG2E, block_q=config.block_q,
                block_kv=config.block_kv, block_size=block_size,
                k_in_flight=k_in_flight, v_in_flight=v_in_flight, group=num_q_heads // num_kv_heads,
                num_q_heads=num_q_heads, num_programs=num_programs, table_width=table_width,
                prefetch_q=config.prefetch_q, interpret=bool(interpret)),
            buffers, ready, free, plgpu.Barrier(num_arrivals=2), collective_axes="wg")

    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((num_tokens, num_q_heads * head_dim), q.dtype),
        grid=(num_programs,),
        grid_names=("programs",),
        num_threads=3,
        thread_name="wg",
        compiler_params=plgpu.CompilerParams(
            approx_math=True, **({"profile_dir": profile[0], "profile_space": profile[1],
                                  "profile_bounds_check": True} if profile else {})),
        **({"interpret": plgpu.InterpretGPUParams() if interpret is True else interpret}
           if interpret else {}),
    )(meta, tables, num_items, q_flat, flat(k_pool), flat(v_pool))
    return out.reshape(q.shape)
